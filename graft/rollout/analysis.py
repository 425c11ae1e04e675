"""Judging checks: one verdict per check per run, and what the run means for the step.

Two kinds of check (graft.rollout.spec):

- a **breaker** is an absolute limit that rolls back: it counts breaches, resets on a clean run, and
  rolls the rollout back once it has breached `consecutive` runs in a row;
- a **gate** is a criterion the step must meet to advance: while it fails the step waits, and it
  rolls back only on conclusive evidence (the canary's error rate shown, at `rollbackConfidence`, to
  exceed the limit).

Counts are judged as counts. An error-rate check compares confidence bounds of the canary's rate
with its limit, not the raw ratio, so one error in 40 requests is not a 2.5% error rate; a
canary-vs-stable comparison bounds the difference of the two rates (graft.rollout.stats);
`output-divergence` bounds the share of the canary's shadow comparisons (its requests re-run through
the table it ran before the patch) that diverged, on the canary alone. A gate is
Successful only once the traffic shows, at `confidence`, that it holds; until then it is
Inconclusive, and the smallest traffic that could settle it follows from its threshold.

Per check: Successful, Failed, Inconclusive (not enough traffic, or no data under `noData: hold`),
Error (the provider failed) or Skipped (a comparison once no stable pod is left). Dry-run checks are
judged and reported but decide nothing.

Per run (`verdict_of`): Failed (roll back), Error (the provider failed: hold), Successful (the step
may advance) or Inconclusive (hold). A gate that lacks traffic holds only the last step that still
has stable pods to compare with: small early steps cannot gather the evidence, and the patch never
reaches all pods without it.
"""
from __future__ import annotations

import math

from graft.api import Verdict
from graft.rollout import stats
from graft.rollout.observation import Measurement
from graft.rollout.queries import QUANTILES, Context, Series, plan
from graft.rollout.spec import BREAKER, GATE, ROLLOUT_WINDOW, Analysis, Check, RolloutSpec
from graft.rollout.status import CheckResult, RolloutStatus

SUCCESSFUL, FAILED, INCONCLUSIVE = Verdict.SUCCESSFUL.value, Verdict.FAILED.value, Verdict.INCONCLUSIVE.value
ERROR, SKIPPED = Verdict.ERROR.value, Verdict.SKIPPED.value


def window_of(check: Check, spec: RolloutSpec, status: RolloutStatus, now: float) -> float:
    """Seconds the check looks back: its window, or for `window: step` the time since the step was in
    place, for `window: rollout` since the rollout started (at least one interval, so the first run of
    a step has something to judge)."""
    if check.window is not None:
        return check.window
    since = status.step_ready_at
    if check.window_text == ROLLOUT_WINDOW and status.started_at is not None:
        since = status.started_at
    if since is None:
        since = now
    return max(float(math.ceil(now - since)), math.ceil(spec.analysis.interval))


def plan_run(spec: RolloutSpec, status: RolloutStatus, namespace: str, now: float) -> list[tuple[Check, list[Series]]]:
    """Every check of the rollout with the numbers it needs now (the operator and the simulator share it)."""
    ctx = Context(namespace, status.canary_revision, status.stable_revision, spec.patch.name, spec.patch.version)
    return [(c, plan(c, ctx, window_of(c, spec, status, now))) for c in spec.analysis.checks]


def _pct(rate: float) -> str:
    return f"{rate * 100:.3g}%"


def _pp(diff: float) -> str:
    return f"{diff * 100:+.3g} pp"


def _fmt(value: float) -> str:
    return f"{value:.4g}"


class _Outcome:
    """What a judging function found: a verdict, the value to report, the numbers, a sentence."""

    def __init__(self, verdict: str, message: str, value: float | None = None, *,
                 conclusive: bool = False, short: bool = False, **numbers: float):
        self.verdict, self.message, self.value = verdict, message, value
        self.conclusive, self.short = conclusive, short   # short: Inconclusive for lack of traffic
        self.numbers = {k: v for k, v in numbers.items() if v is not None and math.isfinite(v)}


