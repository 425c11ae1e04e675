"""Manual approval gates (`untilApproved: true`, or Argo Rollouts' `pause: {}`): a step whose analysis
passed holds, Progressing with reason AwaitingApproval, until a person sets graft.dev/promote; the
analysis goes on meanwhile (and still rolls back), and the progress deadline waits for the person."""
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from graft.rollout.decision import ClearPromote
from graft.rollout.machine import about, analysis_due, decide
from graft.rollout.status import RolloutStatus

from rollout_fleet import BASE, Fleet, breaching, healthy, make_spec, no_data

# step 2 of 3 waits for a person; the analysis runs every 5 s and the deadline is 2 minutes
MANUAL = [{"weight": 1, "pause": "10s"}, {"weight": 50, "untilApproved": True}, {"weight": 100}]
ONE_BREACH = {**BASE["analysis"], "breakers": [{"name": "error-rate", "max": 0.005, "consecutive": 1}]}


def drive(fleet, status, start, until, measure=healthy, step=1.0):
    now = start
    while now <= until:
        m = measure(fleet.spec) if measure and analysis_due(fleet.spec, status, now) else None
        status = fleet.tick(status, now, m)
        now += step
    return status


def waiting(steps=MANUAL, pods=4, **spec):
    """A fleet whose rollout is at step 2, its analysis passed, waiting for approval (t = 40)."""
    fleet = Fleet.of(make_spec(steps=steps, **spec), pods)
    fleet.name = "kv-align"
    status = drive(fleet, RolloutStatus(), 0, 40)
    assert status.step_index == 1 and status.awaiting_approval_since is not None, status.message
    return fleet, status


def reasons(fleet, reason):
    return [e for e in fleet.events if e.reason == reason]


def test_a_manual_step_holds_after_its_analysis_passes_and_says_so():
    fleet, status = waiting()
    assert status.phase == "Progressing" and status.reason == "AwaitingApproval"
    assert status.message == "step 2/3 at 50%: waiting for approval: graft rollout promote kv-align"
    since = status.awaiting_approval_since
    assert since > status.step_ready_at and status.analysis.verdict == "Successful"
    assert len(fleet.patched()) == 2, "the step's canaries stay in place"
    started = reasons(fleet, "StepStarted")[1].message
    assert started.endswith("then it waits for approval (graft rollout promote)"), started
    # an hour later: still waiting, one Event for the whole wait, the analysis still running
    status = drive(fleet, status, 41, 3600, step=30.0)
    assert (status.phase, status.step_index, status.reason) == ("Progressing", 1, "AwaitingApproval")
    assert status.awaiting_approval_since == since and status.analysis.last_run > 3000
    (awaiting,) = reasons(fleet, "AwaitingApproval")
    assert awaiting.type == "Normal" and awaiting.message == status.message
    conditions = {c["type"]: c for c in status.conditions}
    assert conditions["Progressing"]["status"] == "True" and conditions["Progressing"]["reason"] == "AwaitingApproval"
    restored = RolloutStatus.from_dict(status.to_dict())
    assert restored.awaiting_approval_since == since, "the wait survives an operator restart"
    assert status.to_dict()["awaitingApprovalSince"].endswith("Z")


def test_a_promote_approves_the_step_and_is_consumed_then():
    fleet, status = waiting()
    since = status.awaiting_approval_since
    fleet.promote, fleet.promoted_by = "step", "kubectl-annotate"
    d = decide(fleet.spec, status, fleet.observe(status, {}, None), 100)
    assert ClearPromote() in d.actions, "the annotation is consumed by the approval"
    assert d.status.step_index == 2 and d.status.awaiting_approval_since is None
    (approved,) = [e for e in d.events if e.reason == "Approved"]
    assert approved.message == (f"step 2/3 approved (graft.dev/promote, set by kubectl-annotate) "
                                f"after waiting {about(100 - since)}")
    assert not [e for e in d.events if e.reason == "PromotedByUser"]
    status = fleet.tick(status, 100)
    assert fleet.promote is None and status.step_index == 2 and fleet.patched() == set(fleet.pods)
    status = drive(fleet, status, 101, 130)
    assert status.phase == "Promoted"
    assert len(reasons(fleet, "Approved")) == 1 and status.awaiting_approval_since is None


