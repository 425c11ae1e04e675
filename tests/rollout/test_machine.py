"""The step state machine, driven by a fake fleet and a fake clock."""
import pytest
from scipy.stats import binom

from graft.rollout.actions import ApplyPatch
from graft.rollout.decision import ClearResume
from graft.rollout.machine import analysis_due, canary_target, decide
from graft.rollout.observation import Measurement, PodError, Problem
from graft.rollout.status import RolloutStatus

from rollout_fleet import (BASE, Fleet, breaching, healthy, make_spec, no_data, prometheus_down, provider_down,
                           with_values)


def drive(fleet, status, start, until, measure=healthy, step=1.0, stop=None):
    """Tick once a second from `start` to `until`, measuring whenever analysis is due."""
    now = start
    while now <= until:
        m = measure(fleet.spec) if measure and analysis_due(fleet.spec, status, now) else None
        status = fleet.tick(status, now, m)
        if stop and stop(status):
            break
        now += step
    return status, now


@pytest.mark.parametrize("pods,weight,expected", [
    (3, 1, 1), (3, 5, 1), (3, 34, 2), (3, 50, 2), (3, 100, 3), (10, 20, 2), (10, 21, 3), (1, 1, 1), (0, 50, 0),
])
def test_canary_count_is_ceil_of_share_and_at_least_one(pods, weight, expected):
    assert canary_target(pods, weight) == expected


def test_promoted_step_by_step_with_events_in_order(spec):
    fleet = Fleet.of(spec, 4)
    status, _ = drive(fleet, RolloutStatus(), 0, 200, stop=lambda s: s.phase == "Promoted")
    assert status.phase == "Promoted"
    assert fleet.patched() == set(fleet.pods)
    assert status.stable_revision == status.canary_revision == "kv-align@3.2.1"
    assert all(p.track == "stable" and p.patches == "kv-align@3.2.1" for p in fleet.pods.values())
    starts = [e.message for e in fleet.events if e.reason == "StepStarted"]
    assert [m.split(":")[0] for m in starts] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "1 of 4 pods" in starts[0] and "2 of 4 pods" in starts[1] and "4 of 4 pods" in starts[2]
    reasons = fleet.reasons()
    assert reasons.index("PodsPatched") < reasons.index("AnalysisPassed") < reasons.index("Promoted")
    assert reasons.count("WeightSet") == 3 and reasons[-1] == "Promoted"
    assert max(fleet.posts.values()) == 1, "each pod is patched exactly once"


def test_step_advances_only_after_pause_and_analysis(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 9.9, healthy(spec))
    assert status.step_index == 0, "pause of 10 s not over"
    status = fleet.tick(status, 10.0)
    assert status.step_index == 1 and len(fleet.patched()) == 2
    # the second step's pause is over at 20, but no run since the step was in place
    status = fleet.tick(status, 21)
    assert status.step_index == 1
    status = fleet.tick(status, 21.5, healthy(spec))
    assert status.step_index == 2 and fleet.patched() == set(fleet.pods)


def ticks_of(fleet, status, times, measure):
    """One analysis run at each of `times`; returns the status after the last."""
    for t in times:
        status = fleet.tick(status, t, measure(fleet.spec))
    return status


def test_breaker_rolls_back_after_consecutive_breaches():
    spec = make_spec()   # breaker error-rate: max 0.005, consecutive 3
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    for i, t in enumerate((5, 10, 15)):
        status = fleet.tick(status, t, breaching(spec, "error-rate"))
        if i < 2:
            assert status.phase == "Progressing" and status.analysis.result("error-rate").breaches == i + 1
            assert status.step_index == 0, "a breaker short of its limit holds the step"
    assert status.phase == "RolledBack" and status.reason == "AnalysisFailed"
    assert fleet.patched() == set()
    assert "breaker error-rate 50% (50000 errors of 100000 canary requests in 60s)" in status.message
    assert "(breach 3/3)" in status.message
    assert fleet.reasons().count("AnalysisFailed") == 3
    assert {"RollingBack", "RolledBack"} <= set(fleet.reasons())


def test_a_passing_run_resets_the_breach_count():
    spec = make_spec()
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 5, breaching(spec, "error-rate"))
    status = fleet.tick(status, 6, breaching(spec, "error-rate"))
    status = fleet.tick(status, 7, healthy(spec))
    assert status.analysis.result("error-rate").breaches == 0
    status = fleet.tick(status, 8, breaching(spec, "error-rate"))
    assert status.phase == "Progressing"


