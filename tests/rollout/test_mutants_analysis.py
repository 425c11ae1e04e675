"""What a check's verdict says, word for word where the numbers are the point: each test here fails on
a deliberate break of graft/rollout/analysis.py or graft/rollout/stats.py that the rest of the suite
let through (a formatter returning nothing, a flipped bound, a dropped reset)."""
import pytest

from graft.rollout import analysis
from graft.rollout.observation import Measurement

from rollout_fleet import make_spec


def spec_with(**analysis_fields):
    return make_spec(**{f"analysis_{k}": v for k, v in analysis_fields.items()}).analysis


DELTA = spec_with(gates=[{"name": "error-rate-delta", "max": 0.001}], breakers=[])
FRAGMENTATION = spec_with(breakers=[], gates=[{"name": "kv-fragmentation", "max": 0.25, "window": "60s",
                                               "query": 'max(graft_kv_cache_fragmentation_ratio{namespace="{{namespace}}"})'}])


def judge(a, values, **kw):
    (check,) = a.checks
    return analysis.judge(check, Measurement(check.key, values), a, previous=None, stable_pods=True, **kw)


def test_a_difference_is_said_in_percentage_points():
    r = judge(DELTA, {"canary_requests": 100_000, "canary_errors": 10, "stable_requests": 100_000,
                      "stable_errors": 10})
    assert r.verdict == "Successful"
    assert r.message.startswith("error-rate-delta: canary 10/100000 errors (0.01%) vs stable 10/100000 (0.01%) "
                                "over the step so far, difference +0 pp, Fisher p=")
    assert ": within +0.1 pp at 0.95 confidence (upper bound +0.0" in r.message and r.message.endswith(" pp)")


def test_a_custom_value_is_said_with_its_threshold():
    bad = judge(FRAGMENTATION, {"value": 0.3})
    assert (bad.verdict, bad.message) == ("Failed", "kv-fragmentation 0.3 over 60s breaches <= 0.25")
    good = judge(FRAGMENTATION, {"value": 0.123456})
    assert (good.verdict, good.message) == ("Successful", "kv-fragmentation 0.1235 over 60s within <= 0.25")
    assert good.numbers == {"measured": pytest.approx(0.123456), "limit": 0.25}


ERR_GATE = spec_with(breakers=[], gates=[{"name": "error-rate", "max": 0.005, "window": "60s"}])
ERR_BREAKER = spec_with(breakers=[{"name": "error-rate", "max": 0.005, "window": "60s"}], gates=[])
LATENCY = spec_with(breakers=[{"name": "ttft-p99", "maxRatio": 1.5, "window": "30s"},
                              {"name": "latency-p99", "max": 0.8, "window": "30s"}], gates=[])


def test_one_request_is_judged_not_taken_for_none():
    r = judge(ERR_BREAKER, {"canary_requests": 1, "canary_matching": 0})
    assert r.verdict == "Successful" and "no canary requests" not in r.message
    assert r.numbers["requests"] == 1


@pytest.mark.parametrize("requests,errors", [(100, 1), (1000, 4)])
def test_a_gate_without_enough_evidence_either_way_holds(requests, errors):
    # 1 in 100: above 0.5% but far too few requests to say so; 4 in 1000: below 0.5% but not yet shown
    r = judge(ERR_GATE, {"canary_requests": requests, "canary_matching": errors})
    assert (r.verdict, r.short, r.conclusive) == ("Inconclusive", True, False), r.message


def test_a_gate_over_its_limit_with_enough_requests_fails_without_rolling_back():
    r = judge(ERR_GATE, {"canary_requests": 1000, "canary_matching": 8})
    assert (r.verdict, r.conclusive) == ("Failed", False) and "not yet conclusively" in r.message


def test_a_latency_check_reports_the_ratio_or_the_quantile():
    ratio, absolute = LATENCY.checks
    m = {"canary_quantile": 0.3, "canary_samples": 500, "stable_quantile": 0.25, "stable_samples": 500}
    r = analysis.judge(ratio, Measurement(ratio.key, m), LATENCY, previous=None, stable_pods=True)
    assert r.numbers["ratio"] == pytest.approx(1.2) and "quantile" not in r.numbers
    r = analysis.judge(absolute, Measurement(absolute.key, m), LATENCY, previous=None, stable_pods=True)
    assert r.numbers["quantile"] == pytest.approx(0.3) and "ratio" not in r.numbers


def test_no_data_under_pass_says_so():
    a = spec_with(noData="pass", breakers=[], gates=[{"name": "kv-fragmentation", "max": 0.25,
                                                      "query": 'max(graft_kv_cache_fragmentation_ratio{namespace="{{namespace}}"})'}])
    r = judge(a, {"value": None})
    assert (r.verdict, r.message) == ("Successful", "kv-fragmentation: the query returned no data; noData: pass")


DELTA_BREAKER = spec_with(breakers=[{"name": "error-rate-delta", "max": 0.001}], gates=[])


def test_a_difference_breaker_only_ever_breaches_on_conclusive_evidence():
    r = judge(DELTA_BREAKER, {"canary_requests": 300, "canary_errors": 1, "stable_requests": 3000,
                              "stable_errors": 0})
    assert r.verdict == "Successful" and r.message.endswith(": not shown above +0.1 pp")


