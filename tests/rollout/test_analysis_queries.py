"""Check verdicts on counts, run verdicts, and the PromQL each check plans.

Expected verdicts come from the counts the test feeds, through the binomial distribution itself
(scipy's binom), not through the bounds graft.rollout.stats computes: a limit is exceeded "at
confidence c" when seeing this many errors would be rarer than 1 - c if the rate were at the limit.
"""
import math
from types import SimpleNamespace

import pytest
from scipy.stats import binom

from graft.rollout import analysis, stats
from graft.rollout.analysis import plan_run, window_of
from graft.rollout.observation import Measurement
from graft.rollout.queries import Context, is_comparison, plan, render
from graft.rollout.status import CheckResult, RolloutStatus

from rollout_fleet import healthy, make_spec

SPEC = make_spec()
A = SPEC.analysis                                   # the default breakers and gates
ERR = next(c for c in A.breakers if c.name == "error-rate")           # max 0.005, consecutive 3
TTFT = next(c for c in A.breakers if c.name == "ttft-p99")            # maxRatio 1.5
CPU = next(c for c in A.breakers if c.name == "cpu")                  # max 0.92
DELTA = next(c for c in A.gates if c.name == "error-rate-delta")      # max 0.001, window step
DIV = next(c for c in A.breakers if c.name == "output-divergence")    # max 0.05, consecutive 1, window step


def checks(**analysis_fields):
    spec = make_spec(**{f"analysis_{k}": v for k, v in analysis_fields.items()})
    return spec.analysis


def judge(check, values, previous=None, stable_pods=True, a=A, error=None):
    m = Measurement(check.key, values, error) if values is not None or error else None
    return analysis.judge(check, m, a, previous=previous, stable_pods=stable_pods)


def breaker_breaches(errors: int, requests: int, limit: float, confidence: float) -> bool:
    """The oracle: at least `errors` in `requests` would be rarer than 1 - confidence at the limit."""
    return errors > 0 and binom.sf(errors - 1, requests, limit) < 1 - confidence


def gate_holds(bad: int, requests: int, limit: float, confidence: float) -> bool:
    """The oracle: so few bad requests would be rarer than 1 - confidence if the rate were the limit."""
    return binom.cdf(bad, requests, limit) <= 1 - confidence


# a breaker on counts
def test_one_error_in_forty_requests_is_not_a_breach_of_half_a_percent():
    assert not breaker_breaches(1, 40, 0.005, 0.999)
    r = judge(ERR, {"canary_requests": 40, "canary_matching": 1})
    assert (r.verdict, r.breaches, r.role) == ("Successful", 0, "breaker")
    assert r.value == pytest.approx(1 / 40) and "1 errors of 40" in r.message


def test_ten_errors_in_forty_requests_are_a_breach():
    assert breaker_breaches(10, 40, 0.005, 0.999)
    r = judge(ERR, {"canary_requests": 40, "canary_matching": 10})
    assert (r.verdict, r.breaches, r.conclusive) == ("Failed", 1, True)
    assert "breach 1/3" in r.message and r.numbers["errors"] == 10 and r.numbers["requests"] == 40


@pytest.mark.parametrize("requests", [40, 200, 1000, 20000])
def test_breaker_verdict_flips_exactly_where_the_binomial_tail_says(requests):
    """Walk the errors up from zero: the breaker breaches from the first count the oracle rejects."""
    first = next(k for k in range(requests + 1) if breaker_breaches(k, requests, 0.005, 0.999))
    below = judge(ERR, {"canary_requests": requests, "canary_matching": first - 1})
    at = judge(ERR, {"canary_requests": requests, "canary_matching": first})
    assert (below.verdict, at.verdict) == ("Successful", "Failed"), first


def test_breaches_count_up_and_a_clean_run_resets_them():
    prev = CheckResult("error-rate", "Failed", "", "", breaches=1, role="breaker")
    r = judge(ERR, {"canary_requests": 100, "canary_matching": 50}, prev)
    assert (r.verdict, r.breaches) == ("Failed", 2) and "breach 2/3" in r.message
    r = judge(ERR, {"canary_requests": 100, "canary_matching": 0}, prev)
    assert (r.verdict, r.breaches) == ("Successful", 0)


