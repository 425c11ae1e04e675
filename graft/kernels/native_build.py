"""How the C kernels reach the engine: what the CPU can run, compiled on first use, loaded with ctypes.

A kernel module (`cpu_decode`, `cpu_avx512`) names its C source, the instruction-set flags it
needs and how to bind its entry points; `load_native` does the rest. The source is compiled once
per machine with the system's C compiler (well under a second) into a per-user cache
(`GRAFT_KERNEL_CACHE`, else `~/.cache/graft/kernels`), keyed by the source, the flags and the
compiler's version, so an edited source or a new compiler builds afresh and nothing stale is
loaded. No torch headers are involved. The libraries link the OpenMP runtime by its soname, so
they share the one torch has already loaded, and with it torch's thread count.

Where there is no compiler, the build fails or `GRAFT_NATIVE_KERNELS=0` is set, `load_native`
returns None and says why once; the kernel module then reports itself unavailable and the
dispatch (graft.kernels.dispatch) keeps its torch twin: the same results, slower.

This module imports no torch: the engine's configuration reads `cpu_flags` to resolve
`--dtype auto`, and the `graft` command line, which the torch-free operator image runs too, reads
that configuration to build its flags.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# -fopenmp for the parallel loops and the `omp simd` reductions (vectorised without licensing any
# other reordering of float arithmetic); no -ffast-math, which would drop the NaN and cut-off tests
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
_TRUE_OFF = {"0", "false", "no", "off"}


class NativeKernelError(RuntimeError):
    """A C kernel refused its input (a block outside the cache, a bad length) or ran out of memory."""


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo (empty where there is none).

    The kernels are compiled for the flags named here, never with `-march=native`, which can pick
    extensions the CPU lists but a virtual machine does not let it run."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cache_dir() -> Path:
    root = os.environ.get("GRAFT_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "graft", "kernels")
    return Path(root)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(cc: str, flags: tuple[str, ...], out_dir: Path, source: Path) -> Path:
    """Compile `source` (or find it already compiled) and return the shared library's path.

    The name carries a digest of source, flags and compiler version; the file is written under a
    temporary name and renamed into place, so processes building at once never load half a file.
    """
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(flags), version]).encode()).hexdigest()[:16]
    target = out_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_native(source: Path, flags: tuple[str, ...], bind: Callable[[Path], ctypes.CDLL], what: str,
                instead: str) -> ctypes.CDLL | None:
    """Build `source` with `flags` (or find it built), bind it, or say once why not and return None.

    `what` names the kernel in the log ("the native decode kernel"), `instead` what runs in its
    place ("decode attention runs in torch").
    """
    if os.environ.get("GRAFT_NATIVE_KERNELS", "").strip().lower() in _TRUE_OFF:
        log.info("native CPU kernels off (GRAFT_NATIVE_KERNELS): %s", instead)
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: %s (slower, same results)", instead)
        return None
    try:
        return bind(build(cc, flags, cache_dir(), source))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("could not build %s, %s: %s", what, instead, exc)
        return None
