"""Choose between the Triton kernels and their torch twins, and hand the engine slot implementations.

On CUDA with Triton importable the engine gets the kernels; everywhere else the torch twins. The
Triton interpreter (TRITON_INTERPRET=1) makes the kernels runnable on CPU, which is how they are
tested, but it runs them as Python, far too slow to serve from: while it is on, the automatic
choice is the twins, on CPU and CUDA alike, and only a caller that asks gets the kernels.

Every callable returned follows its slot's signature in graft.engine.patches.slots:
- "kv.store": (k, v, k_cache, v_cache, slot_mapping) -> None
- "attention.prefill": (q, k, v, scale) -> out        (one sequence, contiguous K/V)
- "attention.decode": (q, k_cache, v_cache, block_tables, context_lens, scale, gather) -> out

The batched paged prefill (`graft.kernels.prefill.paged_prefill_attention` and its twin) has no slot of
its own: see `paged_prefill_impl`.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

SLOTS = ("kv.store", "attention.prefill", "attention.decode")
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


def kernel_slots(device: str | torch.device, use_triton: bool | None = None) -> dict[str, Callable[..., Any]]:
    """Slot implementations for `device`: Triton kernels on CUDA, torch twins elsewhere.

    use_triton forces the choice (True raises when the kernels cannot run here); None decides by
    device, and takes the twins while the interpreter is on. The keys are the names in SLOTS.
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


def paged_prefill_impl(device: str | torch.device, use_triton: bool | None = None) -> Callable[..., torch.Tensor]:
    """The batched paged prefill for `device`, chosen like `kernel_slots`.

    Signature: (q, k_cache, v_cache, cu_query_lens, context_lens, block_tables, scale) -> out,
    matching the StepContext fields; call it after `kv.store` has written the step's K/V.
    """
    if _use_triton(device, use_triton):
        from graft.kernels.prefill import paged_prefill_attention

        return paged_prefill_attention
    from graft.kernels.reference import paged_prefill_attention

    return paged_prefill_attention


def _use_triton(device: str | torch.device, use_triton: bool | None) -> bool:
    if use_triton is None:
        return torch.device(device).type == "cuda" and triton_available() and not interpreter_enabled()
    if use_triton and not triton_available():
        raise RuntimeError("Triton kernels need CUDA, or TRITON_INTERPRET=1 set before triton is imported")
    return use_triton
