"""Judging metric checks: one verdict per check per run, and one verdict per run.

A check is Successful (within its threshold), Failed (breached), Inconclusive (no data: nothing
returned, or fewer than `minRequests` requests in its window), Error (the provider failed) or
Skipped (a canary-vs-stable comparison once no stable pod is left). What "no data" means is the
rollout's `noData` policy: hold (Inconclusive), fail (a breach) or pass (Successful).

Breaches count up on each Failed run and reset on a Successful one; Inconclusive and Error leave
the count as it was. A run is Failed once any check reaches its `consecutive` limit, and only a
run where every check passes lets a step advance. Dry-run checks are judged and reported but never
decide anything.
"""
from __future__ import annotations

import math

from graft.rollout.observation import Measurement
from graft.rollout.spec import Analysis, MetricCheck
from graft.rollout.status import CheckResult

SUCCESSFUL, FAILED, INCONCLUSIVE, ERROR, SKIPPED = "Successful", "Failed", "Inconclusive", "Error", "Skipped"


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def judge(check: MetricCheck, m: Measurement | None, analysis: Analysis, *,
          previous: CheckResult | None, stable_pods: bool) -> CheckResult:
    """The verdict of one check for one run, carrying its breach count forward from `previous`."""
    breaches = previous.breaches if previous else 0
    result = CheckResult(check.name, INCONCLUSIVE, check.threshold, check.window_text,
                         breaches=breaches, dry_run=check.dry_run)
    if check.comparison and not stable_pods:
        result.verdict, result.breaches = SKIPPED, 0
        result.message = "no stable pods left to compare with"
        return result
    if m is None or m.error:
        result.verdict = ERROR
        result.message = m.error if m is not None else "not measured"
        return result
    gap = _traffic_gap(check, m, analysis.min_requests)
    if gap is None and (m.value is None or math.isnan(m.value)):
        gap = "the query returned no data"
    if gap is not None:
        return _no_data(result, check, analysis.no_data, gap)
    result.value = m.value
    if check.breached(m.value):
        result.verdict, result.breaches = FAILED, breaches + 1
        result.message = (f"{check.name} {_fmt(m.value)} breaches {check.threshold} over {check.window_text} "
                          f"(breach {result.breaches}/{check.consecutive})")
    else:
        result.verdict, result.breaches = SUCCESSFUL, 0
        result.message = f"{check.name} {_fmt(m.value)} within {check.threshold}"
    return result


def _traffic_gap(check: MetricCheck, m: Measurement, min_requests: int) -> str | None:
    if m.requests is not None and m.requests < min_requests:
        return f"{m.requests:.0f} canary requests in {check.window_text}, fewer than minRequests {min_requests}"
    if m.stable_requests is not None and m.stable_requests < min_requests:
        return f"{m.stable_requests:.0f} stable requests in {check.window_text}, fewer than minRequests {min_requests}"
    return None


def _no_data(result: CheckResult, check: MetricCheck, policy: str, why: str) -> CheckResult:
    if policy == "pass":
        result.verdict, result.breaches = SUCCESSFUL, 0
        result.message = f"no data ({why}); noData: pass"
    elif policy == "fail":
        result.verdict, result.breaches = FAILED, result.breaches + 1
        result.message = f"no data ({why}); noData: fail (breach {result.breaches}/{check.consecutive})"
    else:
        result.verdict = INCONCLUSIVE
        result.message = f"no data ({why}); noData: hold"
    return result


def run(analysis: Analysis, measurements: list[Measurement], previous: list[CheckResult], *,
        stable_pods: bool) -> tuple[str, list[CheckResult]]:
    """Judge every check of `analysis`; returns the run's verdict and the per-check results."""
    by_name = {m.name: m for m in measurements}
    prev = {r.name: r for r in previous}
    results = [judge(c, by_name.get(c.name), analysis, previous=prev.get(c.name), stable_pods=stable_pods)
               for c in analysis.metrics]
    return verdict_of(analysis, results), results


def verdict_of(analysis: Analysis, results: list[CheckResult]) -> str:
    """Failed if a check reached its consecutive limit; Successful only if every deciding check passed."""
    limits = {c.name: c.consecutive for c in analysis.metrics}
    deciding = [r for r in results if not r.dry_run and r.verdict != SKIPPED]
    if any(r.verdict == FAILED and r.breaches >= limits.get(r.name, 1) for r in deciding):
        return FAILED
    if any(r.verdict == ERROR for r in deciding):
        return ERROR
    if any(r.verdict != SUCCESSFUL for r in deciding):
        return INCONCLUSIVE
    return SUCCESSFUL


def failing(analysis: Analysis, results: list[CheckResult]) -> list[CheckResult]:
    """The deciding checks that reached their limit: what a rollback is blamed on."""
    limits = {c.name: c.consecutive for c in analysis.metrics}
    return [r for r in results if not r.dry_run and r.verdict == FAILED and r.breaches >= limits.get(r.name, 1)]