def test_pause_with_an_empty_object_is_the_same_gate():
    argo = [{"weight": 1, "pause": "10s"}, {"weight": 50, "pause": {}}, {"weight": 100}]
    fleet, status = waiting(argo)
    assert status.reason == "AwaitingApproval"
    assert make_spec(steps=argo).steps == make_spec(steps=MANUAL).steps


def test_a_failing_breaker_still_rolls_back_while_waiting():
    fleet, status = waiting(analysis=ONE_BREACH)
    status = drive(fleet, status, 41, 300, step=10.0)
    assert status.reason == "AwaitingApproval", "waiting, healthy"
    status = fleet.tick(status, 305, breaching(fleet.spec, "error-rate"))
    assert status.phase == "RolledBack" and status.reason == "AnalysisFailed"
    assert fleet.patched() == set() and status.awaiting_approval_since is None
    assert "analysis failed at step 2/3" in status.message


def test_a_conclusively_failing_gate_still_rolls_back_while_waiting():
    fleet, status = waiting()
    status = fleet.tick(status, 50, breaching(fleet.spec, "error-rate-delta", role="gate"))
    assert status.phase == "RolledBack" and status.reason == "AnalysisFailed", status.message


def test_the_progress_deadline_waits_for_the_person():
    fleet, status = waiting()             # progressDeadline: 2m
    assert fleet.spec.progress_deadline == 120
    status = drive(fleet, status, 41, 6 * 3600, step=60.0)
    assert status.phase == "Progressing" and status.reason == "AwaitingApproval"
    assert not reasons(fleet, "ProgressDeadlineExceeded")
    # no data at all while waiting: the analysis holds, the deadline still waits, no pause on top
    status = drive(fleet, status, 6 * 3600 + 1, 8 * 3600, measure=no_data, step=60.0)
    assert status.phase == "Progressing" and status.reason == "AwaitingApproval"
    assert status.analysis.verdict == "Inconclusive" and not status.pause_conditions
    assert status.message.endswith("(the analysis passed; its latest run is Inconclusive)")
    # once approved, the next step has its own deadline again
    fleet.promote = "step"
    status = fleet.tick(status, 8 * 3600 + 30)
    assert status.step_index == 2
    status = drive(fleet, status, 8 * 3600 + 31, 8 * 3600 + 300, measure=no_data, step=10.0)
    assert status.phase == "RolledBack" and status.reason == "ProgressDeadlineExceeded"


def test_a_promote_before_the_analysis_passed_waits_for_it_and_skips_nothing():
    fleet = Fleet.of(make_spec(steps=MANUAL), 4)
    status = drive(fleet, RolloutStatus(), 0, 12)    # step 2 in place at 10, no run since
    assert status.step_index == 1 and status.awaiting_approval_since is None
    fleet.promote = "step"
    status = drive(fleet, status, 13, 30, measure=no_data)
    assert status.step_index == 1 and fleet.promote == "step", "kept: it approves, it never skips the analysis"
    assert "approved already (graft.dev/promote): it goes on once the analysis passes" in status.message
    status = drive(fleet, status, 31, 40)
    assert status.step_index == 2 and fleet.promote is None
    (approved,) = reasons(fleet, "Approved")
    assert "before its analysis passed" in approved.message
    assert not reasons(fleet, "AwaitingApproval"), "no wait: it was approved already"


def test_promote_step_on_an_ordinary_step_still_skips_it():
    spec = make_spec(steps=[{"weight": 1, "pause": "1h"}, {"weight": 50, "untilApproved": True}, {"weight": 100}])
    fleet = Fleet.of(spec, 4)
    status = fleet.tick(RolloutStatus(), 0)
    fleet.promote = "step"
    status = fleet.tick(status, 1)
    assert status.step_index == 1 and fleet.promote is None and reasons(fleet, "PromotedByUser")


def test_promote_full_while_waiting_approves_and_promotes():
    fleet, status = waiting()
    fleet.promote = "full"
    status = drive(fleet, status, 50, 60)
    assert status.phase == "Promoted" and fleet.patched() == set(fleet.pods)
    assert reasons(fleet, "Approved") and reasons(fleet, "PromotedByUser")


