"""Paged-attention decode: one new token per sequence attends over its cached context, grouped-query."""
import pytest
import torch
import torch.nn.functional as F

from graft.engine.patches.slots import SlotTable
from graft.kernels import reference
from graft.kernels.dispatch import kernel_slots, triton_available
from graft.kernels.paged_decode import paged_decode_attention


def _paged(context_lens, n_kv, head_dim, block_size=64, dtype=torch.float32, spare_blocks=3):
    """Dense per-sequence K/V and the same values scattered into a randomly filled paged cache.

    Blocks are handed out in shuffled order and the cache is filled with noise first, so reading
    the wrong block or past a context's end changes the answer.
    """
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, n_kv, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, n_kv, head_dim).to(dtype)
    order = torch.randperm(num_blocks).tolist()
    width = max(max(blocks_per_seq), 1)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    dense = []
    for i, (n, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        table = [order.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(table, dtype=torch.int32)
        k, v = torch.randn(n, n_kv, head_dim).to(dtype), torch.randn(n, n_kv, head_dim).to(dtype)
        for t in range(n):
            k_cache[table[t // block_size], t % block_size] = k[t]
            v_cache[table[t // block_size], t % block_size] = v[t]
        dense.append((k, v))
    return k_cache, v_cache, tables, dense


def _sdpa_decode(q, dense, scale):
    """Ground truth: PyTorch's own attention, one sequence at a time, K/V repeated per query head."""
    outs = []
    for i, (k, v) in enumerate(dense):
        group = q.shape[1] // k.shape[1]
        kk = k.float().repeat_interleave(group, 1).transpose(0, 1)
        vv = v.float().repeat_interleave(group, 1).transpose(0, 1)
        qq = q[i].float()[:, None, :]                                     # [H, 1, d]
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, scale=scale)[:, 0])
    return torch.stack(outs)


CASES = [
    # context lens, heads, kv heads, head dim, cache block size
    pytest.param([200, 1, 64, 65, 127], 6, 2, 64, 64, id="gqa3-ragged"),
    pytest.param([150, 30], 9, 3, 64, 64, id="smollm2-heads"),
    pytest.param([129, 40, 256], 4, 4, 32, 128, id="mha-dim32-block128"),
    pytest.param([90], 8, 1, 64, 64, id="mqa"),
    pytest.param([75, 16], 6, 2, 64, 16, id="blocks-smaller-than-a-tile"),
]


@pytest.mark.parametrize("context_lens, n_heads, n_kv, head_dim, block_size", CASES)
def test_twin_agrees_with_dense_sdpa(context_lens, n_heads, n_kv, head_dim, block_size):
    torch.manual_seed(0)
    k_cache, v_cache, tables, dense = _paged(context_lens, n_kv, head_dim, block_size)
    q = torch.randn(len(context_lens), n_heads, head_dim)
    scale = head_dim**-0.5
    got = reference.decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
    torch.testing.assert_close(got, _sdpa_decode(q, dense, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("context_lens, n_heads, n_kv, head_dim, block_size", CASES)
def test_kernel_matches_twin_over_shuffled_block_tables(context_lens, n_heads, n_kv, head_dim, block_size):
    torch.manual_seed(1)
    k_cache, v_cache, tables, _ = _paged(context_lens, n_kv, head_dim, block_size)
    q = torch.randn(len(context_lens), n_heads, head_dim)
    scale = head_dim**-0.5
    got = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
    want = reference.decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kernel_reads_context_lens_from_a_device_tensor_and_strided_queries():
    torch.manual_seed(2)
    lens = [70, 5, 190]
    k_cache, v_cache, tables, _ = _paged(lens, 2, 64)
    fused = torch.randn(3, 10, 64)                   # e.g. q, k and v heads of one projection
    q = fused[:, :6]
    got = paged_decode_attention(q, k_cache, v_cache, tables.long(), torch.tensor(lens, dtype=torch.int32), 0.125)
    want = reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_empty_context_gives_zeros_in_kernel_and_twin():
    torch.manual_seed(3)
    k_cache, v_cache, tables, _ = _paged([64, 1], 2, 64)
    q = torch.randn(2, 4, 64)
    lens = [64, 0]
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    want = reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bf16_cache_is_computed_in_fp32():
    torch.manual_seed(4)
    lens = [100, 33]
    k_cache, v_cache, tables, _ = _paged(lens, 3, 64, dtype=torch.bfloat16)
    q = torch.randn(2, 9, 64).to(torch.bfloat16)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    want = reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_decode_slot_takes_the_engine_signature_with_gather():
    torch.manual_seed(5)
    lens = [80, 20]
    k_cache, v_cache, tables, _ = _paged(lens, 3, 64)
    q = torch.randn(2, 9, 64)
    triton_slot = kernel_slots("cpu", use_triton=True)["attention.decode"]
    twin_slot = SlotTable(kernel_slots("cpu"))["attention.decode"]
    assert triton_available() and twin_slot is reference.decode_attention
    args = (q, k_cache, v_cache, tables, lens, 0.125, reference.gather_kv)
    torch.testing.assert_close(triton_slot(*args), twin_slot(*args), atol=1e-4, rtol=1e-4)


def test_bad_shapes_are_refused_with_a_clear_error():
    k_cache, v_cache, tables, _ = _paged([10], 2, 64)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        paged_decode_attention(torch.randn(1, 5, 64), k_cache, v_cache, tables, [10], 0.125)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(torch.randn(1, 4, 64), k_cache, v_cache, tables, [10, 3], 0.125)
    with pytest.raises(ValueError, match="head dim"):
        paged_decode_attention(torch.randn(1, 4, 32), k_cache, v_cache, tables, [10], 0.125)
