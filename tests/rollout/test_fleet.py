"""The fleet's durable patch state: every pod converges to it, whatever happens to the pods.

The harness plays a fleet of engine pods (tests/rollout/rollout_fleet.py) with two controllers, as
the operator runs them: the rollout (decide) and the fleet controller (converge), each tick, while
pods appear, restart, go un-Ready and vanish. A restarted engine comes back running what its
`graft.dev/patches` annotation says (the Downward API), exactly as a real one.
"""
from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from graft.rollout.actions import ApplyPatch, LabelPod, RevertPatch, SetPatched
from graft.rollout.fleet import FleetPod, converge, desired_revision, rollout_labels, with_promoted
from graft.api import BASE, FINAL_PHASES, has_patch, patches_of, revision_of
from graft.rollout.spec import PatchSource, PatchSpec
from graft.rollout.status import RolloutStatus
from tests.rollout.rollout_fleet import Fleet, healthy, make_spec

KV = PatchSpec("kv-align", "3.2.1", PatchSource(builtin=True))
SYNC = PatchSpec("sync-free", "3.2.1", PatchSource(builtin=True))


def pod(name, revision="base", **kw):
    return FleetPod(name, revision=revision, patches=kw.pop("patches", revision), track=kw.pop("track", "stable"), **kw)


def test_a_new_pod_is_annotated_first_then_patched_one_step_at_a_time_then_let_in():
    plan = converge([KV, SYNC], [pod("new", patches=None, track=None, patched=None)])
    assert plan.actions[0] == LabelPod("new", "stable", "kv-align@3.2.1,sync-free@3.2.1")
    assert plan.actions[1] == ApplyPatch("new", KV)
    assert "new" in plan.pending and not plan.converged
    assert not any(isinstance(a, SetPatched) and a.value for a in plan.actions)
    done = converge([KV, SYNC], [pod("new", "kv-align@3.2.1,sync-free@3.2.1")])
    assert done.converged == ["new"] and SetPatched("new", True, "runs kv-align@3.2.1,sync-free@3.2.1") in done.actions


def test_a_patch_the_fleet_does_not_hold_is_reverted_and_an_old_version_replaced():
    plan = converge([PatchSpec("kv-align", "3.2.2", PatchSource(builtin=True))], [pod("a", "fault@1,kv-align@3.2.1")])
    assert plan.actions[-1] == ApplyPatch("a", PatchSpec("kv-align", "3.2.2", PatchSource(builtin=True)), replace=True)
    plan = converge([PatchSpec("kv-align", "3.2.2", PatchSource(builtin=True))], [pod("a", "fault@1,kv-align@3.2.2")])
    assert plan.actions[-1] == RevertPatch("a", "fault")


def test_an_active_rollout_keeps_its_patch_and_the_labels_of_its_pods():
    # a canary runs the rollout's patch: the fleet touches neither it nor its label, Ready or not
    for ready in (True, False):
        canary = pod("canary", "kv-align@3.2.1,sync-free@3.2.1", track="canary", patched=True, ready=ready)
        plan = converge([KV], [canary], rollout_patch="sync-free", rollout_pods={"canary"})
        assert not any(isinstance(a, (LabelPod, RevertPatch)) for a in plan.actions)
    # a pod the rollout does not record yet (held by its gate) joins on the fleet's revision, without
    # the rollout's patch
    plan = converge([KV], [pod("new", patches=None, track=None, ready=False)], rollout_patch="sync-free",
                    rollout_pods={"canary"})
    assert plan.actions[0] == LabelPod("new", "stable", "kv-align@3.2.1")


def test_one_writer_of_a_pods_labels_at_a_time():
    ready, starting = FleetPod("a", ready=True), FleetPod("b", ready=False)
    for phase in ("Progressing", "Paused", "RollingBack"):     # a running rollout: every pod it records
        assert rollout_labels(phase, ["a", "b"], [ready, starting]) == {"a", "b"}
        assert rollout_labels(phase, ["a"], [ready, starting]) == {"a"}
    # a rollout starting on the fleet's selector labels the Ready pods in the tick it starts
    assert rollout_labels("Pending", [], [ready, starting]) == {"a"}
    for phase in ("Promoted", "RolledBack", "Failed"):         # a finished one: none
        assert rollout_labels(phase, ["a", "b"], [ready, starting]) == frozenset()