CONSECUTIVE_ONE = {"breakers": [{"name": "error-rate", "max": 0.005, "consecutive": 1},
                                {"name": "latency-p99", "max": 0.8, "window": "30s", "consecutive": 1}]}


def one_shot(**changes):
    return make_spec(analysis={**BASE["analysis"], **CONSECUTIVE_ONE}, **changes)


def test_single_breach_rolls_back_a_breaker_with_consecutive_one():
    spec = one_shot()
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 5, breaching(spec, "latency-p99"))
    assert status.phase == "RolledBack"
    assert "latency-p99: canary 5e+04 ms over 30s (1000000 samples): breaches <= 0.8 (breach 1/1)" in status.message


def binomial_breach(errors: int, requests: int, limit: float, confidence: float) -> bool:
    """The oracle: at least `errors` of `requests` would be rarer than 1 - confidence at the limit."""
    return errors > 0 and binom.sf(errors - 1, requests, limit) < 1 - confidence


@pytest.mark.parametrize("errors,requests,expected", [
    (1, 40, False), (10, 40, True),          # 2.5% of 40 requests is no evidence against 0.5%; 25% is
    (3, 40, None), (4, 40, None), (1, 1000, None), (25, 1000, None),    # where the oracle flips
])
def test_a_breaker_judges_counts_not_the_raw_ratio(errors, requests, expected):
    spec = one_shot()
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    counts = {"breaker/error-rate": {"canary_requests": requests, "canary_matching": errors}}
    status = fleet.tick(status, 5, with_values(spec, counts))
    breach = binomial_breach(errors, requests, 0.005, spec.analysis.rollback_confidence)
    assert expected is None or breach == expected
    assert (status.phase == "RolledBack") == breach, status.message
    if not breach:
        assert status.analysis.result("error-rate").verdict == "Successful"


def test_a_gate_rolls_back_on_conclusive_evidence_and_holds_on_weak_evidence():
    spec = make_spec()                                   # gate error-rate-delta: max 0.001
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    # 6 errors in 3000 canary requests, none in 3000 stable ones: over the limit, nowhere near conclusive
    weak = {"gate/error-rate-delta": {"canary_requests": 3000, "canary_errors": 6,
                                      "stable_requests": 3000, "stable_errors": 0}}
    status = ticks_of(fleet, status, (5, 10, 15, 20), lambda s: with_values(s, weak))
    assert (status.phase, status.step_index, status.analysis.verdict) == ("Progressing", 0, "Inconclusive")
    # half of the canary's requests fail: one run is enough, whatever the breakers say
    status = ticks_of(fleet, status, (25,), lambda s: breaching(s, "error-rate-delta", role="gate"))
    assert status.phase == "RolledBack" and status.reason == "AnalysisFailed"
    assert "gate error-rate-delta: canary 50000/100000 errors (50%)" in status.message
    assert "at 0.999 confidence" in status.message


def test_a_gate_lacking_traffic_holds_only_the_last_step_with_stable_pods():
    spec = make_spec(steps=[{"weight": 1, "pause": "10s"}, {"weight": 20, "pause": "10s"},
                            {"weight": 50, "pause": "10s"}, {"weight": 100}])
    fleet = Fleet.of(spec, 4)
    few = {"gate/error-rate-delta": {"canary_requests": 300, "canary_errors": 0,
                                     "stable_requests": 3000, "stable_errors": 0}}
    status, now = drive(fleet, RolloutStatus(), 0, 120, measure=lambda s: with_values(s, few))
    assert status.phase == "Progressing" and status.step_index == 2, "steps 1 and 2 may pass, 50% waits"
    assert status.analysis.verdict == "Inconclusive"
    delta = status.analysis.result("error-rate-delta", "gate")
    assert delta.short and "about 2995 error-free canary requests" in delta.message
    status, _ = drive(fleet, status, now, now + 60, stop=lambda s: s.phase == "Promoted")
    assert status.phase == "Promoted"


def test_no_data_at_all_holds_the_first_step_then_pauses_for_a_person():
    # a step never passes on no evidence: with nothing judged on data, not even the first step advances
    spec = make_spec(analysis_inconclusiveLimit=3)
    fleet = Fleet.of(spec, 2)
    status, now = drive(fleet, RolloutStatus(), 0, 60, measure=no_data,
                        stop=lambda s: s.phase != "Progressing")
    assert status.phase == "Paused" and status.step_index == 0 and status.reason == "InconclusiveLimit"
    assert not fleet.spec.paused, "a controller pause lives in status, the spec stays the author's"
    assert [c["reason"] for c in status.pause_conditions] == ["InconclusiveLimit"]
    assert "InconclusiveLimit" in fleet.reasons() and "Promoted" not in fleet.reasons()
    event = next(e for e in fleet.events if e.reason == "InconclusiveLimit")
    assert event.type == "Warning" and "inconclusiveLimit 3" in event.message and "graft.dev/resume=true) or abort" in event.message
    assert fleet.patched() == {"pod-0"}, "nothing rolled back: a person decides"
    # nothing moves while paused
    status, _ = drive(fleet, status, now + 1, now + 40, measure=no_data)
    assert (status.phase, status.step_index) == ("Paused", 0)