@pytest.mark.parametrize("values,why", [
    ({"canary_requests": 0, "canary_matching": 0}, "no canary requests"),
    ({"canary_requests": None, "canary_matching": None}, "no canary requests"),
    ({"canary_requests": math.nan, "canary_matching": 0}, "no canary requests"),
])
def test_no_traffic_holds_without_touching_breaches(values, why):
    r = judge(ERR, values, CheckResult("error-rate", "Failed", "", "", breaches=1, role="breaker"))
    assert (r.verdict, r.breaches) == ("Inconclusive", 1) and why in r.message and "noData: hold" in r.message


def test_no_data_policies():
    empty = {"canary_requests": 0, "canary_matching": 0}
    fail, pass_ = checks(noData="fail"), checks(noData="pass")
    r = judge(ERR, empty, a=fail)
    assert (r.verdict, r.breaches) == ("Failed", 1) and "noData: fail (breach 1/3)" in r.message
    assert judge(ERR, empty, a=pass_).verdict == "Successful"


def test_min_samples_is_the_traffic_floor():
    a = checks(breakers=[{"name": "error-rate", "max": 0.005, "minSamples": 100}])
    (err,) = a.breakers
    r = judge(err, {"canary_requests": 99, "canary_matching": 99}, a=a)
    assert (r.verdict, r.short) == ("Inconclusive", True) and "fewer than minSamples 100" in r.message
    assert judge(err, {"canary_requests": 100, "canary_matching": 99}, a=a).verdict == "Failed"


# a gate on counts
GATES = checks(gates=[{"name": "success-rate", "min": 0.9995}, {"name": "error-rate-delta", "max": 0.001}])
SUCCESS, GDELTA = GATES.gates


def test_a_gate_passes_once_the_traffic_shows_it_holds():
    limit = 1 - 0.9995
    need = next(n for n in range(1, 100_000) if gate_holds(0, n, limit, 0.95))
    assert need == math.ceil(math.log(0.05) / math.log(1 - limit))       # the "rule of three": ~3 / limit
    short = judge(SUCCESS, {"canary_requests": need - 1, "canary_matching": need - 1}, a=GATES)
    assert (short.verdict, short.short, short.role) == ("Inconclusive", True, "gate")
    assert f"about {need} error-free requests" in short.message
    ok = judge(SUCCESS, {"canary_requests": need, "canary_matching": need}, a=GATES)
    assert ok.verdict == "Successful" and ok.value == 1.0


def test_a_gate_fails_conclusively_only_beyond_rollback_confidence():
    limit = 1 - 0.9995
    n = 6000
    weak = next(k for k in range(n) if k / n > limit)                            # above the limit, barely
    assert not breaker_breaches(weak, n, limit, 0.999)
    r = judge(SUCCESS, {"canary_requests": n, "canary_matching": n - weak}, a=GATES)
    assert (r.verdict, r.conclusive) == ("Failed", False)
    strong = next(k for k in range(n) if breaker_breaches(k, n, limit, 0.999))
    r = judge(SUCCESS, {"canary_requests": n, "canary_matching": n - strong}, a=GATES)
    assert (r.verdict, r.conclusive) == ("Failed", True)


def test_difference_gate_needs_both_sides_and_is_skipped_without_stable_pods():
    r = judge(GDELTA, {"canary_requests": 500, "canary_errors": 0, "stable_requests": 0, "stable_errors": 0},
              a=GATES)
    assert (r.verdict, r.short) == ("Inconclusive", True) and "no stable requests" in r.message
    r = judge(GDELTA, {"canary_requests": 500, "canary_errors": 0, "stable_requests": 500, "stable_errors": 0},
              stable_pods=False, a=GATES)
    assert r.verdict == "Skipped" and "no stable pods left" in r.message


def test_difference_gate_on_counts():
    need = stats.min_samples(0.001, 0.95)
    assert need == math.ceil(math.log(0.05) / math.log(0.999)) == 2995     # ~3000 canary requests
    few = judge(GDELTA, {"canary_requests": 400, "canary_errors": 0, "stable_requests": 40_000,
                         "stable_errors": 4}, a=GATES)
    assert (few.verdict, few.short) == ("Inconclusive", True) and f"about {need} error-free canary" in few.message
    plenty = judge(GDELTA, {"canary_requests": 100_000, "canary_errors": 10, "stable_requests": 100_000,
                            "stable_errors": 10}, a=GATES)
    assert plenty.verdict == "Successful" and plenty.value == 0
    # 5% of the canary's requests fail, none of stable's: Fisher's exact p is astronomically small
    worse = judge(GDELTA, {"canary_requests": 1000, "canary_errors": 50, "stable_requests": 1000,
                           "stable_errors": 0}, a=GATES)
    assert (worse.verdict, worse.conclusive) == ("Failed", True) and worse.value == pytest.approx(0.05)
    assert worse.numbers["p_value"] < 1e-10


