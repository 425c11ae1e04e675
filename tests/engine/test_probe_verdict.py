"""The self-check's judgement of probe logits, in full and in 16-bit precision, part by part."""
import torch

from graft.engine.patches.manager import LOW_PRECISION_MEAN_DIFF, ProbeFigures, probe_verdict, row_stats
from graft.engine.runner import ProbeRow


def logits(seed: int = 0, rows: int = 24) -> torch.Tensor:
    return torch.randn(rows, 1000, generator=torch.Generator().manual_seed(seed)) * 4


def test_fp32_accepts_rounding_and_refuses_a_drift_beyond_tolerance():
    base = logits()
    assert probe_verdict(base, base + 1e-5, 1e-3, torch.float32) is None
    nudged = base.clone()
    nudged[3, 7] += 0.01
    assert "differ by 0.01 at position 3" in probe_verdict(base, nudged, 1e-3, torch.float32)


def test_bf16_accepts_summation_noise_but_not_a_different_model():
    base = logits()
    noisy = base + torch.randn_like(base) * 0.1
    assert probe_verdict(base, noisy, 1e-3, torch.bfloat16) is None
    assert "top token" in probe_verdict(base, base * 0.5 + logits(1), 1e-3, torch.bfloat16)


def test_bf16_refuses_a_mean_divergence_beyond_its_limit_even_when_the_top_token_always_agrees():
    base = logits()
    top = base.argmax(-1, keepdim=True)
    # every logit moved down by twice the limit, except each row's top token: the argmax never changes
    shifted = base - 2 * LOW_PRECISION_MEAN_DIFF
    shifted.scatter_(-1, top, base.gather(-1, top))
    stats = row_stats(base, shifted)
    assert stats[:, 2].min() == 1   # the top token agrees on every position
    verdict = probe_verdict(base, shifted, 1e-3, torch.bfloat16)
    assert verdict is not None and "on average" in verdict, verdict


def test_bf16_judges_each_part_on_its_own():
    """A change confined to a few long decodes must not hide behind the many positions it gets right."""
    base = logits(rows=200)
    rows = [ProbeRow("prefill A", f"prefill A at position {i}") for i in range(192)]
    rows += [ProbeRow("decode A", f"decode A at context {193 + i}") for i in range(8)]
    wrong = base.clone()
    wrong[192:] += torch.randn(8, 1000, generator=torch.Generator().manual_seed(2)) * 3
    figures = ProbeFigures.of(row_stats(base, wrong))
    assert figures.mean <= LOW_PRECISION_MEAN_DIFF   # diluted over all 200 positions, it would pass
    verdict = probe_verdict(base, wrong, 1e-3, torch.bfloat16, rows)
    assert verdict is not None and "decode A" in verdict, verdict
    # one near-tie flipped among eight decodes is rounding, not a different model
    flipped = base.clone()
    a, b = base[195].topk(2).indices.tolist()
    flipped[195, a], flipped[195, b] = base[195, b], base[195, a]
    assert probe_verdict(base, flipped, 1e-3, torch.bfloat16, rows) is None


def test_the_figures_name_the_worst_place_and_every_part():
    base = logits(rows=4)
    rows = [ProbeRow("prefill A", "prefill A at position 0"), ProbeRow("prefill A", "prefill A at position 1"),
            ProbeRow("decode A", "decode A at context 3"), ProbeRow("decode B", "decode B at context 2")]
    after = base.clone()
    after[2, 5] += 0.5
    figures = ProbeFigures.of(row_stats(base, after), rows)
    assert figures.positions == 4 and figures.worst_at == "decode A at context 3"
    assert abs(figures.worst - 0.5) < 1e-5 and abs(figures.mean - 0.5 / 4000) < 1e-6
    assert [p.part for p in figures.parts] == ["prefill A", "decode A", "decode B"]
    assert [p.positions for p in figures.parts] == [2, 1, 1]
    assert figures.worst_part.part == "decode A"
    described = figures.describe()
    assert described["worstAt"] == "decode A at context 3" and described["agreement"] == 1.0
    assert "4 positions compared" in figures.words() and "decode A at context 3" in figures.words()


def test_non_finite_logits_are_always_refused():
    base = logits()
    broken = base.clone()
    broken[0, 0] = float("nan")
    assert probe_verdict(base, broken, 10.0, torch.bfloat16) == "probe logits are not finite (position 0)"
    assert ProbeFigures.of(row_stats(base, broken)).describe()["worst"] is None   # JSON has no NaN