def judge(check: Check, m: Measurement | None, analysis: Analysis, *,
          previous: CheckResult | None, stable_pods: bool) -> CheckResult:
    """The verdict of one check for one run, carrying a breaker's breach count forward."""
    breaches = previous.breaches if previous else 0
    result = CheckResult(check.name, INCONCLUSIVE, check.threshold, check.window_text,
                         breaches=breaches, dry_run=check.dry_run, role=check.role)
    if check.comparison and not stable_pods:
        result.verdict, result.breaches = SKIPPED, 0
        result.message = f"{check.name}: no stable pods left to compare with"
        return result
    if m is None or m.error:
        result.verdict = ERROR
        result.message = f"{check.name}: {m.error if m is not None else 'not measured'}"
        return result
    if m.pending:
        result.verdict, result.pending = INCONCLUSIVE, True
        result.message = f"{check.name}: {m.pending}"
        return result
    outcome = _JUDGES[check.kind](check, m, analysis)
    if m.final and outcome.verdict == FAILED:
        outcome.conclusive = True     # one number for the whole step: waiting cannot change it
    result.value, result.numbers = outcome.value, outcome.numbers
    result.short = outcome.short
    if outcome.verdict == INCONCLUSIVE and not outcome.short:
        return _no_data(result, check, analysis.no_data, outcome.message)
    result.verdict, result.conclusive = outcome.verdict, outcome.conclusive
    if outcome.verdict == FAILED and check.role == BREAKER:
        result.breaches = breaches + 1
        result.message = f"{outcome.message} (breach {result.breaches}/{check.consecutive})"
    else:
        if outcome.verdict == SUCCESSFUL:
            result.breaches = 0
        result.message = outcome.message
    return result


def _no_data(result: CheckResult, check: Check, policy: str, why: str) -> CheckResult:
    if policy == "pass":
        result.verdict, result.breaches = SUCCESSFUL, 0
        result.message = f"{why}; noData: pass"
    elif policy == "fail":
        result.verdict = FAILED
        if check.role == BREAKER:
            result.breaches += 1
            result.message = f"{why}; noData: fail (breach {result.breaches}/{check.consecutive})"
        else:
            result.message = f"{why}; noData: fail"
    else:
        result.verdict = INCONCLUSIVE
        result.message = f"{why}; noData: hold"
    return result


def _count(m: Measurement, key: str) -> float:
    v = m.get(key)
    return 0.0 if v is None or math.isnan(v) else max(0.0, v)


def _window(check: Check) -> str:
    if check.window is None:
        return "the rollout so far" if check.window_text == ROLLOUT_WINDOW else "the step so far"
    return check.window_text


def _rate(check: Check, m: Measurement, a: Analysis) -> _Outcome:
    """A share of the canary's requests against an absolute limit, judged on its counts: errors
    (error-rate), failures (success-rate) or divergent shadow comparisons (output-divergence)."""
    window = _window(check)
    if check.metric == "output-divergence":
        n = _count(m, "canary_compared")
        bad = min(_count(m, "canary_divergent"), n)
        if n < 1:
            # nothing compared: no traffic yet, or no canary with a previous table to compare against
            return _Outcome(INCONCLUSIVE, f"{check.name}: no compared requests in {window}", None, short=True)
        limit, value = check.max, bad / n
        shown = (f"{check.name} {int(round(bad))} divergent of {int(round(n))} compared requests in {window} "
                 f"({_pct(value)})")
        limit_text, clean = f"the {_pct(limit)} limit", "compared requests without a divergence"
        counts = dict(compared=n, divergent=bad, share=value)
    else:
        n = _count(m, "canary_requests")
        matching = min(_count(m, "canary_matching"), n)
        success = check.metric == "success-rate"
        bad = n - matching if success else matching
        limit = (1 - check.min) if success else check.max
        if n < 1:
            return _Outcome(INCONCLUSIVE, f"{check.name}: no canary requests in {window}", None)
        value = (matching if success else bad) / n
        shown = f"{check.name} {_pct(value)} ({int(round(bad))} {'failed' if success else 'errors'} of " \
                f"{int(round(n))} canary requests in {window})"
        limit_text = f"the {'failure rate' if success else 'error rate'} {_pct(limit)}"
        clean = "error-free requests"
        counts = dict(requests=n, errors=bad, rate=bad / n)
    lower = stats.rate_lower(bad, n, a.rollback_confidence)
    upper = stats.rate_upper(bad, n, a.confidence)
    numbers = dict(**counts, lower=lower, upper=upper, limit=limit)
    floor = check.min_samples
    if floor is not None and n < floor:
        return _Outcome(INCONCLUSIVE, f"{shown}: fewer than minSamples {floor}", value, short=True, **numbers)
    if lower > limit:
        return _Outcome(FAILED, f"{shown}: above {limit_text} at {a.rollback_confidence:.4g} confidence "
                                f"(lower bound {_pct(lower)})", value, conclusive=True, **numbers)
    if check.role == BREAKER:
        return _Outcome(SUCCESSFUL, f"{shown}: not shown above {limit_text}", value, **numbers)
    if upper <= limit:
        return _Outcome(SUCCESSFUL, f"{shown}: within {limit_text} at {a.confidence:.4g} confidence "
                                    f"(upper bound {_pct(upper)})", value, **numbers)
    need = stats.min_samples(limit, a.confidence)
    if bad / n > limit and n >= need:
        return _Outcome(FAILED, f"{shown}: above {limit_text}, not yet conclusively", value, **numbers)
    return _Outcome(INCONCLUSIVE, f"{shown}: upper bound {_pct(upper)} not yet within {limit_text} "
                                  f"(about {need} {clean} show it)", value, short=True, **numbers)


