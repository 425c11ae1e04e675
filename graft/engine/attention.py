"""The engine's own torch implementations of the attention patch points, and the table a fresh engine starts with.

The plain family is the engine's 3.2.0 behaviour (`graft serve --paths plain`): correct, easy to
read, slow (Python loops over blocks and sequences, explicit matmuls). The fast paths are what a
fresh engine runs by default and what the 3.2.1 hot patches ship: the same results from one
vectorised gather over whole blocks (`gather_aligned`), one fused QKV matmul (`qkv_fused`) and the
attention choosers of graft.kernels.dispatch (`prefill_attention_fast`, `decode_attention_fast`),
which pick a kernel or torch's SDPA per call; the patches name them through this module. Which
attention runs on which device and paths is decided there, not here: `default_slots` asks it.
Every function is pure apart from `store_kv`, which writes the cache.

Shapes follow graft/engine/patches/slots.py: caches are [num_blocks, block_size, n_kv, d]; `linear.qkv`
returns flat projections q [T, n_heads * d], k and v [T, n_kv * d].
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graft.engine.config import DEFAULT_PATHS, PATHS_CHOICES
from graft.engine.patches.slots import KVGather, SlotTable
from graft.engine.sampler import sample_batched
from graft.kernels.dispatch import decode_attention_fast, engine_kernels, linear, prefill_attention_fast
from graft.kernels.torch_attention import num_blocks

__all__ = [
    "store_kv", "gather_per_block", "prefill_attention_naive", "decode_attention_per_seq", "qkv_separate",
    "gather_aligned", "qkv_fused", "prefill_attention_fast", "decode_attention_fast", "default_slots",
]


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the new tokens' K/V [T, n_kv, d] into their flat cache slots."""
    n_kv, d = k_cache.shape[-2:]
    k_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, v)


# ---- plain family (3.2.0) ----


def gather_per_block(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K/V, contiguous [context_len, n_kv, d]: one slice per block, then concatenated."""
    blocks = block_table[: num_blocks(context_len, k_cache.shape[1])].tolist()
    k = torch.cat([k_cache[b] for b in blocks])[:context_len]
    v = torch.cat([v_cache[b] for b in blocks])[:context_len]
    return k, v


def prefill_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal grouped-query attention, written out: q [Lq, H, d] over k, v [Lk, n_kv, d] -> [Lq, H, d]."""
    lq, h, _ = q.shape
    lk, n_kv, _ = k.shape
    k = k.repeat_interleave(h // n_kv, dim=1)
    v = v.repeat_interleave(h // n_kv, dim=1)
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)).float() * scale  # [H, Lq, Lk]
    # query i sits at position lk - lq + i, so it sees keys 0 .. lk - lq + i
    future = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(lk - lq + 1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)


def decode_attention_per_seq(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    scale: float,
    gather: KVGather,
) -> torch.Tensor:
    """One query token per sequence: gather each sequence's context, then attend, one at a time."""
    out = torch.empty_like(q)
    for i, context_len in enumerate(context_lens):
        k, v = gather(k_cache, v_cache, block_tables[i], context_len)
        out[i] = prefill_attention_naive(q[i : i + 1], k, v, scale)[0]
    return out


def qkv_separate(attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three projections, three matmuls."""
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)


# ---- fast family (3.2.1) ----


def gather_aligned(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `gather_per_block` from one index_select over whole blocks (blocks are 64-aligned)."""
    idx = block_table[: num_blocks(context_len, k_cache.shape[1])].long()
    k = k_cache.index_select(0, idx).flatten(0, 1)[:context_len]
    v = v_cache.index_select(0, idx).flatten(0, 1)[:context_len]
    return k, v


def qkv_fused(attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One matmul over the layer's concatenated `qkv_weight`; three when the model is not fused."""
    if attn.qkv_weight is None:
        return qkv_separate(attn, x)
    qkv = linear(x, attn.qkv_weight, attn.qkv_bias)
    return qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)


# ---- tables ----


def default_slots(policy: Callable[..., Any], sampler: Callable[..., Any], paths: str = DEFAULT_PATHS,
                  device: str | torch.device = "cpu") -> SlotTable:
    """The slot table a fresh engine on `device` starts with: the given policy and sampler over the
    plain family, then the slots graft.kernels.dispatch chooses for that device (on CUDA the Triton
    kernels).

    With `paths="fast"` (the default, EngineConfig's, what `graft serve` runs) the fast paths take
    their places: the aligned gather, the fused QKV projection, the batched sampler and the
    dispatch's attention: the same answers, the fixed paths of the 3.2.1 patches.
    """
    if paths not in PATHS_CHOICES:
        raise ValueError(f"paths must be {' or '.join(PATHS_CHOICES)}, got {paths!r}")
    table = SlotTable(
        {
            "kv.store": store_kv,
            "kv.gather": gather_per_block,
            "attention.prefill": prefill_attention_naive,
            "attention.decode": decode_attention_per_seq,
            "linear.qkv": qkv_separate,
            "sampler": sampler,
            "scheduler.policy": policy,
        }
    )
    fast = paths == "fast"
    if fast:
        table = table.with_slots({"kv.gather": gather_aligned, "linear.qkv": qkv_fused, "sampler": sample_batched})
    return table.with_slots(engine_kernels(device, fast))
