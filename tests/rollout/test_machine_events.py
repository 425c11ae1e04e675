"""The state machine's less travelled paths, each with the Event that explains it: routing on a
rollback, coarse pod-ratio steps, engines nobody can reach, a rollback that cannot finish yet, the
engines' refusals, a queued rollout and a route the operator cannot update."""
import pytest

from graft.rollout.decision import SetWeight
from graft.rollout.machine import decide
from graft.rollout.observation import PodError, Problem
from graft.rollout.status import RolloutStatus

from rollout_fleet import BASE, Fleet, breaching, healthy, make_spec

GATEWAY = {"gatewayAPI": {"httpRoute": "llm", "stableService": "llm-stable", "canaryService": "llm-canary"}}
ONE_BREACH = {**BASE["analysis"], "breakers": [{"name": "error-rate", "max": 0.005, "consecutive": 1}]}


def events(fleet, reason):
    return [e for e in fleet.events if e.reason == reason]


# routing on a rollback
@pytest.mark.parametrize("how", ["analysis", "abort"])
def test_a_rolled_back_gateway_rollout_sends_every_request_back_to_stable(how):
    spec = make_spec(trafficRouting=GATEWAY, analysis=ONE_BREACH,
                     steps=[{"weight": 10, "pause": "1h"}, {"weight": 50, "pause": "1h"}, {"weight": 100}])
    fleet = Fleet.of(spec, 4, gateway=True)
    status = fleet.tick(RolloutStatus(), 0)
    assert fleet.route_weight == 10 and fleet.patched() == {"pod-0"}
    if how == "abort":
        fleet.abort = True
        d = decide(spec, status, fleet.observe(status, {}, None), 1)
    else:
        d = decide(spec, status, fleet.observe(status, {}, breaching(spec, "error-rate")), 5)
    assert d.status.phase == "RollingBack"
    weights = [a.weight for a in d.actions if isinstance(a, SetWeight)]
    assert weights == [0], "the route goes back to (100, 0) before anything else"
    status = fleet.tick(status, 6, breaching(spec, "error-rate") if how == "analysis" else None)
    assert status.phase == "RolledBack", status.message
    assert fleet.route_weight == 0 and status.weight == 0 and fleet.patched() == set()
    # the next tick finds nothing to do: the route is where a finished rollback leaves it
    after = decide(spec, status, fleet.observe(status, {}, None), 7)
    assert after.actions == [] and fleet.route_weight == 0


def test_a_rollback_waits_for_the_route_before_it_is_done():
    spec = make_spec(trafficRouting=GATEWAY, analysis=ONE_BREACH)
    fleet = Fleet.of(spec, 2, gateway=True)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.abort = True
    status = fleet.tick(status, 1)
    assert status.phase == "RolledBack"
    # a route someone set by hand to 30% while the engines were already reverted
    fleet.route_weight = 30
    rolling = RolloutStatus.from_dict({**status.to_dict(), "phase": "RollingBack", "endPhase": "RolledBack"})
    d = decide(spec, rolling, fleet.observe(rolling, {}, None), 2)
    assert d.status.phase == "RollingBack" and d.actions == [SetWeight(0)]


# coarse steps under pod-ratio routing
@pytest.mark.parametrize("pods,first,warned", [(3, 1, True), (99, 1, True), (100, 1, False), (4, 25, False),
                                               (4, 24, True), (2, 50, False)])
def test_pod_ratio_routing_warns_when_the_first_step_is_finer_than_one_pod(pods, first, warned):
    spec = make_spec(steps=[{"weight": first, "pause": "1h"}, {"weight": 100}])
    fleet = Fleet.of(spec, pods)
    status = fleet.tick(RolloutStatus(), 0)
    assert status.phase == "Progressing"
    coarse = events(fleet, "CoarseSteps")
    assert bool(coarse) == warned
    if warned:
        (event,) = coarse
        assert event.type == "Warning"
        assert f"over {pods} pods" in event.message and f"{100 / pods:.3g}% of the traffic" in event.message
        assert f"(first: {first}%)" in event.message


def test_gateway_routing_never_warns_of_coarse_steps():
    spec = make_spec(trafficRouting=GATEWAY)
    fleet = Fleet.of(spec, 3, gateway=True)
    fleet.tick(RolloutStatus(), 0)
    assert not events(fleet, "CoarseSteps")


