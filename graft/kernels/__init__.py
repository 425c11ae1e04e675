"""Triton kernels for the engine's hot loops, their torch twins, and the dispatch between them.

- `kernel_slots(device)`: slot implementations ("kv.store", "attention.prefill",
  "attention.decode"), Triton on CUDA, torch twins elsewhere; `paged_prefill_impl(device)` the
  same choice for the batched paged prefill.
- the kernels: `store_kv`, `paged_decode_attention`, `prefill_attention`, `paged_prefill_attention`;
- their twins: `graft.kernels.reference`;
- `cpu_decode`: the paged decode attention for a CPU, in C (compiled on first use, loaded with
  ctypes), whose twin is `graft.engine.attention.decode_attention_varlen`;
- `cpu_avx512`: prefill and paged decode attention for a CPU with AVX-512 BF16, in C, whose twins
  are `prefill_attention_fused` and `decode_attention_varlen`.

Importing the package does not import Triton (it must see TRITON_INTERPRET first, when that is
used): the kernel names load on first access.
"""
from __future__ import annotations

import importlib
from typing import Any

from graft.kernels.dispatch import SLOTS, interpreter_enabled, kernel_slots, paged_prefill_impl, triton_available

_LAZY = {
    "store_kv": "graft.kernels.kv_store",
    "paged_decode_attention": "graft.kernels.paged_decode",
    "prefill_attention": "graft.kernels.prefill",
    "paged_prefill_attention": "graft.kernels.prefill",
}

__all__ = ["SLOTS", "interpreter_enabled", "kernel_slots", "paged_prefill_impl", "triton_available", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graft.kernels' has no attribute {name!r}")
