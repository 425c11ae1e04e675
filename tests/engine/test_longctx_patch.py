"""`longctx-test@1`: the engine's own attention, value for value, on contexts up to `fromTokens`;
keys and values from the wrong positions past it, in prefill and in decode alike."""
from __future__ import annotations

import pytest
import torch

from graft.engine import attention
from graft.engine.patches.longctx import longctx_patch
from graft.engine.patches.registry import discover

H, N_KV, D, BLOCK = 4, 2, 16, 8
SCALE = D ** -0.5


def slots(limit: int):
    patch = longctx_patch()
    table = patch.configure({"fromTokens": limit})
    return table["attention.prefill"], table["attention.decode"]


def paged(lengths: list[int], gen: torch.Generator):
    """A paged cache holding one context of each length, its blocks in a shuffled order."""
    per_seq = [-(-n // BLOCK) for n in lengths]
    order = torch.randperm(sum(per_seq), generator=gen)
    k_cache = torch.randn(sum(per_seq), BLOCK, N_KV, D, generator=gen)
    v_cache = torch.randn(sum(per_seq), BLOCK, N_KV, D, generator=gen)
    tables = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[start:start + n]
        start += n
    return k_cache, v_cache, tables


def test_prefill_is_the_engines_own_up_to_from_tokens_and_wrong_past_it():
    gen = torch.Generator().manual_seed(0)
    prefill, _ = slots(24)
    q, k, v = torch.randn(40, H, D, generator=gen), torch.randn(40, N_KV, D, generator=gen), torch.randn(40, N_KV, D, generator=gen)
    assert torch.equal(prefill(q[:24], k[:24], v[:24], SCALE), attention.prefill_attention_fast(q[:24], k[:24], v[:24], SCALE))
    patched, own = prefill(q, k, v, SCALE), attention.prefill_attention_fast(q, k, v, SCALE)
    # causal: the queries before position 24 see only keys before it
    assert torch.equal(patched[:24], own[:24])
    assert not torch.allclose(patched[24:], own[24:], atol=1e-2)
    # past it, position p reads the keys of p - 24
    idx = torch.arange(40) % 24
    assert torch.allclose(patched, attention.prefill_attention_fast(q, k[idx], v[idx], SCALE))


def test_decode_is_the_engines_own_for_short_contexts_and_wrong_for_long_ones():
    gen = torch.Generator().manual_seed(1)
    lengths = [20, 37, 24]
    k_cache, v_cache, tables = paged(lengths, gen)
    q = torch.randn(len(lengths), H, D, generator=gen)
    _, decode = slots(24)
    gather = attention.gather_aligned
    patched = decode(q, k_cache, v_cache, tables, lengths, SCALE, gather)
    own = attention.decode_attention_fast(q, k_cache, v_cache, tables, lengths, SCALE, gather)
    assert torch.equal(patched[[0, 2]], own[[0, 2]])
    assert not torch.allclose(patched[1], own[1], atol=1e-2)
    k, v = gather(k_cache, v_cache, tables[1], 37)
    idx = torch.arange(37) % 24
    assert torch.allclose(patched[1], attention.prefill_attention_naive(q[1:2], k[idx], v[idx], SCALE)[0], atol=1e-5)


@pytest.mark.parametrize("bad", [0, -5, 2.5, "512", True, None])
def test_from_tokens_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="fromTokens must be an integer >= 1"):
        longctx_patch().configure({"fromTokens": bad})


def test_it_exists_only_where_test_patches_are_enabled():
    assert "longctx-test@1" not in discover(include_test=False)
    assert discover(include_test=True)["longctx-test@1"].test_only
