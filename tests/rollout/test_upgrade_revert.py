"""Upgrading an applied patch (3.2.1 -> 3.2.2) and undoing a promoted one, through the same steps."""
from __future__ import annotations

from graft.api import FINAL_PHASES
from graft.rollout.status import RolloutStatus
from tests.rollout.rollout_fleet import Fleet, breaching, healthy, make_spec


def run(spec, fleet, fail=False, limit=300):
    status, now = RolloutStatus(), 0.0
    from graft.rollout.machine import analysis_due
    while status.phase not in FINAL_PHASES and now < limit:
        m = None
        if analysis_due(spec, status, now):
            m = breaching(spec, "error-rate", role="breaker") if fail else healthy(spec)
        status = fleet.tick(status, now, m)
        now += 1.0
    return status


def fleet_of(spec, revisions):
    fleet = Fleet(spec)
    for i, r in enumerate(revisions):
        fleet.add(f"pod-{i}", r)
    return fleet


def test_an_upgrade_replaces_the_old_version_on_each_pod_and_is_promoted():
    spec = make_spec(patch={"name": "kv-align", "version": "3.2.2", "source": {"builtin": {}}})
    fleet = fleet_of(spec, ["kv-align@3.2.1,sync-free@3.2.1"] * 3)
    status = run(spec, fleet)
    assert status.phase == "Promoted"
    assert (status.stable_patch, status.stable_revision) == ("kv-align@3.2.1", "kv-align@3.2.2,sync-free@3.2.1")
    assert {p.revision for p in fleet.pods.values()} == {"kv-align@3.2.2,sync-free@3.2.1"}
    assert {p.patches for p in fleet.pods.values()} == {"kv-align@3.2.2,sync-free@3.2.1"}


def test_a_failed_upgrade_goes_back_to_the_old_version_not_to_no_version():
    spec = make_spec(patch={"name": "kv-align", "version": "3.2.2", "source": {"builtin": {}}})
    fleet = fleet_of(spec, ["kv-align@3.2.1"] * 3)
    status = run(spec, fleet, fail=True)
    assert status.phase == "RolledBack"
    assert {p.revision for p in fleet.pods.values()} == {"kv-align@3.2.1"}
    assert {p.patches for p in fleet.pods.values()} == {"kv-align@3.2.1"}


def test_a_revert_takes_a_promoted_patch_out_through_the_steps():
    spec = make_spec(action="revert")
    assert spec.action == "revert"
    fleet = fleet_of(spec, ["kv-align@3.2.1,sync-free@3.2.1"] * 4)
    status = RolloutStatus()
    now, seen_mixed = 0.0, False
    from graft.rollout.machine import analysis_due
    while status.phase not in FINAL_PHASES and now < 300:
        status = fleet.tick(status, now, healthy(spec) if analysis_due(spec, status, now) else None)
        revisions = {p.revision for p in fleet.pods.values()}
        seen_mixed |= len(revisions) == 2           # a step with some pods reverted and some not
        now += 1.0
    assert status.phase == "Promoted" and seen_mixed
    assert (status.stable_revision, status.canary_revision) == ("sync-free@3.2.1", "sync-free@3.2.1")
    assert {p.revision for p in fleet.pods.values()} == {"sync-free@3.2.1"}


def test_a_failed_revert_puts_the_patch_back():
    spec = make_spec(action="revert")
    fleet = fleet_of(spec, ["kv-align@3.2.1"] * 3)
    status = run(spec, fleet, fail=True)
    assert status.phase == "RolledBack"
    assert {p.revision for p in fleet.pods.values()} == {"kv-align@3.2.1"}
    assert {p.patches for p in fleet.pods.values()} == {"kv-align@3.2.1"}
