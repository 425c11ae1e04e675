"""Running a verified bundle's code without letting it stop, block or outlive the engine.

A signature says who wrote a bundle, not that its code behaves: its module body may raise
SystemExit, sleep, or loop forever. Two steps keep the engine serving whatever it does:

1. **A check in a throwaway interpreter.** `check_in_subprocess` runs the module and its
   `patches()` in a fresh `python -m graft.engine.patches.loading`, under `timeout` seconds counted
   from the moment the bundle starts (the child imports torch first, so a slow interpreter start is
   not held against the bundle). A bundle that exits, crashes or overruns is refused (422) and
   its process killed; nothing of it ever ran in the engine. A process is the only thing Python
   can stop from outside: a thread running `while True: pass` cannot be interrupted, and would
   keep a core and a share of the GIL for the engine's lifetime.

   The check runs the module as the real load will (`bundle.execute`: the same module name and
   `__file__`, from the same working directory), so a bundle cannot tell the two apart by them.
   It does not run it with the engine's secrets: the child's environment holds only the
   variables of `CHECK_ENV` (no GRAFT_ADMIN_TOKEN, no credentials). Its resources are capped
   (`CheckLimits`): the memory the bundle may add (RLIMIT_DATA, 2 GiB by default: a limit on the
   address space would also count what CUDA reserves and never uses), its CPU time (RLIMIT_CPU,
   `timeout` CPU-seconds), files it writes (RLIMIT_FSIZE), no core dump, and the output it
   prints (64 KiB of stdout and stderr together, which the engine logs; more and it is killed).
2. **The real import, off the event loop.** Only a bundle that passed the check is run in the
   engine, in a daemon thread that the event loop awaits with the same deadline (`run_guarded`),
   so `/health`, inference and the admin API keep answering while it loads, and SIGTERM still ends
   the process. A bundle that behaves differently the second time and overruns is refused too;
   its thread cannot be stopped and is left to finish, logged.

A bundle's module body therefore runs twice (once in the check), which is why bundles should be
free of side effects at import. Re-applying an applied bundle runs nothing: the patch manager keeps
loaded bundles by digest.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from graft.api import digest_of
from graft.engine.patches.base import Patch, PatchError
from graft.engine.patches.bundle import describe, execute, load_bundle

log = logging.getLogger(__name__)

T = TypeVar("T")
START_TIMEOUT = 120.0   # seconds for the check's interpreter to import torch and say it is ready
READY = b"ready\n"


async def run_guarded(fn: Callable[..., T], *args: Any, timeout: float | None, what: str) -> T:
    """`fn(*args)` in a daemon thread, awaited for at most `timeout` seconds.

    Raises what `fn` raises (BaseException included, as an ordinary exception of this coroutine),
    or PatchError(422) when the deadline passes; the thread is then left to finish on its own.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error if isinstance(error, Exception) else RuntimeError(describe(error)))
        else:
            done.set_result(result)

    def target() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed back to the awaiting coroutine, never raised here
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name=f"graft-bundle: {what}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), timeout)
    except TimeoutError:
        log.error("%s did not finish within %gs; its thread is left running", what, timeout)
        raise PatchError(422, f"{what} did not finish within {timeout:g}s; refused") from None


@dataclass(frozen=True, slots=True)
class CheckLimits:
    """What the check's process may use once the bundle starts (`cpu_seconds` None: the timeout)."""

    memory: int = 2 << 30           # bytes of data the bundle may add to the interpreter's
    cpu_seconds: float | None = None
    output: int = 64 << 10          # bytes of stdout and stderr together
    file_size: int = 64 << 20       # bytes of any one file it writes


# the variables the check's process keeps: what Python, torch and the C libraries need, no secrets
CHECK_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH", "PYTHONHOME",
             "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
             "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")


def check_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The check's environment: `CHECK_ENV` and the locale (`LC_*`) of `env` (default: this process's)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k in CHECK_ENV or k.startswith("LC_")}


class _OutputCapped(Exception):
    pass


async def _read_capped(stream: asyncio.StreamReader, budget: list[int], into: bytearray) -> None:
    """Read `stream` to its end into `into`, taking from the shared `budget`; _OutputCapped past it."""
    while chunk := await stream.read(16384):
        budget[0] -= len(chunk)
        if budget[0] < 0:
            raise _OutputCapped
        into += chunk


