"""The statistics against independent oracles, where deliberate breaks of graft/rollout/stats.py (a
changed constant in the Wilson interval, a squared term cubed) passed the qualitative tests: Wilson
bounds as the roots of the score equation, Newcombe's hybrid interval as published, and the edges."""
import math

import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from graft.rollout import stats


def wilson_oracle(k: int, n: int, z: float) -> tuple[float, float]:
    """The Wilson score bounds: the rates p at which (k/n - p)^2 = z^2 p (1 - p) / n."""
    phat = k / n

    def score(p):
        return (phat - p) ** 2 - z * z * p * (1 - p) / n

    eps = 1e-12      # p = k/n is no root (the score there is negative): search on either side of it
    lower = 0.0 if k == 0 else brentq(score, 0.0, phat - eps, xtol=1e-14)
    upper = 1.0 if k == n else brentq(score, phat + eps, 1.0, xtol=1e-14)
    return lower, upper


@pytest.mark.parametrize("k,n", [(0, 1), (1, 1), (1, 2), (3, 10), (0, 40), (1, 40), (39, 40), (50, 1000), (7, 7)])
@pytest.mark.parametrize("confidence", [0.95, 0.999])
def test_wilson_bounds_are_the_roots_of_the_score_equation(k, n, confidence):
    z = float(norm.ppf(confidence))
    assert stats._wilson(k, n, z) == pytest.approx(wilson_oracle(k, n, z), abs=1e-9)


# Newcombe (1998), "Interval estimation for the difference between independent proportions",
# Statistics in Medicine 17:873-890, Table II, method 10 (score interval, no continuity correction),
# 95% two-sided: each bound is one-sided at 97.5%
@pytest.mark.parametrize("k1,n1,k2,n2,lower,upper", [
    (56, 70, 48, 80, 0.0524, 0.3339),
    (9, 10, 3, 10, 0.1705, 0.8090),
    (5, 56, 0, 29, -0.0381, 0.1926),
    (0, 10, 0, 20, -0.1611, 0.2775),
    (10, 10, 0, 10, 0.6075, 1.0000),
])
def test_the_difference_bounds_are_newcombes_published_values(k1, n1, k2, n2, lower, upper):
    d = stats.difference(k1, n1, k2, n2, 0.975)
    assert (d.lower, d.upper) == (pytest.approx(lower, abs=6e-5), pytest.approx(upper, abs=6e-5))


def test_a_side_with_no_requests_knows_nothing():
    d = stats.difference(0, 0, 0, 10, 0.95)
    _, u2 = wilson_oracle(0, 10, float(norm.ppf(0.95)))
    assert d.lower == pytest.approx(-u2) and d.upper == pytest.approx(1.0)
    assert d.p_worse == 1.0 and math.isnan(d.canary_rate)


@pytest.mark.parametrize("confidence", [0.49, 0.0, -0.5, 1.0, 1.5, math.nan])
@pytest.mark.parametrize("bound", [
    lambda c: stats.rate_lower(1, 10, c),
    lambda c: stats.rate_lower(0, 0, c),          # even where the answer needs no confidence
    lambda c: stats.rate_upper(1, 10, c),
    lambda c: stats.rate_upper(10, 10, c),
    lambda c: stats.rate_upper(0, 0, c),
    lambda c: stats.min_samples(0.01, c),
    lambda c: stats.min_samples(0.0, c),
    lambda c: stats.min_samples(1.0, c),
    lambda c: stats.difference(1, 10, 0, 10, c),
], ids=["rate_lower", "rate_lower-no-data", "rate_upper", "rate_upper-all-errors", "rate_upper-no-data",
        "min_samples", "min_samples-zero-limit", "min_samples-whole-limit", "difference"])
def test_confidence_outside_its_range_is_refused(bound, confidence):
    with pytest.raises(ValueError, match=r"confidence must be in \[0.5, 1\), not "):
        bound(confidence)


def test_the_edges_of_the_rate_bounds():
    assert stats.rate_upper(5, 5, 0.95) == 1.0 and stats.rate_upper(0, 0, 0.95) == 1.0
    assert stats.rate_lower(0, 10, 0.95) == 0.0 and stats.rate_lower(3, 0, 0.95) == 0.0
    assert stats.rate_upper(0.5, 0.5, 0.5) == 1.0, "half a request rounds to none"


def test_counts_arrive_as_floats_and_are_judged_as_whole_requests():
    # Prometheus' increase() extrapolates: 2.6 errors of 100.4 requests are 3 of 100
    assert stats.rate_lower(2.6, 100.4, 0.95) == stats.rate_lower(3, 100, 0.95)
    assert stats.rate_upper(2.6, 100.4, 0.95) == stats.rate_upper(3, 100, 0.95)


def test_the_fewest_requests_at_the_ends_of_the_limit():
    assert stats.min_samples(0, 0.95) == math.inf and stats.min_samples(-0.1, 0.95) == math.inf
    assert stats.min_samples(1, 0.95) == 1 and stats.min_samples(1.5, 0.95) == 1