BUNDLE = PatchSpec("short-first", "1.0.0", PatchSource(builtin=False, config_map="short-first", key="bundle.py",
                                                     digest="sha256:" + "0" * 64))


def test_a_restarted_engine_waiting_for_the_fleets_bundle_gets_it_back():
    waiting = pod("a", "base", patches="short-first@1.0.0", ready=False, awaiting=("short-first@1.0.0",))
    plan = converge([BUNDLE], [waiting])
    assert ApplyPatch("a", BUNDLE) in plan.actions and "a" in plan.pending
    # during an upgrade of that very patch the rollout owns its name, but a restarted stable pod
    # still needs the fleet's version back: nobody else would apply it (the pod is not Ready)
    plan = converge([BUNDLE], [waiting], rollout_patch="short-first")
    assert ApplyPatch("a", BUNDLE) in plan.actions


def test_an_awaited_entry_the_fleet_does_not_hold_is_reverted_so_the_engine_stops_waiting():
    # a canary of a bundle rollout restarted, and the fleet (which never promoted it) takes it back
    waiting = pod("c", "base", patches="short-first@1.0.0", track="canary", ready=False,
                  awaiting=("short-first@1.0.0",))
    plan = converge([], [waiting], rollout_patch="short-first", rollout_pods={"c"})
    assert RevertPatch("c", "short-first") in plan.actions
    assert not any(isinstance(a, LabelPod) for a in plan.actions), "its label stays the rollout's"
    # once the engine stopped waiting, the pod is converged at base
    done = converge([], [pod("c", "base", ready=False)], rollout_patch="short-first")
    assert done.converged == ["c"]


def test_a_ready_pod_is_never_taken_for_waiting():
    plan = converge([KV], [pod("r", "kv-align@3.2.1", awaiting=("short-first@1.0.0",), patched=True)],
                    rollout_patch="short-first")
    assert plan.converged == ["r"] and not any(isinstance(a, (ApplyPatch, RevertPatch)) for a in plan.actions)


def test_the_right_version_with_another_config_is_swapped_for_the_fleets():
    from graft.api import config_digest

    noisy = PatchSpec("fault", "1", PatchSource(builtin=True), config={"errorRate": 0.5})
    # a restart brought it back with its defaults: GRAFT_PATCHES names versions, not configs
    restarted = pod("a", "fault@1", configs={"fault": config_digest({})}, patched=True)
    plan = converge([noisy], [restarted])
    assert ApplyPatch("a", noisy, replace=True) in plan.actions and "a" in plan.pending
    right = pod("a", "fault@1", configs={"fault": config_digest({"errorRate": 0.5})}, patched=True)
    assert converge([noisy], [right]).converged == ["a"]
    # an engine that reports no config digest is taken at its revision
    assert converge([noisy], [pod("a", "fault@1", patched=True)]).converged == ["a"]


def test_promotion_replaces_the_same_patch_and_keeps_the_others():
    kv2 = PatchSpec("kv-align", "3.2.2", PatchSource(builtin=True))
    assert [p.ref for p in with_promoted([KV, SYNC], kv2)] == ["kv-align@3.2.2", "sync-free@3.2.1"]
    assert desired_revision([]) == BASE