async def check_in_subprocess(source: str, timeout: float, digest: str | None = None,
                              limits: CheckLimits = CheckLimits()) -> list[str]:
    """Run a bundle once in a throwaway interpreter; the ids (`name@version`) of its patches.

    Raises PatchError(422) when the bundle raises, exits, crashes, overruns `timeout` or a limit.
    """
    digest = digest or digest_of(source)
    cpu = limits.cpu_seconds if limits.cpu_seconds is not None else timeout
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "graft.engine.patches.loading", digest,
        json.dumps({"memory": limits.memory, "cpu": cpu, "file_size": limits.file_size}),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=check_environment())
    budget = [limits.output]
    printed, out = bytearray(), bytearray()
    printing = asyncio.ensure_future(_read_capped(proc.stderr, budget, printed))
    try:
        proc.stdin.write(source.encode("utf-8"))
        proc.stdin.close()
        try:
            ready = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT)
        except TimeoutError:
            raise PatchError(503, f"the bundle check did not start within {START_TIMEOUT:g}s") from None
        if ready != READY:
            raise PatchError(503, f"the bundle check did not start (exit code {await proc.wait()})")
        try:
            await asyncio.wait_for(asyncio.gather(_read_capped(proc.stdout, budget, out), printing, proc.wait()),
                                   timeout)
        except TimeoutError:
            raise PatchError(422, f"the bundle did not finish loading within {timeout:g}s; refused") from None
        except _OutputCapped:
            raise PatchError(422, f"the bundle printed more than {limits.output // 1024} KiB while loading; "
                                  "refused") from None
    finally:
        printing.cancel()
        if printing.done() and not printing.cancelled():
            printing.exception()   # retrieved: an overflow before the bundle started is the same refusal
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        if printed:
            log.info("the check of bundle %s printed: %s", digest, printed.decode("utf-8", "replace").rstrip())
    try:
        result = json.loads(out.decode("utf-8").strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise PatchError(422, f"the bundle ended its process while loading ({_exit_status(proc.returncode, cpu)})") \
            from None
    if isinstance(result, dict) and "error" in result:
        raise PatchError(422, f"the bundle failed to load: {result['error']}")
    if not isinstance(result, dict) or not isinstance(result.get("patches"), list):
        raise PatchError(422, "the bundle's check answered nonsense; refused")
    return [str(p) for p in result["patches"]]


async def load_checked(source: str, digest: str, timeout: float) -> list[Patch]:
    """A verified bundle's patches, loaded into this process once a throwaway run of it passed."""
    await check_in_subprocess(source, timeout, digest)
    return await run_guarded(load_bundle, source, digest, timeout=timeout, what="loading the bundle")


def _exit_status(code: int | None, cpu: float | None = None) -> str:
    if code is not None and code < 0:
        if cpu is not None and -code == signal.SIGXCPU:
            return f"killed by SIGXCPU: it used up the {cpu:g} CPU-seconds it may use"
        if cpu is not None and -code == signal.SIGKILL:
            return f"killed by SIGKILL (the check allows {cpu:g} CPU-seconds)"
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


# the check's own process
def _die_with_parent() -> None:
    """Ask Linux to kill this process when the engine goes, whatever the bundle is doing."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)


def _limit(kind: int, soft: int, hard: int | None = None) -> None:
    """Lower the limit `kind` to `soft` (and `hard`, default `soft`), never above its hard limit now."""
    with contextlib.suppress(ValueError, OSError):
        ceiling = resource.getrlimit(kind)[1]
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(soft if hard is None else hard, ceiling)
        resource.setrlimit(kind, (soft, soft if hard is None else hard))


def _apply_limits(memory: int, cpu: float, file_size: int) -> None:
    """The bundle's share of this process, on top of what the interpreter (and torch) hold now."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = int(math.ceil(usage.ru_utime + usage.ru_stime + cpu))
    _limit(resource.RLIMIT_CPU, used, used + 1)   # SIGXCPU, then SIGKILL a second later
    with contextlib.suppress(OSError, ValueError, AttributeError):
        status = Path("/proc/self/status").read_text()
        data = int(status.split("VmData:", 1)[1].split()[0]) * 1024
        _limit(resource.RLIMIT_DATA, data + memory)
    _limit(resource.RLIMIT_FSIZE, file_size)
    _limit(resource.RLIMIT_CORE, 0)


def _check_main() -> None:
    _die_with_parent()
    digest, limits = sys.argv[1], json.loads(sys.argv[2])
    results = os.fdopen(os.dup(1), "w")   # the answer to the engine; the bundle's prints go to stderr
    os.dup2(2, 1)
    __import__("torch")   # warm: bundles use it, and its import is not the bundle's time
    source = sys.stdin.buffer.read().decode("utf-8")
    _apply_limits(int(limits["memory"]), float(limits["cpu"]), int(limits["file_size"]))
    results.write(READY.decode())
    results.flush()
    try:
        answer: dict[str, Any] = {"patches": [p.id for p in execute(source, digest)]}
    except PatchError as exc:
        answer = {"error": exc.message}
    except MemoryError:
        answer = {"error": f"MemoryError: it may add {int(limits['memory']) >> 20} MiB to the interpreter's memory"}
    except BaseException as exc:  # SystemExit, KeyboardInterrupt...: all of it is the bundle's failure
        answer = {"error": describe(exc)}
    results.write(json.dumps(answer) + "\n")
    results.flush()
    os._exit(0)   # no atexit handler or lingering thread of the bundle runs after this


if __name__ == "__main__":
    _check_main()
