"""The engine's own patches: the 3.2.1 set that fixes the 3.2.0 long-context slowdown.

The engine's plain paths are the 3.2.0 behaviour (per-block KV gathers, separate Q/K/V projections
and an unfused prefill attention, a sampler that reads each choice back to the host); each patch
swaps in the fixed path for its part.
"""
from __future__ import annotations

from graft.engine import attention
from graft.engine.patches.base import Patch
from graft.engine.sampler import sample_batched

VERSION = "3.2.1"


def _fuse(engine) -> None:
    engine.model.fuse_qkv()


def _unfuse(engine) -> None:
    engine.model.unfuse_qkv()


def patches() -> list[Patch]:
    return [
        Patch("kv-align", VERSION,
              {"kv.gather": attention.gather_aligned},
              description="KV gathers aligned to 64-token blocks: one vectorised gather over the block "
                          "table instead of a copy per block"),
        Patch("prefill-fusion", VERSION,
              {"linear.qkv": attention.qkv_fused, "attention.prefill": attention.prefill_attention_fast},
              description="one fused QKV projection and a fused prefill attention (SDPA; the native "
                          "bf16 flash-attention kernel on a CPU that has AVX-512 BF16)",
              migrate=_fuse, unmigrate=_unfuse, tolerance=2e-3),
        Patch("sync-free", VERSION,
              {"attention.decode": attention.decode_attention_fast, "sampler": sample_batched},
              description="no host-device synchronisation inside the step: one decode attention call "
                          "for the whole batch (the native kernel on a CPU, batched SDPA elsewhere) and a "
                          "batched sampler with one transfer per step"),
    ]
