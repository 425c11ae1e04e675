"""Torch implementations of the attention patch points, in two families.

The plain family is the engine's 3.2.0 behaviour (`graft serve --paths plain`): correct, easy to
read, slow (Python loops over blocks and sequences, explicit matmuls). The fast family is what a
fresh engine runs by default and what the 3.2.1 hot patches ship: the same results from
vectorised gathers, `scaled_dot_product_attention` and one fused QKV matmul. Every function is pure apart from `store_kv`, which writes the cache.

Shapes follow graft/engine/patches/slots.py: caches are [num_blocks, block_size, n_kv, d]; `linear.qkv`
returns flat projections q [T, n_heads * d], k and v [T, n_kv * d].
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from graft.engine.patches.slots import SlotTable
from graft.engine.sampler import sample_batched
from graft.kernels import cpu_avx512, cpu_decode

Gather = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the new tokens' K/V [T, n_kv, d] into their flat cache slots."""
    n_kv, d = k_cache.shape[-2:]
    k_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, v)


def _num_blocks(context_len: int, block_size: int) -> int:
    return -(-context_len // block_size)


# ---- plain family (3.2.0) ----


def gather_per_block(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K/V, contiguous [context_len, n_kv, d]: one slice per block, then concatenated."""
    blocks = block_table[: _num_blocks(context_len, k_cache.shape[1])].tolist()
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
    gather: Gather,
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
    idx = block_table[: _num_blocks(context_len, k_cache.shape[1])].long()
    k = k_cache.index_select(0, idx).flatten(0, 1)[:context_len]
    v = v_cache.index_select(0, idx).flatten(0, 1)[:context_len]
    return k, v


def prefill_attention_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal grouped-query attention through `scaled_dot_product_attention`; same contract as the naive one."""
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


def prefill_attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The fastest prefill attention for the tensors, the same results from each (within bf16 rounding).

    On a CPU in bf16 with AVX-512 BF16 the native kernel (graft/kernels/cpu_avx512.py: a flash-
    attention loop on the CPU's bf16 dot products); otherwise `prefill_attention_fused`.
    """
    if q.device.type == "cpu" and cpu_avx512.supports_prefill(q, k, v):
        return cpu_avx512.prefill_attention(q, k, v, scale)
    return prefill_attention_fused(q, k, v, scale)


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
    n_blocks = _num_blocks(max(context_lens), block_size)
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
    """All decodes, each sequence over its own blocks only: the default on a CPU.

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
        blocks = block_tables[i, : _num_blocks(n, block_size)]
        k = k_cache.index_select(0, blocks).view(-1, n_kv, d)[:n]         # [n, n_kv, d]
        v = v_cache.index_select(0, blocks).view(-1, n_kv, d)[:n]
        scores = torch.matmul(grouped[i], k.permute(1, 2, 0)).float()      # [n_kv, group, n]
        probs = scores.mul_(scale).softmax(dim=-1).to(v.dtype)
        out[i] = torch.matmul(probs, v.transpose(0, 1)).view(q.shape[1], d)
    return out


def decode_attention_fast(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    scale: float,
    gather: Gather,
) -> torch.Tensor:
    """The fastest decode attention for the tensors' device, the same results from each.

    On a CPU in bf16 a native kernel that reads the paged cache in place: the AVX-512 BF16 one
    (graft/kernels/cpu_avx512.py) where the CPU has it, else the portable one
    (graft/kernels/cpu_decode.py); in fp32, or where neither can be built,
    `decode_attention_varlen`; elsewhere `decode_attention_batched`, which keeps the step free of
    host syncs. `graft bench kernels` times each against `decode_attention_varlen`.
    """
    if q.device.type == "cpu":
        if cpu_avx512.supports_decode(q, k_cache, v_cache):
            return cpu_avx512.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
        if cpu_decode.preferred(q, k_cache):
            return cpu_decode.paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale)
        return decode_attention_varlen(q, k_cache, v_cache, block_tables, context_lens, scale, gather)
    return decode_attention_batched(q, k_cache, v_cache, block_tables, context_lens, scale, gather)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the native kernel for the few rows of a decode step in bf16 on a CPU
    with AVX-512 BF16 (graft/kernels/cpu_avx512.py), where torch's matmul cannot keep the weights
    streaming from memory."""
    if bias is None and x.device.type == "cpu" and cpu_avx512.supports_linear(x, weight):
        return cpu_avx512.linear(x, weight)
    return F.linear(x, weight, bias)


def qkv_fused(attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One matmul over the layer's concatenated `qkv_weight`; three when the model is not fused."""
    if attn.qkv_weight is None:
        return qkv_separate(attn, x)
    qkv = linear(x, attn.qkv_weight, attn.qkv_bias)
    return qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)


# ---- tables ----


def default_slots(policy: Callable[..., Any], sampler: Callable[..., Any], paths: str = "plain") -> SlotTable:
    """The slot table a fresh engine starts with: the given policy and sampler over the plain family.

    With `paths="fast"` (what `graft serve` runs by default) the fast family and the batched
    sampler take their places: the same answers, the fixed paths of the 3.2.1 patches.
    """
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
    if paths == "fast":
        table = table.with_slots({**FAST_SLOTS, "sampler": sample_batched})
    elif paths != "plain":
        raise ValueError(f"paths must be fast or plain, got {paths!r}")
    return table


FAST_SLOTS: dict[str, Callable[..., Any]] = {
    "kv.gather": gather_aligned,
    "attention.prefill": prefill_attention_fast,
    "attention.decode": decode_attention_fast,
    "linear.qkv": qkv_fused,
}
