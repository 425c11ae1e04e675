"""The step state machine: `decide(spec, status, observation, now) -> Decision`.

Pure and level-triggered: it compares what the status says the rollout should look like with what
the operator observed, and returns the actions that close the gap, the events that explain each
transition and the new status. The operator applies the actions, feeds their outcomes back as a
fresh observation and calls `decide` again until nothing is left to do; calling it twice on the
same input gives the same answer, so a restarted operator picks up exactly where it was.

Phases: Pending -> Progressing <-> Paused -> Promoted, or -> RollingBack -> RolledBack | Failed.
Promoted, RolledBack and Failed are final: the machine does nothing more for them.

Per step: enough pods become canaries (ceil(N * weight / 100), at least one), each canary's engine
gets the patch, the router gets the weight; then the step holds for its pause and until an analysis
run after the step was in place passes. A manual step (`untilApproved`) then holds, Progressing with
reason AwaitingApproval, until a person approves it (the annotation graft.dev/promote), the analysis
running on meanwhile and the progress deadline waiting. A check reaching its breach limit, a user
abort, a patch the engine refuses or a step stuck past `progressDeadline` rolls back: route first,
then every patched engine reverted.
"""
from __future__ import annotations

import math
from collections import Counter

from graft.rollout import analysis as judge
from graft.rollout.actions import LabelPod, PodAction, RevertPatch, apply_patch
from graft.rollout.decision import ClearPromote, ClearResume, Decision, Event, RecordPromotion, SetWeight
from graft.rollout.durations import format_duration
from graft.rollout.hooks import Hook, HookType
from graft.rollout.observation import PERMANENT_ERRORS, VERIFY_FAILED, Observation, PodObservation
from graft.api import FINAL_PHASES, Reason, has_patch, patches_of, with_patch, without_patch
from graft.rollout.spec import REVERT, PatchSource, PatchSpec, RolloutSpec
from graft.rollout.status import (CANARY, FAILED, PAUSED, PENDING, PROGRESSING, PROMOTED,
                                  ROLLED_BACK, ROLLING_BACK, STABLE, CheckResult, PodRecord, RolloutStatus, to_time)

WARNING = "Warning"
# reasons for a pause the analysis asked for (a person resumes or aborts)
RESUME_HINT = "resume (graft rollout resume, or the annotation graft.dev/resume=true) or abort"


def canary_target(pods: int, weight: int) -> int:
    """How many of `pods` run the patch at `weight` percent: ceil(N * w / 100), at least one."""
    if pods <= 0 or weight <= 0:
        return 0
    return min(pods, max(1, math.ceil(pods * weight / 100)))


def about(seconds: float) -> str:
    """A measured time, to the second, for a message."""
    return format_duration(round(max(0.0, seconds)))


def same_patch(revision: str, ref: str) -> str | None:
    """The other version of `ref`'s patch in `revision` (what an upgrade replaces), or None."""
    name = ref.partition("@")[0]
    return next((r for r in patches_of(revision) if r.partition("@")[0] == name and r != ref), None)


def stable_of(revisions: list[str], ref: str, reverting: bool) -> str:
    """The revision most pods run outside the rollout: the stable side.

    Applying, pods that already run `ref` (a restarted operator) count as their revision without it;
    reverting, the stable side is what runs the patch."""
    if reverting:
        having = [r for r in revisions if has_patch(r, ref)] or revisions
        return Counter(having).most_common(1)[0][0] if having else "base"
    plain = [r for r in revisions if not has_patch(r, ref)] or [without_patch(r, ref) for r in revisions]
    counts = Counter(plain)
    if not counts:
        return "base"
    best = max(counts.values())
    return min(r for r, c in counts.items() if c == best)


def known_revision(status: RolloutStatus, pod: PodObservation) -> str | None:
    """The revision recorded for `pod` if its container is the one recorded; None: ask the engine."""
    record = status.pod(pod.name)
    if record is None or record.revision is None or not pod.container_id:
        return None
    if (record.uid, record.container_id, record.restart_count) != (pod.uid, pod.container_id, pod.restart_count):
        return None
    return record.revision


def analysis_due(spec: RolloutSpec, status: RolloutStatus, now: float) -> bool:
    """True when an analysis run is due: canaries have served for an interval since the last run."""
    if status.phase not in (PROGRESSING, PAUSED):
        return False
    since = [p.patched_at for p in status.pods if p.track == CANARY and p.patched_at is not None]
    if not since or now < min(since) + spec.analysis.interval:
        return False
    last = status.analysis.last_run
    return last is None or now >= last + spec.analysis.interval