# output divergence: the canary's shadow comparisons, judged on their counts
(DIV_GATE,) = checks(gates=[{"name": "output-divergence", "max": 0.05}]).gates


def shadow(divergent, compared):
    return {"canary_compared": compared, "canary_divergent": divergent}


def test_three_divergent_of_three_compared_roll_back_and_two_of_two_do_not():
    assert breaker_breaches(3, 3, 0.05, 0.999) and not breaker_breaches(2, 2, 0.05, 0.999)
    r = judge(DIV, shadow(3, 3))
    assert (r.verdict, r.breaches, r.conclusive, r.role) == ("Failed", 1, True, "breaker")
    assert r.message == ("output-divergence 3 divergent of 3 compared requests in the rollout so far (100%): above "
                         "the 5% limit at 0.999 confidence (lower bound 10%) (breach 1/1)")
    assert r.value == 1.0 and r.numbers == pytest.approx(
        {"compared": 3, "divergent": 3, "share": 1.0, "lower": 0.1, "upper": 1.0, "limit": 0.05})
    v, results = verdict(A, {DIV.key: shadow(3, 3)})
    assert v == "Failed" and [r.name for r in analysis.failing(A, results)] == ["output-divergence"], \
        "consecutive 1: the first breach rolls back"
    for divergent, compared in ((1, 1), (1, 2), (2, 2)):
        r = judge(DIV, shadow(divergent, compared))
        assert (r.verdict, r.breaches) == ("Successful", 0), r.message
        assert r.message.endswith(f"{divergent} divergent of {compared} compared requests in the rollout so far "
                                  f"({divergent / compared:.0%}): not shown above the 5% limit")
        assert verdict(A, {DIV.key: shadow(divergent, compared)})[0] == "Successful"


@pytest.mark.parametrize("compared", [3, 10, 59, 1000, 20000])
def test_divergence_breaker_flips_exactly_where_the_binomial_tail_says(compared):
    first = next(k for k in range(compared + 1) if breaker_breaches(k, compared, 0.05, 0.999))
    below, at = judge(DIV, shadow(first - 1, compared)), judge(DIV, shadow(first, compared))
    assert (below.verdict, at.verdict) == ("Successful", "Failed"), first


def test_divergence_gate_passes_once_none_in_n_compared_bounds_the_share_within_its_limit():
    need = next(n for n in range(1, 10_000) if gate_holds(0, n, 0.05, 0.95))
    assert need == stats.min_samples(0.05, 0.95) == 59
    short = judge(DIV_GATE, shadow(0, need - 1))
    assert (short.verdict, short.short, short.role) == ("Inconclusive", True, "gate")
    assert short.message == ("output-divergence 0 divergent of 58 compared requests in the rollout so far (0%): upper "
                             "bound 5.03% not yet within the 5% limit (about 59 compared requests without a "
                             "divergence show it)")
    ok = judge(DIV_GATE, shadow(0, need))
    assert ok.verdict == "Successful" and ok.value == 0
    assert ok.message == ("output-divergence 0 divergent of 59 compared requests in the rollout so far (0%): within "
                          "the 5% limit at 0.95 confidence (upper bound 4.95%)")
    # a few divergent requests among many: Successful once the upper bound is within the limit
    assert judge(DIV_GATE, shadow(5, 1000)).verdict == "Successful"


def test_divergence_gate_rolls_back_only_on_conclusive_evidence():
    # 5 of 60 (8.3%): above the limit by the estimate, not beyond doubt: the step waits
    assert not breaker_breaches(5, 60, 0.05, 0.999)
    weak = judge(DIV_GATE, shadow(5, 60))
    assert (weak.verdict, weak.conclusive) == ("Failed", False) and "not yet conclusively" in weak.message
    # 2 of 10: too few to say either way
    assert (judge(DIV_GATE, shadow(2, 10)).verdict, judge(DIV_GATE, shadow(2, 10)).short) == ("Inconclusive", True)
    strong = judge(DIV_GATE, shadow(20, 60))
    assert (strong.verdict, strong.conclusive) == ("Failed", True) and "at 0.999 confidence" in strong.message


