"""Paged-attention decode: one query token per sequence over its cached keys, grouped-query.

One program per (sequence, kv-head). It holds the queries of every head that shares that kv-head
(the GQA group, padded to a power of two), so each key/value tile is read from memory once per
group rather than once per query head. It walks the sequence's block table in 64-token tiles with
an online softmax; all arithmetic is fp32 whatever the storage dtype.

Decode reads a handful of query rows per tile, far below the 16 rows `tl.dot` needs, and is bound
by memory, not arithmetic; the products are broadcast multiply-and-sum in fp32 instead.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

TILE_TOKENS = 64
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_qd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)

    heads = kv_head * GROUP + tl.arange(0, GROUP_P)           # the query heads of this group
    dims = tl.arange(0, HEAD_DIM_P)
    head_ok = tl.arange(0, GROUP_P) < GROUP
    dim_ok = dims < HEAD_DIM
    q_mask = head_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd, mask=q_mask, other=0.0)
    # Folding log2(e) into the scale lets the softmax use exp2.
    q = q.to(tl.float32) * qk_scale

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)

    for start in range(0, context_len, TILE):
        tokens = start + tl.arange(0, TILE)
        tok_ok = tokens < context_len
        if BLOCK_SIZE % TILE == 0:
            # The tile lies inside one cache block: one table lookup, then 32-bit offsets from its base.
            block = tl.load(block_tables_ptr + seq * stride_btb + (start // BLOCK_SIZE) * stride_btn).to(tl.int64)
            k_base = k_cache_ptr + block * stride_kcb
            v_base = v_cache_ptr + block * stride_vcb
            k_rows = (tokens % BLOCK_SIZE) * stride_kco
            v_rows = (tokens % BLOCK_SIZE) * stride_vco
        else:
            # Blocks smaller than a tile: one table lookup per token.
            blocks = tl.load(block_tables_ptr + seq * stride_btb + (tokens // BLOCK_SIZE) * stride_btn,
                             mask=tok_ok, other=0).to(tl.int64)
            k_base = k_cache_ptr
            v_base = v_cache_ptr
            k_rows = blocks * stride_kcb + (tokens % BLOCK_SIZE) * stride_kco
            v_rows = blocks * stride_vcb + (tokens % BLOCK_SIZE) * stride_vco
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k_ptrs = k_base + k_rows[:, None] + kv_head * stride_kch + dims[None, :] * stride_kcd
        v_ptrs = v_base + v_rows[:, None] + kv_head * stride_vch + dims[None, :] * stride_vcd
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)   # [TILE, D]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(tl.float32)

        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)             # [GROUP_P, TILE]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    # An empty context (a padding row) leaves l_i at 0: answer zeros rather than 0/0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Sequence[int] | torch.Tensor,
    scale: float,
    gather: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """Decode attention, q [B, H, d] over the paged cache [num_blocks, block_size, n_kv, d]; returns [B, H, d].

    block_tables [B, max_blocks] (int32 or int64) lists each sequence's cache blocks in order;
    context_lens (a list of B ints or an int tensor on q's device) counts its cached tokens,
    the current token included; pass the tensor when capturing CUDA graphs, since a list is
    copied to the device on every call. A context of 0 yields zeros. `gather` is part of the
    `attention.decode` slot signature for implementations that read K/V contiguously; this
    kernel reads the cache in place and ignores it.
    """
    del gather
    group = _check_decode_args(q, k_cache, v_cache, block_tables)
    batch, _, head_dim = q.shape
    lens = _context_lens_tensor(context_lens, batch, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    if batch == 0:
        return out
    n_kv = k_cache.shape[2]
    _paged_decode_kernel[(batch, n_kv)](
        q, k_cache, v_cache, block_tables, lens, out,
        scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, GROUP_P=triton.next_power_of_2(group),
        HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], TILE=TILE_TOKENS,
        num_warps=_num_warps(group, head_dim),
    )
    return out


def _num_warps(group: int, head_dim: int) -> int:
    # The [group, tile, dim] products live in registers: spread the larger ones over more threads.
    size = triton.next_power_of_2(group) * TILE_TOKENS * triton.next_power_of_2(head_dim)
    return 4 if size <= 8192 else 8


def _context_lens_tensor(context_lens: Sequence[int] | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """context_lens as an int tensor on `device`: a list is copied over, a tensor checked and kept."""
    if isinstance(context_lens, torch.Tensor):
        if context_lens.shape != (batch,) or context_lens.device != device:
            raise ValueError(f"context_lens must be [{batch}] on {device}, "
                             f"got {tuple(context_lens.shape)} on {context_lens.device}")
        return context_lens
    if len(context_lens) != batch:
        raise ValueError(f"context_lens has {len(context_lens)} entries for a batch of {batch}")
    return torch.tensor(context_lens, dtype=torch.int32, device=device)


def _check_decode_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor) -> int:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, n_heads, d], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"caches must both be [num_blocks, block_size, n_kv, d], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head dim differs: q has {head_dim}, the cache {k_cache.shape[3]}")
    if n_heads % n_kv:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key/value heads ({n_kv})")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be a 2-D int tensor, got {block_tables.dtype} {tuple(block_tables.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for a batch of {q.shape[0]}")
    return n_heads // n_kv

