"""KV store: new keys and values land in their paged-cache slots, whatever the slot order."""
import pytest
import torch

from graft.engine.patches.slots import SlotTable
from graft.kernels import reference
from graft.kernels.dispatch import kernel_slots, triton_available
from graft.kernels.kv_store import store_kv

N_KV, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 3, 64, 64, 6


def _caches(dtype=torch.float32, block_size=BLOCK_SIZE, n_kv=N_KV, head_dim=HEAD_DIM):
    shape = (NUM_BLOCKS, block_size, n_kv, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def _store_both(k, v, slots, dtype=torch.float32, **cache_kw):
    k_cache, v_cache = _caches(dtype, **cache_kw)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    reference.store_kv(k, v, k_ref, v_ref, slots)
    return (k_cache, v_cache), (k_ref, v_ref)


def test_twin_writes_each_token_to_block_and_offset_of_its_slot():
    torch.manual_seed(0)
    k, v = torch.randn(40, N_KV, HEAD_DIM), torch.randn(40, N_KV, HEAD_DIM)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:40]
    k_cache, v_cache = _caches()
    reference.store_kv(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE], k[t])
        assert torch.equal(v_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE], v[t])


def test_twin_gather_reads_back_what_store_wrote_through_a_shuffled_block_table():
    torch.manual_seed(1)
    table = torch.tensor([4, 0, 5], dtype=torch.int32)
    n = 150                                       # ends inside the third block
    positions = torch.arange(n)
    slots = table.long()[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    k, v = torch.randn(n, N_KV, HEAD_DIM), torch.randn(n, N_KV, HEAD_DIM)
    k_cache, v_cache = _caches()
    reference.store_kv(k, v, k_cache, v_cache, slots)
    k_back, v_back = reference.gather_kv(k_cache, v_cache, table, n)
    assert torch.equal(k_back, k) and torch.equal(v_back, v)


@pytest.mark.parametrize("num_tokens", [1, 37, 130])
def test_kernel_matches_twin_on_shuffled_slots(num_tokens):
    torch.manual_seed(num_tokens)
    k, v = torch.randn(num_tokens, N_KV, HEAD_DIM), torch.randn(num_tokens, N_KV, HEAD_DIM)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens]
    got, want = _store_both(k, v, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_kernel_skips_padding_slots_and_leaves_the_rest_of_the_cache_alone():
    torch.manual_seed(2)
    k, v = torch.randn(8, N_KV, HEAD_DIM), torch.randn(8, N_KV, HEAD_DIM)
    slots = torch.tensor([5, -1, 70, 300, -1, 64, 0, 383])
    k_cache, v_cache = _caches()
    before = k_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat_after, flat_before = k_cache.view(-1, N_KV, HEAD_DIM), before.view(-1, N_KV, HEAD_DIM)
    assert torch.equal(flat_after[~written], flat_before[~written])
    assert torch.equal(flat_after[slots[slots >= 0]], k[slots >= 0])


def test_kernel_reads_strided_views_of_a_fused_qkv_projection():
    torch.manual_seed(3)
    n_heads, num_tokens = 9, 20
    qkv = torch.randn(num_tokens, (n_heads + 2 * N_KV) * HEAD_DIM)
    q_end, k_end = n_heads * HEAD_DIM, (n_heads + N_KV) * HEAD_DIM
    k = qkv[:, q_end:k_end].view(num_tokens, N_KV, HEAD_DIM)
    v = qkv[:, k_end:].view(num_tokens, N_KV, HEAD_DIM)
    assert not k.is_contiguous()
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens]
    got, want = _store_both(k, v, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_kernel_handles_other_block_sizes_head_counts_and_casts_to_the_cache_dtype():
    torch.manual_seed(4)
    k, v = torch.randn(30, 1, 32), torch.randn(30, 1, 32)
    slots = torch.randperm(NUM_BLOCKS * 128)[:30]
    got, want = _store_both(k, v, slots, dtype=torch.float16, block_size=128, n_kv=1, head_dim=32)
    assert got[0].dtype == torch.float16
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_kernel_rejects_a_cache_of_another_shape():
    k_cache, v_cache = _caches()
    k = torch.randn(4, N_KV, 32)
    with pytest.raises(ValueError, match="cache holds"):
        store_kv(k, k, k_cache, v_cache, torch.arange(4))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(torch.randn(4, N_KV, HEAD_DIM), torch.randn(4, N_KV, HEAD_DIM), k_cache, v_cache, torch.arange(3))


def test_slots_fit_the_engine_slot_table_and_cpu_gets_the_twins():
    table = SlotTable(kernel_slots("cpu"))
    assert table["kv.store"] is reference.store_kv
    assert kernel_slots("cpu", use_triton=True)["kv.store"] is store_kv


def test_automatic_choice_never_serves_from_the_interpreter():
    # The tests run with TRITON_INTERPRET=1: kernels are available, yet not picked by themselves.
    assert triton_available()
    assert kernel_slots("cuda")["kv.store"] is reference.store_kv
    assert kernel_slots("cuda", use_triton=True)["kv.store"] is store_kv