@pytest.mark.parametrize("values", [shadow(0, 0), shadow(None, None), {}, shadow(math.nan, math.nan)])
@pytest.mark.parametrize("policy", ["hold", "fail"])
def test_no_compared_requests_is_a_lack_of_traffic_and_holds_nothing(values, policy):
    """Engines with nothing to compare against (stable pods, a canary restarted into the patch) and
    steps without traffic yet export no comparison: never a breach, whatever noData says."""
    a = checks(noData=policy)
    prev = CheckResult("output-divergence", "Successful", "", "", role="breaker")
    r = judge(DIV, values, prev, a=a)
    assert (r.verdict, r.short, r.breaches, r.value) == ("Inconclusive", True, 0, None)
    assert r.message == "output-divergence: no compared requests in the rollout so far"
    assert verdict(a, {DIV.key: values})[0] == "Successful", "a breaker without data holds nothing"


def test_divergence_is_judged_on_the_canary_alone_with_or_without_stable_pods():
    assert not DIV.comparison
    assert judge(DIV, shadow(3, 3), stable_pods=False).verdict == "Failed"
    assert judge(DIV, shadow(0, 100), stable_pods=False).verdict == "Successful"


def test_a_rate_over_the_step_says_so():
    (so_far,) = checks(breakers=[{"name": "error-rate", "max": 0.005, "window": "step"}]).breakers
    r = judge(so_far, {"canary_requests": 40, "canary_matching": 1})
    assert "(1 errors of 40 canary requests in the step so far)" in r.message


def test_a_rollout_window_looks_back_to_the_rollout_start_and_a_step_window_to_the_step():
    from graft.rollout.analysis import window_of
    from graft.rollout.spec import parse_spec
    from graft.rollout.status import RolloutStatus
    spec = parse_spec({"selector": {"matchLabels": {"app": "x"}}, "patch": {"name": "p", "version": "1"},
                       "analysis": {"interval": "10s", "breakers": [
                           {"name": "output-divergence", "max": 0.05},
                           {"name": "error-rate", "max": 0.01, "window": "step"},
                           {"name": "sticky", "metric": "error-rate", "max": 0.01, "window": "rollout"}]}})
    divergence, step, sticky = spec.analysis.breakers
    assert divergence.window_text == "rollout"           # output-divergence's default
    status = RolloutStatus(started_at=1000.0, step_ready_at=1500.0)
    assert window_of(divergence, spec, status, 1600.0) == 600
    assert window_of(sticky, spec, status, 1600.0) == 600
    assert window_of(step, spec, status, 1600.0) == 100
    assert window_of(divergence, spec, status, 1000.5) == 10   # at least one interval
    r = judge(sticky, {"canary_requests": 40, "canary_matching": 1})
    assert "(1 errors of 40 canary requests in the rollout so far)" in r.message


# latency and values
def test_quantile_ratio_against_stable():
    ok = judge(TTFT, {"canary_quantile": 0.30, "canary_samples": 500, "stable_quantile": 0.25, "stable_samples": 900})
    assert ok.verdict == "Successful" and ok.value == pytest.approx(1.2)
    slow = judge(TTFT, {"canary_quantile": 0.40, "canary_samples": 500, "stable_quantile": 0.25,
                        "stable_samples": 900})
    assert (slow.verdict, slow.breaches) == ("Failed", 1) and slow.value == pytest.approx(1.6)
    assert "breaches 1.5 x stable" in slow.message


@pytest.mark.parametrize("canary,stable,side", [(199, 1000, "canary"), (1000, 199, "stable")])
def test_a_p99_needs_200_samples_on_each_side(canary, stable, side):
    r = judge(TTFT, {"canary_quantile": 9.0, "canary_samples": canary, "stable_quantile": 0.1,
                     "stable_samples": stable})
    assert (r.verdict, r.short) == ("Inconclusive", True)
    assert f"{min(canary, stable)} {side} samples" in r.message and "the 200 a p99 needs" in r.message


def test_absolute_quantile_needs_no_stable_side():
    a = checks(breakers=[{"name": "latency-p99", "max": 0.8}])
    (lat,) = a.breakers
    assert not lat.comparison
    r = judge(lat, {"canary_quantile": 0.9, "canary_samples": 300}, stable_pods=False, a=a)
    assert r.verdict == "Failed" and "breaches <= 0.8" in r.message


def test_cpu_is_a_value_with_no_traffic_floor():
    assert judge(CPU, {"value": 0.5}).verdict == "Successful"
    assert judge(CPU, {"value": 0.95}).verdict == "Failed"
    r = judge(CPU, {"value": None})
    assert r.verdict == "Inconclusive" and "returned no data" in r.message


