"""Attention in torch operators where no kernel serves: the fast paths' fallbacks and the C kernels' twins.

The dispatch (graft.kernels.dispatch) runs these when no kernel takes the tensors: for prefill,
`prefill_attention_fused` (torch's SDPA); for decode, `decode_attention_varlen` on a CPU (fp32,
or where the C kernels cannot be built) and `decode_attention_batched` on any other device. They are also what the C kernels are checked and timed against
(`tests/kernels`, `graft bench kernels`). Each follows its slot's signature
(graft.engine.patches.slots) and computes in the input dtype; the Triton kernels' twins, which
compute everything in float32 to say what correct means, are graft.kernels.reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graft.kernels.reference import Gather


def num_blocks(context_len: int, block_size: int) -> int:
    """Cache blocks that hold `context_len` tokens."""
    return -(-context_len // block_size)


def prefill_attention_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal grouped-query attention of q [Lq, H, d] over k, v [Lk, n_kv, d] (Lk >= Lq, the last
    Lq keys the queries'), through `scaled_dot_product_attention`; returns [Lq, H, d]."""
    lq, lk = q.shape[0], k.shape[0]
    mask = None
    if lk != lq:
        # bottom-right aligned causal mask: SDPA's own is_causal aligns top-left
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    # batched 4-D inputs: with 3-D ones the CPU dispatcher falls back to the unfused math kernel
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def decode_attention_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    scale: float,
    gather: Gather,
) -> torch.Tensor:
    """All decodes at once: one padded gather of every sequence's blocks and one masked SDPA.

    `gather` is unused: the blocks of all sequences are fetched together here. The padding read
    (slots past a context, block 0 for table padding) is masked out, so it must hold finite values:
    allocate the cache with zeros, not `torch.empty`, since a NaN would survive the mask.
    """
    b, block_size = q.shape[0], k_cache.shape[1]
    n_blocks = num_blocks(max(context_lens), block_size)
    # index_select over whole blocks copies 64-token slabs; advanced indexing is several times slower here
    idx = block_tables[:, :n_blocks].reshape(-1).long()
    k = k_cache.index_select(0, idx).view(b, n_blocks * block_size, *k_cache.shape[2:])  # [B, L, n_kv, d]
    v = v_cache.index_select(0, idx).view(b, n_blocks * block_size, *v_cache.shape[2:])
    lens = torch.tensor(context_lens, device=q.device)
    valid = torch.arange(k.shape[1], device=q.device) < lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True,
    )
    return out.reshape(b, q.shape[1], q.shape[2])


def decode_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    scale: float,
    gather: Gather,
) -> torch.Tensor:
    """All decodes, each sequence over its own blocks only: the fallback on a CPU.

    `decode_attention_batched` pads every sequence to the longest one, so with mixed lengths it
    copies and attends over several times the tokens there are (2.4x on 16 mixed BBH prompts), and
    a masked bf16 SDPA with one query row is slow on a CPU. Here each sequence gathers its own
    whole blocks (no padding) and attends with two small grouped matmuls, scores and softmax in
    float32. `gather` is unused, as in the batched form.
    """
    block_size, n_kv, d = k_cache.shape[1:]
    out = torch.empty_like(q)
    grouped = q.view(q.shape[0], n_kv, -1, d)                              # [B, n_kv, group, d]
    for i, n in enumerate(context_lens):
        blocks = block_tables[i, : num_blocks(n, block_size)]
        k = k_cache.index_select(0, blocks).view(-1, n_kv, d)[:n]         # [n, n_kv, d]
        v = v_cache.index_select(0, blocks).view(-1, n_kv, d)[:n]
        scores = torch.matmul(grouped[i], k.permute(1, 2, 0)).float()      # [n_kv, group, n]
        probs = scores.mul_(scale).softmax(dim=-1).to(v.dtype)
        out[i] = torch.matmul(probs, v.transpose(0, 1)).view(q.shape[1], d)
    return out
