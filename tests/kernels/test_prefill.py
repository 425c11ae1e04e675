"""Prefill attention: causal, variable-length, grouped-query, over earlier cached context when there is some."""
import pytest
import torch
import torch.nn.functional as F

from graft.engine.patches.slots import SlotTable
from graft.kernels import kernel_slots, paged_prefill_impl, reference
from graft.kernels.kv_store import store_kv
from graft.kernels.prefill import paged_prefill_attention, prefill_attention


def _sdpa_causal(q, k, v, scale):
    """Ground truth: PyTorch's attention with an explicit bottom-right causal mask."""
    lq, lk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qq = q.float().transpose(0, 1)
    kk = k.float().repeat_interleave(group, 1).transpose(0, 1)
    vv = v.float().repeat_interleave(group, 1).transpose(0, 1)
    allowed = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, scale=scale).transpose(0, 1)


def _paged_batch(chunks, n_heads, n_kv, head_dim, block_size=64, dtype=torch.float32):
    """A packed batch of prompt chunks: (earlier cached tokens, new tokens) per sequence.

    K/V for every token (earlier and new) go into shuffled blocks of a noise-filled cache through
    the KV-store kernel, as the engine does before attention.
    """
    totals = [prior + new for prior, new in chunks]
    blocks_per_seq = [-(-n // block_size) for n in totals]
    num_blocks = sum(blocks_per_seq) + 2
    k_cache = torch.randn(num_blocks, block_size, n_kv, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, n_kv, head_dim).to(dtype)
    order = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(chunks), max(blocks_per_seq), dtype=torch.int32)
    dense, queries = [], []
    for i, (n, nb) in enumerate(zip(totals, blocks_per_seq)):
        tables[i, :nb] = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.int32)
        pos = torch.arange(n)
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        k, v = torch.randn(n, n_kv, head_dim).to(dtype), torch.randn(n, n_kv, head_dim).to(dtype)
        store_kv(k, v, k_cache, v_cache, slots)
        dense.append((k, v))
        queries.append(torch.randn(chunks[i][1], n_heads, head_dim).to(dtype))
    cu = torch.tensor([0, *torch.tensor([new for _, new in chunks]).cumsum(0).tolist()], dtype=torch.int32)
    return torch.cat(queries), k_cache, v_cache, cu, totals, tables, dense


@pytest.mark.parametrize("lq, lk, n_heads, n_kv", [(1, 1, 2, 2), (37, 37, 6, 2), (20, 150, 9, 3), (64, 100, 4, 1)])
def test_twin_agrees_with_dense_sdpa(lq, lk, n_heads, n_kv):
    torch.manual_seed(lq + lk)
    q, k, v = torch.randn(lq, n_heads, 64), torch.randn(lk, n_kv, 64), torch.randn(lk, n_kv, 64)
    got = reference.prefill_attention(q, k, v, 0.125)
    torch.testing.assert_close(got, _sdpa_causal(q, k, v, 0.125), atol=1e-5, rtol=1e-5)


def test_paged_twin_agrees_with_dense_sdpa_per_sequence():
    torch.manual_seed(0)
    q, k_cache, v_cache, cu, lens, tables, dense = _paged_batch([(0, 30), (100, 17)], 6, 2, 64)
    got = reference.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, 0.125)
    want = torch.cat([_sdpa_causal(q[cu[i] : cu[i + 1]], k, v, 0.125) for i, (k, v) in enumerate(dense)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "chunks, n_heads, n_kv, head_dim, block_m",
    [
        pytest.param([(0, 50), (0, 7), (0, 90)], 6, 2, 64, 32, id="fresh-prompts"),
        pytest.param([(64, 40), (130, 1), (3, 60)], 6, 2, 64, 16, id="chunks-over-cached-context"),
        pytest.param([(0, 33), (70, 45)], 9, 3, 64, None, id="smollm2-heads-default-tile"),
        pytest.param([(20, 40), (0, 25)], 4, 4, 32, 16, id="mha-dim32"),
    ],
)
def test_paged_kernel_matches_twin(chunks, n_heads, n_kv, head_dim, block_m):
    torch.manual_seed(1)
    q, k_cache, v_cache, cu, lens, tables, _ = _paged_batch(chunks, n_heads, n_kv, head_dim)
    scale = head_dim**-0.5
    got = paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, scale, block_m=block_m)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, scale)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [128, 16])
def test_paged_kernel_over_larger_and_smaller_cache_blocks(block_size):
    torch.manual_seed(2)
    q, k_cache, v_cache, cu, lens, tables, _ = _paged_batch([(100, 50), (0, 20)], 4, 2, 64, block_size=block_size)
    got = paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, 0.125, max_query_len=50)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, 0.125)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_prompt_prefilled_in_chunks_equals_prompt_prefilled_at_once():
    torch.manual_seed(3)
    n = 150
    q, k_cache, v_cache, _, lens, tables, _ = _paged_batch([(0, n)], 6, 2, 64)
    whole = paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, n], dtype=torch.int32), lens, tables, 0.125)
    pieces = []
    for start, end in [(0, 64), (64, 100), (100, 150)]:
        cu = torch.tensor([0, end - start], dtype=torch.int32)
        pieces.append(paged_prefill_attention(q[start:end], k_cache, v_cache, cu, [end], tables, 0.125))
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lq, lk", [(1, 1), (45, 45), (30, 170), (80, 100)])
def test_contiguous_slot_matches_twin(lq, lk):
    torch.manual_seed(lq * lk)
    q, k, v = torch.randn(lq, 6, 64), torch.randn(lk, 2, 64), torch.randn(lk, 2, 64)
    got = prefill_attention(q, k, v, 0.125)
    torch.testing.assert_close(got, reference.prefill_attention(q, k, v, 0.125), atol=1e-4, rtol=1e-4)


def test_fp16_takes_the_tensor_core_path_and_stays_close():
    torch.manual_seed(4)
    q, k_cache, v_cache, cu, lens, tables, _ = _paged_batch([(30, 40), (0, 20)], 6, 2, 64, dtype=torch.float16)
    got = paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, 0.125)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, 0.125)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_bf16_is_computed_in_fp32_under_the_interpreter():
    torch.manual_seed(5)
    q, k, v = (torch.randn(n, h, 64).to(torch.bfloat16) for n, h in [(40, 6), (70, 2), (70, 2)])
    got = prefill_attention(q, k, v, 0.125)
    torch.testing.assert_close(got.float(), reference.prefill_attention(q, k, v, 0.125).float(), atol=1e-2, rtol=1e-2)


def test_prefill_slots_take_the_engine_signatures():
    torch.manual_seed(6)
    q, k, v = torch.randn(10, 9, 64), torch.randn(25, 3, 64), torch.randn(25, 3, 64)
    triton_slot = kernel_slots("cpu", use_triton=True)["attention.prefill"]
    twin_slot = SlotTable(kernel_slots("cpu"))["attention.prefill"]
    torch.testing.assert_close(triton_slot(q, k, v, 0.125), twin_slot(q, k, v, 0.125), atol=1e-4, rtol=1e-4)
    assert paged_prefill_impl("cpu") is reference.paged_prefill_attention
    assert paged_prefill_impl("cpu", use_triton=True) is paged_prefill_attention


def test_more_queries_than_keys_is_refused():
    q, k = torch.randn(10, 2, 64), torch.randn(5, 2, 64)
    with pytest.raises(ValueError, match="at least as many keys"):
        prefill_attention(q, k, k, 0.125)
    with pytest.raises(ValueError, match="at least as many keys"):
        reference.prefill_attention(q, k, k, 0.125)
