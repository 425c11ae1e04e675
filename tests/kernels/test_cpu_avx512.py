"""The AVX-512 BF16 attention kernels (graft/kernels/cpu_avx512.py) against exact attention and torch.

The prefill kernel must give causal attention over exactly the keys each query may see (its position and
the ones before it, the queries being the last lq of lk tokens), for any lengths around its
64-key blocks and 16-query tiles, any grouping of heads, strided views as the model hands them
over, and scores from flat to one-hot; to the precision of a bf16 flash attention, which is what
torch's own SDPA gives in bf16. The decode kernel must give what its twin
`decode_attention_varlen` gives over exactly each sequence's cached tokens, read in place through
shuffled block tables, and refuse a table or a length that would read outside the cache.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from graft.kernels import cpu_avx512, dispatch, native_build
from graft.kernels import torch_attention as TA

HAS_ISA = cpu_avx512.cpu_supported(native_build.cpu_flags())
needs_isa = pytest.mark.skipif(not HAS_ISA, reason="this CPU has no AVX-512 BF16 (the engine uses torch's SDPA)")


@pytest.fixture(autouse=True)
def fresh_library():
    cpu_avx512.library.cache_clear()
    yield
    cpu_avx512.library.cache_clear()


def exact(q, k, v, scale):
    """Attention in float64 over the bf16 values, query i seeing keys 0..lk - lq + i."""
    lq, h, _ = q.shape
    lk, n_kv, _ = k.shape
    q64, k64, v64 = q.double(), k.double(), v.double()
    out = torch.empty(lq, h, q.shape[2], dtype=torch.float64)
    for qh in range(h):
        kh = qh // (h // n_kv)
        scores = q64[:, qh] @ k64[:, kh].T * scale
        late = torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1)
        out[:, qh] = scores.masked_fill(late, float("-inf")).softmax(-1) @ v64[:, kh]
    return out


def inputs(lq, lk, heads=9, n_kv=3, seed=0, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(lq, heads, 64, generator=gen) * spread).bfloat16()
    k = torch.randn(lk, n_kv, 64, generator=gen).bfloat16()
    v = torch.randn(lk, n_kv, 64, generator=gen).bfloat16()
    return q, k, v


SHAPES = [(1, 1), (1, 64), (1, 65), (3, 70), (16, 16), (17, 17), (64, 64), (65, 65), (63, 129),
          (100, 1000), (513, 700), (1000, 1000)]


@needs_isa
@pytest.mark.parametrize("lq,lk", SHAPES)
def test_matches_exact_attention_as_closely_as_torch_sdpa_in_bf16(lq, lk):
    q, k, v = inputs(lq, lk, seed=lq * 7 + lk)
    want = exact(q, k, v, 0.125)
    got = cpu_avx512.prefill_attention(q, k, v, 0.125)
    sdpa = TA.prefill_attention_fused(q, k, v, 0.125)
    assert got.shape == (lq, 9, 64) and got.dtype == torch.bfloat16
    err, sdpa_err = (got.double() - want).abs().max().item(), (sdpa.double() - want).abs().max().item()
    # bf16 output rounding alone is up to 2^-9 of a value; the kernel may not be worse than torch
    assert err <= max(1.25 * sdpa_err, 4e-3), (err, sdpa_err)


@needs_isa
@pytest.mark.parametrize("heads,n_kv", [(9, 3), (8, 1), (4, 4), (12, 2)])
def test_every_grouping_of_query_heads(heads, n_kv):
    q, k, v = inputs(37, 150, heads, n_kv, seed=heads)
    got = cpu_avx512.prefill_attention(q, k, v, 0.125)
    torch.testing.assert_close(got.double(), exact(q, k, v, 0.125), atol=1e-2, rtol=1e-2)


@needs_isa
def test_strided_views_of_a_fused_projection_give_what_contiguous_copies_give():
    """The model splits one QKV matmul's output: q, k and v are views with a token stride of 960."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(90, 9 * 64 + 2 * 3 * 64, generator=gen).bfloat16()
    q, k, v = (t.view(90, -1, 64) for t in qkv.split([576, 192, 192], dim=-1))
    assert not k.is_contiguous() and not v.is_contiguous()
    got = cpu_avx512.prefill_attention(q, k, v, 0.125)
    assert torch.equal(got, cpu_avx512.prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125))


