"""The statistics and the judge: counts are judged as counts, with the numbers behind each verdict."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binomtest

from graft.rollout import analysis, stats
from graft.rollout.observation import Measurement
from graft.rollout.spec import parse_spec

SPEC = {"selector": {"matchLabels": {"app": "llm"}}, "patch": {"name": "kv-align", "version": "3.2.1"}}


def spec_with(**analysis_fields):
    return parse_spec({**SPEC, "analysis": analysis_fields})


@given(n=st.integers(1, 5000), data=st.data(), confidence=st.sampled_from([0.9, 0.95, 0.99, 0.999]))
@settings(max_examples=150, deadline=None)
def test_rate_bounds_are_the_exact_one_sided_clopper_pearson_bounds(n, data, confidence):
    k = data.draw(st.integers(0, n))
    # a one-sided bound at alpha is one end of the two-sided exact interval at 1 - 2 alpha
    ci = binomtest(k, n).proportion_ci(confidence_level=1 - 2 * (1 - confidence), method="exact")
    assert stats.rate_lower(k, n, confidence) == pytest.approx(ci.low, abs=1e-9)
    assert stats.rate_upper(k, n, confidence) == pytest.approx(ci.high, abs=1e-9)


@pytest.mark.parametrize("limit,confidence", [(0.001, 0.95), (0.005, 0.95), (0.01, 0.99), (0.0005, 0.9)])
def test_min_samples_is_the_first_count_whose_clean_upper_bound_fits_the_limit(limit, confidence):
    n = stats.min_samples(limit, confidence)
    assert stats.rate_upper(0, n, confidence) <= limit < stats.rate_upper(0, n - 1, confidence)


@given(kc=st.integers(0, 50), nc=st.integers(50, 20000), ks=st.integers(0, 50), ns=st.integers(50, 20000))
@settings(max_examples=200, deadline=None)
def test_difference_bounds_bracket_the_estimate_and_widen_with_confidence(kc, nc, ks, ns):
    d95 = stats.difference(kc, nc, ks, ns, 0.95)
    d999 = stats.difference(kc, nc, ks, ns, 0.999)
    assert d95.lower <= d95.estimate <= d95.upper
    assert d999.lower <= d95.lower + 1e-12 and d95.upper <= d999.upper + 1e-12
    assert 0 <= d95.p_worse <= 1


def test_difference_p_value_is_fishers_one_sided_exact_test():
    from scipy.stats import fisher_exact
    d = stats.difference(7, 1000, 10, 10000, 0.95)
    assert d.p_worse == pytest.approx(fisher_exact([[7, 993], [10, 9990]], alternative="greater")[1])


def breaker(spec, name):
    return next(c for c in spec.analysis.breakers if c.name == name)


def gate(spec, name):
    return next(c for c in spec.analysis.gates if c.name == name)


def judge(spec, check, values, previous=None, stable_pods=True):
    return analysis.judge(check, Measurement(check.key, values), spec.analysis, previous=previous,
                          stable_pods=stable_pods)


def test_one_error_in_forty_requests_is_not_a_breach_of_half_a_percent():
    spec = spec_with()
    err = breaker(spec, "error-rate")
    one = judge(spec, err, {"canary_requests": 40, "canary_matching": 1})
    assert (one.verdict, one.breaches) == ("Successful", 0)
    assert one.value == pytest.approx(0.025)
    ten = judge(spec, err, {"canary_requests": 40, "canary_matching": 10})
    assert (ten.verdict, ten.breaches) == ("Failed", 1)
    # the numbers behind it are in the result, for the status and the Event
    assert ten.numbers["requests"] == 40 and ten.numbers["errors"] == 10 and ten.numbers["lower"] > 0.005
    assert "10 errors of 40" in ten.message


def test_breaker_counts_consecutive_breaches_and_resets_on_a_clean_run():
    spec = spec_with()
    err = breaker(spec, "error-rate")
    bad = {"canary_requests": 1000, "canary_matching": 100}
    good = {"canary_requests": 1000, "canary_matching": 0}
    r1 = judge(spec, err, bad)
    r2 = judge(spec, err, bad, previous=r1)
    assert r2.breaches == 2 and analysis.verdict_of(spec.analysis, [r2]) == "Inconclusive"
    r3 = judge(spec, err, bad, previous=r2)
    assert analysis.verdict_of(spec.analysis, [r3]) == "Failed"
    assert judge(spec, err, good, previous=r2).breaches == 0
    # no data keeps the count where it was
    assert judge(spec, err, {"canary_requests": 0, "canary_matching": 0}, previous=r2).breaches == 2


def test_error_delta_gate_passes_holds_and_rolls_back_on_the_evidence():
    spec = spec_with()
    delta = gate(spec, "error-rate-delta")
    assert delta.window is None                       # the step so far
    passed = judge(spec, delta, {"canary_requests": 6000, "canary_errors": 0,
                                 "stable_requests": 60000, "stable_errors": 6})
    assert passed.verdict == "Successful" and passed.numbers["upper"] <= 0.001
    short = judge(spec, delta, {"canary_requests": 300, "canary_errors": 0,
                                "stable_requests": 3000, "stable_errors": 0})
    assert (short.verdict, short.short) == ("Inconclusive", True)
    assert "about 2995 error-free canary requests" in short.message
    held = judge(spec, delta, {"canary_requests": 6000, "canary_errors": 18,
                               "stable_requests": 60000, "stable_errors": 30})
    assert (held.verdict, held.conclusive) == ("Failed", False)   # 0.3% vs 0.05%: holds, not yet proven
    proven = judge(spec, delta, {"canary_requests": 6000, "canary_errors": 120,
                                 "stable_requests": 60000, "stable_errors": 30})
    assert (proven.verdict, proven.conclusive) == ("Failed", True)
    assert proven.numbers["p_value"] < 1e-6 and "Fisher p=" in proven.message
    assert analysis.verdict_of(spec.analysis, [proven]) == "Failed"
    assert analysis.verdict_of(spec.analysis, [held]) == "Inconclusive"


def test_a_gate_lacking_traffic_holds_only_the_last_step_with_stable_pods():
    spec = spec_with()
    delta = gate(spec, "error-rate-delta")
    short = judge(spec, delta, {"canary_requests": 100, "canary_errors": 0,
                                "stable_requests": 9900, "stable_errors": 1})
    err = judge(spec, breaker(spec, "error-rate"), {"canary_requests": 100, "canary_matching": 0})
    assert analysis.verdict_of(spec.analysis, [err, short], final_evidence=False) == "Successful"
    assert analysis.verdict_of(spec.analysis, [err, short], final_evidence=True) == "Inconclusive"
    # but a step never passes on no evidence at all: something must have been judged on data
    assert analysis.verdict_of(spec.analysis, [short], final_evidence=False) == "Inconclusive"


def test_latency_ratio_is_judged_against_stable_with_enough_samples():
    spec = spec_with()
    tpot = breaker(spec, "tpot-p99")
    assert tpot.max_ratio == 1.3
    slow = judge(spec, tpot, {"canary_quantile": 0.09, "canary_samples": 5000,
                              "stable_quantile": 0.06, "stable_samples": 5000})
    assert slow.verdict == "Failed" and slow.value == pytest.approx(1.5)
    ok = judge(spec, tpot, {"canary_quantile": 0.065, "canary_samples": 5000,
                            "stable_quantile": 0.06, "stable_samples": 5000})
    assert ok.verdict == "Successful"
    few = judge(spec, tpot, {"canary_quantile": 0.5, "canary_samples": 150,
                             "stable_quantile": 0.06, "stable_samples": 5000})
    assert (few.verdict, few.short) == ("Inconclusive", True) and "fewer than the 200" in few.message
    skipped = judge(spec, tpot, {}, stable_pods=False)
    assert skipped.verdict == "Skipped"


def test_cpu_is_a_share_of_the_quota():
    spec = spec_with()
    cpu = breaker(spec, "cpu")
    assert judge(spec, cpu, {"value": 0.5}).verdict == "Successful"
    assert judge(spec, cpu, {"value": 0.95}).verdict == "Failed"
    assert "graft_cpu_quota_cores" in analysis.plan_run(spec, _status(), "llm", 100.0)[3][1][0].promql


def _status():
    from graft.rollout.status import RolloutStatus
    return RolloutStatus(canary_revision="kv-align@3.2.1", stable_revision="base", step_ready_at=40.0)


def test_step_window_spans_the_step_so_far():
    spec = spec_with()
    plan = dict((c.key, s) for c, s in analysis.plan_run(spec, _status(), "llm", 100.0))
    delta = plan["gate/error-rate-delta"]
    assert {s.key for s in delta} == {"canary_requests", "canary_errors", "stable_requests", "stable_errors"}
    assert all(s.window == 60 for s in delta)         # 100 - 40
    assert 'revision="kv-align@3.2.1",status=~"error|timeout"' in delta[1].promql and "[60s]" in delta[1].promql
    # the first run of a step still looks back a whole interval
    early = dict((c.key, s) for c, s in analysis.plan_run(spec, _status(), "llm", 41.0))
    assert early["gate/error-rate-delta"][0].window == spec.analysis.interval


def test_provider_errors_are_their_own_verdict():
    spec = spec_with()
    results = [analysis.judge(c, Measurement(c.key, error="Prometheus at x is unreachable"), spec.analysis,
                              previous=None, stable_pods=True) for c in spec.analysis.checks]
    assert {r.verdict for r in results} == {"Error"}
    assert analysis.verdict_of(spec.analysis, results) == "Error"