def gates_due(spec: RolloutSpec, status: RolloutStatus, now: float, analysing: bool) -> tuple[Hook, ...]:
    """The gate webhooks the operator asks this tick, before `decide()`: the rollout hooks with every
    analysis run; the confirm-promotion hooks while a gated step (manual, or the one before the last)
    waits, or once its pause is over (so its answer is there when the step is done)."""
    out = spec.hooks_of(HookType.ROLLOUT) if analysing else ()
    confirm = spec.hooks_of(HookType.CONFIRM_PROMOTION)
    if confirm and status.phase == PROGRESSING and not status.full_promotion:
        step = spec.step(status.step_index)
        gated = step.until_approved or status.step_index + 2 == len(spec.steps)
        paused = status.step_ready_at is not None and now >= status.step_ready_at + step.pause
        if gated and (status.awaiting_approval_since is not None or paused):
            out += confirm
    return out


def decide(spec: RolloutSpec, status: RolloutStatus, obs: Observation, now: float) -> Decision:
    """The next actions, events and status of one rollout."""
    machine = _Machine(spec, status.copy(), obs, now)
    machine.run()
    machine.status.refresh_conditions(now)
    return Decision(machine.status, machine.actions, machine.events)


class _Machine:
    def __init__(self, spec: RolloutSpec, status: RolloutStatus, obs: Observation, now: float):
        self.spec, self.status, self.obs, self.now = spec, status, obs, now
        self.ref = status.patch or spec.patch.ref
        self.actions: list = []
        self.events: list[Event] = []
        self.restarted: set[str] = set()
        self.promote_used = False        # the graft.dev/promote control was acted on in this decision

    # plumbing
    def event(self, reason: str, message: str, type: str = "Normal") -> None:
        self.events.append(Event(reason, message, type))

    def note(self, reason: str, message: str, type: str = WARNING) -> None:
        """Say why the rollout is waiting; an event only when the reason is news."""
        if self.status.message != message:
            self.event(reason, message, type)
        self.status.reason, self.status.message = reason, message

    @property
    def ready(self) -> list[PodObservation]:
        return [p for p in self.obs.pods if p.ready]

    @property
    def step_label(self) -> str:
        return f"step {self.status.step_index + 1}/{len(self.spec.steps)}"

    # top level
    def run(self) -> None:
        self.status.observed_generation = self.obs.generation
        if self.status.phase in FINAL_PHASES:
            return
        if self.status.phase == PENDING:
            self.pending()
            return
        self.sync_pods()
        if self.status.phase == ROLLING_BACK:
            self.rolling_back()
        else:
            self.progressing()

    def pending(self) -> None:
        obs, spec = self.obs, self.spec
        if obs.controls.abort:
            self.event(Reason.ABORTED, "aborted by the user before any pod was patched", WARNING)
            self.finish(ROLLED_BACK, Reason.ABORTED, "aborted by the user before any pod was patched")
            return
        if spec.paused:
            self.note(Reason.PAUSED, "created paused: nothing is patched until spec.paused is false", "Normal")
            return
        if obs.problem is not None:
            if obs.problem.permanent:
                self.finish(FAILED, obs.problem.reason, obs.problem.message)
            else:
                self.note(obs.problem.reason, obs.problem.message)
                if obs.problem.reason != Reason.QUEUED:     # waiting its turn is not a lack of progress
                    self.pending_deadline(obs.problem.message)
            return
        ready = self.ready
        if not ready:
            message = f"no ready pods match the selector {spec.selector.to_query()}"
            self.note(Reason.NO_PODS, message)
            self.pending_deadline(message)
            return
        known = [p for p in ready if p.revision is not None]
        refused = next((p for p in ready if p.error is not None and p.error.permanent), None)
        if refused is not None and not known:
            # every engine we could ask refused us (a wrong token): nothing can start
            self.finish(FAILED, PERMANENT_ERRORS[refused.error.kind], f"pod {refused.name}: {refused.error.message}")
            return
        if not known:
            errors = "; ".join(f"{p.name}: {p.error.message}" for p in ready if p.error) or "no answer"
            message = f"cannot read the revision of any engine ({errors})"
            self.note(Reason.ENGINES_UNREACHABLE, message)
            self.pending_deadline(message)
            return
        status = self.status
        status.patch = self.ref = spec.patch.ref
        status.stable_revision = stable_of([p.revision for p in known], self.ref, self.reverting)
        status.stable_patch = "" if self.reverting else same_patch(status.stable_revision, self.ref) or ""
        status.canary_revision = self.canary_form(status.stable_revision)
        status.phase, status.reason, status.started_at = PROGRESSING, Reason.STARTED, self.now
        first = spec.steps[0].weight
        if obs.route_weight is None and len(ready) * first < 100:
            self.event(Reason.COARSE_STEPS, f"pod-ratio routing over {len(ready)} pods: the smallest share is one pod, "
                                      f"{100 / len(ready):.3g}% of the traffic, so steps below that "
                                      f"(first: {first}%) send more than they ask; use Gateway API routing "
                                      "or more pods for finer steps", WARNING)
        status.pods = [PodRecord(p.name, p.uid, p.container_id, p.restart_count,
                            CANARY if self.in_canary_form(p.revision) else STABLE, p.revision)
                  for p in obs.pods]
        self.start_step(0)
        self.progressing()

    def pending_deadline(self, why: str) -> None:
        if self.now - self.obs.created_at > self.spec.progress_deadline:
            self.finish(FAILED, Reason.PROGRESS_DEADLINE_EXCEEDED,
                        f"not started within {format_duration(self.spec.progress_deadline)}: {why}")

    # pods
    def sync_pods(self) -> None:
        """Drop records of vanished pods, notice restarts and newcomers, take in fresh revisions."""
        status, seen = self.status, {p.name for p in self.obs.pods}
        for record in [r for r in status.pods if r.name not in seen]:
            status.pods.remove(record)
            self.event(Reason.POD_DROPPED, f"pod {record.name} is gone (was {record.track}); dropped from the rollout")
        for pod in self.obs.pods:
            record = status.pod(pod.name)
            if record is None:
                track = CANARY if self.in_canary_form(pod.revision) and status.phase != ROLLING_BACK else STABLE
                status.pods.append(PodRecord(pod.name, pod.uid, pod.container_id, pod.restart_count, track,
                                        pod.revision))
                continue
            if pod.container_id and (record.uid, record.container_id, record.restart_count) != (
                    pod.uid, pod.container_id, pod.restart_count):
                if record.container_id:
                    self.restarted.add(pod.name)
                record.uid, record.container_id, record.restart_count = pod.uid, pod.container_id, pod.restart_count
                record.revision, record.patched_at = pod.revision, None
            elif pod.revision is not None:
                record.revision = pod.revision
        status.pods.sort(key=lambda r: r.name)

    # what "patched" means: applying the rollout's patch (replacing another version of it), or, for a
    # rollout of `action: revert`, removing it; "unpatched" is the stable form, what the pod ran before
    @property
    def reverting(self) -> bool:
        return self.spec.action == REVERT

    def canary_form(self, revision: str) -> str:
        return without_patch(revision, self.ref) if self.reverting else with_patch(revision, self.ref)

    def stable_form(self, revision: str) -> str:
        if self.reverting:
            return with_patch(revision, self.ref)
        if self.status.stable_patch:              # an upgrade: back to the version the fleet ran
            return with_patch(revision, self.status.stable_patch)
        return without_patch(revision, self.ref)

    def in_canary_form(self, revision: str | None) -> bool:
        if revision is None:
            return False
        return not has_patch(revision, self.ref) if self.reverting else has_patch(revision, self.ref)

    def to_canary(self, pod: str, running: str) -> PodAction:
        """The admin call that brings a pod to its canary form: the patch applied (or, reverting, removed)."""
        if self.reverting:
            return RevertPatch(pod, self.ref.partition("@")[0])
        return apply_patch(pod, self.spec.patch, running)

    def to_stable(self, pod: str, running: str) -> PodAction:
        """The admin call that brings a pod back to its stable form: what it ran before this rollout."""
        if self.reverting:
            return apply_patch(pod, self.spec.patch, running)
        if self.status.stable_patch:              # an upgrade: the version the fleet ran, swapped back in
            return apply_patch(pod, self.stable_patch_spec(), running)
        return RevertPatch(pod, self.ref.partition("@")[0])

    def stable_patch_spec(self) -> PatchSpec:
        """The version an upgrade goes back to: as the fleet records it, else a built-in of that version."""
        recorded = self.obs.stable_patch
        if recorded is not None and recorded.ref == self.status.stable_patch:
            return recorded
        name, _, version = self.status.stable_patch.partition("@")
        return PatchSpec(name, version, PatchSource(builtin=True))

    def wants_patch(self, record: PodRecord) -> bool:
        return self.status.phase == PROMOTED or (self.status.phase in (PROGRESSING, PAUSED) and record.track == CANARY)

    def converge_pods(self, act: bool = True) -> list[str]:
        """Emit the pod actions that bring each ready pod to its track; returns the pods not there yet."""
        waiting = []
        for pod in self.ready:
            record = self.status.pod(pod.name)
            wants = self.wants_patch(record)
            if record.revision is None:
                waiting.append(pod.name)
                continue
            has = self.in_canary_form(record.revision)
            if wants != has:
                waiting.append(pod.name)
                if act and pod.error is None:   # an engine that just failed is tried again next tick
                    self.actions.append(self.to_canary(pod.name, record.revision) if wants
                                        else self.to_stable(pod.name, record.revision))
                    if wants and pod.name in self.restarted:
                        self.event(Reason.POD_REPATCHED, f"pod {pod.name} restarted and came back without "
                                                   f"{self.ref}; patching it again", WARNING)
            elif wants and record.patched_at is None:
                record.patched_at = self.now
            elif not wants:
                record.patched_at = None
            revision = self.canary_form(record.revision) if wants else self.stable_form(record.revision)
            track = STABLE if self.status.phase in FINAL_PHASES | {ROLLING_BACK} else record.track
            if act and (pod.track != track or pod.patches != revision):
                self.actions.append(LabelPod(pod.name, track, revision))
        if act:
            self.mark_unready()
        return waiting

    def mark_unready(self) -> None:
        """Pods that are not Ready cannot be asked, but their label and annotation can be made right,
        so that a container that restarts comes back with what its track should run."""
        for pod in self.obs.pods:
            if pod.ready:
                continue
            record = self.status.pod(pod.name)
            if record is None:
                continue
            wants = self.wants_patch(record)
            base = pod.patches or record.revision or self.status.stable_revision or "base"
            revision = self.canary_form(base) if wants else self.stable_form(base)
            track = STABLE if self.status.phase in FINAL_PHASES | {ROLLING_BACK} else record.track
            if pod.track != track or pod.patches != revision:
                self.actions.append(LabelPod(pod.name, track, revision))

    def pod_failure(self) -> bool:
        """A refusal from an engine ends the rollout: roll back whatever was patched."""
        for pod in self.ready:
            err = pod.error
            if err is None:
                continue
            if err.kind == VERIFY_FAILED:
                self.rollback(Reason.PATCH_VERIFY_FAILED, f"pod {pod.name}: {err.message}", ROLLED_BACK)
                return True
            if err.permanent:
                self.rollback(PERMANENT_ERRORS[err.kind], f"pod {pod.name}: {err.message}", FAILED)
                return True
        return False

    # progressing and paused
    def start_step(self, index: int) -> None:
        status, step = self.status, self.spec.step(index)
        status.step_index, status.step_started_at, status.step_ready_at = index, self.now, None
        status.awaiting_approval_since = None
        status.analysis.inconclusive_runs = status.analysis.error_runs = 0
        status.analysis.outage_seconds = 0.0
        pods = len(self.ready)
        self.event(Reason.STEP_STARTED, f"{self.step_label}: weight {step.weight}%, "
                                  f"{canary_target(pods, step.weight)} of {pods} pods run {self.ref}"
                                  + (f", then a pause of {step.pause_text}" if step.pause_text else "")
                                  + (", then it waits for approval (graft rollout promote)"
                                     if step.until_approved else ""))

    def progressing(self) -> None:
        status, obs, spec = self.status, self.obs, self.spec
        if obs.controls.abort:
            self.event(Reason.ABORTED, "aborted by the user (graft.dev/abort)", WARNING)
            self.rollback(Reason.ABORTED, "aborted by the user", ROLLED_BACK)
            return
        if spec.patch.ref != status.patch:
            self.rollback(Reason.PATCH_CHANGED, f"spec.patch changed from {status.patch} to {spec.patch.ref} "
                                          "during the rollout; create a new PatchRollout", ROLLED_BACK)
            return
        if obs.problem is not None:
            if obs.problem.permanent:
                self.rollback(obs.problem.reason, obs.problem.message, FAILED)
            else:
                self.note(obs.problem.reason, obs.problem.message)
                self.deadline(obs.problem.message)
            return
        if self.pod_failure():
            return
        if status.awaiting_approval_since is not None and not any(self.gate()):
            status.awaiting_approval_since = None     # the step no longer asks for approval (spec edited)
        self.pause_or_resume()
        if obs.controls.promote is not None:
            self.promote_request(obs.controls.promote)
        ready = self.step_in_place()
        if obs.measurements is not None and self.analyse():
            return
        if status.phase == PROGRESSING and ready and self.step_done() and self.approved():
            if status.step_index + 1 >= len(spec.steps) or status.full_promotion:
                self.promote()
                return
            self.start_step(status.step_index + 1)
            ready = self.step_in_place()
        if status.phase == PROGRESSING:
            self.deadline(self.waiting_for(ready))
        if status.phase in (PROGRESSING, PAUSED):
            self.progress_message(ready)

    def pause_or_resume(self) -> None:
        """Two kinds of pause: the user's (spec.paused) and the controller's (status.pauseConditions,
        ended by the graft.dev/resume annotation). The rollout goes on when neither holds it."""
        status, spec = self.status, self.spec
        if self.obs.controls.resume:
            self.actions.append(ClearResume())
            if status.pause_conditions:
                ended = ", ".join(str(c.get("reason")) for c in status.pause_conditions)
                status.pause_conditions = []
                self.event(Reason.PAUSE_ENDED, f"{ended} pause at {self.step_label} ended by the user (graft.dev/resume)"
                           + ("; spec.paused still holds it" if spec.paused else ""))
        if (spec.paused or status.pause_conditions) and status.phase == PROGRESSING:
            status.phase = PAUSED
            self.event(Reason.PAUSED, f"paused at {self.step_label} (weight {status.weight}%)")
        elif not spec.paused and not status.pause_conditions and status.phase == PAUSED:
            status.phase, status.step_started_at = PROGRESSING, self.now
            if status.step_ready_at is not None:
                status.step_ready_at = self.now
            status.awaiting_approval_since = None     # the step's analysis passes again, then it waits again
            a = status.analysis
            a.inconclusive_runs = a.error_runs = 0
            a.outage_since, a.outage_seconds = None, 0.0
            self.event(Reason.RESUMED, f"resumed at {self.step_label}; its pause starts over")

    def pause_for_analysis(self, reason: str, message: str) -> None:
        """The analysis cannot decide: pause for a person, saying why, instead of holding to the
        deadline. The pause lives in status.pauseConditions, not in spec.paused: the spec stays what
        its author wrote, so a GitOps tool has nothing to heal and cannot resume it by accident."""
        status = self.status
        status.phase = PAUSED
        status.pause_conditions = [{"reason": reason, "message": message, "startTime": to_time(self.now)}]
        status.reason, status.message = reason, f"{self.step_label}: {message}; paused: {RESUME_HINT}"
        self.event(reason, status.message, WARNING)

    def promote_request(self, how: str) -> None:
        status = self.status
        if how == "step" and self.spec.step(status.step_index).until_approved \
                and status.awaiting_approval_since is None and not status.full_promotion:
            # a manual step approved before its analysis passed: the approval never skips the analysis,
            # and the annotation stays until it approves the step (`approved`, once the analysis passes)
            return
        self.actions.append(ClearPromote())
        self.promote_used = True
        if how not in ("step", "full"):
            self.event(Reason.INVALID_CONTROL, f"graft.dev/promote must be 'step' or 'full', not {how!r}", WARNING)
            return
        last = len(self.spec.steps) - 1
        if status.awaiting_approval_since is not None:
            self.approve()
            if how == "step":
                if status.step_index >= last:
                    status.full_promotion = True      # nothing left after the last step: promote
                else:
                    self.start_step(status.step_index + 1)
                return
        if how == "full" or status.step_index >= last:
            status.full_promotion = True
            self.event(Reason.PROMOTED_BY_USER, f"full promotion requested at {self.step_label}: "
                                         "remaining steps and analysis skipped")
            if status.step_index < last:
                self.start_step(last)
        else:
            self.event(Reason.PROMOTED_BY_USER, f"{self.step_label} promoted by the user")
            self.start_step(status.step_index + 1)

    def step_in_place(self) -> bool:
        """Pick canaries for the step, converge pods, then the route; True once all of it is in place."""
        status, weight = self.status, self.spec.step(self.status.step_index).weight
        ready = self.ready
        target = canary_target(len(ready), weight)
        canaries = [p for p in ready if status.pod(p.name).track == CANARY]
        if len(canaries) > target:
            # a replaced canary came back: keep the longest-serving canaries, the rest go back to stable
            canaries.sort(key=lambda p: (status.pod(p.name).patched_at is None, status.pod(p.name).patched_at or 0,
                                         p.name))
            for pod in canaries[target:]:
                status.pod(pod.name).track = STABLE
                self.event(Reason.CANARY_RETURNED, f"pod {pod.name} is a canary beyond the {target} that "
                                             f"{self.step_label} asks for; back to stable")
            canaries = canaries[:target]
        for pod in sorted((p for p in ready if status.pod(p.name).track != CANARY), key=lambda p: p.name):
            if len(canaries) >= target:
                break
            status.pod(pod.name).track = CANARY
            canaries.append(pod)
        status.canary_pods = len(canaries)
        status.traffic_share = round(100 * len(canaries) / len(ready), 1) if ready and self.obs.route_weight is None \
            else float(self.spec.step(status.step_index).weight)
        if not ready:
            return False
        if self.converge_pods():
            return False
        if self.obs.route_weight is not None and self.obs.route_weight != weight:
            self.actions.append(SetWeight(weight))
            return False
        if status.step_ready_at is None:
            status.step_ready_at, status.weight = self.now, weight
            pods = f"{len(canaries)} of {len(ready)} pods"
            self.event(Reason.PODS_PATCHED, f"{self.step_label}: {pods} run {self.ref} ({status.canary_revision})")
            route = (f"HTTPRoute {self.spec.traffic_routing.http_route} sends {weight}% to "
                     f"{self.spec.traffic_routing.canary_service}"
                     if self.obs.route_weight is not None else f"{pods} are canaries")
            self.event(Reason.WEIGHT_SET, f"{self.step_label}: canary weight {weight}% ({route})")
        return True

    def step_done(self) -> bool:
        status = self.status
        if status.full_promotion:
            return True
        paused_enough = self.now >= status.step_ready_at + self.spec.step(status.step_index).pause
        analysis = status.analysis
        # strictly after: a run measured in the tick that put the step in place saw the step before
        passed = (analysis.last_run is not None and analysis.last_run > status.step_ready_at
                  and analysis.verdict == judge.SUCCESSFUL)
        return paused_enough and passed

    def gate(self) -> tuple[bool, tuple[Hook, ...]]:
        """What the current step waits for once its pause and analysis are done: a person (a manual
        step), and the confirm-promotion webhooks (at a manual step, and before the last step)."""
        status, spec = self.status, self.spec
        if status.full_promotion:
            return False, ()
        manual = spec.step(status.step_index).until_approved
        hooks = spec.hooks_of(HookType.CONFIRM_PROMOTION) if manual or status.step_index + 2 == len(spec.steps) else ()
        return manual, hooks

    def confirmed(self, hooks: tuple[Hook, ...]) -> bool:
        return bool(hooks) and all((a := self.obs.hooks.get(h.name)) is not None and a.ok for h in hooks)

    def approved(self) -> bool:
        """The step's pause and analysis are done: True when it may go on. A manual step goes on once
        approved (by a person, or by its confirm-promotion webhooks answering 2xx); a step before the
        last goes on once its confirm-promotion webhooks answer 2xx; until then it waits (one Event
        when the wait starts). A promote that came before the analysis passed, kept since, approves
        it now."""
        status = self.status
        manual, hooks = self.gate()
        if not manual and not hooks:
            return True
        if manual and self.obs.controls.promote == "step" and not self.promote_used:
            self.actions.append(ClearPromote())
            self.promote_used = True
            self.approve()
            return True
        if self.confirmed(hooks):
            since = status.awaiting_approval_since
            self.event(Reason.CONFIRMED, f"{self.step_label} confirmed by webhook {', '.join(h.name for h in hooks)}"
                       + (f" after waiting {about(self.now - since)}" if since is not None else ""))
            status.awaiting_approval_since = None
            return True
        if status.awaiting_approval_since is None:
            status.awaiting_approval_since = self.now
            self.event(Reason.AWAITING_APPROVAL if manual else Reason.AWAITING_CONFIRMATION, self.approval_message())
        return False

    def approve(self) -> None:
        """Say who approved the step (as far as the object tells) and after how long a wait."""
        status, who = self.status, self.obs.controls.promoted_by
        by = "graft.dev/promote" + (f", set by {who}" if who else "")
        since = status.awaiting_approval_since
        self.event(Reason.APPROVED, f"{self.step_label} approved ({by}) "
                             + (f"after waiting {about(self.now - since)}" if since is not None else
                                "before its analysis passed; it goes on now that the analysis passed"))
        status.awaiting_approval_since = None

    def approval_message(self) -> str:
        status = self.status
        step = self.spec.step(status.step_index)
        manual, hooks = self.gate()
        asked = []
        if manual:
            asked.append(f"graft rollout promote {self.obs.name}" if self.obs.name else "graft rollout promote")
        for h in hooks:
            answer = self.obs.hooks.get(h.name)
            said = "not asked yet" if answer is None else ("answered 2xx" if answer.ok else answer.message)
            asked.append(f"webhook {h.name} ({said})")
        what = "approval" if manual else "confirmation"
        message = f"{self.step_label} at {step.weight}%: waiting for {what}: {' or '.join(asked)}"
        verdict = status.analysis.verdict
        if verdict is not None and verdict != judge.SUCCESSFUL:
            message += f" (the analysis passed; its latest run is {verdict})"
        return message

    def final_evidence(self) -> bool:
        """True at the last step that still has stable pods: gates must have their evidence here."""
        return self.status.step_index + 2 >= len(self.spec.steps)

    def analyse(self) -> bool:
        """Fold this tick's measurements into the status; True when the run failed the rollout."""
        status, spec = self.status, self.spec
        analysis_spec = spec.analysis
        stable_pods = any(status.pod(p.name).track == STABLE for p in self.ready)
        before = status.analysis.verdict
        verdict, results = judge.run(analysis_spec, self.obs.measurements, status.analysis.results,
                                     stable_pods=stable_pods, final_evidence=self.final_evidence())
        hooks = self.hook_results()
        results = results + hooks
        if any(h.verdict == judge.FAILED for h in hooks):
            verdict = judge.FAILED
        status.analysis.last_run, status.analysis.verdict, status.analysis.results = self.now, verdict, results
        status.record_analysis(analysis_spec.measurement_retention)
        for r in results:
            if r.verdict == judge.FAILED and (r.role == "breaker" or r.conclusive):
                self.event(Reason.ANALYSIS_FAILED, f"{r.role} {r.message}", WARNING)
        if verdict == judge.FAILED:
            blamed = "; ".join([f"{r.role} {r.message}" for r in judge.failing(analysis_spec, results)]
                               + [f"{r.role} {r.message}" for r in hooks if r.verdict == judge.FAILED])
            self.rollback(Reason.ANALYSIS_FAILED, f"analysis failed at {self.step_label}: {blamed}", ROLLED_BACK)
            return True
        outage = self.outage(verdict, results)
        status.analysis.error_runs = status.analysis.error_runs + 1 if verdict == judge.ERROR and not outage else 0
        paused_enough = (status.step_ready_at is not None
                         and self.now >= status.step_ready_at + spec.step(status.step_index).pause)
        # a number on its way (a job check's Job) is not a run that could not decide: its own deadline bounds it
        waiting = any(r.pending for r in results)
        holding = verdict == judge.INCONCLUSIVE and paused_enough and not status.full_promotion and not waiting
        status.analysis.inconclusive_runs = status.analysis.inconclusive_runs + 1 if holding else 0
        summary = "; ".join(r.message for r in results if not r.dry_run and r.verdict != judge.SKIPPED)
        held = "; ".join(f"{r.role} {r.message}" for r in judge.holding(results))
        if verdict == judge.SUCCESSFUL and before != judge.SUCCESSFUL:
            self.event(Reason.ANALYSIS_PASSED, f"{self.step_label}: {summary}")
        elif verdict in (judge.INCONCLUSIVE, judge.ERROR) and before != verdict:
            self.event(Reason.ANALYSIS_INCONCLUSIVE, f"{self.step_label}: holding ({verdict}): {held}", WARNING)
        if status.phase != PROGRESSING or status.awaiting_approval_since is not None:
            return False      # a person is asked already: no pause for one on top of it
        since = status.analysis.outage_since
        if outage and analysis_spec.outage_limit and self.now - since >= analysis_spec.outage_limit:
            self.pause_for_analysis(Reason.ANALYSIS_OUTAGE_LIMIT, f"Prometheus could not be reached for "
                                                  f"{about(self.now - since)} (outageLimit "
                                                  f"{format_duration(analysis_spec.outage_limit)}): {held}")
        elif analysis_spec.error_limit and status.analysis.error_runs >= analysis_spec.error_limit:
            self.pause_for_analysis(Reason.ANALYSIS_ERROR_LIMIT, f"the analysis failed {status.analysis.error_runs} runs in a row "
                                                 f"(errorLimit {analysis_spec.error_limit}): {held}")
        elif (analysis_spec.inconclusive_limit
              and status.analysis.inconclusive_runs >= analysis_spec.inconclusive_limit):
            self.pause_for_analysis(Reason.INCONCLUSIVE_LIMIT,
                                    f"the analysis held the step {status.analysis.inconclusive_runs} runs past its "
                                    f"pause (inconclusiveLimit {analysis_spec.inconclusive_limit}): {held}")
        return False

    def hook_results(self) -> list[CheckResult]:
        """The rollout webhooks' answers to this run, as checks named webhook/NAME: a non-2xx is a
        failed breaker (the run fails and the rollout rolls back); a hook not asked is left out."""
        out = []
        for h in self.spec.hooks_of(HookType.ROLLOUT):
            answer = self.obs.hooks.get(h.name)
            if answer is None:
                continue
            out.append(CheckResult(h.check_name, judge.SUCCESSFUL if answer.ok else judge.FAILED, "2xx", "-",
                                   breaches=0 if answer.ok else 1,
                                   message=f"{h.check_name}: " + ("answered 2xx" if answer.ok else answer.message),
                                   role="breaker"))
        return out

    def outage(self, verdict: str, results: list) -> bool:
        """Track an outage of Prometheus (every failing query of a deciding check failed to reach it):
        the step holds, its progress deadline waits, and it goes on by itself once Prometheus answers."""
        a = self.status.analysis
        failing = {f"{r.role}/{r.name}" for r in judge.holding(results) if r.verdict == judge.ERROR}
        errors = [m for m in self.obs.measurements or [] if m.check in failing]
        outage = verdict == judge.ERROR and bool(errors) and all(m.outage for m in errors)
        if outage and a.outage_since is None:
            a.outage_since = self.now
            limit = self.spec.analysis.outage_limit
            self.event(Reason.ANALYSIS_UNAVAILABLE, f"{self.step_label}: Prometheus cannot be reached ({errors[0].error}); "
                                    f"holding at weight {self.status.weight}% until it answers"
                                    + (f", pausing after {format_duration(limit)}" if limit else ""), WARNING)
        elif not outage and a.outage_since is not None:
            lasted = max(0.0, self.now - a.outage_since)
            a.outage_seconds += lasted
            a.outage_since = None
            self.event(Reason.ANALYSIS_AVAILABLE, f"{self.step_label}: Prometheus answers again after "
                                            f"{about(lasted)}; the step goes on")
        return outage

    def waiting_for(self, ready: bool) -> str:
        if not ready:
            waiting = self.converge_pods(act=False)
            if not self.ready:
                return "no ready pods match the selector"
            if waiting:
                errors = [f"{p.name}: {p.error.message}" for p in self.ready if p.error]
                return f"pods not in place: {', '.join(waiting)}" + (f" ({'; '.join(errors)})" if errors else "")
            return "the route weight is not set yet"
        analysis = self.status.analysis
        if analysis.verdict is None:
            return "no analysis yet"
        if analysis.outage_since is not None:
            return (f"Prometheus unreachable for {about(self.now - analysis.outage_since)}; "
                    "holding until it answers")
        return f"analysis {analysis.verdict}"

    def deadline(self, why: str) -> None:
        status = self.status
        if status.phase != PROGRESSING or status.step_started_at is None:
            return
        if status.awaiting_approval_since is not None:
            return      # waiting for a person is no lack of progress: a new step starts the deadline anew
        # time spent holding for Prometheus is not the step's fault: the deadline waits for it
        limit = (status.step_started_at + self.spec.step(status.step_index).pause + self.spec.progress_deadline
                 + status.analysis.held_by_outage(self.now))
        if self.now > limit:
            self.rollback(Reason.PROGRESS_DEADLINE_EXCEEDED,
                          f"{self.step_label} made no progress for {format_duration(self.spec.progress_deadline)} "
                          f"past its pause: {why}", ROLLED_BACK)

    def progress_message(self, ready: bool) -> None:
        status = self.status
        canaries = sum(1 for p in self.ready if status.pod(p.name).track == CANARY)
        head = f"{self.step_label}: weight {self.spec.step(status.step_index).weight}%, " \
               f"{canaries} of {len(self.ready)} pods canary"
        if status.phase == PAUSED:
            if not status.pause_conditions:      # a pause the analysis asked for keeps its reason
                status.reason, status.message = Reason.PAUSED, f"{head}; paused"
            return
        why = self.waiting_for(ready)
        if not self.ready:
            self.note(Reason.NO_PODS, f"{head}; {why}")
            return
        if status.awaiting_approval_since is not None:
            manual, _ = self.gate()
            status.reason = Reason.AWAITING_APPROVAL if manual else Reason.AWAITING_CONFIRMATION
            status.message = self.approval_message()
            return
        if self.spec.step(status.step_index).until_approved and self.obs.controls.promote == "step" \
                and not self.promote_used:
            why += "; approved already (graft.dev/promote): it goes on once the analysis passes"
        status.reason = Reason.ANALYSIS_UNAVAILABLE if ready and status.analysis.outage_since is not None else Reason.PROGRESSING
        status.message = f"{head}; {why}"

    # endings
    def promote(self) -> None:
        status = self.status
        status.phase, status.reason, status.weight = PROMOTED, Reason.PROMOTED, 100
        status.awaiting_approval_since = None
        status.stable_revision = status.canary_revision
        self.actions.append(RecordPromotion())
        for record in status.pods:
            record.track = STABLE
        self.converge_pods()
        if self.obs.route_weight is not None and self.obs.route_weight != 0:
            self.actions.append(SetWeight(0))
        status.message = f"{self.ref} promoted: all {len(self.ready)} pods run {status.stable_revision}"
        self.event(Reason.PROMOTED, status.message)

    def rollback(self, reason: str, message: str, end: str) -> None:
        status = self.status
        status.phase, status.reason, status.message = ROLLING_BACK, reason, message
        status.cause, status.end_phase = message, end
        status.awaiting_approval_since = None
        # nothing planned for the step still applies: rolling back recomputes pods and route
        self.actions = [action for action in self.actions if isinstance(action, (ClearPromote, ClearResume))]
        self.event(Reason.ROLLING_BACK, f"{message}; reverting {self.ref}", WARNING)
        self.rolling_back()

    def rolling_back(self) -> None:
        status = self.status
        for record in status.pods:
            record.track = STABLE
        if self.obs.route_weight is not None and self.obs.route_weight != 0:
            self.actions.append(SetWeight(0))
        if self.obs.problem is not None and not self.obs.problem.permanent:
            self.blocked(self.obs.problem.message)
            return
        waiting = self.converge_pods()
        if waiting or (self.obs.route_weight is not None and self.obs.route_weight != 0):
            errors = [f"{p.name}: {p.error.message}" for p in self.ready if p.error and p.name in waiting]
            if errors:
                self.blocked(f"cannot revert {self.ref} on {'; '.join(errors)}")
            return
        self.finish(status.end_phase or ROLLED_BACK, status.reason, status.cause)
        self.event(Reason.ROLLED_BACK, f"{self.ref} reverted on every pod; all run {status.stable_revision} ({status.cause})",
                   WARNING if status.phase == FAILED else "Normal")

    def blocked(self, why: str) -> None:
        """The rollback cannot finish yet: say so, keeping the reason it started for."""
        message = f"{self.status.cause}; rolling back, but {why}"
        if self.status.message != message:
            self.event(Reason.ROLLBACK_BLOCKED, why, WARNING)
        self.status.message = message

    def finish(self, phase: str, reason: str, message: str) -> None:
        status = self.status
        status.phase, status.reason, status.message = phase, reason, message
        status.weight, status.end_phase, status.cause = 0, "", ""
        if phase == FAILED:
            self.event(reason, message, WARNING)