@needs_isa
def test_each_query_sees_its_own_position_and_nothing_later():
    q, k, v = inputs(40, 100, seed=5)
    out = cpu_avx512.prefill_attention(q, k, v, 0.125)
    for i in (0, 1, 15, 16, 17, 39):
        seen = 100 - 40 + i + 1
        alone = cpu_avx512.prefill_attention(q[i:i + 1], k[:seen], v[:seen], 0.125)
        assert torch.equal(out[i], alone[0])
    # a later key changed: the rows before it are untouched, bit for bit
    k2, v2 = k.clone(), v.clone()
    k2[90:], v2[90:] = 100.0, -100.0
    changed = cpu_avx512.prefill_attention(q, k2, v2, 0.125)
    assert torch.equal(changed[:30], out[:30]) and not torch.equal(changed[30:], out[30:])


@needs_isa
@pytest.mark.parametrize("spread", [0.0, 30.0])
def test_flat_and_one_hot_scores(spread):
    """All-equal scores average the values; sharply peaked ones pick one value (no NaN, no overflow)."""
    q, k, v = inputs(70, 130, seed=9, spread=spread)
    got = cpu_avx512.prefill_attention(q, k, v, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), exact(q, k, v, 1.0), atol=2e-2, rtol=2e-2)


@needs_isa
def test_refuses_what_it_does_not_take():
    q, k, v = inputs(4, 8)
    assert cpu_avx512.supports_prefill(q, k, v)
    assert not cpu_avx512.supports_prefill(q.float(), k.float(), v.float())              # fp32: torch's SDPA
    assert not cpu_avx512.supports_prefill(q[..., :32], k[..., :32], v[..., :32])       # head size 32
    assert not cpu_avx512.supports_prefill(*inputs(9, 8))                               # more queries than keys
    assert not cpu_avx512.supports_prefill(q, k, v[:7])                                  # k and v disagree
    wide = torch.randn(4, 9, 128).bfloat16()[..., ::2]                            # last dim strided
    assert not cpu_avx512.supports_prefill(wide, k, v)
    with pytest.raises(native_build.NativeKernelError, match="does not take"):
        cpu_avx512.prefill_attention(q.float(), k.float(), v.float(), 0.125)
    # and the engine's slot routes what the kernel refuses to SDPA, with the same answer
    q32, k32, v32 = q.float(), k.float(), v.float()
    torch.testing.assert_close(dispatch.prefill_attention_fast(q32, k32, v32, 0.125),
                               TA.prefill_attention_fused(q32, k32, v32, 0.125))


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("GRAFT_NATIVE_KERNELS", "off")
    assert cpu_avx512.library() is None and not cpu_avx512.supports_prefill(*inputs(4, 8))


