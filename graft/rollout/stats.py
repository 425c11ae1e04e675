"""The statistics behind the analysis: confidence bounds on error rates and their difference.

A rollout sees counts (errors out of requests), not rates. One error in 40 canary requests is not a
2.5% error rate; it is weak evidence of a rate somewhere between almost nothing and several
percent. The checks therefore judge bounds, one-sided, at a stated confidence:

- one rate against a limit: the exact (Clopper-Pearson) bounds of a binomial proportion;
- canary against stable: Newcombe's hybrid score interval for the difference of two proportions
  (built from Wilson score bounds; well behaved at the very low rates an inference fleet has),
  with Fisher's exact test reported beside it as the p-value that the canary is worse at all.

Everything here is pure and deterministic; scipy supplies the distributions. Its quantiles and
Fisher's sums cost tens of microseconds each and a rollout (or a simulation of thousands) asks the
same counts again run after run, so they are remembered per (counts, confidence) (`_CACHE` entries
each).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from scipy import stats as _st


def _alpha(confidence: float) -> float:
    """1 - confidence, refusing a confidence no one-sided bound means anything at: below one half
    the "upper" bound falls under the estimate, and at 1 (or NaN) there is no bound at all."""
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence must be in [0.5, 1), not {confidence}")
    return 1.0 - confidence


_CACHE = 1 << 16


def rate_lower(k: float, n: float, confidence: float) -> float:
    """One-sided lower bound of a binomial proportion (Clopper-Pearson): the rate is at least this."""
    alpha = _alpha(confidence)
    k, n = _counts(k, n)
    if k == 0 or n == 0:
        return 0.0
    return _beta_quantile(alpha, k, n - k + 1)


def rate_upper(k: float, n: float, confidence: float) -> float:
    """One-sided upper bound of a binomial proportion (Clopper-Pearson): the rate is at most this."""
    alpha = _alpha(confidence)
    k, n = _counts(k, n)
    if n == 0 or k >= n:
        return 1.0
    return _beta_quantile(1.0 - alpha, k + 1, n - k)


@lru_cache(maxsize=_CACHE)
def _beta_quantile(q: float, a: int, b: int) -> float:
    return float(_st.beta.ppf(q, a, b))


@lru_cache(maxsize=64)
def _z(confidence: float) -> float:
    return float(_st.norm.ppf(1 - _alpha(confidence)))


def min_samples(limit: float, confidence: float) -> int:
    """The fewest requests that can show a rate is at most `limit` (with no error at all).

    With zero errors in n requests the exact upper bound is 1 - alpha^(1/n); it reaches `limit` at
    n = ln(alpha) / ln(1 - limit) (about 3 / limit at 95%: the "rule of three").
    """
    alpha = _alpha(confidence)
    if limit <= 0:
        return math.inf  # type: ignore[return-value]
    if limit >= 1:
        return 1
    return math.ceil(math.log(alpha) / math.log1p(-limit))


def _wilson(k: float, n: float, z: float) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(slots=True, frozen=True)
class Difference:
    """Canary minus stable error rate, with one-sided bounds and Fisher's p-value."""

    canary_errors: int
    canary_requests: int
    stable_errors: int
    stable_requests: int
    lower: float        # at `confidence`: the difference is at least this
    upper: float        # at `confidence`: the difference is at most this
    p_worse: float      # Fisher's exact one-sided p-value for "the canary errs more often"

    @property
    def canary_rate(self) -> float:
        return self.canary_errors / self.canary_requests if self.canary_requests else math.nan

    @property
    def stable_rate(self) -> float:
        return self.stable_errors / self.stable_requests if self.stable_requests else math.nan

    @property
    def estimate(self) -> float:
        return self.canary_rate - self.stable_rate


def difference(canary_errors: float, canary_requests: float, stable_errors: float,
               stable_requests: float, confidence: float) -> Difference:
    """Bounds on (canary rate - stable rate), one-sided at `confidence` each way (Newcombe, method 10)."""
    k1, n1 = _counts(canary_errors, canary_requests)
    k2, n2 = _counts(stable_errors, stable_requests)
    z = _z(confidence)
    p1 = k1 / n1 if n1 else 0.0
    p2 = k2 / n2 if n2 else 0.0
    l1, u1 = _wilson(k1, n1, z)
    l2, u2 = _wilson(k2, n2, z)
    d = p1 - p2
    lower = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    upper = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    return Difference(k1, n1, k2, n2, lower, upper, _p_worse(k1, n1, k2, n2))


FISHER_UP_TO = 200_000   # requests on both sides together: beyond, Fisher's sum costs seconds and more


@lru_cache(maxsize=_CACHE)
def _p_worse(k1: int, n1: int, k2: int, n2: int) -> float:
    """One-sided p-value for "the canary errs more often": Fisher's exact test while its sum over the
    hypergeometric tail stays cheap, the pooled two-proportion z-test (which it converges to) beyond."""
    if not n1 or not n2:
        return 1.0
    if n1 + n2 <= FISHER_UP_TO:
        return float(_st.fisher_exact([[k1, n1 - k1], [k2, n2 - k2]], alternative="greater")[1])
    pooled = (k1 + k2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    diff = k1 / n1 - k2 / n2
    if se == 0:
        return 0.0 if diff > 0 else 1.0
    return float(_st.norm.sf(diff / se))


MAX_COUNT = 10 ** 12   # no window holds more requests; the tests' integer types end near 2^63


def _counts(k: float, n: float) -> tuple[int, int]:
    """Counts as integers: Prometheus' increase() extrapolates, so counters arrive as floats. Counts
    past MAX_COUNT (a counter reset misread, a custom query's sum) are clamped to it, so the tests
    below get numbers they can work with instead of raising."""
    n_i = min(MAX_COUNT, max(0, int(round(n))))
    k_i = min(n_i, max(0, int(round(min(k, MAX_COUNT)))))
    return k_i, n_i