# the two controllers together, under churn
class World:
    """Pods, a rollout of kv-align@3.2.1 and the fleet controller, ticking together."""

    def __init__(self, n: int, gateway: bool, fail_at: int | None):
        self.spec = make_spec(trafficRouting=({"gatewayAPI": {"httpRoute": "r", "stableService": "s",
                                                              "canaryService": "c"}} if gateway else {"podRatio": {}}))
        self.fleet = Fleet.of(self.spec, n, gateway=gateway)
        self.status = RolloutStatus()
        self.patches: list[PatchSpec] = []            # the PatchFleet's spec.patches
        self.fail_at = fail_at
        self.next_pod = n
        self.now = 0.0
        self.promoted_at: float | None = None

    def measurements(self):
        from tests.rollout.rollout_fleet import breaching
        if self.fail_at is not None and self.now >= self.fail_at:
            return breaching(self.spec, "error-rate", role="breaker")
        return healthy(self.spec)

    def rollout_tick(self):
        from graft.rollout.machine import analysis_due
        if self.status.phase in FINAL_PHASES:
            return
        before = self.status.phase
        m = self.measurements() if analysis_due(self.spec, self.status, self.now) else None
        self.status = self.fleet.tick(self.status, self.now, m)
        if self.status.phase == "Promoted" and before != "Promoted":
            self.patches = with_promoted(self.patches, self.spec.patch)
            self.promoted_at = self.now

    def fleet_tick(self):
        active = self.status.phase not in FINAL_PHASES and self.status.phase != "Pending"
        pods = [FleetPod(p.name, running=p.ready, ready=p.ready, track=p.track, patches=p.patches,
                         revision=p.revision if p.ready else None) for p in self.fleet.pods.values()]
        owned = rollout_labels(self.status.phase, [r.name for r in self.status.pods], pods) if active else ()
        plan = converge(self.patches, pods, rollout_patch=self.spec.patch.name if active else None,
                        rollout_pods=owned)
        for a in plan.actions:
            p = self.fleet.pods[a.pod]
            if isinstance(a, LabelPod):
                p.track, p.patches = a.track, a.revision
            elif isinstance(a, ApplyPatch):
                p.revision = revision_of([r for r in patches_of(p.revision) if r.partition("@")[0] != a.patch.name]
                                         + [a.patch.ref])
            elif isinstance(a, RevertPatch):
                p.revision = revision_of(r for r in patches_of(p.revision) if r.partition("@")[0] != a.name)

    def churn(self, event: tuple[str, int]):
        kind, i = event
        names = sorted(self.fleet.pods)
        if kind == "add" or not names:
            name = f"pod-{self.next_pod}"
            self.next_pod += 1
            self.fleet.add(name)            # a new pod starts with no annotation: base
            return
        p = self.fleet.pods[names[i % len(names)]]
        if kind == "restart":
            p.container += 1
            p.restarts += 1
            p.revision = p.patches or BASE  # the engine comes back with its annotation
        elif kind == "unready":
            p.ready = not p.ready
        elif kind == "vanish" and len(names) > 1:
            del self.fleet.pods[p.name]

    def tick(self, event=None):
        if event is not None:
            self.churn(event)
        self.rollout_tick()
        self.fleet_tick()
        self.now += 1.0


events = st.lists(st.one_of(st.none(), st.tuples(st.sampled_from(["add", "restart", "unready", "vanish"]),
                                                 st.integers(0, 20))), min_size=0, max_size=80)


@given(n=st.integers(1, 6), gateway=st.booleans(), fail_at=st.one_of(st.none(), st.integers(5, 60)),
       churn=events)
@settings(max_examples=150, deadline=None)
def test_every_pod_ends_with_the_revision_label_and_annotation_of_the_final_phase(n, gateway, fail_at, churn):
    w = World(n, gateway, fail_at)
    for event in churn:
        w.tick(event)
    for p in w.fleet.pods.values():       # churn stops; every pod comes back
        p.ready = True
    for _ in range(400):
        w.tick()
        if w.status.phase in FINAL_PHASES and all(
                (p.track, p.patches, p.revision) == ("stable", desired_revision(w.patches), desired_revision(w.patches))
                for p in w.fleet.pods.values()):
            break
    assert w.status.phase in ("Promoted", "RolledBack"), (w.status.phase, w.status.message)
    promoted = w.status.phase == "Promoted"
    if promoted:          # never past a failing analysis (the test's own clock says when it started failing)
        assert fail_at is None or w.promoted_at < fail_at
    else:                 # a healthy rollout ends rolled back only for a reason other than its analysis
        assert fail_at is not None or w.status.reason != "AnalysisFailed", w.status.message
    for p in w.fleet.pods.values():
        assert has_patch(p.revision, w.spec.patch.ref) == promoted, (p, w.status.phase)
        assert has_patch(p.patches, w.spec.patch.ref) == promoted, (p, w.status.phase)
        assert p.track == "stable", p
        assert p.revision == p.patches == desired_revision(w.patches), p


def test_a_pod_added_after_promotion_runs_the_promoted_revision():
    w = World(2, False, None)
    while w.status.phase != "Promoted":
        w.tick()
    w.churn(("add", 0))                   # scaled up: the new pod starts on base
    newcomer = w.fleet.pods["pod-2"]
    assert (newcomer.revision, newcomer.patches) == ("base", None)
    w.fleet_tick()                        # annotation first, then the engine: one tick
    assert (newcomer.track, newcomer.patches, newcomer.revision) == ("stable", "kv-align@3.2.1", "kv-align@3.2.1")