def test_the_traffic_share_is_what_the_pods_make_under_pod_ratio_and_the_weight_under_gateway():
    spec = make_spec(steps=[{"weight": 1, "pause": "1h"}, {"weight": 100}])
    status = Fleet.of(spec, 3).tick(RolloutStatus(), 0)
    assert (status.canary_pods, status.traffic_share) == (1, 33.3)
    gspec = make_spec(trafficRouting=GATEWAY, steps=[{"weight": 1, "pause": "1h"}, {"weight": 100}])
    status = Fleet.of(gspec, 3, gateway=True).tick(RolloutStatus(), 0)
    assert (status.canary_pods, status.traffic_share) == (1, 1.0)


# engines nobody can reach
def test_engines_that_cannot_be_asked_hold_the_start_with_one_event_then_the_deadline_fails_it(spec):
    fleet = Fleet.of(spec, 2)
    for pod in fleet.pods.values():
        pod.unreachable = True
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 30)
    assert status.phase == "Pending" and status.reason == "EnginesUnreachable"
    assert status.message == ("cannot read the revision of any engine "
                              "(pod-0: connection refused; pod-1: connection refused)")
    (event,) = events(fleet, "EnginesUnreachable")
    assert event.type == "Warning" and fleet.posts == {}
    status = fleet.tick(status, 120)
    assert status.phase == "Pending", "the deadline is 2m after creation, not yet past"
    status = fleet.tick(status, 121)
    assert status.phase == "Failed" and status.reason == "ProgressDeadlineExceeded"
    assert "not started within 2m: cannot read the revision of any engine" in status.message


def test_one_engine_answering_is_enough_to_start(spec):
    fleet = Fleet.of(spec, 2)
    fleet.pods["pod-0"].unreachable = True
    status = fleet.tick(RolloutStatus(), 0)
    assert status.phase == "Progressing" and not events(fleet, "EnginesUnreachable")
    assert status.stable_revision == "base", "read from the engine that answered"
    # the canary is chosen by name; its engine is asked again every tick until it answers
    assert fleet.patched() == set() and "pods not in place: pod-0 (pod-0: connection refused)" in status.message
    fleet.pods["pod-0"].unreachable = False
    fleet.tick(status, 1)
    assert fleet.patched() == {"pod-0"}


# a rollback that cannot finish yet
def test_a_rollback_blocked_by_an_unreachable_canary_says_so_once_and_finishes_when_it_answers(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 10, healthy(spec))
    assert fleet.patched() == {"pod-0", "pod-1"}
    fleet.pods["pod-1"].unreachable = True
    fleet.abort = True
    for t in (11, 12, 13):
        status = fleet.tick(status, t)
        assert status.phase == "RollingBack" and status.reason == "Aborted"
    assert status.message == ("aborted by the user; rolling back, but cannot revert kv-align@3.2.1 on "
                              "pod-1: connection refused")
    (event,) = events(fleet, "RollbackBlocked")
    assert event.type == "Warning" and event.message == "cannot revert kv-align@3.2.1 on pod-1: connection refused"
    assert fleet.patched() == {"pod-1"} and fleet.deletes["pod-1"] == 3, "tried again every tick"
    assert "RolledBack" not in fleet.reasons()
    fleet.pods["pod-1"].unreachable = False
    status = fleet.tick(status, 14)
    assert (status.phase, status.reason, status.message) == ("RolledBack", "Aborted", "aborted by the user")
    assert fleet.patched() == set() and fleet.reasons()[-1] == "RolledBack"


