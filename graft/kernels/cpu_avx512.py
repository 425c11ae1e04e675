"""The engine's bf16 CPU kernels on AVX-512 BF16, in C: attention and the layer around it.

Two attention kernels in `csrc/cpu_avx512bf16.c`, both on the CPU's bf16 dot-product instruction
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
  weighted in float32. A sequence is one work item and each cached token's row (all its KV
  heads) is read at once, 32 tokens prefetched ahead across the scattered blocks.

And the layer around attention, which the model's native forward (graft.engine.models.llama,
where `graft.kernels.dispatch.native_layers` allows it) runs in place of torch's operators:
RMSNorm fused with the residual add, RoPE on queries and keys at once, SiLU-and-mul, and a linear
layer for the few rows of a decode step (torch's bf16 matmul reads the weights far below the
memory's speed there). Each rounds where torch's bf16 operators round.

`graft bench kernels` times both against the paths they replace (docs/benchmarks.md). They are
built and loaded by graft.kernels.native_build, as `cpu_decode` is (same cache, same
`GRAFT_NATIVE_KERNELS` switch), with AVX-512 flags, and only on a CPU whose /proc/cpuinfo lists
them (Intel from Cooper Lake and Sapphire Rapids, AMD from Zen 4). Elsewhere, in another dtype, or
for a head size other than 64, graft.kernels.dispatch keeps the paths before them
(`prefill_attention_fused`, the `cpu_decode` kernel or `decode_attention_varlen`): the same results
within bf16 rounding.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from graft.kernels import native_build
from graft.kernels.cpu_decode import call_paged_decode
from graft.kernels.native_build import NativeKernelError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_avx512bf16.c"
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
    lib.graft_rms_norm_bf16.argtypes = [p, i64, p, i64, p, p, i64, i, i, ctypes.c_float]
    lib.graft_rope_bf16.argtypes = [p, i64, p, p, i64, p, p, p, i64, i64, i, i, i, i]
    lib.graft_silu_mul_bf16.argtypes = [p, i64, p, i, i]
    lib.graft_linear_bf16.argtypes = [p, i64, p, p, i, i, i]
    for fn in (lib.graft_prefill_bf16, lib.graft_paged_decode_bf16_avx512, lib.graft_rms_norm_bf16,
               lib.graft_rope_bf16, lib.graft_silu_mul_bf16, lib.graft_linear_bf16):
        fn.restype = i
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with the reason logged once) where they cannot be had."""
    instead = "bf16 attention runs without AVX-512 kernels"
    missing = REQUIRED_CPU - native_build.cpu_flags()
    if missing:
        log.info("this CPU lacks %s: %s", ", ".join(sorted(missing)), instead)
        return None
    return native_build.load_native(SOURCE, native_build.BASE_FLAGS + ISA_FLAGS, _bind,
                                    "the AVX-512 attention kernels", instead)


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


# ---- the layer around attention ----
#
# Each function below takes bf16 CPU tensors whose last dimension is contiguous and returns what
# the torch expression in its docstring returns, within a bf16 rounding. Callers check the
# matching `supports_*` first, or `supports_layers` once for a whole model's sizes.


def supports_layers(hidden_size: int, head_dim: int, intermediate_size: int) -> bool:
    """Whether a decoder of these sizes can run every layer kernel below (RMSNorm over the hidden
    size, RoPE over the head size, SiLU-and-mul over the intermediate size), the kernels built."""
    return hidden_size % 16 == 0 and head_dim % 32 == 0 and intermediate_size % 16 == 0 and available()


def _rows_ok(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(1) == 1
               for t in tensors)


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_rows_ok(x) and weight.dtype == torch.bfloat16 and weight.is_contiguous()
            and weight.shape == (x.shape[1],) and x.shape[1] % 16 == 0 and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x^2) + eps)).to(bf16)` over rows x [T, D], statistics in float32.

    With `delta` [T, D], first `x += delta` in place (the residual add before the norm), so the
    caller's residual stream moves on without a separate add."""
    lib = library()
    if lib is None or not supports_rms_norm(x, weight) or (delta is not None and (
            not _rows_ok(delta) or delta.shape != x.shape)):
        raise NativeKernelError("the native RMSNorm does not take these tensors")
    out = torch.empty(x.shape, dtype=x.dtype)
    status = lib.graft_rms_norm_bf16(
        None if delta is None else delta.data_ptr(), 0 if delta is None else delta.stride(0),
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps)
    if status:
        raise NativeKernelError(f"the native RMSNorm refused x {tuple(x.shape)}")
    return out


def supports_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    """q [T, Hq, d] and k [T, Hk, d] with each head contiguous, d a multiple of 32, float32 tables."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == torch.bfloat16 and q.dim() == k.dim() == 3
            and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2] == cos.shape[1] and q.shape[2] % 32 == 0
            and q.stride(2) == k.stride(2) == 1 and q.stride(1) == k.stride(1) == q.shape[2]
            and cos.dtype == torch.float32 and cos.is_contiguous() and available())


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> torch.Tensor:
    """Half-rotation RoPE at `positions` [T] (int64) from the float32 tables cos, sin
    [max_position, d]: returns the rotated queries [T, Hq, d], contiguous, and rotates k in place."""
    lib = library()
    if (lib is None or not supports_rope(q, k, cos) or sin.shape != cos.shape or not sin.is_contiguous()
            or sin.dtype != torch.float32 or positions.dtype != torch.int64 or positions.shape != (q.shape[0],)):
        raise NativeKernelError("the native RoPE does not take these tensors")
    positions = positions.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    status = lib.graft_rope_bf16(q.data_ptr(), q.stride(0), out.data_ptr(), k.data_ptr(), k.stride(0),
                                 positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.shape[0],
                                 q.shape[0], q.shape[1], k.shape[1], q.shape[2])
    if status:
        raise NativeKernelError(f"a position is outside the RoPE tables ({cos.shape[0]} positions)")
    return out


def supports_silu_mul(gate_up: torch.Tensor) -> bool:
    return _rows_ok(gate_up) and gate_up.shape[1] % 32 == 0 and available()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for gate_up [T, 2 I] = [gate | up]; returns [T, I]."""
    lib = library()
    if lib is None or not supports_silu_mul(gate_up):
        raise NativeKernelError("the native SiLU-and-mul does not take these tensors")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    if lib.graft_silu_mul_bf16(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter):
        raise NativeKernelError(f"the native SiLU-and-mul refused {tuple(gate_up.shape)}")
    return out


LINEAR_MAX_ROWS = 64
"""Most rows `linear` is chosen for: up to here it beats torch's bf16 matmul (`graft bench
kernels`), beyond it the matmul's blocking wins."""


def supports_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_rows_ok(x) and 1 <= x.shape[0] <= LINEAR_MAX_ROWS and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] == x.shape[1]
            and x.shape[1] % 32 == 0 and weight.shape[0] % 8 == 0 and available())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for the few rows of a decode step: x [M, K], weight [N, K] -> [M, N]."""
    lib = library()
    if lib is None or not supports_linear(x, weight):
        raise NativeKernelError("the native linear layer does not take these tensors")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    if lib.graft_linear_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                             x.shape[0], weight.shape[0], x.shape[1]):
        raise NativeKernelError(f"the native linear layer refused x {tuple(x.shape)}, w {tuple(weight.shape)}")
    return out