def test_the_inconclusive_limit_counts_only_runs_after_the_steps_pause():
    spec = make_spec(analysis_inconclusiveLimit=4, analysis_interval="1s",
                     steps=[{"weight": 50, "pause": "10s"}, {"weight": 100}])
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    ready_at, runs_past_pause = status.step_ready_at, 0
    for t in range(1, 30):
        status = fleet.tick(status, t, no_data(fleet.spec) if analysis_due(fleet.spec, status, t) else None)
        if status.analysis.last_run == t and t >= ready_at + 10:
            runs_past_pause += 1
        if status.phase == "Paused":
            break
        assert runs_past_pause < 4
    assert status.reason == "InconclusiveLimit" and runs_past_pause == 4
    assert t == ready_at + 10 + 3, "the fourth holding run after the 10 s pause"


def test_a_job_still_running_holds_the_step_without_counting_towards_the_inconclusive_limit():
    job = {"spec": {"template": {"spec": {"containers": [{"name": "eval", "image": "e"}]}}}, "jsonPath": "$.d"}
    spec = make_spec(analysis_inconclusiveLimit=2, analysis_interval="1s",
                     analysis_gates=[{"name": "quality", "max": 0.2, "job": job}],
                     steps=[{"weight": 50, "pause": "2s"}, {"weight": 100}])
    fleet = Fleet.of(spec, 2)

    def measure(answer):
        return lambda s: [m if m.check != "gate/quality" else answer for m in healthy(s)]
    pending = measure(Measurement("gate/quality", {"value": None}, pending="job q running"))
    status = fleet.tick(RolloutStatus(), 0)
    status, now = drive(fleet, status, 1, 30, measure=pending)
    assert (status.phase, status.step_index, status.analysis.inconclusive_runs) == ("Progressing", 0, 0), \
        status.message
    assert status.analysis.result("quality").pending
    status, _ = drive(fleet, status, now + 1, now + 10, measure=measure(Measurement("gate/quality", {"value": 0.0},
                                                                                    final=True)),
                      stop=lambda s: s.step_index == 1)
    assert status.step_index == 1, "the Job's number in, the step advanced"


def test_no_data_fail_is_a_breach_of_every_breaker_that_got_none():
    spec = make_spec(analysis_noData="fail")
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    status = ticks_of(fleet, status, (5, 10), no_data)
    assert status.phase == "Progressing" and status.analysis.result("error-rate").breaches == 2
    status = ticks_of(fleet, status, (15,), no_data)
    assert status.phase == "RolledBack" and "noData: fail (breach 3/3)" in status.message


GATED = {"breakers": [{"name": "error-rate", "max": 0.005}],
         "gates": [{"name": "kv-fragmentation", "max": 0.25,
                    "query": 'max(graft_kv_cache_fragmentation_ratio{namespace="{{namespace}}"})'}]}


@pytest.mark.parametrize("policy,promoted", [("hold", False), ("pass", True), ("fail", False)])
def test_no_data_policy_of_a_gate(policy, promoted):
    spec = make_spec(analysis={**BASE["analysis"], **GATED, "noData": policy})
    fleet = Fleet.of(spec, 2)
    empty = {"gate/kv-fragmentation": {"value": None}}
    status, _ = drive(fleet, RolloutStatus(), 0, 100, measure=lambda s: with_values(s, empty),
                      stop=lambda s: s.phase != "Progressing")
    assert (status.phase == "Promoted") == promoted, status.message
    if not promoted:
        # a gate with no data holds; even noData: fail is not conclusive evidence, so never a rollback
        assert status.step_index == 0 and status.phase in ("Progressing", "Paused")
        assert "RollingBack" not in fleet.reasons()