def test_a_rollback_blocked_by_a_transient_problem_keeps_its_cause(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.abort = True
    fleet.problem = Problem("AdminTokenMissing", "Secret graft/admin-token not found")
    status = fleet.tick(status, 1)
    assert status.phase == "RollingBack" and status.reason == "Aborted"
    assert status.message == "aborted by the user; rolling back, but Secret graft/admin-token not found"
    assert [e.message for e in events(fleet, "RollbackBlocked")] == ["Secret graft/admin-token not found"]
    assert fleet.patched() == {"pod-0"}, "no admin call without the token"
    fleet.problem = None
    status = fleet.tick(status, 2)
    assert status.phase == "RolledBack" and fleet.patched() == set()


# refusals from the engines
@pytest.mark.parametrize("kind,reason", [("malformed", "PatchRefused"), ("unauthorized", "Unauthorized"),
                                         ("conflict", "PatchConflict"), ("unknown-patch", "UnknownPatch")])
def test_a_refusal_fails_the_rollout_with_its_own_reason_and_reverts_the_canaries(spec, kind, reason):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    assert fleet.patched() == {"pod-0"}
    fleet.pods["pod-1"].refuse = PodError(kind, f"POST /admin/patches: refused ({kind})")
    status = fleet.tick(status, 10, healthy(spec))
    assert status.phase == "Failed" and status.reason == reason
    assert status.message == f"pod pod-1: POST /admin/patches: refused ({kind})"
    (event,) = events(fleet, reason)
    assert event.type == "Warning" and event.message == status.message
    assert fleet.patched() == set() and fleet.reasons()[-1] == "RolledBack"
    assert next(e for e in fleet.events if e.reason == "RolledBack").type == "Warning", "a failure is a warning"


def test_an_unreachable_engine_is_no_refusal(spec):
    fleet = Fleet.of(spec, 2)
    fleet.pods["pod-0"].refuse = PodError("unreachable", "503 draining")
    status = fleet.tick(RolloutStatus(), 0)
    assert status.phase == "Progressing", "tried again next tick"


# a rollout waiting its turn
def test_a_queued_rollout_waits_past_the_deadline_and_says_so_once(spec):
    fleet = Fleet.of(spec, 2)
    fleet.problem = Problem("Queued", "queued: PatchRollout other is active on fleet llm-engine")
    status = fleet.tick(RolloutStatus(), 0)
    for t in (60, 121, 600):
        status = fleet.tick(status, t)
    assert status.phase == "Pending" and status.reason == "Queued"
    assert [e.type for e in events(fleet, "Queued")] == ["Warning"]
    assert fleet.patched() == set()
    fleet.problem = None
    status = fleet.tick(status, 601)
    assert status.phase == "Progressing" and fleet.patched() == {"pod-0"}


def test_any_other_transient_problem_fails_a_rollout_that_never_started_at_the_deadline(spec):
    fleet = Fleet.of(spec, 2)
    fleet.problem = Problem("AdminTokenMissing", "Secret graft/admin-token not found")
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 120)
    assert status.phase == "Pending"
    status = fleet.tick(status, 121)
    assert status.phase == "Failed" and status.reason == "ProgressDeadlineExceeded"
    assert status.message == "not started within 2m: Secret graft/admin-token not found"


# the route cannot be updated
def test_a_route_update_failure_holds_the_step_with_one_event_then_the_deadline_rolls_back():
    spec = make_spec(trafficRouting=GATEWAY)
    fleet = Fleet.of(spec, 2, gateway=True)
    status = fleet.tick(RolloutStatus(), 0)
    assert fleet.route_weight == 1
    fleet.problem = Problem("HTTPRouteUpdateFailed", "HTTPRoute llm/llm: 409 the object has been modified")
    for t in (5, 10, 15):
        status = fleet.tick(status, t, healthy(spec))
    assert status.phase == "Progressing" and status.step_index == 0 and fleet.route_weight == 1
    assert status.reason == "HTTPRouteUpdateFailed" and status.message.startswith("HTTPRoute llm/llm: 409")
    assert [e.type for e in events(fleet, "HTTPRouteUpdateFailed")] == ["Warning"]
    # the step started at 0 with a pause of 10 s; the deadline is 2 minutes past the pause
    status = fleet.tick(status, 130)
    assert status.phase == "Progressing"
    fleet.problem = Problem("HTTPRouteUpdateFailed", "HTTPRoute llm/llm: 409 the object has been modified")
    status = fleet.tick(status, 131)
    assert status.phase == "RollingBack" and status.reason == "ProgressDeadlineExceeded"
    fleet.problem = None
    status = fleet.tick(status, 132)
    assert status.phase == "RolledBack" and fleet.route_weight == 0 and fleet.patched() == set()
