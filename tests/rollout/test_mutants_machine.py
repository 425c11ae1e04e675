"""Behaviour of the state machine and the fleet controller that no other test pinned down: each test
here fails on a deliberate break of graft/rollout/machine.py or graft/rollout/fleet.py (a flipped
comparison, a dropped statement) that the rest of the suite let through."""
import pytest

from graft.rollout.actions import ApplyPatch, LabelPod, RevertPatch, SetPatched
from graft.rollout.decision import ClearPromote, RecordPromotion
from graft.rollout.fleet import FleetPod, adopt, converge, without
from graft.rollout.machine import canary_target, decide, stable_of
from graft.rollout.observation import PodError
from graft.rollout.spec import PatchSource, PatchSpec
from graft.rollout.status import RolloutStatus

from rollout_fleet import Fleet, breaching, healthy, make_spec, no_data, provider_down

KV = PatchSpec("kv-align", "3.2.1", PatchSource(builtin=True))
SYNC = PatchSpec("sync-free", "3.2.1", PatchSource(builtin=True))


# canary counts and the stable side
@pytest.mark.parametrize("pods,weight", [(3, 0), (0, 0), (5, -1)])
def test_no_weight_means_no_canary(pods, weight):
    assert canary_target(pods, weight) == 0


@pytest.mark.parametrize("revisions,reverting,stable", [
    (["x@1", "x@1", "y@1"], False, "x@1"),                 # the most common revision
    (["y@1", "x@1"], False, "x@1"),                        # a tie: the first by name, whatever the order
    (["kv-align@3.2.1", "base"], False, "base"),           # a pod already patched is not the stable side
    (["kv-align@3.2.1"], False, "base"),                   # ... unless all are: then without the patch
    ([], False, "base"),
    (["kv-align@3.2.1", "base", "base"], True, "kv-align@3.2.1"),   # reverting: what runs the patch
    (["base", "base"], True, "base"),                      # reverting a patch no pod runs
])
def test_the_stable_revision(revisions, reverting, stable):
    assert stable_of(revisions, "kv-align@3.2.1", reverting) == stable


def test_a_revert_records_the_patched_revision_as_stable():
    spec = make_spec(action="revert")
    fleet = Fleet.of(spec, 3)
    for pod in fleet.pods.values():
        pod.revision = "kv-align@3.2.1"
    status = fleet.tick(RolloutStatus(), 0)
    assert (status.stable_revision, status.canary_revision) == ("kv-align@3.2.1", "base")


# what every decision carries
def test_a_decision_records_the_generation_and_the_conditions_it_saw(spec):
    fleet = Fleet.of(spec, 2)
    fleet.generation = 7
    status = fleet.tick(RolloutStatus(), 0)
    assert status.observed_generation == 7
    conditions = {c["type"]: c for c in status.conditions}
    assert conditions["Progressing"]["status"] == "True" and conditions["Promoted"]["status"] == "False"
    assert all(c["observedGeneration"] == 7 for c in conditions.values())