def test_dry_run_check_is_reported_but_never_decides():
    spec = make_spec(analysis_breakers=[{"name": "error-rate", "max": 0.01},
                                        {"name": "latency-p99", "max": 0.5, "dryRun": True}])
    fleet = Fleet.of(spec, 2)
    slow = {"breaker/latency-p99": {"canary_quantile": 3.0, "canary_samples": 5000}}
    status, _ = drive(fleet, RolloutStatus(), 0, 100, measure=lambda s: with_values(s, slow),
                      stop=lambda s: s.phase == "Promoted")
    assert status.phase == "Promoted"
    latency = status.analysis.result("latency-p99")
    assert latency.verdict == "Failed" and latency.dry_run and latency.breaches > 1


def test_provider_errors_pause_at_the_error_limit_and_a_resume_resets_the_count():
    spec = make_spec()                                   # errorLimit 4
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    status = ticks_of(fleet, status, (5, 10, 15), provider_down)
    assert (status.phase, status.analysis.verdict, status.analysis.error_runs) == ("Progressing", "Error", 3)
    assert status.step_index == 0, "an Error run never advances a step"
    status = ticks_of(fleet, status, (20,), provider_down)
    assert status.phase == "Paused" and status.reason == "AnalysisErrorLimit"
    assert not fleet.spec.paused and [c["reason"] for c in status.pause_conditions] == ["AnalysisErrorLimit"]
    event = next(e for e in fleet.events if e.reason == "AnalysisErrorLimit")
    assert "4 runs in a row (errorLimit 4)" in event.message and "refused the query" in event.message
    assert "graft.dev/resume" in event.message
    stored = RolloutStatus.from_dict(status.to_dict())
    assert (stored.pause_conditions, stored.analysis.error_runs) == (status.pause_conditions, 4)
    status = ticks_of(fleet, stored, (25, 30), provider_down)
    assert status.phase == "Paused", "still failing: still paused"
    fleet.resume = True                                  # graft rollout resume
    status = fleet.tick(status, 31)
    assert status.phase == "Progressing" and "Resumed" in fleet.reasons() and not fleet.resume
    assert (status.analysis.error_runs, status.analysis.inconclusive_runs, status.pause_conditions) == (0, 0, [])
    status = ticks_of(fleet, status, (36, 41, 46), provider_down)
    assert status.phase == "Progressing" and status.analysis.error_runs == 3, "counted from zero again"
    status, _ = drive(fleet, status, 47, 200, stop=lambda s: s.phase == "Promoted")
    assert status.phase == "Promoted"


def test_error_limit_zero_holds_until_the_deadline_rolls_back():
    spec = make_spec(analysis_errorLimit=0)
    fleet = Fleet.of(spec, 2)
    status, _ = drive(fleet, RolloutStatus(), 0, 300, measure=provider_down, stop=lambda s: s.phase != "Progressing")
    assert status.phase == "RolledBack" and status.reason == "ProgressDeadlineExceeded"
    assert "analysis Error" in status.message and status.step_index == 0


def test_a_controller_pause_survives_a_gitops_self_heal_and_ends_on_the_resume_annotation():
    spec = make_spec(analysis_errorLimit=1)
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 5, provider_down(spec))
    assert status.phase == "Paused" and status.reason == "AnalysisErrorLimit"
    # a GitOps tool re-applies the manifest as written (paused: false, a new generation): still paused
    fleet.set_paused(False)
    status, _ = drive(fleet, status, 6, 60)
    assert status.phase == "Paused" and status.reason == "AnalysisErrorLimit" and "Resumed" not in fleet.reasons()
    assert fleet.patched() == {"pod-0"}
    # the user's own pause and the controller's are separate: ending one leaves the other
    fleet.set_paused(True)
    fleet.resume = True
    d = decide(fleet.spec, status, fleet.observe(status, {}, None), 61)
    assert ClearResume() in d.actions and d.status.pause_conditions == [] and d.status.phase == "Paused"
    assert "spec.paused still holds it" in next(e.message for e in d.events if e.reason == "PauseEnded")
    fleet.resume = False
    fleet.set_paused(False)
    status, _ = drive(fleet, d.status, 62, 200, stop=lambda s: s.phase == "Promoted")
    assert status.phase == "Promoted" and fleet.reasons().count("Resumed") == 1


def test_a_resume_without_a_pause_is_consumed_and_changes_nothing():
    spec = make_spec()
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0, healthy(spec))
    fleet.resume = True
    status = fleet.tick(status, 1, healthy(spec))
    assert not fleet.resume and status.phase == "Progressing" and "Resumed" not in fleet.reasons()


