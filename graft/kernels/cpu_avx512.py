"""Attention on a CPU with AVX-512 BF16, in C: the engine's prefill and decode attention in bf16.

Two kernels in `csrc/attention_avx512bf16.c`, both on the CPU's bf16 dot-product instruction
(vdpbf16ps: exact bf16 products summed in float32), head size 64:

- **prefill**: causal attention of one sequence's new tokens over its context, a flash-attention
  loop (online softmax, no score matrix in memory) with keys and values packed into the
  instruction's pair order. Torch's CPU `scaled_dot_product_attention` runs the same loop with its
  bf16 products through float32 on a CPU without AMX: about 0.1 TFLOPS here (`graft bench
  kernels`), against 955-995 GFLOPS for the bf16 matmuls of the same prefill (the roofline's
  rate), which made attention the largest single cost of a prefill of 1,000-token prompts. The
  weights are rounded to bf16 for the product with the values, as a
  bf16 flash attention does.
- **decode**: one query token per sequence over the paged cache read in place, as the portable
  `cpu_decode` kernel does, but with the dot products on vdpbf16ps and sixteen keys' sums folded
  by lane permutes instead of one horizontal sum per key (that kernel's bound); the values are
  weighted in float32.

`graft bench kernels` times both against the paths they replace (docs/benchmarks.md). They are
built, cached and loaded as `cpu_decode` is (same cache, same `GRAFT_NATIVE_KERNELS` switch),
with AVX-512 flags, and only on a CPU whose /proc/cpuinfo lists them (Intel from Cooper Lake and
Sapphire Rapids, AMD from Zen 4). Elsewhere, in another dtype, or for a head size other than 64,
the engine keeps the paths before them (`prefill_attention_fused`, the `cpu_decode` kernel or
`decode_attention_varlen`): the same results within bf16 rounding.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from graft.kernels.cpu_decode import BASE_FLAGS, NativeKernelError, call_paged_decode, load_native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "attention_avx512bf16.c"
HEAD_DIM = 64
MAX_GROUP = 16          # query heads per KV head the decode kernel takes (GROUP_MAX in the C file)
# what /proc/cpuinfo must list, and the flags that let the compiler emit it
REQUIRED_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"})
ISA_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")


def cpu_supported(cpu: set[str]) -> bool:
    return REQUIRED_CPU <= cpu


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.graft_prefill_bf16.argtypes = [p, i64, i64, p, i64, i64, p, i64, i64, p, i, i, i, i, i, ctypes.c_float]
    lib.graft_paged_decode_bf16_avx512.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i, i64, ctypes.c_float]
    lib.graft_prefill_bf16.restype = lib.graft_paged_decode_bf16_avx512.restype = i
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with the reason logged once) where they cannot be had."""
    from graft.engine.config import cpu_flags
    instead = "bf16 attention runs without AVX-512 kernels"
    missing = REQUIRED_CPU - cpu_flags()
    if missing:
        log.info("this CPU lacks %s: %s", ", ".join(sorted(missing)), instead)
        return None
    return load_native(SOURCE, BASE_FLAGS + ISA_FLAGS, _bind, "the AVX-512 attention kernels", instead)


def available() -> bool:
    return library() is not None


def supports_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the prefill kernel takes these tensors: bf16 on the CPU, head size 64, the last
    dimension contiguous, grouped heads, no more queries than keys, and the kernels built."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.bfloat16
            and q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape
            and q.shape[2] == k.shape[2] == HEAD_DIM and q.shape[1] % k.shape[1] == 0
            and 1 <= q.shape[0] <= k.shape[0]
            and q.stride(2) == k.stride(2) == v.stride(2) == 1 and available())


def supports_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the decode kernel takes these tensors: bf16 on the CPU, contiguous, head size 64,
    at most 16 query heads per KV head, and the kernels built."""
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
            and q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            and q.shape[2] == k_cache.shape[3] == HEAD_DIM and q.shape[1] % k_cache.shape[2] == 0
            and q.shape[1] // k_cache.shape[2] <= MAX_GROUP
            and q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous() and available())


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The `attention.prefill` slot: q [lq, H, 64] over k, v [lk, n_kv, 64] (lk >= lq), causal with
    the query rows at the last lq positions; returns [lq, H, 64]. Callers check `supports_prefill`."""
    lib = library()
    if lib is None or not supports_prefill(q, k, v):
        raise NativeKernelError("the native prefill kernel does not take these tensors")
    lq, h, d = q.shape
    lk, n_kv, _ = k.shape
    out = torch.empty(lq, h, d, dtype=q.dtype)
    status = lib.graft_prefill_bf16(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(), lq, lk, h, n_kv, d, scale)
    if status == -1:
        raise NativeKernelError(f"the native prefill kernel refused q {tuple(q.shape)}, k {tuple(k.shape)}")
    if status:
        raise NativeKernelError("the native prefill kernel ran out of memory")
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    scale: float,
    gather=None,
) -> torch.Tensor:
    """The `attention.decode` slot: q [B, H, 64] over each sequence's first context_lens[i] cached
    tokens; returns [B, H, 64]. Callers check `supports_decode`; `gather` is unused."""
    lib = library()
    if lib is None or not supports_decode(q, k_cache, v_cache):
        raise NativeKernelError("the native decode kernel does not take these tensors")
    return call_paged_decode(lib.graft_paged_decode_bf16_avx512, q, k_cache, v_cache, block_tables, context_lens, scale)