def _difference(check: Check, m: Measurement, a: Analysis) -> _Outcome:
    nc, ns = _count(m, "canary_requests"), _count(m, "stable_requests")
    kc, ks = min(_count(m, "canary_errors"), nc), min(_count(m, "stable_errors"), ns)
    window = _window(check)
    limit = check.max
    if nc < 1 or ns < 1:
        side = "canary" if nc < 1 else "stable"
        return _Outcome(INCONCLUSIVE, f"{check.name}: no {side} requests in {window}", None, short=True)
    d = stats.difference(kc, nc, ks, ns, a.confidence)
    strict = stats.difference(kc, nc, ks, ns, a.rollback_confidence)
    shown = (f"{check.name}: canary {d.canary_errors}/{d.canary_requests} errors ({_pct(d.canary_rate)}) vs "
             f"stable {d.stable_errors}/{d.stable_requests} ({_pct(d.stable_rate)}) over {window}, "
             f"difference {_pp(d.estimate)}, Fisher p={d.p_worse:.3g}")
    numbers = dict(canary_requests=nc, canary_errors=kc, stable_requests=ns, stable_errors=ks,
                   difference=d.estimate, lower=strict.lower, upper=d.upper, p_value=d.p_worse, limit=limit)
    value = d.estimate
    if strict.lower > limit and d.p_worse < 1 - a.rollback_confidence:
        return _Outcome(FAILED, f"{shown}: the canary errs more than {_pp(limit)} over stable at "
                                f"{a.rollback_confidence:.4g} confidence (lower bound {_pp(strict.lower)})",
                        value, conclusive=True, **numbers)
    if check.role == BREAKER:
        return _Outcome(SUCCESSFUL, f"{shown}: not shown above {_pp(limit)}", value, **numbers)
    if d.upper <= limit:
        return _Outcome(SUCCESSFUL, f"{shown}: within {_pp(limit)} at {a.confidence:.4g} confidence "
                                    f"(upper bound {_pp(d.upper)})", value, **numbers)
    need = stats.min_samples(limit, a.confidence)
    if d.estimate > limit and nc >= need:
        return _Outcome(FAILED, f"{shown}: above {_pp(limit)}, not yet conclusively", value, **numbers)
    # too few requests for a few background errors to mean anything: wait for traffic
    return _Outcome(INCONCLUSIVE, f"{shown}: upper bound {_pp(d.upper)} not yet within {_pp(limit)} "
                                  f"(about {need} error-free canary requests show it)", value, short=True, **numbers)


def quantile_floor(check: Check) -> int:
    """Samples a quantile must rest on: enough that at least two lie above it (200 for a p99)."""
    if check.min_samples is not None:
        return check.min_samples
    q = QUANTILES[check.metric][1]
    return math.ceil(2 / (1 - q) - 1e-9)


def _quantile(check: Check, m: Measurement, a: Analysis) -> _Outcome:
    floor = quantile_floor(check)
    window = check.window_text
    qc, nc = m.get("canary_quantile"), _count(m, "canary_samples")
    ratio = check.max_ratio is not None
    qs, ns = (m.get("stable_quantile"), _count(m, "stable_samples")) if ratio else (None, math.inf)
    numbers = dict(canary_quantile=qc, canary_samples=nc, stable_quantile=qs,
                   stable_samples=None if not ratio else ns)
    if nc < floor or ns < floor:
        side, n = ("canary", nc) if nc < floor else ("stable", ns)
        return _Outcome(INCONCLUSIVE, f"{check.name}: {int(n)} {side} samples in {window}, fewer than the "
                                      f"{floor} a p99 needs", None, short=True, **numbers)
    if qc is None or math.isnan(qc) or (ratio and (qs is None or math.isnan(qs) or qs <= 0)):
        return _Outcome(INCONCLUSIVE, f"{check.name}: the query returned no data", None)
    if ratio:
        value = qc / qs
        shown = (f"{check.name}: canary {qc * 1000:.4g} ms vs stable {qs * 1000:.4g} ms over {window}, "
                 f"ratio {value:.3g}")
        limit = f"{check.max_ratio:g} x stable"
    else:
        value = qc
        shown = f"{check.name}: canary {qc * 1000:.4g} ms over {window} ({int(nc)} samples)"
        limit = check.threshold
    numbers["ratio" if ratio else "quantile"] = value
    numbers["limit"] = check.max_ratio if ratio else check.max
    if check.breached(value):
        return _Outcome(FAILED, f"{shown}: breaches {limit}", value, **numbers)
    if ratio and check.max is not None and qc > check.max:
        return _Outcome(FAILED, f"{shown}: breaches <= {check.max:g}s", value, **numbers)
    return _Outcome(SUCCESSFUL, f"{shown}: within {limit}", value, **numbers)


