"""Paged-attention decode on a CPU, in C: the engine's decode attention where no GPU is.

Torch has no paged decode attention for a CPU. Its twin, `decode_attention_varlen`, gathers each
sequence's blocks and attends with a dozen small operators per sequence per layer, and at one
query row per sequence those operators cost more in dispatch than in arithmetic; in bf16 its
small matmuls are slow besides. `csrc/paged_decode_cpu.c` reads the keys and values in place from
the paged cache, one sequence per OpenMP work item, scores and softmax in float32. `graft bench
kernels` times the two on SmolLM2's shapes (docs/benchmarks.md: 1.5-4.7x in bf16).

The C file is compiled once per machine with the system's C compiler (well under a second) into
a per-user cache, keyed by the source, the flags and the compiler, and loaded with ctypes; no
torch headers are involved. It links the OpenMP runtime by its soname, so it shares the one torch
has already loaded, and with it torch's thread count. Where there is no compiler, the build fails
or `GRAFT_NATIVE_KERNELS=0` is set, `available()` is False (the reason is logged once) and the
engine keeps the torch twin: the same results, slower.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.c"
# -fopenmp for the parallel loop and the `omp simd` reductions (vectorised without licensing any
# other reordering of float arithmetic); no -ffast-math, which would drop the NaN and cut-off tests
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
_TRUE_OFF = {"0", "false", "no", "off"}


class NativeKernelError(RuntimeError):
    """The kernel refused its input (a block outside the cache, a bad length) or ran out of memory."""


def isa_flags(cpu: set[str]) -> tuple[str, ...]:
    """Instruction-set flags for this CPU, named from /proc/cpuinfo, never `-march=native` (which
    can pick extensions the CPU lists but a virtual machine does not let it run)."""
    if {"avx2", "fma"} <= cpu:
        return ("-mavx2", "-mfma")
    return ()


def cache_dir() -> Path:
    root = os.environ.get("GRAFT_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "graft", "kernels")
    return Path(root)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(cc: str, flags: tuple[str, ...], out_dir: Path, source: Path = SOURCE) -> Path:
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


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i = ctypes.c_void_p, ctypes.c_int
    for fn in (lib.graft_paged_decode_bf16, lib.graft_paged_decode_f32):
        fn.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i, ctypes.c_int64, ctypes.c_float]
        fn.restype = i
    return lib


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


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with the reason logged once) where it cannot be had."""
    from graft.engine.config import cpu_flags
    return load_native(SOURCE, BASE_FLAGS + isa_flags(cpu_flags()), _bind, "the native decode kernel",
                       "decode attention runs in torch")


def available() -> bool:
    return library() is not None


_FUNCTIONS = {torch.bfloat16: "graft_paged_decode_bf16", torch.float32: "graft_paged_decode_f32"}


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: on the CPU, bf16 or fp32, contiguous, the kernel built."""
    return (q.device.type == "cpu" and q.dtype in _FUNCTIONS and k_cache.dtype == q.dtype
            and q.is_contiguous() and k_cache.is_contiguous() and available())


def preferred(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the engine should run the kernel rather than its twin: in bf16 only. In bf16 the
    twin's small matmuls are slow on a CPU and the kernel wins at every shape `graft bench kernels`
    times; in fp32 the twin's matmuls are fast and the kernel loses from 16 sequences of 1,024
    tokens up, the shapes of a loaded decode step. The fp32 entry point stays for that benchmark
    and for checking the kernel's arithmetic against the twin to float32 precision."""
    return q.dtype == torch.bfloat16 and supports(q, k_cache)


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    scale: float,
    gather=None,
) -> torch.Tensor:
    """The `attention.decode` slot: q [B, H, d] over each sequence's first context_lens[i] cached
    tokens; returns [B, H, d]. Callers check `supports` first; `gather` is unused."""
    lib = library()
    if lib is None or not supports(q, k_cache) or v_cache.dtype != q.dtype or not v_cache.is_contiguous():
        raise NativeKernelError("the native decode kernel does not take these tensors")
    return call_paged_decode(getattr(lib, _FUNCTIONS[q.dtype]), q, k_cache, v_cache, block_tables, context_lens, scale)


def call_paged_decode(fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: list[int], scale: float) -> torch.Tensor:
    """Run a C paged decode entry point (this module's or cpu_avx512's: the same arguments) on
    tensors its caller has checked; raise NativeKernelError on the status it returns."""
    b, h, d = q.shape
    num_blocks, block_size, n_kv, _ = k_cache.shape
    tables = block_tables.to(torch.int32).contiguous()
    lens = torch.tensor(context_lens, dtype=torch.int32)
    if len(context_lens) != b or tables.shape[0] != b or h % n_kv:
        raise NativeKernelError(f"shapes disagree: q {tuple(q.shape)}, tables {tuple(tables.shape)}, "
                                f"{len(context_lens)} lengths, {n_kv} KV heads")
    out = torch.empty_like(q)
    status = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                out.data_ptr(), b, h, n_kv, d, block_size, tables.shape[1], num_blocks, scale)
    if status == -1:
        raise NativeKernelError("a block table names a block outside the cache, or a length is out of range")
    if status:
        raise NativeKernelError("the native decode kernel ran out of memory")
    return out