def test_provider_error_is_error():
    r = judge(ERR, None, error="Prometheus at http://p:9090 is unreachable")
    assert r.verdict == "Error" and "unreachable" in r.message
    assert judge(ERR, None).verdict == "Error", "a check that was not measured"


# run verdicts
def verdict(a, changed: dict, previous=(), stable_pods=True, final_evidence=True):
    """The run verdict with every check healthy except those in `changed` (key -> values)."""
    ms = healthy_for(a)
    for m in ms:
        if m.check in changed:
            m.values = changed[m.check]
    return analysis.run(a, ms, list(previous), stable_pods=stable_pods, final_evidence=final_evidence)


def healthy_for(a):
    return healthy(SimpleNamespace(analysis=a))


def test_run_verdicts():
    assert verdict(A, {})[0] == "Successful"
    one = verdict(A, {ERR.key: {"canary_requests": 1000, "canary_matching": 500}})
    assert one[0] == "Inconclusive", "a breaker 1 of 3 breaches holds the step, it does not roll back"
    assert analysis.failing(A, one[1]) == []
    third = verdict(A, {ERR.key: {"canary_requests": 1000, "canary_matching": 500}},
                    previous=[CheckResult("error-rate", "Failed", "", "", breaches=2, role="breaker")])
    assert third[0] == "Failed" and [r.name for r in analysis.failing(A, third[1])] == ["error-rate"]
    down = analysis.run(A, [Measurement(c.key, error="down") for c in A.checks], [], stable_pods=True)
    assert down[0] == "Error"


def test_a_breaker_without_data_holds_nothing():
    assert verdict(A, {ERR.key: {"canary_requests": 0, "canary_matching": 0}})[0] == "Successful"


def test_a_gate_lacking_traffic_holds_only_the_last_step_with_stable_pods():
    short = {DELTA.key: {"canary_requests": 100, "canary_errors": 0, "stable_requests": 100, "stable_errors": 0}}
    assert verdict(A, short, final_evidence=False)[0] == "Successful"
    v, results = verdict(A, short, final_evidence=True)
    assert v == "Inconclusive" and [r.name for r in analysis.holding(results)] == ["error-rate-delta"]


def test_a_gate_failing_without_conclusive_evidence_holds():
    # canary 6/3000 vs stable 0/3000: 0.2 pp worse by the estimate, over the 0.1 pp limit, not conclusively
    weak = {DELTA.key: {"canary_requests": 3000, "canary_errors": 6, "stable_requests": 3000, "stable_errors": 0}}
    v, results = verdict(A, weak)
    delta = next(r for r in results if (r.role, r.name) == ("gate", DELTA.name))
    assert (delta.verdict, delta.conclusive) == ("Failed", False) and v == "Inconclusive"


def test_dry_run_checks_never_decide():
    a = checks(breakers=[{"name": "error-rate", "max": 0.005},
                         {"name": "latency-p99", "max": 0.5, "dryRun": True}])
    lat = a.breakers[1]
    v, results = verdict(a, {lat.key: {"canary_quantile": 3.0, "canary_samples": 1000}})
    assert v == "Successful" and next(r for r in results if r.name == "latency-p99").verdict == "Failed"


# the plan: what each check asks Prometheus
CTX = Context("llm", "kv@1", "base", "kv", "1")


def test_rate_check_plans_requests_and_errors_of_the_canary():
    series = {s.key: s for s in plan(ERR, CTX, 60)}
    assert set(series) == {"canary_requests", "canary_matching"}
    # the requests the engine answered: a client's hang-up is neither an error nor in the denominator
    assert series["canary_requests"].promql == \
        'sum(increase(graft_requests_total{namespace="llm",revision="kv@1",status!~"abandoned|cancelled"}[60s]))'
    assert series["canary_matching"].promql == \
        'sum(increase(graft_requests_total{namespace="llm",revision="kv@1",status=~"error|timeout"}[60s]))'
    (ok,) = checks(gates=[{"name": "success-rate", "min": 0.99}]).gates
    assert 'status="ok"' in {s.key: s for s in plan(ok, CTX, 60)}["canary_matching"].promql