def test_pod_records_are_kept_in_name_order(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.add("a-late")
    status = fleet.tick(status, 1)
    assert [p.name for p in status.pods] == ["a-late", "pod-0", "pod-1"]


# starting
def test_an_abort_before_the_start_says_so(spec):
    fleet = Fleet.of(spec, 2)
    fleet.abort = True
    status = fleet.tick(RolloutStatus(), 0)
    assert (status.phase, status.reason) == ("RolledBack", "Aborted")
    assert [(e.reason, e.type) for e in fleet.events] == [("Aborted", "Warning")]
    assert fleet.posts == {}


def test_every_engine_refusing_the_token_fails_the_start_at_once(spec):
    fleet = Fleet.of(spec, 2)
    for pod in fleet.pods.values():
        pod.unreachable = True            # no revision comes back from any engine
    refused = {name: PodError("unauthorized", "GET /admin/patches: 403 wrong token") for name in fleet.pods}
    d = decide(spec, RolloutStatus(), fleet.observe(RolloutStatus(), refused, None), 0)
    assert (d.status.phase, d.status.reason) == ("Failed", "Unauthorized")
    assert d.status.message == "pod pod-0: GET /admin/patches: 403 wrong token"
    assert [e.reason for e in d.events] == ["Unauthorized"] and d.actions == []


# steps and analysis counters
def test_a_new_step_starts_its_holding_and_error_counts_from_zero():
    spec = make_spec(analysis_inconclusiveLimit=5, steps=[{"weight": 1, "pause": "5s"}, {"weight": 50, "pause": "1h"},
                                                          {"weight": 100}])
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    for t in (5, 10, 15):
        status = fleet.tick(status, t, no_data(spec))
    for t in (20, 25):
        status = fleet.tick(status, t, provider_down(spec))
    assert status.analysis.error_runs == 2 and status.step_index == 0
    fleet.promote = "step"
    status = fleet.tick(status, 26)
    assert status.step_index == 1
    assert (status.analysis.inconclusive_runs, status.analysis.error_runs) == (0, 0)


def test_analysis_passed_is_said_once_per_turn_to_successful(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    for t in (5, 10, 15):
        status = fleet.tick(status, t, healthy(spec))
    assert fleet.reasons().count("AnalysisPassed") == 1
    status = fleet.tick(status, 20, no_data(spec))
    assert fleet.reasons().count("AnalysisInconclusive") == 1
    status = fleet.tick(status, 25, healthy(spec))
    assert fleet.reasons().count("AnalysisPassed") == 2


def test_losing_every_ready_pod_mid_rollout_says_no_pods(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    for pod in fleet.pods.values():
        pod.ready = False
    status = fleet.tick(status, 1)
    assert status.phase == "Progressing" and status.reason == "NoPods"
    assert status.message == "step 1/3: weight 1%, 0 of 0 pods canary; no ready pods match the selector"
    assert fleet.reasons().count("NoPods") == 1


def test_a_promotion_records_itself_and_says_what_every_pod_runs(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.promote = "full"
    actions, answered = [], {}
    for _ in range(4):                           # one operator tick, keeping every action
        d = decide(spec, status, fleet.observe(status, {}, None, answered), 1)
        status = d.status
        actions += d.actions
        fleet.execute(d, answered)
    assert status.phase == "Promoted" and actions.count(RecordPromotion()) == 1
    assert status.message == "kv-align@3.2.1 promoted: all 4 pods run kv-align@3.2.1"


def test_a_rollback_drops_what_the_same_tick_planned_for_the_next_step(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.promote = "step"                       # would patch a second pod ...
    one = make_spec(analysis={"interval": "5s", "breakers": [{"name": "error-rate", "max": 0.005,
                                                              "consecutive": 1}]})
    d = decide(one, status, fleet.observe(status, {}, breaching(one, "error-rate")), 5)
    assert d.status.phase == "RollingBack"       # ... but the same run rolls back
    assert not [a for a in d.actions if isinstance(a, ApplyPatch)]
    assert ClearPromote() in d.actions, "the promote control is still consumed"
    assert [a.pod for a in d.actions if isinstance(a, RevertPatch)] == ["pod-0"]


# the fleet controller
def pod(name, revision="base", **kw):
    return FleetPod(name, revision=revision, patches=kw.pop("patches", revision), track=kw.pop("track", "stable"),
                    **kw)


@pytest.mark.parametrize("changes", [{"track": "canary"}, {"patches": "base"}])
def test_a_pod_is_relabelled_when_either_its_track_or_its_annotation_is_off(changes):
    plan = converge([KV], [pod("p", "kv-align@3.2.1", patched=True, **changes)])
    assert plan.actions == [LabelPod("p", "stable", "kv-align@3.2.1")]


def test_pods_that_cannot_be_asked_are_pending_with_the_reason():
    plan = converge([KV], [pod("a", running=False, ready=False, patched=False),
                           pod("b", revision=None, patches="kv-align@3.2.1", error="connection refused"),
                           pod("c", revision=None, patches="kv-align@3.2.1")])
    assert plan.pending == {"a": "not running", "b": "connection refused", "c": "the engine did not answer"}
    assert plan.converged == []


def test_a_patched_pod_that_must_change_is_let_out_first():
    plan = converge([KV], [pod("p", "sync-free@3.2.1", patches="kv-align@3.2.1", patched=True)])
    assert SetPatched("p", False, "converging to kv-align@3.2.1") in plan.actions
    assert ApplyPatch("p", KV, replace=False) in plan.actions, "no version of kv-align runs there to replace"


@pytest.mark.parametrize("patched", [False, None])
def test_a_converged_pod_is_let_in_unless_it_already_is(patched):
    plan = converge([KV], [pod("p", "kv-align@3.2.1", patched=patched)])
    assert plan.actions == [SetPatched("p", True, "runs kv-align@3.2.1")] and plan.converged == ["p"]
    assert converge([KV], [pod("p", "kv-align@3.2.1", patched=True)]).actions == []


def test_a_patch_no_longer_held_is_reverted():
    plan = converge([], [pod("p", "kv-align@3.2.1", patches="base", patched=True)])
    assert RevertPatch("p", "kv-align") in plan.actions


def test_undoing_and_adopting_patches():
    assert without([KV, SYNC], "kv-align") == [SYNC]
    assert without([SYNC], "kv-align") == [SYNC]
    assert adopt("kv-align@3.2.1,sync-free@3.2.1") == [KV, SYNC]
    assert adopt("base") == []


# user promotions
def test_promote_step_at_the_last_step_is_a_full_promotion():
    spec = make_spec(steps=[{"weight": 50, "pause": "10s"}, {"weight": 100, "pause": "1h"}])
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 10, healthy(spec))
    assert status.step_index == 1 and status.phase == "Progressing"
    fleet.promote = "step"
    status = fleet.tick(status, 11)
    assert status.phase == "Promoted" and status.full_promotion
    (event,) = [e for e in fleet.events if e.reason == "PromotedByUser"]
    assert event.message == "full promotion requested at step 2/2: remaining steps and analysis skipped"


def test_promote_full_starts_the_last_step_then_promotes(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.promote = "full"
    status = fleet.tick(status, 1)
    assert status.phase == "Promoted"
    messages = [(e.reason, e.message.split(":")[0]) for e in fleet.events]
    assert messages.index(("PromotedByUser", "full promotion requested at step 1/3")) \
        < messages.index(("StepStarted", "step 3/3")) < [r for r, _ in messages].index("Promoted")


# a canary that comes back
def test_a_returning_canary_gives_way_to_the_longest_serving_one():
    spec = make_spec(steps=[{"weight": 1, "pause": "1h"}, {"weight": 100}])
    fleet = Fleet.of(spec, 3)
    fleet.pods["pod-0"].ready = False
    status = fleet.tick(RolloutStatus(), 0)
    assert fleet.patched() == {"pod-1"}                      # patched at 0
    fleet.pods["pod-0"].ready, fleet.pods["pod-1"].ready = True, False
    status = fleet.tick(status, 1)
    assert fleet.patched() == {"pod-0", "pod-1"}             # pod-0 took its place at 1
    fleet.pods["pod-1"].ready = True                          # pod-1 is back, still patched
    status = fleet.tick(status, 2)
    assert [e.message for e in fleet.events if e.reason == "CanaryReturned"] == [
        "pod pod-0 is a canary beyond the 1 that step 1/2 asks for; back to stable"]
    assert fleet.patched() == {"pod-1"} and status.canary_pods == 1
    assert {p.name: p.track for p in status.pods} == {"pod-0": "stable", "pod-1": "canary", "pod-2": "stable"}


# what the rollout says it waits for
def test_the_message_says_what_the_step_waits_for(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    assert status.message == "step 1/3: weight 1%, 1 of 4 pods canary; no analysis yet"
    gateway = make_spec(trafficRouting={"gatewayAPI": {"httpRoute": "llm", "stableService": "s", "canaryService": "c"}})
    gfleet = Fleet.of(gateway, 2, gateway=True)
    status = gfleet.tick(RolloutStatus(), 0)
    gfleet.route_weight = 0                                   # someone set the route back by hand
    d = decide(gateway, status, gfleet.observe(status, {}, None), 1)
    assert d.status.message == "step 1/3: weight 1%, 1 of 2 pods canary; the route weight is not set yet"


def test_a_paused_rollout_is_never_rolled_back_by_the_deadline(spec):
    from graft.rollout.observation import Problem
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.set_paused(True)
    status = fleet.tick(status, 1)
    assert status.phase == "Paused"
    fleet.problem = Problem("AdminTokenMissing", "Secret graft/admin-token not found")
    status = fleet.tick(status, 1000)
    assert status.phase == "Paused" and "RollingBack" not in fleet.reasons()


# endings
@pytest.mark.parametrize("how", ["promote", "abort"])
def test_every_pod_record_ends_stable_and_pod_ratio_routing_sets_no_weight(spec, how):
    from graft.rollout.decision import SetWeight
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 10, healthy(spec))
    setattr(fleet, how, "full" if how == "promote" else True)
    actions, answered = [], {}
    for _ in range(4):
        d = decide(spec, status, fleet.observe(status, {}, None, answered), 11)
        status = d.status
        actions += d.actions
        fleet.execute(d, answered)
    assert status.phase == ("Promoted" if how == "promote" else "RolledBack")
    assert {p.track for p in status.pods} == {"stable"}
    assert not [a for a in actions if isinstance(a, SetWeight)], "pod ratio has no weight to set"


# before the start
def test_a_permanent_problem_fails_a_rollout_that_never_started(spec):
    from graft.rollout.observation import Problem
    fleet = Fleet.of(spec, 2)
    fleet.problem = Problem("DigestMismatch", "bundle digest sha256:aa != pinned sha256:bb", permanent=True)
    status = fleet.tick(RolloutStatus(), 0)
    assert (status.phase, status.reason) == ("Failed", "DigestMismatch")
    assert [(e.reason, e.type) for e in fleet.events] == [("DigestMismatch", "Warning")] and fleet.posts == {}


def test_the_start_deadline_counts_from_the_rollouts_creation(spec):
    fleet = Fleet.of(spec, 0)
    fleet.created_at = 1000.0
    status = fleet.tick(RolloutStatus(), 1100)
    assert status.phase == "Pending", "100 s after creation, the deadline is 2m"
    status = fleet.tick(status, 1121)
    assert (status.phase, status.reason) == ("Failed", "ProgressDeadlineExceeded")


def test_a_pod_whose_revision_is_unknown_starts_stable(spec):
    fleet = Fleet.of(spec, 3)
    fleet.pods["pod-2"].unreachable = True
    status = fleet.tick(RolloutStatus(), 0)
    assert status.pod("pod-2").track == "stable" and status.pod("pod-0").track == "canary"
    assert fleet.patched() == {"pod-0"}


def test_a_pod_that_is_not_ready_gets_its_annotation_right_even_when_its_track_is(spec):
    fleet = Fleet.of(spec, 3)
    p = fleet.pods["pod-2"]
    p.ready, p.track, p.patches = False, "stable", "kv-align@3.2.1"
    fleet.tick(RolloutStatus(), 0)
    assert (p.track, p.patches) == ("stable", "base")


def test_a_refusal_turns_every_pod_stable_in_the_same_decision(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 10, healthy(spec))
    assert status.canary_pods == 2
    refused = {"pod-0": PodError("conflict", "409 another version is applied")}
    d = decide(spec, status, fleet.observe(status, refused, None), 11)
    assert (d.status.phase, d.status.reason) == ("RollingBack", "PatchConflict")
    assert {p.track for p in d.status.pods} == {"stable"}
    assert not [a for a in d.actions if isinstance(a, ApplyPatch)]


def test_a_step_with_no_ready_pod_never_advances(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    for pod in fleet.pods.values():
        pod.ready = False
    status = fleet.tick(status, 10, healthy(spec))
    assert status.step_index == 0 and status.reason == "NoPods"


def test_a_clean_run_ends_the_error_count(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    for t in (5, 10):
        status = fleet.tick(status, t, provider_down(spec))
    assert status.analysis.error_runs == 2
    status = fleet.tick(status, 15, no_data(spec))
    assert status.analysis.error_runs == 0


def test_a_rollout_paused_in_the_tick_of_a_run_says_it_is_paused(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.set_paused(True)
    status = fleet.tick(status, 5, healthy(spec))
    assert (status.phase, status.reason) == ("Paused", "Paused")
    assert status.message == "step 1/3: weight 1%, 1 of 2 pods canary; paused"


def test_a_pod_outside_the_rollouts_hands_keeps_the_rollouts_patch_in_its_annotation():
    # held out of the Service by its readiness gate: not Ready, so the fleet controller labels it;
    # the rollout decides about its own patch, so the annotation keeps what the engine runs of it
    held = pod("p", "kv-align@3.2.1", patches="base", ready=False, patched=False)
    plan = converge([SYNC], [held], rollout_patch="kv-align")
    assert plan.actions[0] == LabelPod("p", "stable", "kv-align@3.2.1,sync-free@3.2.1")
    assert ApplyPatch("p", SYNC) in plan.actions and not [a for a in plan.actions if isinstance(a, RevertPatch)]


def test_the_other_version_an_upgrade_replaces_is_of_the_same_patch():
    from graft.rollout.machine import same_patch
    assert same_patch("sync-free@3.2.1", "kv-align@3.2.2") is None
    assert same_patch("kv-align@3.2.1,sync-free@3.2.1", "kv-align@3.2.2") == "kv-align@3.2.1"
    assert same_patch("kv-align@3.2.2", "kv-align@3.2.2") is None


def test_a_breach_short_of_its_limit_is_an_event_whatever_the_check(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    status = fleet.tick(status, 5, breaching(spec, "tpot-p99"))         # a latency ratio: breach 1/3
    assert status.phase == "Progressing"
    (event,) = [e for e in fleet.events if e.reason == "AnalysisFailed"]
    assert event.message.startswith("breaker tpot-p99: ") and event.message.endswith("(breach 1/3)")


def test_holding_runs_in_a_row_are_said_once(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    for t in (5, 10, 15):
        status = fleet.tick(status, t, no_data(spec))
    assert fleet.reasons().count("AnalysisInconclusive") == 1


def test_a_promoted_rollout_is_at_weight_100(spec):
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.promote = "full"
    status = fleet.tick(status, 1)
    assert (status.phase, status.weight) == ("Promoted", 100)


def test_a_canary_that_is_not_ready_keeps_its_label_and_is_not_relabelled_again(spec):
    fleet = Fleet.of(spec, 3)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.pods["pod-0"].ready = False
    status = fleet.tick(status, 1)
    assert (fleet.pods["pod-0"].track, fleet.pods["pod-0"].patches) == ("canary", "kv-align@3.2.1")
    d = decide(spec, status, fleet.observe(status, {}, None), 2)
    assert not [a for a in d.actions if isinstance(a, LabelPod) and a.pod == "pod-0"]


def test_a_verify_failure_turns_every_pod_stable_in_the_same_decision(spec):
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    refused = {"pod-0": PodError("verify-failed", "failed its self-check and was reverted")}
    d = decide(spec, status, fleet.observe(status, refused, None), 1)
    assert (d.status.phase, d.status.reason) == ("RollingBack", "PatchVerifyFailed")
    assert {p.track for p in d.status.pods} == {"stable"}


def test_promote_step_at_the_last_step_starts_no_step_again():
    spec = make_spec(steps=[{"weight": 50, "pause": "1h"}, {"weight": 100, "pause": "1h"}])
    fleet = Fleet.of(spec, 2)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.promote = "step"
    status = fleet.tick(status, 1)
    fleet.promote = "step"
    status = fleet.tick(status, 2)
    assert status.phase == "Promoted"
    assert [e.message.split(":")[0] for e in fleet.events if e.reason == "StepStarted"] == ["step 1/2", "step 2/2"]


def test_an_upgrading_pods_annotation_keeps_the_version_it_runs():
    held = pod("p", "kv-align@3.2.2", patches="kv-align@3.2.1", ready=False, patched=False)
    plan = converge([KV], [held], rollout_patch="kv-align")
    assert plan.actions[0] == LabelPod("p", "stable", "kv-align@3.2.2")


@pytest.mark.parametrize("pods,weight,canaries", [(200, 51, 102), (1000, 11, 110), (101, 99, 100)])
def test_canary_counts_of_large_fleets_are_exact_percentages(pods, weight, canaries):
    assert canary_target(pods, weight) == canaries