@pytest.mark.parametrize("values", [
    {"canary_requests": 300, "canary_errors": 1, "stable_requests": 3000, "stable_errors": 0},     # too few
    {"canary_requests": 4000, "canary_errors": 4, "stable_requests": 4000, "stable_errors": 2},    # not yet shown
])
def test_a_difference_gate_between_evidence_either_way_holds(values):
    r = judge(DELTA, values)
    assert (r.verdict, r.short, r.conclusive) == ("Inconclusive", True, False), r.message


def test_a_difference_gate_over_its_limit_with_enough_requests_fails_without_rolling_back():
    r = judge(DELTA, {"canary_requests": 4000, "canary_errors": 12, "stable_requests": 4000, "stable_errors": 4})
    assert (r.verdict, r.conclusive) == ("Failed", False) and "not yet conclusively" in r.message


def test_one_request_on_each_side_is_enough_to_compare():
    r = judge(DELTA, {"canary_requests": 1, "canary_errors": 0, "stable_requests": 1, "stable_errors": 0})
    assert "no canary requests" not in r.message and "no stable requests" not in r.message
    assert r.numbers["canary_requests"] == 1 == r.numbers["stable_requests"]


def test_a_latency_ratio_check_with_an_absolute_cap_breaches_either():
    a = spec_with(breakers=[{"name": "ttft-p99", "maxRatio": 1.5, "max": 0.8, "window": "30s"}], gates=[])
    r = judge(a, {"canary_quantile": 0.9, "canary_samples": 500, "stable_quantile": 0.8, "stable_samples": 500})
    assert r.verdict == "Failed" and ": breaches <= 0.8s (breach 1/1)" in r.message


def test_min_samples_sets_the_floor_of_a_quantile_and_of_a_custom_value():
    a = spec_with(breakers=[{"name": "latency-p99", "max": 0.8, "minSamples": 50}], gates=[])
    assert judge(a, {"canary_quantile": 0.9, "canary_samples": 60}).verdict == "Failed"
    assert judge(a, {"canary_quantile": 0.9, "canary_samples": 40}).verdict == "Inconclusive"
    c = spec_with(breakers=[], gates=[{"name": "kv", "max": 0.25, "minSamples": 100, "query": 'max(up{namespace="{{namespace}}"})'}])
    short = judge(c, {"value": 0.1, "canary_requests": 50})
    assert (short.verdict, short.short) == ("Inconclusive", True) and "fewer than minSamples 100" in short.message
    assert judge(c, {"value": 0.1, "canary_requests": 150}).verdict == "Successful"


def test_a_gate_lacking_traffic_holds_unless_told_a_later_step_will_gather_it():
    a = spec_with(breakers=[{"name": "error-rate", "max": 0.005}], gates=[{"name": "error-rate-delta", "max": 0.001}])
    breaker, gate = a.checks
    ms = [Measurement(breaker.key, {"canary_requests": 300, "canary_matching": 0}),
          Measurement(gate.key, {"canary_requests": 300, "canary_errors": 0, "stable_requests": 3000,
                                 "stable_errors": 0})]
    assert analysis.run(a, ms, [], stable_pods=True)[0] == "Inconclusive"
    assert analysis.run(a, ms, [], stable_pods=True, final_evidence=False)[0] == "Successful"
    results = analysis.run(a, ms, [], stable_pods=True)[1]
    assert analysis.verdict_of(a, results) == "Inconclusive"
    assert analysis.verdict_of(a, results, final_evidence=False) == "Successful"


def test_no_data_under_hold_says_so():
    r = judge(FRAGMENTATION, {"value": None})
    assert (r.verdict, r.message) == ("Inconclusive", "kv-fragmentation: the query returned no data; noData: hold")


def test_a_rate_exactly_at_its_limit_is_not_over_it():
    r = judge(ERR_GATE, {"canary_requests": 1000, "canary_matching": 5})          # 0.5% of a 0.5% limit
    assert (r.verdict, r.short) == ("Inconclusive", True), r.message


def test_exactly_the_requests_a_gate_needs_are_enough_to_fail_it():
    from graft.rollout import stats
    need = stats.min_samples(0.005, 0.95)
    r = judge(ERR_GATE, {"canary_requests": need, "canary_matching": 4})           # 0.67% of 598
    assert (r.verdict, r.conclusive) == ("Failed", False), r.message
    need = stats.min_samples(0.001, 0.95)
    r = judge(DELTA, {"canary_requests": need, "canary_errors": 9, "stable_requests": need, "stable_errors": 3})
    assert (r.verdict, r.conclusive) == ("Failed", False), r.message


def test_a_p99_on_exactly_200_samples_a_side_is_judged():
    ratio = LATENCY.checks[0]
    m = {"canary_quantile": 0.3, "canary_samples": 200, "stable_quantile": 0.25, "stable_samples": 200}
    r = analysis.judge(ratio, Measurement(ratio.key, m), LATENCY, previous=None, stable_pods=True)
    assert r.verdict == "Successful", r.message


def test_no_data_under_fail_says_so_for_a_gate():
    a = spec_with(noData="fail", breakers=[], gates=[{"name": "kv-fragmentation", "max": 0.25,
                                                      "query": 'max(graft_kv_cache_fragmentation_ratio{namespace="{{namespace}}"})'}])
    r = judge(a, {"value": None})
    assert (r.verdict, r.message) == ("Failed", "kv-fragmentation: the query returned no data; noData: fail")