def test_difference_check_plans_both_sides():
    series = {s.key: s.promql for s in plan(DELTA, CTX, 42)}
    assert set(series) == {"canary_requests", "canary_errors", "stable_requests", "stable_errors"}
    # the engine's failures (errors, and requests it ended at its timeout) over the requests it
    # answered: a client's hang-up is in neither, so hanging up on one side cannot tilt the comparison
    assert series["stable_errors"] == \
        'sum(increase(graft_requests_total{namespace="llm",revision="base",status=~"error|timeout"}[42s]))'
    assert series["stable_requests"] == \
        'sum(increase(graft_requests_total{namespace="llm",revision="base",status!~"abandoned|cancelled"}[42s]))'

    assert 'revision="kv@1",status!~"abandoned|cancelled"}[42s]' in series["canary_requests"]


def test_quantile_check_plans_the_median_of_each_pods_p99_and_its_samples():
    series = {s.key: s.promql for s in plan(TTFT, CTX, 30)}
    assert set(series) == {"canary_quantile", "canary_samples", "stable_quantile", "stable_samples"}
    assert series["canary_quantile"] == (
        'quantile(0.5, histogram_quantile(0.99, sum by (le, instance) (rate(graft_time_to_first_token_seconds_bucket'
        '{namespace="llm",revision="kv@1"}[30s]))) >= 0)')
    assert series["stable_samples"] == \
        'sum(increase(graft_time_to_first_token_seconds_count{namespace="llm",revision="base"}[30s]))'
    (absolute,) = checks(breakers=[{"name": "latency-p99", "max": 0.8}]).breakers
    assert {s.key for s in plan(absolute, CTX, 30)} == {"canary_quantile", "canary_samples"}


def test_output_divergence_plans_the_canarys_compared_and_divergent_shadow_requests():
    series = {s.key: s for s in plan(DIV, CTX, 95)}
    assert set(series) == {"canary_compared", "canary_divergent"}
    assert series["canary_compared"].promql == (
        'sum(increase(graft_shadow_requests_total{namespace="llm",revision="kv@1",result=~"agree|divergent"}[95s]))')
    assert series["canary_divergent"].promql == (
        'sum(increase(graft_shadow_requests_total{namespace="llm",revision="kv@1",result="divergent"}[95s]))')
    assert {(s.kind, s.side, s.status) for s in series.values()} == {("shadow", "canary", "compared"),
                                                                      ("shadow", "canary", "divergent")}
    assert not any("base" in s.promql for s in series.values()), "no stable side: the engine compares itself"


def test_cpu_check_joins_process_metrics_to_the_canary_revision():
    (s,) = plan(CPU, CTX, 120)
    assert s.key == "value" and "process_cpu_seconds_total" in s.promql and "[120s]" in s.promql
    assert "graft_cpu_quota_cores" in s.promql
    assert 'graft_engine_revision_info{namespace="llm",revision="kv@1"} == 1' in s.promql


def test_custom_query_templating_and_escaping():
    a = checks(breakers=[{"name": "ttft", "max": 1, "window": "1.5s", "minSamples": 10,
                          "query": 'x{namespace="{{namespace}}",r="{{canaryRevision}}",p="{{patchName}}"}[{{window}}]'}])
    (check,) = a.breakers
    series = {s.key: s.promql for s in plan(check, Context('a"b', "kv@1", "base", "kv", "1"), 1.5)}
    assert series["value"] == 'x{namespace="a\\"b",r="kv@1",p="kv"}[1500ms]'
    assert "canary_requests" in series, "minSamples needs the canary's requests"
    assert is_comparison("{{ stableRevision }}") and not is_comparison("{{canaryRevision}}")
    with pytest.raises(KeyError, match="pod"):
        render("{{pod}}", {})


def test_plan_run_windows_a_step_check_by_the_time_the_step_has_been_in_place():
    status = RolloutStatus(canary_revision="kv-align@3.2.1", stable_revision="base", step_ready_at=100.0)
    windows = {c.key: {s.window for s in series} for c, series in plan_run(SPEC, status, "llm", 163.2)}
    assert windows[DELTA.key] == {64.0}, "since the step was in place, rounded up"
    assert windows[DIV.key] == {64.0}, "output-divergence too: the evidence of the whole step"
    assert windows[ERR.key] == {60.0}
    assert window_of(DELTA, SPEC, status, 101) == SPEC.analysis.interval, "at least one interval"
    promql = [s.promql for _, series in plan_run(SPEC, status, "llm", 163.2) for s in series]
    assert all('namespace="llm"' in q for q in promql)
    assert any('revision="kv-align@3.2.1"' in q for q in promql)