def test_a_cpu_without_avx512_bf16_keeps_torch_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr("graft.kernels.native_build.cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    with caplog.at_level(logging.INFO, logger="graft.kernels.cpu_avx512"):
        assert cpu_avx512.library() is None
    assert "avx512_bf16" in caplog.text
    q, k, v = inputs(5, 9)
    torch.testing.assert_close(dispatch.prefill_attention_fast(q, k, v, 0.125), TA.prefill_attention_fused(q, k, v, 0.125))


@needs_isa
def test_a_failed_build_leaves_the_torch_path_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("GRAFT_KERNEL_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="graft.kernels.native_build"):
        assert cpu_avx512.library() is None
    assert "could not build the AVX-512 attention kernels" in caplog.text


def test_compiled_without_the_native_march():
    assert not any("march" in f for f in cpu_avx512.ISA_FLAGS + native_build.BASE_FLAGS)
    assert cpu_avx512.cpu_supported({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma", "sse4_2"})
    assert not cpu_avx512.cpu_supported({"avx512f", "avx512bw", "avx512vl", "fma"})


@needs_isa
def test_the_model_in_bf16_is_as_close_to_float32_attention_through_the_kernel_as_through_sdpa():
    """SmolLM2 in bf16 prefills a 3-shot BBH prompt (700 tokens: one chunk, then a chunk after
    cached context) with its attention in float32, through SDPA in bf16 and through the kernel.
    bf16 rounds every hidden state, so neither matches float32 attention exactly (about 1.4% of the
    logits' range on average here); the kernel may not stray further than torch's SDPA does."""
    from graft.bench.data import bbh_prompts
    from graft.engine.config import EngineConfig
    from graft.engine.engine import LLMEngine
    from tests.support import data_dir

    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_memory=64 << 20))
    assert engine.slots["attention.prefill"] is dispatch.prefill_attention_fast and cpu_avx512.available()
    ids = engine.tokenizer.encode(bbh_prompts(data_dir(), ["date_understanding"])[0].text)[:700]
    blocks = list(range(11))

    def logits(prefill):
        return engine.runner.probe_logits(ids, engine.slots.with_slots({"attention.prefill": prefill}), blocks)

    exact32 = logits(lambda q, k, v, s: TA.prefill_attention_fused(q.float(), k.float(), v.float(), s).to(q.dtype))
    scale = exact32.abs().amax(-1)

    def stray(x):
        return (x - exact32).abs().amax(-1) / scale, (x.argmax(-1) == exact32.argmax(-1)).float().mean()

    (kernel, kernel_agree), (sdpa, sdpa_agree) = stray(logits(dispatch.prefill_attention_fast)), stray(logits(TA.prefill_attention_fused))
    assert kernel.mean() <= 1.1 * sdpa.mean() and kernel.max() <= 1.25 * sdpa.max(), (kernel.mean(), sdpa.mean())
    assert kernel_agree >= sdpa_agree - 0.01 and kernel_agree > 0.95


# ---- decode ----


def paged(lengths, n_kv=3, seed=0, spare=3):
    """bf16 caches holding `lengths` tokens in shuffled blocks, spare blocks full of other data."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // 64) for n in lengths]
    num_blocks = sum(need) + spare
    k_cache = torch.randn(num_blocks, 64, n_kv, 64, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, 64, n_kv, 64, generator=gen).bfloat16()
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n])
        at += n
    width = max(need)
    return k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


DECODE_CASES = [
    ([1], 9, 3), ([2, 15, 16, 17], 9, 3), ([5, 64, 65, 130], 9, 3), ([300, 1, 77, 128, 129, 2], 4, 4),
    ([63, 640, 1], 8, 1), ([2517, 559, 997], 9, 3), ([1000] * 16, 9, 3), ([33], 16, 1),
]


@needs_isa
@pytest.mark.parametrize("lengths,heads,n_kv", DECODE_CASES)
def test_decode_matches_its_twin_over_shuffled_blocks(lengths, heads, n_kv):
    k_cache, v_cache, tables = paged(lengths, n_kv, seed=len(lengths) + heads)
    q = torch.randn(len(lengths), heads, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = cpu_avx512.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 0.125)
    # the twin in float32 over the same bf16 values: the kernel's only rounding is its bf16 output
    want = TA.decode_attention_varlen(q.float(), k_cache.float(), v_cache.float(), tables, lengths, 0.125, None)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=4e-3, rtol=8e-3)


@needs_isa
def test_decode_reads_nothing_past_a_sequence_and_nothing_outside_the_cache():
    k_cache, v_cache, tables = paged([100], spare=0)
    q = torch.randn(1, 9, 64).bfloat16()
    before = cpu_avx512.paged_decode_attention(q, k_cache, v_cache, tables, [70], 0.125)
    k_cache[tables[0, 1], 6:], v_cache[tables[0, 1], 6:] = 1e4, -1e4     # tokens 70.. of the sequence
    assert torch.equal(cpu_avx512.paged_decode_attention(q, k_cache, v_cache, tables, [70], 0.125), before)
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(native_build.NativeKernelError, match="outside the cache"):
        cpu_avx512.paged_decode_attention(q, k_cache, v_cache, bad, [100], 0.125)
    with pytest.raises(native_build.NativeKernelError, match="length"):
        cpu_avx512.paged_decode_attention(q, k_cache, v_cache, tables, [129], 0.125)
    with pytest.raises(native_build.NativeKernelError, match="length"):
        cpu_avx512.paged_decode_attention(q, k_cache, v_cache, tables, [0], 0.125)


@needs_isa
def test_decode_refuses_what_it_does_not_take():
    k_cache, v_cache, tables = paged([10])
    q = torch.randn(1, 9, 64).bfloat16()
    assert cpu_avx512.supports_decode(q, k_cache, v_cache)
    assert not cpu_avx512.supports_decode(q.float(), k_cache.float(), v_cache.float())
    assert not cpu_avx512.supports_decode(torch.randn(1, 10, 64).bfloat16(), k_cache, v_cache)  # 10 over 3
    one_kv = paged([10], n_kv=1)
    assert not cpu_avx512.supports_decode(torch.randn(1, 17, 64).bfloat16(), *one_kv[:2])   # a group of 17
    assert not cpu_avx512.supports_decode(q, k_cache[..., :32].contiguous(), v_cache[..., :32].contiguous())
    with pytest.raises(native_build.NativeKernelError, match="does not take"):
        cpu_avx512.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, [10], 0.125)
