"""One OpenMP team for the model: the step loop's.

Torch runs its CPU operators on an OpenMP team that belongs to the thread calling them, and the
OpenMP runtime (libgomp) keeps a thread's team alive for as long as that thread lives. The engine
loads the model on the thread that builds it (the server's main thread) and runs it on the step
loop thread, so once the loop is running there are two teams: with torch's default of one thread
per core, twice as many OpenMP threads as cores. libgomp then stops letting its idle threads spin
between two parallel regions (it throttles the spin to about a hundred iterations whenever it
manages more threads than there are cores) and every operator of a step pays a futex wake-up per
worker instead. On two cores that made a whole pass of the BBH workload 1.3x slower in the step
loop thread than on the thread that loaded the model, and elementwise operators twice as slow.

`release_threads()` ends the calling thread's team through OpenMP 5.0's `omp_pause_resource_all`
(a soft pause: the runtime may start a team again later if that thread runs another parallel
region). `LLMEngine` calls it at the end of its construction, on the thread that loaded the model
(`graft serve` builds the engine in a worker thread of its event loop), and again in `start()`, so
the step loop's team is the only one left. Threads that run torch code briefly (a
patch's `migrate` runs in a thread of its own) take their team with them when they end.
"""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1   # omp_pause_resource_t: omp_pause_soft
_RUNTIMES = ("libgomp", "libiomp5", "libomp")


def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    except OSError:
        return None
    for path in sorted(paths):
        if any(os.path.basename(path).startswith(name) for name in _RUNTIMES):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            if hasattr(lib, "omp_pause_resource_all"):
                return lib
    return None


def release_threads() -> bool:
    """End the calling thread's OpenMP worker threads; True when the runtime did.

    Safe at any time outside a parallel region: a later parallel region on this thread starts a
    new team. False where no OpenMP runtime with `omp_pause_resource_all` is loaded.
    """
    lib = _runtime()
    if lib is None:
        log.debug("no OpenMP runtime with omp_pause_resource_all loaded: nothing to release")
        return False
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    lib.omp_pause_resource_all.restype = ctypes.c_int
    return lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
