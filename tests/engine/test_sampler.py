"""The samplers: no accepted setting yields a NaN or a token outside the vocabulary."""
from __future__ import annotations

import pytest
import torch

from graft.engine.sampler import sample_batched, sample_per_row
from graft.engine.sequence import InvalidParam, SamplingParams

SAMPLERS = [sample_per_row, sample_batched]
VOCAB = 64


def peaked_logits(rows: int = 1, top: int = 7) -> torch.Tensor:
    """Logits of a confident model: token `top` far ahead, the rest spread out."""
    logits = torch.linspace(-5, 5, VOCAB).repeat(rows, 1)
    logits[:, top] = 30.0
    return logits


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("settings", [
    {"temperature": 1e-40}, {"temperature": 1e-30}, {"temperature": 1e-6}, {"temperature": 2e-5},
    {"top_p": 1e-40}, {"top_p": 1e-46}, {"top_p": 5e-324},
    {"temperature": 1e-40, "top_p": 1e-40, "top_k": 3},
])
def test_tiny_temperature_or_top_p_picks_the_most_likely_token(sampler, settings):
    params = SamplingParams(**settings, seed=1)
    gen = torch.Generator().manual_seed(1)
    assert sampler(peaked_logits(), [params], [gen]) == [7]


# a model unsure between four tokens: 0.5, 0.25, 0.15, 0.1 (the prefix masses are 0.5, 0.75, 0.9)
UNSURE = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()


def drawn(sampler, params: SamplingParams, draws: int = 300) -> set[int]:
    """The tokens seen in `draws` samples of UNSURE, each with a seed of its own."""
    return {tok for seed in range(draws) for tok in sampler(UNSURE, [params], [torch.Generator().manual_seed(seed)])}


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("settings, kept", [
    ({"top_p": 0.4}, {0}), ({"top_p": 0.6}, {0, 1}), ({"top_p": 0.8}, {0, 1, 2}), ({"top_p": 1.0}, {0, 1, 2, 3}),
    ({"top_k": 1}, {0}), ({"top_k": 2}, {0, 1}), ({"top_k": 3}, {0, 1, 2}),
    ({"top_k": 3, "top_p": 0.6}, {0, 1}), ({"top_k": 2, "top_p": 0.8}, {0, 1}),
])
def test_top_p_and_top_k_sample_from_exactly_the_tokens_they_keep(sampler, settings, kept):
    # top_p keeps the smallest prefix whose mass reaches it, top_k the k most likely; both apply
    assert drawn(sampler, SamplingParams(temperature=1.0, **settings)) == kept


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_seed_gives_the_same_draws_and_another_seed_others(sampler):
    params = SamplingParams(temperature=1.0)

    def draws(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [tok for _ in range(40) for tok in sampler(UNSURE, [params], [gen])]
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_top_k_beyond_the_vocabulary_means_no_cut(sampler):
    logits = torch.zeros(1, VOCAB)  # uniform: every token possible
    params = SamplingParams(top_k=10**30, temperature=1.0)
    seen = {tok for _ in range(200) for tok in sampler(logits, [params], [None])}
    assert len(seen) > VOCAB // 2 and all(0 <= t < VOCAB for t in seen)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_huge_logits_stay_finite_at_the_smallest_sampled_temperature(sampler):
    logits = peaked_logits()
    logits[0, 3] = 3e4
    params = SamplingParams(temperature=1e-5)  # just above greedy: logits / t would be 3e9
    assert sampler(logits, [params], [None]) == [3]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_batch_mixing_extreme_settings_samples_every_row(sampler):
    params = [SamplingParams(temperature=1e-40), SamplingParams(top_p=1e-45, temperature=2.0),
              SamplingParams(top_k=10**6), SamplingParams(temperature=0.0), SamplingParams(seed=2**63 - 1)]
    gens = [None, None, None, None, torch.Generator().manual_seed(2**63 - 1)]
    tokens = sampler(peaked_logits(len(params)), params, gens)
    assert tokens[:2] == [7, 7] and tokens[3] == 7
    assert all(0 <= t < VOCAB for t in tokens)


@pytest.mark.parametrize("settings, param", [
    ({"seed": 2**63}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_p": float("nan")}, "top_p"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"logprobs": 21}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
])
def test_sampling_params_refuse_what_the_sampler_cannot_honour(settings, param):
    with pytest.raises(InvalidParam) as err:
        SamplingParams(**settings)
    assert err.value.param == param


def test_the_extreme_seeds_are_accepted_by_torch():
    for seed in (-(2**63), 2**63 - 1, 0):
        SamplingParams(seed=seed)
        torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_without_top_k_or_top_p_nothing_is_sorted_and_the_draw_is_the_same(sampler, monkeypatch):
    """Plain temperature sampling (OpenAI's default) skips the vocabulary sort, and draws what the
    filter would have let through: the same seeds give the same tokens as a top_p that keeps all
    four tokens of UNSURE (its last prefix mass is 0.9), which does go through the filter."""
    import graft.engine.sampler as S
    calls = []
    real = S._filter_logits
    monkeypatch.setattr(S, "_filter_logits", lambda *a: calls.append(1) or real(*a))

    def draws(params: SamplingParams) -> list[int]:
        gens = [torch.Generator().manual_seed(3 + i) for i in range(2)]
        return [tok for _ in range(30) for tok in sampler(UNSURE.repeat(2, 1), [params, params], gens)]
    plain = draws(SamplingParams(temperature=0.8))
    assert calls == []
    keeps_all = draws(SamplingParams(temperature=0.8, top_p=0.999))
    assert calls and plain == keeps_all and set(plain) == {0, 1, 2, 3}


def _seeded(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("patched", [False, True], ids=["base-sampler", "patched-sampler"])
def test_a_failed_batch_rewinds_the_seeded_generators_so_each_row_gets_its_own_tokens(patched):
    """A sampler that draws from every row's generator and then raises: the batch is sampled again
    (row by row, or by the base sampler under a patch) from the generators as they were, so a
    seeded request gets the very tokens it would have had without the failure."""
    from graft.engine.engine import GuardedSampler

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.9, seed=s) for s in (11, 12, 13, 14)]
    expected = sample_batched(logits, params, _seeded((11, 12, 13, 14)))

    def draws_then_raises(logits, params, generators):
        for gen in generators:
            torch.rand(8, generator=gen)          # the generators moved on...
        raise RuntimeError("broken after drawing")   # ...and the batch failed

    if patched:
        guarded = GuardedSampler(draws_then_raises, vocab_size=50, fallback=sample_batched)
    else:
        guarded = GuardedSampler(sample_batched, vocab_size=50)
        real = guarded.sampler
        calls = []

        def first_call_fails(logits, params, generators):
            calls.append(len(params))
            if len(calls) == 1:
                return draws_then_raises(logits, params, generators)
            return real(logits, params, generators)
        guarded.sampler = first_call_fails
    tokens = guarded(logits, params, _seeded((11, 12, 13, 14)))
    assert tokens == expected
    # and the generators are left where a clean batch leaves them: the next step agrees too
    clean, rerun = _seeded((11, 12, 13, 14)), _seeded((11, 12, 13, 14))
    sample_batched(logits, params, clean)
    guarded(logits, params, rerun)
    assert [g.get_state().tolist() == c.get_state().tolist() for g, c in zip(rerun, clean)] == [True] * 4