def test_a_manual_last_step_waits_before_promoting():
    steps = [{"weight": 50, "pause": "10s"}, {"weight": 100, "pause": {}}]
    fleet = Fleet.of(make_spec(steps=steps), 2)
    status = drive(fleet, RolloutStatus(), 0, 60)
    assert status.phase == "Progressing" and status.step_index == 1 and status.reason == "AwaitingApproval"
    assert fleet.patched() == set(fleet.pods), "every pod runs the patch; the promotion waits"
    fleet.promote = "step"
    status = drive(fleet, status, 61, 70)
    assert status.phase == "Promoted" and reasons(fleet, "Approved") and not reasons(fleet, "PromotedByUser")


def test_a_pause_while_waiting_starts_the_wait_over_on_resume():
    fleet, status = waiting()
    fleet.set_paused(True)
    status = drive(fleet, status, 41, 60)
    assert status.phase == "Paused" and status.reason == "Paused"
    fleet.set_paused(False)
    status = fleet.tick(status, 61)
    assert status.phase == "Progressing" and status.awaiting_approval_since is None
    status = drive(fleet, status, 62, 90)
    assert status.reason == "AwaitingApproval" and len(reasons(fleet, "AwaitingApproval")) == 2


def test_an_abort_while_waiting_rolls_back():
    fleet, status = waiting()
    fleet.abort = True
    status = fleet.tick(status, 50)
    assert status.phase == "RolledBack" and status.reason == "Aborted" and fleet.patched() == set()


def test_a_step_no_longer_manual_goes_on():
    fleet, status = waiting()
    fleet.spec = make_spec(steps=[{"weight": 1, "pause": "10s"}, {"weight": 50}, {"weight": 100}])
    status = drive(fleet, status, 41, 50)
    assert status.step_index == 2 and status.awaiting_approval_since is None


# the properties, over any steps, pauses and times a person promotes

@st.composite
def manual_rollouts(draw):
    weights = sorted(draw(st.sets(st.integers(min_value=1, max_value=99), max_size=3))) + [100]
    steps = []
    for w in weights:
        kind = draw(st.sampled_from(["duration", "manual", "argo", "none"]))
        steps.append({"weight": w, **{"duration": {"pause": draw(st.sampled_from(["0s", "3s", "20s"]))},
                                      "manual": {"untilApproved": True}, "argo": {"pause": {}},
                                      "none": {}}[kind]})
    return make_spec(steps=steps, progressDeadline="1m", analysis_inconclusiveLimit=3)


tick = st.tuples(
    st.floats(min_value=0.5, max_value=40.0),                          # time passing
    st.sampled_from(["healthy"] * 6 + ["no-data", "breach"]),          # what the analysis says
    st.sampled_from([None] * 8 + ["step", "full"]),                    # a person promotes
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(manual_rollouts(), st.integers(min_value=1, max_value=5), st.lists(tick, min_size=1, max_size=60))
def test_a_manual_step_is_left_only_on_a_promote_and_never_times_out(spec, pods, ticks):
    fleet = Fleet.of(spec, pods)
    status, now = RolloutStatus(), 0.0
    for dt, measured, promote in ticks:
        now += dt
        if promote is not None:
            fleet.promote = promote
        before = status
        due = analysis_due(spec, status, now)
        measurements = None
        if due:
            measurements = {"healthy": healthy, "no-data": no_data,
                            "breach": lambda s: breaching(s, s.analysis.breakers[0].name)}[measured](spec)
        promoted = fleet.promote
        status = fleet.tick(status, now, measurements)
        if before.phase not in ("Progressing", "Paused"):
            continue
        step = spec.step(before.step_index)
        left = status.step_index > before.step_index or status.phase == "Promoted"
        if left and step.until_approved:
            event("a manual step was left")
            assert promoted is not None, "a manual step went on without graft.dev/promote"
        if before.awaiting_approval_since is not None and status.phase in ("RollingBack", "RolledBack"):
            assert status.reason != "ProgressDeadlineExceeded", "the deadline expired a rollout waiting for a person"
        if status.awaiting_approval_since is not None:
            event("waiting for approval")
            assert status.reason in ("AwaitingApproval", "Paused", "NoPods")
            assert spec.step(status.step_index).until_approved and status.analysis.verdict is not None
    approved = [e.message for e in fleet.events if e.reason == "Approved"]
    manual = {f"step {i + 1}/{len(spec.steps)}" for i, s in enumerate(spec.steps) if s.until_approved}
    assert all(m.split(" approved")[0] in manual for m in approved), "only a manual step is approved"