def test_a_canary_restarting_during_the_rollback_comes_back_clean():
    w = World(3, False, fail_at=10**9)
    while not any(p.track == "canary" and has_patch(p.revision, w.spec.patch.ref) for p in w.fleet.pods.values()):
        w.tick()
    canary = next(p for p in w.fleet.pods.values() if p.track == "canary")
    canary.ready = False                  # restarting: the rollout cannot reach it
    w.fail_at = w.now
    while w.status.phase != "RolledBack":
        w.tick()
    # its label and annotation were made right while it was away
    assert (canary.track, canary.patches) == ("stable", "base")
    w.tick(("restart", sorted(w.fleet.pods).index(canary.name)))
    canary.ready = True
    w.tick()
    assert canary.revision == "base"


def test_a_returning_canary_leaves_no_surplus_canary():
    from graft.rollout.machine import canary_target
    w = World(3, False, None)
    w.spec = dataclasses.replace(w.spec, steps=(dataclasses.replace(w.spec.steps[0], pause=60.0),) + w.spec.steps[1:])
    w.fleet.spec = w.spec
    while not any(p.track == "canary" for p in w.fleet.pods.values()):
        w.tick()
    first = next(p for p in w.fleet.pods.values() if p.track == "canary")
    first.ready = False                   # a replacement canary is picked
    for _ in range(3):
        w.tick()
    assert sum(p.track == "canary" for p in w.fleet.pods.values() if p.ready) == 1
    first.ready = True                    # it comes back after a restart, with its annotation's patch
    first.container += 1
    first.restarts += 1
    first.revision = first.patches
    for _ in range(3):
        w.tick()
        ready = [p for p in w.fleet.pods.values() if p.ready]
        canaries = [p.name for p in ready if p.track == "canary"]
        assert w.status.step_index == 0
        assert len(canaries) == canary_target(len(ready), 1) == 1, canaries
        assert sum(has_patch(p.revision, w.spec.patch.ref) for p in ready) == 1
    assert "CanaryReturned" in w.fleet.reasons()


def test_the_rollback_itself_relabels_a_canary_that_is_not_ready():
    # the rollout alone (no fleet controller): its rollback must reach the pod's label and annotation
    w = World(3, False, fail_at=10**9)
    while not any(p.track == "canary" and has_patch(p.revision, w.spec.patch.ref) for p in w.fleet.pods.values()):
        w.rollout_tick()
        w.now += 1
    canary = next(p for p in w.fleet.pods.values() if p.track == "canary")
    canary.ready = False
    w.fail_at = w.now
    for _ in range(20):
        w.rollout_tick()
        w.now += 1
    assert w.status.phase == "RolledBack"
    assert (canary.track, canary.patches) == ("stable", "base")


def test_the_right_version_from_other_code_is_swapped_for_the_fleets():
    pinned = "sha256:" + "1" * 64
    bundle = PatchSpec("short-first", "1.0.0", PatchSource(builtin=False, config_map="b", key="bundle.py",
                                                         digest=pinned))
    other = pod("a", "short-first@1.0.0", digests={"short-first": "sha256:" + "2" * 64}, patched=True)
    assert ApplyPatch("a", bundle, replace=True) in converge([bundle], [other]).actions
    same = pod("a", "short-first@1.0.0", digests={"short-first": pinned.upper().replace("SHA256", "sha256")},
               patched=True)
    assert converge([bundle], [same]).converged == ["a"]


def test_a_canary_that_is_not_ready_is_labelled_by_one_controller_only():
    # both controllers tick over a canary whose engine is not Ready: the rollout keeps it a canary
    # (it may come back, and rejoins as one), and the fleet controller leaves its label to the rollout
    w = World(3, False, None)
    w.spec = dataclasses.replace(w.spec, steps=(dataclasses.replace(w.spec.steps[0], pause=600.0),) + w.spec.steps[1:])
    w.fleet.spec = w.spec
    while not any(p.track == "canary" for p in w.fleet.pods.values()):
        w.tick()
    canary = next(p for p in w.fleet.pods.values() if p.track == "canary")
    canary.ready = False
    seen = []
    for _ in range(20):
        w.rollout_tick()
        seen.append((canary.track, canary.patches))
        w.fleet_tick()
        seen.append((canary.track, canary.patches))
        w.now += 1.0
    assert set(seen) == {("canary", "kv-align@3.2.1")}
