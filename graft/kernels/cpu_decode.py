"""Paged-attention decode on a CPU, in C: the engine's decode attention where no GPU is.

Torch has no paged decode attention for a CPU. Its twin, `decode_attention_varlen`
(graft.kernels.torch_attention), gathers each sequence's blocks and attends with a dozen small
operators per sequence per layer, and at one query row per sequence those operators cost more in
dispatch than in arithmetic; in bf16 its small matmuls are slow besides.
`csrc/paged_decode_cpu.c` reads the keys and values in place from the paged cache, one sequence
per OpenMP work item, scores and softmax in float32. `graft bench kernels` times the two on
SmolLM2's shapes (docs/benchmarks.md: 1.5-4.7x in bf16).

It is built and loaded by graft.kernels.native_build, with AVX2 and FMA where the CPU lists them.
Where it cannot be had, `available()` is False and graft.kernels.dispatch keeps the twin.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from graft.kernels import native_build
from graft.kernels.native_build import NativeKernelError

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.c"


def isa_flags(cpu: set[str]) -> tuple[str, ...]:
    """Instruction-set flags for this kernel on a CPU with flags `cpu` (see native_build.cpu_flags)."""
    if {"avx2", "fma"} <= cpu:
        return ("-mavx2", "-mfma")
    return ()


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i = ctypes.c_void_p, ctypes.c_int
    for fn in (lib.graft_paged_decode_bf16, lib.graft_paged_decode_f32):
        fn.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i, ctypes.c_int64, ctypes.c_float]
        fn.restype = i
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with the reason logged once) where it cannot be had."""
    return native_build.load_native(SOURCE, native_build.BASE_FLAGS + isa_flags(native_build.cpu_flags()), _bind,
                                    "the native decode kernel", "decode attention runs in torch")


def available() -> bool:
    return library() is not None


_FUNCTIONS = {torch.bfloat16: "graft_paged_decode_bf16", torch.float32: "graft_paged_decode_f32"}


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: on the CPU, bf16 or fp32, contiguous, the kernel built."""
    return (q.device.type == "cpu" and q.dtype in _FUNCTIONS and k_cache.dtype == q.dtype
            and q.is_contiguous() and k_cache.is_contiguous() and available())


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
