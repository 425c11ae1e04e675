"""Plain-torch twins of the Triton kernels: they define what correct means.

Every twin does its arithmetic in float32 and returns the input dtype, the same contract as the
Triton kernels, so a kernel is right when it agrees with its twin to rounding. The dispatch
(graft.kernels.dispatch) serves them in the kernels' place where Triton cannot compile.

Shapes (the engine's, see graft.engine.patches.slots):
- a paged cache is [num_blocks, block_size, n_kv, d]; a flat slot is block * block_size + offset;
- queries are [tokens, n_heads, d], keys and values [tokens, n_kv, d];
- grouped-query: query head h reads key/value head h // (n_heads // n_kv).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Gather = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [T, n_kv, d] into their cache slots; a negative slot (padding) is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    # Indexing by (block, offset) rather than a flattened view works for any cache strides.
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values, contiguous [context_len, n_kv, d], read through its block table."""
    block_size = k_cache.shape[1]
    positions = torch.arange(context_len, device=k_cache.device)
    blocks = block_table.to(k_cache.device).long()[positions // block_size]
    offsets = positions % block_size
    return k_cache[blocks, offsets], v_cache[blocks, offsets]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal grouped-query attention of q [Lq, H, d] over k, v [Lk, n_kv, d], Lk >= Lq.

    The last Lq keys belong to the queries, so query i sits at position Lk - Lq + i and sees keys
    0 .. Lk - Lq + i (bottom-right aligned causal mask, as in chunked prefill).
    """
    lq, lk = q.shape[0], k.shape[0]
    if lk < lq:
        raise ValueError(f"need at least as many keys as queries, got {lk} keys for {lq} queries")
    group = _group_size(q.shape[1], k.shape[1])
    qf = q.float().transpose(0, 1)                                     # [H, Lq, d]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)     # [H, Lk, d]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale                         # [H, Lq, Lk]
    query_pos = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    key_pos = torch.arange(lk, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf                           # [H, Lq, d]
    return out.transpose(0, 1).to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Sequence[int] | torch.Tensor,
    scale: float,
    gather: Gather = gather_kv,
) -> torch.Tensor:
    """One query token per sequence, q [B, H, d], over each sequence's cached keys; returns [B, H, d].

    A sequence with an empty context (a padding row) gets zeros.
    """
    lens = _as_list(context_lens)
    if len(lens) != q.shape[0] or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"batch mismatch: q {q.shape[0]}, block_tables {block_tables.shape[0]}, context_lens {len(lens)}")
    out = torch.zeros_like(q)
    for i, n in enumerate(lens):
        if n > 0:
            k, v = gather(k_cache, v_cache, block_tables[i], n)
            out[i] = prefill_attention(q[i : i + 1], k, v, scale)[0]
    return out


def _group_size(n_heads: int, n_kv: int) -> int:
    if n_kv <= 0 or n_heads % n_kv:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key/value heads ({n_kv})")
    return n_heads // n_kv


def _as_list(values: Sequence[int] | torch.Tensor) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)