def test_a_prometheus_outage_holds_the_step_past_its_deadline_and_goes_on_by_itself():
    spec = make_spec(progressDeadline="30s")             # outageLimit 10m
    fleet = Fleet.of(spec, 2)
    status, now = drive(fleet, RolloutStatus(), 0, 30, stop=lambda s: s.step_index == 1 and s.step_ready_at)
    assert status.step_index == 1
    stepped = status.step_ready_at
    status, now = drive(fleet, status, now + 1, now + 300, measure=prometheus_down)
    assert (status.phase, status.step_index, status.reason) == ("Progressing", 1, "AnalysisUnavailable")
    assert status.analysis.verdict == "Error" and status.analysis.error_runs == 0
    assert "Prometheus unreachable for 4m" in status.message and "holding until it answers" in status.message
    assert status.step_ready_at == stepped, "nothing moved"
    assert fleet.reasons().count("AnalysisUnavailable") == 1
    event = next(e for e in fleet.events if e.reason == "AnalysisUnavailable")
    assert event.type == "Warning" and "is unreachable" in event.message and "pausing after 10m" in event.message
    stored = RolloutStatus.from_dict(status.to_dict())
    assert stored.analysis.outage_since == status.analysis.outage_since is not None
    status, now = drive(fleet, stored, now, now + 120, stop=lambda s: s.phase == "Promoted")
    assert status.phase == "Promoted", status.message
    back = next(e for e in fleet.events if e.reason == "AnalysisAvailable")
    assert "answers again after 5m" in back.message
    assert "ProgressDeadlineExceeded" not in fleet.reasons() and "Paused" not in fleet.reasons()
    assert status.analysis.outage_since is None


def test_an_outage_counts_towards_the_deadline_only_once_it_ends():
    spec = make_spec(progressDeadline="30s")
    fleet = Fleet.of(spec, 2)
    status, now = drive(fleet, RolloutStatus(), 0, 30, stop=lambda s: s.step_index == 1 and s.step_ready_at)
    status, now = drive(fleet, status, now + 1, now + 100, measure=prometheus_down)
    # back, but with no evidence: the deadline runs again, from where the outage stopped it
    status, _ = drive(fleet, status, now, now + 200, measure=no_data, stop=lambda s: s.phase != "Progressing")
    assert status.phase == "RolledBack" and status.reason == "ProgressDeadlineExceeded"
    assert status.analysis.outage_seconds >= 95


def test_an_outage_past_the_outage_limit_pauses_for_a_person():
    spec = make_spec(analysis_outageLimit="2m")
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    status, now = drive(fleet, status, 1, 600, measure=prometheus_down, stop=lambda s: s.phase != "Progressing")
    assert (status.phase, status.reason) == ("Paused", "AnalysisOutageLimit")
    assert 120 <= now <= 130 and status.step_index == 0
    assert "could not be reached for 2m" in status.message and "(outageLimit 2m)" in status.message
    assert [c["reason"] for c in status.pause_conditions] == ["AnalysisOutageLimit"] and not fleet.spec.paused
    status, now = drive(fleet, status, now + 1, now + 60)           # Prometheus back: a person still decides
    assert status.phase == "Paused"
    fleet.resume = True
    status, _ = drive(fleet, status, now, now + 200, stop=lambda s: s.phase == "Promoted")
    assert status.phase == "Promoted"


def test_an_outage_limit_of_zero_holds_for_ever():
    spec = make_spec(analysis_outageLimit="0s")
    fleet = Fleet.of(spec, 2)
    status, _ = drive(fleet, RolloutStatus(), 0, 4 * 3600, measure=prometheus_down, step=30.0)
    assert (status.phase, status.reason, status.step_index) == ("Progressing", "AnalysisUnavailable", 0)


def test_one_refused_query_among_unreachable_ones_is_an_error_not_an_outage():
    spec = make_spec()
    fleet = Fleet.of(spec, 2)

    def mixed(s):
        out = prometheus_down(s)
        out[0] = provider_down(s)[0]
        return out

    status, _ = drive(fleet, RolloutStatus(), 0, 60, measure=mixed, stop=lambda s: s.phase != "Progressing")
    assert (status.phase, status.reason) == ("Paused", "AnalysisErrorLimit")
    assert "AnalysisUnavailable" not in fleet.reasons()


def test_pause_holds_resume_restarts_the_step_clock():
    spec = make_spec()
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    paused = make_spec(paused=True)
    fleet.spec = paused
    status, _ = drive(fleet, status, 1, 100)
    assert status.phase == "Paused" and status.step_index == 0 and fleet.reasons().count("Paused") == 1
    assert status.analysis.last_run is not None, "a paused rollout keeps being analysed"
    fleet.spec = spec
    status = fleet.tick(status, 101, healthy(spec))
    assert status.phase == "Progressing" and "Resumed" in fleet.reasons()
    assert status.step_started_at == 101 and status.step_index == 0
    status, _ = drive(fleet, status, 102, 110)
    assert status.step_index == 0, "the pause starts over after a resume"
    status, _ = drive(fleet, status, 111, 120)
    assert status.step_index == 1


