"""The self-check's judgement of probe logits, in full and in 16-bit precision."""
import torch

from graft.engine.patches.manager import probe_verdict


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(24, 1000, generator=torch.Generator().manual_seed(seed)) * 4


def test_fp32_accepts_rounding_and_refuses_a_drift_beyond_tolerance():
    base = logits()
    assert probe_verdict(base, base + 1e-5, 1e-3, torch.float32) is None
    nudged = base.clone()
    nudged[3, 7] += 0.01
    assert "differ by 0.01" in probe_verdict(base, nudged, 1e-3, torch.float32)


def test_bf16_accepts_summation_noise_but_not_a_different_model():
    base = logits()
    noisy = base + torch.randn_like(base) * 0.1
    assert probe_verdict(base, noisy, 1e-3, torch.bfloat16) is None
    assert "top token" in probe_verdict(base, base * 0.5 + logits(1), 1e-3, torch.bfloat16)


def test_non_finite_logits_are_always_refused():
    base = logits()
    broken = base.clone()
    broken[0, 0] = float("nan")
    assert probe_verdict(base, broken, 10.0, torch.bfloat16) == "probe logits are not finite"
