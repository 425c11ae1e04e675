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
run after the step was in place passes. A check reaching its breach limit, a user abort, a patch
the engine refuses or a step stuck past `progressDeadline` rolls back: route first, then every
patched engine reverted.
"""
from __future__ import annotations

import math
from collections import Counter

from graft.rollout import analysis as judge
from graft.rollout.decision import (ClearPromote, Decision, Event, LabelPod, PatchPod, PauseRollout,
                                    RecordPromotion, SetWeight, UnpatchPod)
from graft.rollout.durations import format_duration
from graft.rollout.observation import PERMANENT_ERRORS, VERIFY_FAILED, Observation, PodObservation
from graft.api import has_patch, patches_of, with_patch, without_patch
from graft.rollout.spec import REVERT, RolloutSpec
from graft.rollout.status import (CANARY, FAILED, FINAL, PAUSED, PENDING, PROGRESSING, PROMOTED,
                                  ROLLED_BACK, ROLLING_BACK, STABLE, PodRecord, RolloutStatus)

WARNING = "Warning"
# reasons for a pause the analysis asked for (a person resumes or aborts)
INCONCLUSIVE_LIMIT, ERROR_LIMIT = "InconclusiveLimit", "AnalysisErrorLimit"
QUEUED = "Queued"      # another rollout is active on the same fleet


def canary_target(pods: int, weight: int) -> int:
    """How many of `pods` run the patch at `weight` percent: ceil(N * w / 100), at least one."""
    if pods <= 0 or weight <= 0:
        return 0
    return min(pods, max(1, math.ceil(pods * weight / 100)))


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
    rec = status.pod(pod.name)
    if rec is None or rec.revision is None or not pod.container_id:
        return None
    if (rec.uid, rec.container_id, rec.restart_count) != (pod.uid, pod.container_id, pod.restart_count):
        return None
    return rec.revision


def analysis_due(spec: RolloutSpec, status: RolloutStatus, now: float) -> bool:
    """True when an analysis run is due: canaries have served for an interval since the last run."""
    if status.phase not in (PROGRESSING, PAUSED):
        return False
    since = [p.patched_at for p in status.pods if p.track == CANARY and p.patched_at is not None]
    if not since or now < min(since) + spec.analysis.interval:
        return False
    last = status.analysis.last_run
    return last is None or now >= last + spec.analysis.interval


def decide(spec: RolloutSpec, status: RolloutStatus, obs: Observation, now: float) -> Decision:
    """The next actions, events and status of one rollout."""
    machine = _Machine(spec, status.copy(), obs, now)
    machine.run()
    machine.s.refresh_conditions(now)
    return Decision(machine.s, machine.actions, machine.events)


class _Machine:
    def __init__(self, spec: RolloutSpec, status: RolloutStatus, obs: Observation, now: float):
        self.spec, self.s, self.obs, self.now = spec, status, obs, now
        self.ref = status.patch or spec.patch.ref
        self.actions: list = []
        self.events: list[Event] = []
        self.restarted: set[str] = set()

    # plumbing
    def event(self, reason: str, message: str, type: str = "Normal") -> None:
        self.events.append(Event(reason, message, type))

    def note(self, reason: str, message: str, type: str = WARNING) -> None:
        """Say why the rollout is waiting; an event only when the reason is news."""
        if self.s.message != message:
            self.event(reason, message, type)
        self.s.reason, self.s.message = reason, message

    @property
    def ready(self) -> list[PodObservation]:
        return [p for p in self.obs.pods if p.ready]

    @property
    def step_label(self) -> str:
        return f"step {self.s.step_index + 1}/{len(self.spec.steps)}"

    # top level
    def run(self) -> None:
        self.s.observed_generation = self.obs.generation
        if self.s.phase in FINAL:
            return
        if self.s.phase == PENDING:
            self.pending()
            return
        self.sync_pods()
        if self.s.phase == ROLLING_BACK:
            self.rolling_back()
        else:
            self.progressing()

    def pending(self) -> None:
        obs, spec = self.obs, self.spec
        if obs.controls.abort:
            self.event("Aborted", "aborted by the user before any pod was patched", WARNING)
            self.finish(ROLLED_BACK, "Aborted", "aborted by the user before any pod was patched")
            return
        if spec.paused:
            self.note("Paused", "created paused: nothing is patched until spec.paused is false", "Normal")
            return
        if obs.problem is not None:
            if obs.problem.permanent:
                self.finish(FAILED, obs.problem.reason, obs.problem.message)
            else:
                self.note(obs.problem.reason, obs.problem.message)
                if obs.problem.reason != QUEUED:     # waiting its turn is not a lack of progress
                    self.pending_deadline(obs.problem.message)
            return
        ready = self.ready
        if not ready:
            message = f"no ready pods match the selector {spec.selector.to_query()}"
            self.note("NoPods", message)
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
            self.note("EnginesUnreachable", message)
            self.pending_deadline(message)
            return
        s = self.s
        s.patch = self.ref = spec.patch.ref
        s.stable_revision = stable_of([p.revision for p in known], self.ref, self.reverting)
        s.stable_patch = "" if self.reverting else same_patch(s.stable_revision, self.ref) or ""
        s.canary_revision = self.canary_form(s.stable_revision)
        s.phase, s.reason, s.started_at = PROGRESSING, "Started", self.now
        first = spec.steps[0].weight
        if obs.route_weight is None and len(ready) * first < 100:
            self.event("CoarseSteps", f"pod-ratio routing over {len(ready)} pods: the smallest share is one pod, "
                                      f"{100 / len(ready):.3g}% of the traffic, so steps below that "
                                      f"(first: {first}%) send more than they ask; use Gateway API routing "
                                      "or more pods for finer steps", WARNING)
        s.pods = [PodRecord(p.name, p.uid, p.container_id, p.restart_count,
                            CANARY if self.in_canary_form(p.revision) else STABLE, p.revision)
                  for p in obs.pods]
        self.start_step(0)
        self.progressing()

    def pending_deadline(self, why: str) -> None:
        if self.now - self.obs.created_at > self.spec.progress_deadline:
            self.finish(FAILED, "ProgressDeadlineExceeded",
                        f"not started within {format_duration(self.spec.progress_deadline)}: {why}")

    # pods
    def sync_pods(self) -> None:
        """Drop records of vanished pods, notice restarts and newcomers, take in fresh revisions."""
        s, seen = self.s, {p.name for p in self.obs.pods}
        for rec in [r for r in s.pods if r.name not in seen]:
            s.pods.remove(rec)
            self.event("PodDropped", f"pod {rec.name} is gone (was {rec.track}); dropped from the rollout")
        for pod in self.obs.pods:
            rec = s.pod(pod.name)
            if rec is None:
                track = CANARY if self.in_canary_form(pod.revision) and s.phase != ROLLING_BACK else STABLE
                s.pods.append(PodRecord(pod.name, pod.uid, pod.container_id, pod.restart_count, track,
                                        pod.revision))
                continue
            if pod.container_id and (rec.uid, rec.container_id, rec.restart_count) != (
                    pod.uid, pod.container_id, pod.restart_count):
                if rec.container_id:
                    self.restarted.add(pod.name)
                rec.uid, rec.container_id, rec.restart_count = pod.uid, pod.container_id, pod.restart_count
                rec.revision, rec.patched_at = pod.revision, None
            elif pod.revision is not None:
                rec.revision = pod.revision
        s.pods.sort(key=lambda r: r.name)

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
        if self.s.stable_patch:              # an upgrade: back to the version the fleet ran
            return with_patch(revision, self.s.stable_patch)
        return without_patch(revision, self.ref)

    def in_canary_form(self, revision: str | None) -> bool:
        if revision is None:
            return False
        return not has_patch(revision, self.ref) if self.reverting else has_patch(revision, self.ref)

    def wants_patch(self, rec: PodRecord) -> bool:
        return self.s.phase == PROMOTED or (self.s.phase in (PROGRESSING, PAUSED) and rec.track == CANARY)

    def converge_pods(self, act: bool = True) -> list[str]:
        """Emit the pod actions that bring each ready pod to its track; returns the pods not there yet."""
        waiting = []
        for pod in self.ready:
            rec = self.s.pod(pod.name)
            wants = self.wants_patch(rec)
            if rec.revision is None:
                waiting.append(pod.name)
                continue
            has = self.in_canary_form(rec.revision)
            if wants != has:
                waiting.append(pod.name)
                if act and pod.error is None:   # an engine that just failed is tried again next tick
                    self.actions.append(PatchPod(pod.name) if wants else UnpatchPod(pod.name))
                    if wants and pod.name in self.restarted:
                        self.event("PodRepatched", f"pod {pod.name} restarted and came back without "
                                                   f"{self.ref}; patching it again", WARNING)
            elif wants and rec.patched_at is None:
                rec.patched_at = self.now
            elif not wants:
                rec.patched_at = None
            revision = self.canary_form(rec.revision) if wants else self.stable_form(rec.revision)
            track = STABLE if self.s.phase in FINAL + (ROLLING_BACK,) else rec.track
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
            rec = self.s.pod(pod.name)
            if rec is None:
                continue
            wants = self.wants_patch(rec)
            base = pod.patches or rec.revision or self.s.stable_revision or "base"
            revision = self.canary_form(base) if wants else self.stable_form(base)
            track = STABLE if self.s.phase in FINAL + (ROLLING_BACK,) else rec.track
            if pod.track != track or pod.patches != revision:
                self.actions.append(LabelPod(pod.name, track, revision))

    def pod_failure(self) -> bool:
        """A refusal from an engine ends the rollout: roll back whatever was patched."""
        for pod in self.ready:
            err = pod.error
            if err is None:
                continue
            if err.kind == VERIFY_FAILED:
                self.rollback("PatchVerifyFailed", f"pod {pod.name}: {err.message}", ROLLED_BACK)
                return True
            if err.permanent:
                self.rollback(PERMANENT_ERRORS[err.kind], f"pod {pod.name}: {err.message}", FAILED)
                return True
        return False

    # progressing and paused
    def start_step(self, index: int) -> None:
        s, step = self.s, self.spec.step(index)
        s.step_index, s.step_started_at, s.step_ready_at = index, self.now, None
        s.analysis.inconclusive_runs = s.analysis.error_runs = 0
        pods = len(self.ready)
        self.event("StepStarted", f"{self.step_label}: weight {step.weight}%, "
                                  f"{canary_target(pods, step.weight)} of {pods} pods run {self.ref}"
                                  + (f", then a pause of {step.pause_text}" if step.pause_text else ""))

    def progressing(self) -> None:
        s, obs, spec = self.s, self.obs, self.spec
        if obs.controls.abort:
            self.event("Aborted", "aborted by the user (graft.dev/abort)", WARNING)
            self.rollback("Aborted", "aborted by the user", ROLLED_BACK)
            return
        if spec.patch.ref != s.patch:
            self.rollback("PatchChanged", f"spec.patch changed from {s.patch} to {spec.patch.ref} "
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
        self.pause_or_resume()
        if obs.controls.promote is not None:
            self.promote_request(obs.controls.promote)
        ready = self.step_in_place()
        if obs.measurements is not None and self.analyse():
            return
        if s.phase == PROGRESSING and ready and self.step_done():
            if s.step_index + 1 >= len(spec.steps) or s.full_promotion:
                self.promote()
                return
            self.start_step(s.step_index + 1)
            ready = self.step_in_place()
        if s.phase == PROGRESSING:
            self.deadline(self.waiting_for(ready))
        if s.phase in (PROGRESSING, PAUSED):
            self.progress_message(ready)

    def pause_or_resume(self) -> None:
        s, spec = self.s, self.spec
        asked = s.pause_generation is not None
        if asked and not spec.paused and self.obs.generation < s.pause_generation + 2:
            # the analysis asked for spec.paused and it is not written (or not seen) yet: ask again
            self.actions.append(PauseRollout())
            return
        if spec.paused and s.phase == PROGRESSING:
            s.phase = PAUSED
            self.event("Paused", f"paused at {self.step_label} (weight {s.weight}%)")
        elif not spec.paused and s.phase == PAUSED:
            s.phase, s.step_started_at, s.pause_generation = PROGRESSING, self.now, None
            if s.step_ready_at is not None:
                s.step_ready_at = self.now
            s.analysis.inconclusive_runs = s.analysis.error_runs = 0
            self.event("Resumed", f"resumed at {self.step_label}; its pause starts over")

    def pause_for_analysis(self, reason: str, message: str) -> None:
        """The analysis cannot decide: pause for a person, saying why, instead of holding to the deadline."""
        s = self.s
        s.phase, s.pause_generation = PAUSED, self.obs.generation
        self.actions.append(PauseRollout())
        s.reason, s.message = reason, f"{self.step_label}: {message}; paused: resume or abort"
        self.event(reason, s.message, WARNING)

    def promote_request(self, how: str) -> None:
        s = self.s
        self.actions.append(ClearPromote())
        if how not in ("step", "full"):
            self.event("InvalidControl", f"graft.dev/promote must be 'step' or 'full', not {how!r}", WARNING)
            return
        last = len(self.spec.steps) - 1
        if how == "full" or s.step_index >= last:
            s.full_promotion = True
            self.event("PromotedByUser", f"full promotion requested at {self.step_label}: "
                                         "remaining steps and analysis skipped")
            if s.step_index < last:
                self.start_step(last)
        else:
            self.event("PromotedByUser", f"{self.step_label} promoted by the user")
            self.start_step(s.step_index + 1)

    def step_in_place(self) -> bool:
        """Pick canaries for the step, converge pods, then the route; True once all of it is in place."""
        s, weight = self.s, self.spec.step(self.s.step_index).weight
        ready = self.ready
        target = canary_target(len(ready), weight)
        canaries = [p for p in ready if s.pod(p.name).track == CANARY]
        if len(canaries) > target:
            # a replaced canary came back: keep the longest-serving canaries, the rest go back to stable
            canaries.sort(key=lambda p: (s.pod(p.name).patched_at is None, s.pod(p.name).patched_at or 0, p.name))
            for pod in canaries[target:]:
                s.pod(pod.name).track = STABLE
                self.event("CanaryReturned", f"pod {pod.name} is a canary beyond the {target} that "
                                             f"{self.step_label} asks for; back to stable")
            canaries = canaries[:target]
        for pod in sorted((p for p in ready if s.pod(p.name).track != CANARY), key=lambda p: p.name):
            if len(canaries) >= target:
                break
            s.pod(pod.name).track = CANARY
            canaries.append(pod)
        s.canary_pods = len(canaries)
        s.traffic_share = round(100 * len(canaries) / len(ready), 1) if ready and self.obs.route_weight is None \
            else float(self.spec.step(s.step_index).weight)
        if not ready:
            return False
        if self.converge_pods():
            return False
        if self.obs.route_weight is not None and self.obs.route_weight != weight:
            self.actions.append(SetWeight(weight))
            return False
        if s.step_ready_at is None:
            s.step_ready_at, s.weight = self.now, weight
            pods = f"{len(canaries)} of {len(ready)} pods"
            self.event("PodsPatched", f"{self.step_label}: {pods} run {self.ref} ({s.canary_revision})")
            route = (f"HTTPRoute {self.spec.traffic_routing.http_route} sends {weight}% to "
                     f"{self.spec.traffic_routing.canary_service}"
                     if self.obs.route_weight is not None else f"{pods} are canaries")
            self.event("WeightSet", f"{self.step_label}: canary weight {weight}% ({route})")
        return True

    def step_done(self) -> bool:
        s = self.s
        if s.full_promotion:
            return True
        paused_enough = self.now >= s.step_ready_at + self.spec.step(s.step_index).pause
        a = s.analysis
        # strictly after: a run measured in the tick that put the step in place saw the step before
        passed = a.last_run is not None and a.last_run > s.step_ready_at and a.verdict == judge.SUCCESSFUL
        return paused_enough and passed

    def final_evidence(self) -> bool:
        """True at the last step that still has stable pods: gates must have their evidence here."""
        return self.s.step_index + 2 >= len(self.spec.steps)

    def analyse(self) -> bool:
        """Fold this tick's measurements into the status; True when the run failed the rollout."""
        s, spec = self.s, self.spec
        a = spec.analysis
        stable_pods = any(s.pod(p.name).track == STABLE for p in self.ready)
        before = s.analysis.verdict
        verdict, results = judge.run(a, self.obs.measurements, s.analysis.results,
                                     stable_pods=stable_pods, final_evidence=self.final_evidence())
        s.analysis.last_run, s.analysis.verdict, s.analysis.results = self.now, verdict, results
        for r in results:
            if r.verdict == judge.FAILED and (r.role == "breaker" or r.conclusive):
                self.event("AnalysisFailed", f"{r.role} {r.message}", WARNING)
        if verdict == judge.FAILED:
            blamed = "; ".join(f"{r.role} {r.message}" for r in judge.failing(a, results))
            self.rollback("AnalysisFailed", f"analysis failed at {self.step_label}: {blamed}", ROLLED_BACK)
            return True
        s.analysis.error_runs = s.analysis.error_runs + 1 if verdict == judge.ERROR else 0
        paused_enough = s.step_ready_at is not None and self.now >= s.step_ready_at + spec.step(s.step_index).pause
        holding = verdict == judge.INCONCLUSIVE and paused_enough and not s.full_promotion
        s.analysis.inconclusive_runs = s.analysis.inconclusive_runs + 1 if holding else 0
        summary = "; ".join(r.message for r in results if not r.dry_run and r.verdict != judge.SKIPPED)
        held = "; ".join(f"{r.role} {r.message}" for r in judge.holding(results))
        if verdict == judge.SUCCESSFUL and before != judge.SUCCESSFUL:
            self.event("AnalysisPassed", f"{self.step_label}: {summary}")
        elif verdict in (judge.INCONCLUSIVE, judge.ERROR) and before != verdict:
            self.event("AnalysisInconclusive", f"{self.step_label}: holding ({verdict}): {held}", WARNING)
        if s.phase != PROGRESSING:
            return False
        if a.error_limit and s.analysis.error_runs >= a.error_limit:
            self.pause_for_analysis(ERROR_LIMIT, f"the analysis failed {s.analysis.error_runs} runs in a row "
                                                 f"(errorLimit {a.error_limit}): {held}")
        elif a.inconclusive_limit and s.analysis.inconclusive_runs >= a.inconclusive_limit:
            self.pause_for_analysis(INCONCLUSIVE_LIMIT,
                                    f"the analysis held the step {s.analysis.inconclusive_runs} runs past its "
                                    f"pause (inconclusiveLimit {a.inconclusive_limit}): {held}")
        return False

    def waiting_for(self, ready: bool) -> str:
        if not ready:
            waiting = self.converge_pods(act=False)
            if not self.ready:
                return "no ready pods match the selector"
            if waiting:
                errors = [f"{p.name}: {p.error.message}" for p in self.ready if p.error]
                return f"pods not in place: {', '.join(waiting)}" + (f" ({'; '.join(errors)})" if errors else "")
            return "the route weight is not set yet"
        a = self.s.analysis
        if a.verdict is None:
            return "no analysis yet"
        return f"analysis {a.verdict}"

    def deadline(self, why: str) -> None:
        s = self.s
        if s.phase != PROGRESSING or s.step_started_at is None:
            return
        limit = s.step_started_at + self.spec.step(s.step_index).pause + self.spec.progress_deadline
        if self.now > limit:
            self.rollback("ProgressDeadlineExceeded",
                          f"{self.step_label} made no progress for {format_duration(self.spec.progress_deadline)} "
                          f"past its pause: {why}", ROLLED_BACK)

    def progress_message(self, ready: bool) -> None:
        s = self.s
        canaries = sum(1 for p in self.ready if s.pod(p.name).track == CANARY)
        head = f"{self.step_label}: weight {self.spec.step(s.step_index).weight}%, " \
               f"{canaries} of {len(self.ready)} pods canary"
        if s.phase == PAUSED:
            if s.pause_generation is None:      # a pause the analysis asked for keeps its reason
                s.reason, s.message = "Paused", f"{head}; paused"
            return
        why = self.waiting_for(ready)
        if not self.ready:
            self.note("NoPods", f"{head}; {why}")
            return
        s.reason, s.message = "Progressing", f"{head}; {why}"

    # endings
    def promote(self) -> None:
        s = self.s
        s.phase, s.reason, s.weight = PROMOTED, "Promoted", 100
        s.stable_revision = s.canary_revision
        self.actions.append(RecordPromotion())
        for rec in s.pods:
            rec.track = STABLE
        self.converge_pods()
        if self.obs.route_weight is not None and self.obs.route_weight != 0:
            self.actions.append(SetWeight(0))
        s.message = f"{self.ref} promoted: all {len(self.ready)} pods run {s.stable_revision}"
        self.event("Promoted", s.message)

    def rollback(self, reason: str, message: str, end: str) -> None:
        s = self.s
        s.phase, s.reason, s.message, s.cause, s.end_phase = ROLLING_BACK, reason, message, message, end
        # nothing planned for the step still applies: rolling back recomputes pods and route
        self.actions = [a for a in self.actions if isinstance(a, ClearPromote)]
        self.event("RollingBack", f"{message}; reverting {self.ref}", WARNING)
        self.rolling_back()

    def rolling_back(self) -> None:
        s = self.s
        for rec in s.pods:
            rec.track = STABLE
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
        self.finish(s.end_phase or ROLLED_BACK, s.reason, s.cause)
        self.event("RolledBack", f"{self.ref} reverted on every pod; all run {s.stable_revision} ({s.cause})",
                   WARNING if s.phase == FAILED else "Normal")

    def blocked(self, why: str) -> None:
        """The rollback cannot finish yet: say so, keeping the reason it started for."""
        message = f"{self.s.cause}; rolling back, but {why}"
        if self.s.message != message:
            self.event("RollbackBlocked", why, WARNING)
        self.s.message = message

    def finish(self, phase: str, reason: str, message: str) -> None:
        s = self.s
        s.phase, s.reason, s.message, s.weight, s.end_phase, s.cause = phase, reason, message, 0, "", ""
        if phase == FAILED:
            self.event(reason, message, WARNING)
