"""The gate webhooks in the state machine: confirm-promotion holds a manual step and the step before
the last until it answers 2xx (a 2xx approves a manual step as a person would); a rollout webhook's
non-2xx at an analysis run is a failed breaker that rolls back. The answers come in the observation
(the operator asks, graft.operator.hooks); the machine only judges them."""
from graft.rollout.hooks import HookAnswer
from graft.rollout.status import RolloutStatus

from rollout_fleet import Fleet, make_spec
from test_machine_approval import MANUAL, drive, reasons

CONFIRM = [{"name": "ci", "type": "confirm-promotion", "url": "http://ci.local/confirm"}]
ROLLOUT = [{"name": "smoke", "type": "rollout", "url": "http://ci.local/smoke"}]
THREE = [{"weight": 1, "pause": "10s"}, {"weight": 50, "pause": "10s"}, {"weight": 100}]


def refusing(name="ci"):
    return {name: HookAnswer(name, False, 403, "HTTP 403: change freeze until Monday")}


def test_the_step_before_the_last_waits_for_confirm_promotion_saying_what_it_answered():
    fleet = Fleet.of(make_spec(steps=THREE, webhooks=CONFIRM), 4)
    fleet.hooks = refusing()
    status = drive(fleet, RolloutStatus(), 0, 200)
    assert (status.phase, status.step_index, status.reason) == ("Progressing", 1, "AwaitingConfirmation")
    assert status.message == ("step 2/3 at 50%: waiting for confirmation: "
                              "webhook ci (HTTP 403: change freeze until Monday)")
    assert len(reasons(fleet, "AwaitingConfirmation")) == 1, "one Event for the whole wait"
    assert not reasons(fleet, "Confirmed")
    # the first step went on without asking: only the promotion to the last step is confirmed
    assert [e.message.split(":")[0] for e in reasons(fleet, "StepStarted")] == ["step 1/3", "step 2/3"]
    fleet.hooks = {"ci": HookAnswer("ci", True, 200)}
    status = drive(fleet, status, 201, 260)
    assert status.phase == "Promoted"
    (confirmed,) = reasons(fleet, "Confirmed")
    assert confirmed.message.startswith("step 2/3 confirmed by webhook ci after waiting")


def test_the_wait_for_a_hook_is_no_lack_of_progress():
    fleet = Fleet.of(make_spec(steps=THREE, webhooks=CONFIRM, progressDeadline="1m"), 4)
    fleet.hooks = refusing()
    status = drive(fleet, RolloutStatus(), 0, 1200, step=5.0)
    assert (status.phase, status.reason) == ("Progressing", "AwaitingConfirmation")


def test_a_manual_step_is_approved_by_its_confirm_promotion_hook():
    fleet = Fleet.of(make_spec(steps=MANUAL, webhooks=CONFIRM), 4)
    fleet.name = "kv-align"
    fleet.hooks = refusing()
    status = drive(fleet, RolloutStatus(), 0, 60)
    assert (status.step_index, status.reason) == (1, "AwaitingApproval")
    assert status.message == ("step 2/3 at 50%: waiting for approval: graft rollout promote kv-align or "
                              "webhook ci (HTTP 403: change freeze until Monday)")
    fleet.hooks = {"ci": HookAnswer("ci", True, 204)}
    status = drive(fleet, status, 61, 62)
    assert status.step_index == 2 and status.awaiting_approval_since is None
    assert reasons(fleet, "Confirmed") and not reasons(fleet, "Approved")


def test_a_person_still_approves_a_manual_step_whose_hook_refuses():
    fleet = Fleet.of(make_spec(steps=MANUAL, webhooks=CONFIRM), 4)
    fleet.hooks = refusing()
    status = drive(fleet, RolloutStatus(), 0, 60)
    fleet.promote = "step"
    status = drive(fleet, status, 61, 62)
    assert status.step_index == 2 and reasons(fleet, "Approved")


def test_a_rollout_hook_that_refuses_is_a_failed_check_that_rolls_back():
    fleet = Fleet.of(make_spec(steps=THREE, webhooks=ROLLOUT), 4)
    fleet.hooks = {"smoke": HookAnswer("smoke", True, 200)}
    status = drive(fleet, RolloutStatus(), 0, 12)
    assert status.phase == "Progressing"
    assert any(r.name == "webhook/smoke" and r.verdict == "Successful" for r in status.analysis.results)
    fleet.hooks = {"smoke": HookAnswer("smoke", False, 500, "HTTP 500: smoke test failed: 3 of 20 prompts")}
    status = drive(fleet, status, 13, 40)
    assert status.phase in ("RollingBack", "RolledBack")
    failed = [e for e in fleet.events if e.reason == "AnalysisFailed"]
    assert failed and "webhook/smoke: HTTP 500: smoke test failed: 3 of 20 prompts" in failed[-1].message


def test_hooks_not_asked_change_nothing():
    """The simulator asks no hook: a spec with hooks behaves as one without, but for the waits it declares."""
    plain = Fleet.of(make_spec(steps=MANUAL), 4)
    hooked = Fleet.of(make_spec(steps=MANUAL, webhooks=ROLLOUT), 4)
    a, b = drive(plain, RolloutStatus(), 0, 60), drive(hooked, RolloutStatus(), 0, 60)
    assert (a.phase, a.step_index, a.reason) == (b.phase, b.step_index, b.reason)