def test_failing_analysis_rolls_back_even_while_paused():
    spec = one_shot(paused=False)
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.spec = one_shot(paused=True)
    status = fleet.tick(status, 1)
    status = fleet.tick(status, 6, breaching(fleet.spec, "latency-p99"))
    assert status.phase == "RolledBack"


def test_created_paused_patches_nothing():
    spec = make_spec(paused=True)
    fleet = Fleet.of(spec, 2)
    status, _ = drive(fleet, RolloutStatus(), 0, 30)
    assert status.phase == "Pending" and fleet.patched() == set() and status.reason == "Paused"


def test_promote_step_skips_the_rest_of_the_step(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.promote = "step"
    status = fleet.tick(status, 1)
    assert status.step_index == 1 and len(fleet.patched()) == 2 and fleet.promote is None
    assert "PromotedByUser" in fleet.reasons()


def test_promote_full_patches_everything_and_promotes_without_analysis(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.promote = "full"
    status = fleet.tick(status, 1)
    assert status.phase == "Promoted" and fleet.patched() == set(fleet.pods)
    assert status.analysis.last_run is None


def test_invalid_promote_value_is_refused_with_an_event(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.promote = "everything"
    status = fleet.tick(status, 1)
    assert status.step_index == 0 and "InvalidControl" in fleet.reasons() and fleet.promote is None


def test_abort_reverts_every_canary(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 10, healthy(spec))
    assert len(fleet.patched()) == 2
    fleet.abort = True
    status = fleet.tick(status, 11)
    assert status.phase == "RolledBack" and status.reason == "Aborted" and fleet.patched() == set()
    assert {"Aborted", "RollingBack", "RolledBack"} <= set(fleet.reasons())
    assert all(p.track == "stable" and p.patches == "base" for p in fleet.pods.values())


def test_restarted_canary_is_patched_again(spec):
    fleet = Fleet.of(spec, 3)
    status = fleet.tick(RolloutStatus(), 0)
    (canary,) = fleet.patched()
    fleet.restart(canary)
    status = fleet.tick(status, 1)
    assert canary in fleet.patched() and fleet.posts[canary] == 2
    assert "PodRepatched" in fleet.reasons()
    assert status.pod(canary).restart_count == 1


def test_restarted_canary_that_came_back_patched_is_not_posted_again(spec):
    fleet = Fleet.of(spec, 3)
    status = fleet.tick(RolloutStatus(), 0)
    (canary,) = fleet.patched()
    fleet.restart(canary, keep_patch=True)
    status = fleet.tick(status, 1)
    assert fleet.posts[canary] == 1 and "PodRepatched" not in fleet.reasons()


def test_vanished_canary_is_dropped_and_replaced(spec):
    fleet = Fleet.of(spec, 3)
    status = fleet.tick(RolloutStatus(), 0)
    (canary,) = fleet.patched()
    del fleet.pods[canary]
    status = fleet.tick(status, 1)
    assert status.pod(canary) is None and "PodDropped" in fleet.reasons()
    assert len(fleet.patched()) == 1 and canary not in fleet.patched()


def test_new_pod_joins_as_stable(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.add("pod-new")
    status = fleet.tick(status, 1)
    assert status.pod("pod-new").track == "stable" and fleet.pods["pod-new"].track == "stable"


def test_operator_restart_resumes_without_repatching(spec):
    fleet = Fleet.of(spec, 4)
    status, _ = drive(fleet, RolloutStatus(), 0, 12)
    assert status.step_index == 1
    posts = dict(fleet.posts)
    stored = RolloutStatus.from_dict(status.to_dict())     # what a new operator reads back
    for name in fleet.pods:                                  # and it believes nothing it did not store
        fleet.pods[name].track = fleet.pods[name].track
    again = fleet.tick(stored, 13)
    assert fleet.posts == posts and again.step_index == 1 and again.phase == "Progressing"


def test_decide_is_idempotent(spec):
    fleet = Fleet.of(spec, 3)
    status = fleet.tick(RolloutStatus(), 0)
    obs = fleet.observe(status, {}, healthy(spec))
    a, b = decide(spec, status, obs, 7), decide(spec, status, obs, 7)
    assert a == b


def test_unknown_patch_fails_and_reverts_what_was_patched(spec):
    fleet = Fleet.of(spec, 4)
    status, _ = drive(fleet, RolloutStatus(), 0, 10)
    assert len(fleet.patched()) == 2
    for name in fleet.pods:
        if name not in fleet.patched():
            fleet.pods[name].refuse = PodError("unknown-patch", "no built-in patch kv-align@3.2.1")
    status, _ = drive(fleet, status, 11, 30)
    assert status.phase == "Failed" and status.reason == "UnknownPatch"
    assert "no built-in patch" in status.message and fleet.patched() == set()
    assert "UnknownPatch" in fleet.reasons()


def test_unknown_patch_on_the_first_pod_fails(spec):
    fleet = Fleet.of(spec, 2)
    for pod in fleet.pods.values():
        pod.refuse = PodError("unknown-patch", "404 no built-in patch kv-align@3.2.1")
    status = fleet.tick(RolloutStatus(), 0)
    assert status.phase == "Failed" and status.reason == "UnknownPatch"


def test_verify_failure_rolls_back(spec):
    fleet = Fleet.of(spec, 2)
    fleet.pods["pod-0"].refuse = PodError("verify-failed", "failed its self-check and was reverted")
    status = fleet.tick(RolloutStatus(), 0)
    assert status.phase == "RolledBack" and status.reason == "PatchVerifyFailed"


def test_unreachable_engine_holds_with_a_message_then_recovers(spec):
    fleet = Fleet.of(spec, 2)
    status, _ = drive(fleet, RolloutStatus(), 0, 10)
    assert status.step_index == 1 and fleet.patched() == {"pod-0"}
    fleet.pods["pod-1"].unreachable = True
    status = fleet.tick(status, 21, healthy(spec))
    assert status.step_index == 2 and status.phase == "Progressing"
    assert "pods not in place: pod-1 (pod-1: connection refused)" in status.message
    fleet.pods["pod-1"].unreachable = False
    status = fleet.tick(status, 22)
    assert fleet.patched() == {"pod-0", "pod-1"}


def test_no_pods_is_pending_then_failed_at_the_deadline(spec):
    fleet = Fleet.of(spec, 0)
    status = fleet.tick(RolloutStatus(), 0)
    assert status.phase == "Pending" and "no ready pods match the selector app=llm-engine" in status.message
    status = fleet.tick(status, 60)
    assert fleet.reasons() == ["NoPods"], "one event, not one per tick"
    status = fleet.tick(status, 121)
    assert status.phase == "Failed" and status.reason == "ProgressDeadlineExceeded"


def test_transient_problem_waits_with_one_event(spec):
    fleet = Fleet.of(spec, 2)
    fleet.problem = Problem("SecretMissing", "Secret graft/admin-token not found")
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 1)
    assert status.phase == "Pending" and status.message == "Secret graft/admin-token not found"
    assert fleet.reasons() == ["SecretMissing"] and fleet.patched() == set()
    fleet.problem = None
    status = fleet.tick(status, 2)
    assert status.phase == "Progressing"


def test_permanent_problem_mid_rollout_reverts_and_fails(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.problem = Problem("DigestMismatch", "bundle digest sha256:aa != pinned sha256:bb", permanent=True)
    status = fleet.tick(status, 1)
    assert status.phase == "Failed" and status.reason == "DigestMismatch" and fleet.patched() == set()


def test_gateway_route_follows_pods_and_returns_to_stable_first_on_rollback():
    spec = one_shot(trafficRouting={"gatewayAPI": {"httpRoute": "llm", "stableService": "llm-stable",
                                                    "canaryService": "llm-canary"}})
    fleet = Fleet.of(spec, 4, gateway=True)
    status = fleet.tick(RolloutStatus(), 0)
    assert fleet.route_weight == 1 and status.weight == 1
    assert "HTTPRoute llm sends 1% to llm-canary" in [e.message for e in fleet.events if e.reason == "WeightSet"][0]
    d = decide(spec, status, fleet.observe(status, {}, breaching(spec, "latency-p99")), 5)
    kinds = [type(a).__name__ for a in d.actions]
    assert kinds.index("SetWeight") < kinds.index("RevertPatch"), "traffic leaves the canary before the revert"


def test_gateway_promotion_moves_everything_to_stable():
    spec = make_spec(trafficRouting={"gatewayAPI": {"httpRoute": "llm", "stableService": "llm-stable",
                                                    "canaryService": "llm-canary"}})
    fleet = Fleet.of(spec, 2, gateway=True)
    status, _ = drive(fleet, RolloutStatus(), 0, 100, stop=lambda s: s.phase == "Promoted")
    assert status.phase == "Promoted" and fleet.route_weight == 0
    assert all(p.track == "stable" for p in fleet.pods.values())


def test_final_phases_do_nothing(spec):
    fleet = Fleet.of(spec, 2)
    fleet.abort = True
    status = fleet.tick(RolloutStatus(), 0)
    fleet.abort, fleet.promote = False, "full"
    d = decide(spec, status, fleet.observe(status, {}, healthy(spec)), 50)
    assert d.actions == [] and d.events == [] and d.status.phase == "RolledBack"


def test_spec_patch_change_mid_rollout_rolls_back(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.spec = make_spec(patch={"name": "kv-align", "version": "3.2.2"})
    status = fleet.tick(status, 1)
    assert status.phase == "RolledBack" and status.reason == "PatchChanged"
    assert not any("kv-align" in p.revision for p in fleet.pods.values())


COMPARISONS = (("gate", "error-rate-delta"), ("gate", "tpot-p99"), ("breaker", "ttft-p99"), ("breaker", "tpot-p99"))


def test_comparison_checks_are_skipped_once_no_stable_pod_is_left():
    # the last step holds for a pause, so its runs can be read before the promotion
    spec = make_spec(steps=[{"weight": 1, "pause": "10s"}, {"weight": 50, "pause": "10s"},
                            {"weight": 100, "pause": "1h"}])
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 10, healthy(spec))        # step 2 in place at 10: pod-1 is still stable
    assert status.step_index == 1 and fleet.patched() == {"pod-0"}
    status = fleet.tick(status, 15, healthy(spec))        # a run while one stable pod is left
    results = {(r.role, r.name): r for r in status.analysis.results}
    for key in COMPARISONS:
        assert results[key].verdict == "Successful", (key, results[key].message)
    # the run at 20 is judged with the pods of step 2, then step 3 makes pod-1 a canary too
    status = fleet.tick(status, 20, healthy(spec))
    assert status.step_index == 2 and fleet.patched() == {"pod-0", "pod-1"}
    assert all(r.verdict != "Skipped" for r in status.analysis.results), "judged while pod-1 was stable"
    status = fleet.tick(status, 25, healthy(spec))        # the first run with no stable pod
    assert (status.phase, status.step_index, status.analysis.last_run) == ("Progressing", 2, 25)
    results = {(r.role, r.name): r for r in status.analysis.results}
    for key in COMPARISONS:
        r = results[key]
        assert (r.verdict, r.breaches, r.value) == ("Skipped", 0, None), key
        assert r.message == f"{key[1]}: no stable pods left to compare with"
    # the absolute checks are still judged, and a skipped comparison holds nothing
    assert results[("breaker", "error-rate")].verdict == "Successful"
    assert results[("breaker", "cpu")].verdict == "Successful"
    assert status.analysis.verdict == "Successful"


def test_a_stable_pod_that_is_not_ready_leaves_nothing_to_compare_with():
    spec = make_spec(steps=[{"weight": 50, "pause": "10s"}, {"weight": 100, "pause": "1h"}])
    fleet = Fleet.of(spec, 3)
    status = fleet.tick(RolloutStatus(), 0)
    assert fleet.patched() == {"pod-0", "pod-1"}
    fleet.pods["pod-2"].ready = False                      # the last stable pod serves no traffic
    status = fleet.tick(status, 10, healthy(spec))
    assert status.step_index == 1 and status.pod("pod-2").track == "stable"
    status = fleet.tick(status, 15, healthy(spec))
    results = {(r.role, r.name): r.verdict for r in status.analysis.results}
    assert all(results[key] == "Skipped" for key in COMPARISONS), results


def test_analysis_waits_an_interval_after_the_first_canary(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    assert not analysis_due(spec, status, 4.9) and analysis_due(spec, status, 5)


def test_actions_only_touch_ready_pods(spec):
    fleet = Fleet.of(spec, 2)
    fleet.pods["pod-0"].ready = False
    status = fleet.tick(RolloutStatus(), 0)
    assert fleet.patched() == {"pod-1"}
    d = decide(spec, status, fleet.observe(status, {}, None), 1)
    assert not [a for a in d.actions if isinstance(a, ApplyPatch)]


def test_a_run_from_the_tick_that_put_a_step_in_place_does_not_count_for_it(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 10, healthy(spec))      # step 1 done; step 2 put in place at 10
    assert status.step_index == 1 and status.step_ready_at == 10 and status.analysis.last_run == 10
    status = fleet.tick(status, 20)
    assert status.step_index == 1, "the run at 10 measured step 1, not step 2"