def _value(check: Check, m: Measurement, a: Analysis) -> _Outcome:
    value = m.get("value")
    if check.min_samples is not None:
        n = _count(m, "canary_requests")
        if n < check.min_samples:
            return _Outcome(INCONCLUSIVE, f"{check.name}: {int(n)} canary requests in {check.window_text}, "
                                          f"fewer than minSamples {check.min_samples}", None, short=True)
    if value is None or math.isnan(value):
        return _Outcome(INCONCLUSIVE, f"{check.name}: the query returned no data", None)
    source = "from its Job" if getattr(check, "job", None) is not None else f"over {check.window_text}"
    what = f"{check.name} {_fmt(value)} {source}"
    limit = dict(limit=check.max if check.max is not None else check.min)
    if check.breached(value):
        return _Outcome(FAILED, f"{what} breaches {check.threshold}", value, measured=value, **limit)
    return _Outcome(SUCCESSFUL, f"{what} within {check.threshold}", value, measured=value, **limit)


_JUDGES = {"rate": _rate, "difference": _difference, "quantile": _quantile,
           "utilisation": _value, "custom": _value}


def run(analysis: Analysis, measurements: list[Measurement], previous: list[CheckResult], *,
        stable_pods: bool, final_evidence: bool = True) -> tuple[str, list[CheckResult]]:
    """Judge every check of `analysis`; returns the run's verdict and the per-check results.

    `final_evidence`: this is the last step with stable pods, so a gate that lacks traffic holds it.
    """
    by_key = {m.check: m for m in measurements}
    prev = {(r.role, r.name): r for r in previous}
    results = [judge(c, by_key.get(c.key), analysis, previous=prev.get((c.role, c.name)), stable_pods=stable_pods)
               for c in analysis.checks]
    return verdict_of(analysis, results, final_evidence=final_evidence), results


def _deciding(results: list[CheckResult]) -> list[CheckResult]:
    return [r for r in results if not r.dry_run and r.verdict != SKIPPED]


def failing(analysis: Analysis, results: list[CheckResult]) -> list[CheckResult]:
    """The deciding checks that call for a rollback: what a rollback is blamed on."""
    limits = {(c.role, c.name): c.consecutive for c in analysis.checks}
    out = []
    for r in _deciding(results):
        if r.verdict != FAILED:
            continue
        if r.role == BREAKER and r.breaches >= limits.get((r.role, r.name), 1):
            out.append(r)
        elif r.role == GATE and r.conclusive:
            out.append(r)
    return out


def verdict_of(analysis: Analysis, results: list[CheckResult], *, final_evidence: bool = True) -> str:
    """Failed: roll back. Error: the provider failed. Successful: the step may advance. Else Inconclusive."""
    if failing(analysis, results):
        return FAILED
    deciding = _deciding(results)
    if any(r.verdict == ERROR for r in deciding):
        return ERROR
    if deciding and not any(r.verdict == SUCCESSFUL for r in deciding):
        return INCONCLUSIVE     # nothing was judged on data: a step never passes on no evidence at all
    for r in deciding:
        if r.verdict == SUCCESSFUL:
            continue
        if r.role == BREAKER and r.verdict == INCONCLUSIVE and not r.pending:
            continue        # a breaker without data guards nothing, but holds nothing either
        if r.role == GATE and r.verdict == INCONCLUSIVE and r.short and not final_evidence:
            continue        # gathered at a later, larger step
        return INCONCLUSIVE
    return SUCCESSFUL


def holding(results: list[CheckResult]) -> list[CheckResult]:
    """The deciding checks that keep a step from advancing this run."""
    return [r for r in _deciding(results) if r.verdict in (FAILED, INCONCLUSIVE, ERROR)
            and not (r.role == BREAKER and r.verdict == INCONCLUSIVE and not r.pending)]
