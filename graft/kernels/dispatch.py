"""Which implementation runs each of the engine's hot loops: every such choice is made in this file.

Each patch point has a torch path, and some have kernels that do the same work faster on some
hardware. Five things decide between them:

- **the device**: on CUDA the Triton kernels (graft.kernels.kv_store, paged_decode, prefill) serve
  `kv.store`, `attention.prefill` and `attention.decode`, whatever `--paths` says. The Triton
  interpreter (TRITON_INTERPRET=1) makes them runnable on a CPU, which is how they are tested, but
  runs them as Python, far too slow to serve from: while it is on, CUDA gets their float32 twins
  (graft.kernels.reference) instead, and only a caller that asks gets the kernels (`kernel_slots`).
- **the `--paths` setting**: on a CPU, `plain` (the 3.2.0 paths) keeps the engine's own torch code
  for attention (graft.engine.attention) and the model's torch layers; `fast` takes the per-call
  choosers below for attention, and the native layers where they fit (`native_layers`).
- **the dtype and the tensors** (device, layout, head size), per call, in the choosers.
- **the CPU's features**: what /proc/cpuinfo lists (graft.kernels.native_build.cpu_flags) and
  whether the C kernels built there; each C kernel's `supports*` says both.
- **patches**: the built-in 3.2.1 patches ship these same choosers (`prefill-fusion@3.2.1` the
  prefill one, `sync-free@3.2.1` the decode one), so a patched engine runs what a fresh engine on
  the fast paths runs; a patch replaces whatever its slot held, a Triton kernel included.

What runs, by device and `--paths` (`engine_kernels` at load, then the choosers per call):

- CUDA, either paths: the Triton `store_kv`, `prefill_attention` and `paged_decode_attention`
  (their twins while the interpreter is on); the model's torch layers.
- CPU, fast paths: `attention.prefill` the AVX-512 BF16 kernel (bf16, head size 64), else torch's
  SDPA; `attention.decode` the AVX-512 BF16 kernel, else the portable C kernel (bf16), else
  `decode_attention_varlen`; in bf16 with AVX-512 BF16 the model's layers through
  graft.kernels.cpu_avx512, `linear` on the small-row kernel at a decode step's few rows.
- CPU, plain paths: the engine's 3.2.0 torch code in every slot, the model's torch layers.

Every callable here follows its slot's signature in graft.engine.patches.slots.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from graft.kernels import cpu_avx512, cpu_decode
from graft.kernels.torch_attention import decode_attention_batched, decode_attention_varlen, prefill_attention_fused

_TRUE = {"1", "true", "yes", "on"}


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter (read the way Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """True when the Triton kernels can run here: Triton importable and either CUDA or the interpreter."""
    return _triton_importable() and (interpreter_enabled() or torch.cuda.is_available())


# ---- once per engine, at load ----


def engine_kernels(device: str | torch.device, fast: bool) -> dict[str, Callable[..., Any]]:
    """The slots of a fresh engine's table that this module chooses, for an engine on `device`
    running the fast paths (`fast`) or the plain ones; the engine's own paths fill the rest.

    On CUDA: `kernel_slots`, fast or plain alike. Elsewhere on the fast paths: the attention
    choosers, which pick per call. Elsewhere on the plain paths: none.
    """
    if torch.device(device).type == "cuda":
        return kernel_slots(device)
    if fast:
        return {"attention.prefill": prefill_attention_fast, "attention.decode": decode_attention_fast}
    return {}


def native_layers(device: str | torch.device, dtype: torch.dtype, fast: bool, *, hidden_size: int, head_dim: int,
                  intermediate_size: int) -> bool:
    """Whether the model runs its decoder layers through graft.kernels.cpu_avx512: on the fast
    paths, bf16 on a CPU with AVX-512 BF16, a model of sizes the kernels take. The plain paths keep
    the torch layers, so `graft bench patches` still measures what the 3.2.1 patches change."""
    return (fast and torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and cpu_avx512.supports_layers(hidden_size, head_dim, intermediate_size))


def kernel_slots(device: str | torch.device, use_triton: bool | None = None) -> dict[str, Callable[..., Any]]:
    """`kv.store`, `attention.prefill` and `attention.decode`: the Triton kernels or their twins.

    use_triton forces the choice (True raises when the kernels cannot run here); None takes the
    kernels on CUDA with Triton compiling (not the interpreter), the twins otherwise.
    """
    if _use_triton(device, use_triton):
        from graft.kernels import kv_store, paged_decode, prefill

        return {
            "kv.store": kv_store.store_kv,
            "attention.prefill": prefill.prefill_attention,
            "attention.decode": paged_decode.paged_decode_attention,
        }
    from graft.kernels import reference

    return {
        "kv.store": reference.store_kv,
        "attention.prefill": reference.prefill_attention,
        "attention.decode": reference.decode_attention,
    }


def _use_triton(device: str | torch.device, use_triton: bool | None) -> bool:
    if use_triton is None:
        return torch.device(device).type == "cuda" and triton_available() and not interpreter_enabled()
    if use_triton and not triton_available():
        raise RuntimeError("Triton kernels need CUDA, or TRITON_INTERPRET=1 set before triton is imported")
    return use_triton


# ---- per call: the fast paths' choosers ----


def prefill_attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The fastest prefill attention for the tensors, the same results from each (within bf16 rounding).

    On a CPU in bf16 with AVX-512 BF16 and head size 64 the native kernel (a flash-attention loop on
    the CPU's bf16 dot products, 4.2-5.7x torch's SDPA at the chunks the engine runs); otherwise
    torch's SDPA (`prefill_attention_fused`).
    """
    if cpu_avx512.supports_prefill(q, k, v):
        return cpu_avx512.prefill_attention(q, k, v, scale)
    return prefill_attention_fused(q, k, v, scale)


def decode_attention_fast(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    scale: float,
    gather: Callable[..., Any],
) -> torch.Tensor:
    """The fastest decode attention for the tensors, the same results from each (within bf16 rounding).

    On a CPU: the AVX-512 BF16 kernel where it takes the tensors (bf16, head size 64); else, in
    bf16, the portable C kernel; else `decode_attention_varlen`. The portable kernel only in bf16:
    there the twin's small matmuls are slow and the kernel wins at every shape `graft bench kernels`
    times, while in fp32 the twin's matmuls are fast and the kernel loses from 16 sequences of
    1,024 tokens up, the shapes of a loaded decode step. On any other device
    `decode_attention_batched`, which keeps the step free of host syncs.
    """
    if q.device.type != "cpu":
        return decode_attention_batched(q, k_cache, v_cache, block_tables, context_lens, scale, gather)
    if cpu_avx512.supports_decode(q, k_cache, v_cache):
        return cpu_avx512.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    if q.dtype == torch.bfloat16 and cpu_decode.supports(q, k_cache):
        return cpu_decode.paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale)
    return decode_attention_varlen(q, k_cache, v_cache, block_tables, context_lens, scale, gather)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the AVX-512 BF16 kernel for the few rows of a decode step (up to
    `cpu_avx512.LINEAR_MAX_ROWS`, no bias), where torch's bf16 matmul cannot keep the weights
    streaming from memory; a prefill chunk's rows stay with torch's matmul."""
    if bias is None and cpu_avx512.supports_linear(x, weight):
        return cpu_avx512.linear(x, weight)
    return F.linear(x, weight, bias)
