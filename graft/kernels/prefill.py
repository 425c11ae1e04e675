"""Causal prefill attention, flash style: the `attention.prefill` slot on CUDA.

The slot, `prefill_attention(q, k, v, scale)`, takes one sequence's chunk of queries [Lq, H, d]
and its keys and values [Lk, n_kv, d], contiguous (the engine's `kv.gather` has read the earlier
context out of the paged cache, or the chunk is the whole of it); the queries are the last Lq
keys' positions. The kernel reads the buffer as a cache of 64-token blocks through an identity
block table, so each key tile is one table lookup and 32-bit offsets from its block's base (the
tail block is only partly valid, and masked loads never read past the last key).

Grid: (query tiles of BLOCK_M rows, one sequence, query heads). Each program walks key tiles of
BLOCK_N tokens up to its last query's position only (causal skipping), with an online softmax and
fp32 accumulation. fp16/bf16 tiles go to `tl.dot` as they are (tensor cores, fp32 accumulate);
fp32 inputs, and bf16 under the CPU interpreter (whose bf16 arithmetic is wrong), are computed in
exact fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graft.kernels.dispatch import interpreter_enabled

CONTIGUOUS_BLOCK = 64   # tokens per block of the identity table over the contiguous K/V
KEY_TILE = 64           # keys per tile (BLOCK_N): a divisor of CONTIGUOUS_BLOCK, and >= 16 for tl.dot
_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_query_lens_ptr, context_lens_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    stride_btb, stride_btn,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m_tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(cu_query_lens_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_query_lens_ptr + seq + 1) - q_start).to(tl.int32)
    if m_tile * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    prior = context_len - q_len                                  # tokens cached before this chunk
    kv_head = head // GROUP

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    query_pos = prior + rows
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    q_ptrs = q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)

    # Causal skipping: no key past this tile's last query position is ever needed.
    key_end = tl.minimum(context_len, prior + (m_tile + 1) * BLOCK_M)
    for start in range(0, key_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < key_end
        # The tile lies inside one block (BLOCK_N divides BLOCK_SIZE): one table lookup, then 32-bit
        # offsets from the block's base.
        block = tl.load(block_tables_ptr + seq * stride_btb + (start // BLOCK_SIZE) * stride_btn).to(tl.int64)
        k_base = k_cache_ptr + block * stride_kcb
        v_base = v_cache_ptr + block * stride_vcb
        k_rows = (cols % BLOCK_SIZE) * stride_kco
        v_rows = (cols % BLOCK_SIZE) * stride_vco
        kt_ptrs = k_base + k_rows[None, :] + kv_head * stride_kch + dims[:, None] * stride_kcd
        kt = tl.load(kt_ptrs, mask=dim_ok[:, None] & col_ok[None, :], other=0.0)       # [D, BLOCK_N]
        v_ptrs = v_base + v_rows[:, None] + kv_head * stride_vch + dims[None, :] * stride_vcd
        v = tl.load(v_ptrs, mask=col_ok[:, None] & dim_ok[None, :], other=0.0)         # [BLOCK_N, D]
        kt = kt.to(q.dtype)
        v = v.to(q.dtype)

        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        visible = col_ok[None, :] & (cols[None, :] <= query_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # Key 0 is visible to every row, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The `attention.prefill` slot: causal attention of q [Lq, H, d] over contiguous k, v [Lk, n_kv, d].

    The last Lq keys belong to the queries (Lk >= Lq). Returns [Lq, H, d].
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"need q [Lq, H, d] and k, v [Lk, n_kv, d], "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    lq, lk = q.shape[0], k.shape[0]
    if lk < lq:
        raise ValueError(f"need at least as many keys as queries, got {lk} keys for {lq} queries")
    if k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}: head dims must match, heads divide")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    if lq == 0:
        return out
    device = q.device
    # Token t of the buffer is block t // 64, offset t % 64 of a cache whose block stride is 64 tokens.
    block_table = torch.arange(triton.cdiv(lk, CONTIGUOUS_BLOCK), dtype=torch.int32, device=device)[None, :]
    # Built on the device rather than copied from a host list: no host-to-device copy per layer.
    cu = torch.arange(2, dtype=torch.int32, device=device) * lq
    lens = torch.full((1,), lk, dtype=torch.int32, device=device)
    n_heads, head_dim = q.shape[1], q.shape[2]
    exact = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreter_enabled())
    block_m = _default_block_m(lq, exact)
    grid = (triton.cdiv(lq, block_m), 1, n_heads)
    _prefill_kernel[grid](
        q, k, v, block_table, cu, lens, out,
        scale * _LOG2E,
        *q.stride(), CONTIGUOUS_BLOCK * k.stride(0), *k.stride(), CONTIGUOUS_BLOCK * v.stride(0), *v.stride(),
        *block_table.stride(), *out.stride(),
        GROUP=n_heads // k.shape[1], HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=CONTIGUOUS_BLOCK, BLOCK_M=block_m, BLOCK_N=KEY_TILE,
        UPCAST=exact, DOT_PRECISION="ieee" if exact else "tf32",
        # fp32 tiles take twice the registers: more threads keep a 32-row tile from spilling (sm_90).
        num_warps=8 if exact and block_m >= 32 else 4,
    )
    return out


def _default_block_m(max_query_len: int, exact: bool) -> int:
    # Short chunks waste less of a 16- or 32-row tile than of a 64-row one; fp32 stops at 32 rows.
    return max(16, min(32 if exact else 64, triton.next_power_of_2(max_query_len)))
