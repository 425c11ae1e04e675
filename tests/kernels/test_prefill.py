"""Prefill attention: causal, grouped-query, a chunk of queries over its contiguous context (earlier tokens and its own)."""
import pytest
import torch
import torch.nn.functional as F

from graft.engine.patches.slots import SlotTable
from graft.kernels import reference
from graft.kernels.dispatch import kernel_slots
from graft.kernels.prefill import prefill_attention


def _sdpa_causal(q, k, v, scale):
    """Ground truth: PyTorch's attention with an explicit bottom-right causal mask."""
    lq, lk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qq = q.float().transpose(0, 1)
    kk = k.float().repeat_interleave(group, 1).transpose(0, 1)
    vv = v.float().repeat_interleave(group, 1).transpose(0, 1)
    allowed = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, scale=scale).transpose(0, 1)


@pytest.mark.parametrize("lq, lk, n_heads, n_kv", [(1, 1, 2, 2), (37, 37, 6, 2), (20, 150, 9, 3), (64, 100, 4, 1)])
def test_twin_agrees_with_dense_sdpa(lq, lk, n_heads, n_kv):
    torch.manual_seed(lq + lk)
    q, k, v = torch.randn(lq, n_heads, 64), torch.randn(lk, n_kv, 64), torch.randn(lk, n_kv, 64)
    got = reference.prefill_attention(q, k, v, 0.125)
    torch.testing.assert_close(got, _sdpa_causal(q, k, v, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "lq, lk, n_heads, n_kv, head_dim",
    [(1, 1, 6, 2, 64), (45, 45, 6, 2, 64), (30, 170, 6, 2, 64), (80, 100, 6, 2, 64), (33, 103, 9, 3, 64),
     (40, 60, 4, 4, 32), (17, 200, 4, 1, 64)],
)
def test_contiguous_slot_matches_twin(lq, lk, n_heads, n_kv, head_dim):
    """Any chunk over any earlier context (a prompt at once, a chunk after cached tokens), grouped
    heads or not, across the kernel's 64-key tiles and its 16- to 32-row query tiles."""
    torch.manual_seed(lq * lk)
    q, k, v = torch.randn(lq, n_heads, head_dim), torch.randn(lk, n_kv, head_dim), torch.randn(lk, n_kv, head_dim)
    got = prefill_attention(q, k, v, head_dim**-0.5)
    torch.testing.assert_close(got, reference.prefill_attention(q, k, v, head_dim**-0.5), atol=1e-4, rtol=1e-4)


def test_strided_views_as_the_model_hands_them_over():
    """q, k, v as slices of one fused projection: the kernel reads them through their strides."""
    torch.manual_seed(7)
    qkv = torch.randn(50, (6 + 2 * 2) * 64)
    q, k, v = (t.view(50, -1, 64) for t in qkv.split([6 * 64, 2 * 64, 2 * 64], dim=-1))
    got = prefill_attention(q, k, v, 0.125)
    assert got.is_contiguous()
    torch.testing.assert_close(got, reference.prefill_attention(q, k, v, 0.125), atol=1e-4, rtol=1e-4)


def test_fp16_takes_the_tensor_core_path_and_stays_close():
    torch.manual_seed(4)
    q, k, v = (torch.randn(n, h, 64).half() for n, h in [(40, 6), (70, 2), (70, 2)])
    got = prefill_attention(q, k, v, 0.125)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, reference.prefill_attention(q, k, v, 0.125), atol=2e-3, rtol=2e-3)


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


def test_more_queries_than_keys_is_refused():
    q, k = torch.randn(10, 2, 64), torch.randn(5, 2, 64)
    with pytest.raises(ValueError, match="at least as many keys"):
        prefill_attention(q, k, k, 0.125)
    with pytest.raises(ValueError, match="at least as many keys"):
        reference.prefill_attention(q, k, k, 0.125)
