"""One reconciliation of one PatchRollout: observe, decide, act, until nothing is left to do.

Level-triggered and safe to repeat: pods' engine revisions are the truth (asked again whenever a
pod's container is not the one recorded), so a retried or restarted reconciliation never applies
a patch twice. The status is written here, through the status subresource, while the rollout's
lock is held, so the next reconciliation always starts from it.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from graft.operator import pods as podsmod
from graft.operator.admin import AdminClient, AdminError, EngineAnswer
from graft.operator.executor import Outcome, PodExecutor
from graft.operator.fleet import (FleetOverlap, active_rollout, create_for_gated_pods, find_fleet,
                                  find_or_create_fleet, record_promotion)
from graft.operator.kube import cluster_template_path, fleet_path, rollout_path, template_path
from graft.operator.pods import AddressError
from graft.operator.problems import PrometheusRefused, SecretError, TokenError
from graft.operator.prometheus import ProviderError
from graft.operator.web import allowed_url
from graft.operator.revisions import Container, engine_answer
from graft.operator.routers import RouteError, Router, router_for
from graft.operator.runtime import Runtime
from graft.rollout import loop
from graft.rollout.actions import PodAction
from graft.rollout.analysis import plan_run
from graft.rollout.decision import Action, ClearPromote, ClearResume, Event, RecordPromotion, SetWeight
from graft.rollout.hooks import HookAnswer, HookType
from graft.rollout.machine import analysis_due, gates_due, known_revision
from graft.rollout.notifications import payload as rollout_payload
from graft.rollout.observation import (UNREACHABLE, Controls, Measurement, Observation, PodError,
                                       PodObservation, Problem)
from graft.api import ACTIVE_PHASES, FINAL_PHASES, Reason, has_patch
from graft.rollout.spec import REVERT, PatchSpec, RolloutSpec, SpecError, parse_fleet_spec, parse_spec, template_refs
from graft.rollout.status import FAILED, PENDING, ROLLED_BACK, ROLLING_BACK, STABLE, RolloutStatus, from_time

PROMOTE_ANNOTATION = "graft.dev/promote"
RESUME_ANNOTATION = "graft.dev/resume"
ABORT_ANNOTATION = "graft.dev/abort"


@dataclass(slots=True)
class Result:
    status: RolloutStatus
    events: list[Event] = field(default_factory=list)


async def reconcile(runtime: Runtime, body: dict[str, Any], now: float, *, abort: bool = False) -> Result:
    """Reconcile the rollout `body` (as just read from the API server) at time `now`."""
    stored = RolloutStatus.from_dict(body.get("status"))
    try:
        templates = await load_templates(runtime, body)
        spec = parse_spec(body.get("spec") or {}, templates)
    except SpecError as e:
        lenient = _without_templates(body) if stored.phase in ACTIVE_PHASES else None
        if lenient is not None and (abort or _past_deadline(stored, lenient, now)):
            # the analysis cannot be read any more (a template deleted since), but what to take out
            # and where the traffic goes can: abort, so canaries are reverted and a deletion completes
            status, events = await Reconciliation(runtime, lenient, body, now, True).run(stored)
            why = "being deleted" if abort else "past its progress deadline"
            message = f"invalid spec: {e}; {why}, the canaries are reverted"
            if stored.message != message:
                events.insert(0, Event(Reason.INVALID_SPEC, message, "Warning"))
            status.message = message if status.phase in ACTIVE_PHASES else status.message
            status.refresh_conditions(now)
            result = await _write(runtime, body, stored, Result(status, events))
            announce(runtime, body, lenient, stored, result, now)
            return result
        result = await _write(runtime, body, stored, _invalid(stored, e, body, now))
        announce(runtime, body, None, stored, result, now)
        return result
    if stored.phase == FAILED and stored.reason == Reason.INVALID_SPEC:
        stored = RolloutStatus()    # the spec was fixed: start over
    if stored.phase in FINAL_PHASES:
        return Result(stored)
    status, events = await Reconciliation(runtime, spec, body, now, abort).run(stored)
    result = await _write(runtime, body, stored, Result(status, events))
    announce(runtime, body, spec, stored, result, now)
    return result


def announce(runtime: Runtime, body: dict[str, Any], spec: RolloutSpec | None, stored: RolloutStatus,
             result: Result, now: float) -> None:
    """Tell what this reconciliation changed from `stored` (written already): the notification
    receivers, and the rollout's fired webhooks (post-rollout at its end, rollback when one begins,
    event for every Event). Never waits: everything leaves through the outbox. A spec that does not
    parse has no webhooks to call (`spec` None); its receivers still hear that it failed."""
    before, after = stored.to_dict(), result.status.to_dict()
    runtime.notifier.publish(body, before, after, result.events, now)
    if spec is None or not spec.hooks:
        return
    was, phase = before.get("phase"), after.get("phase")
    fired = []
    if phase != was and phase in (ROLLING_BACK, ROLLED_BACK) and was not in (ROLLING_BACK, ROLLED_BACK):
        fired += [(h, "rollback") for h in spec.hooks_of(HookType.ROLLBACK)]
    if phase != was and phase in FINAL_PHASES:
        fired += [(h, phase) for h in spec.hooks_of(HookType.POST_ROLLOUT)]
    for h, moment in fired:
        runtime.hooks.fire(h, rollout_payload(body, after, moment))
    for event in result.events:
        for h in spec.hooks_of(HookType.EVENT):
            runtime.hooks.fire(h, rollout_payload(body, after, "event", reason=event.reason, message=event.message,
                                                  event_type=event.type))


async def load_templates(runtime: Runtime, body: dict[str, Any]) -> dict[tuple[str, bool], dict[str, Any]]:
    """The specs of the analysis templates the rollout names (those that exist)."""
    namespace = body["metadata"]["namespace"]
    out = {}
    for name, cluster in template_refs(body.get("spec") or {}):
        path = cluster_template_path(name) if cluster else template_path(namespace, name)
        found = await runtime.kube.get(path)
        if found is not None:
            out[(name, cluster)] = found.get("spec") or {}
    return out


def _invalid(stored: RolloutStatus, error: SpecError, body: dict[str, Any], now: float) -> Result:
    status = stored.copy()
    message = f"invalid spec: {error}"
    if status.phase in ACTIVE_PHASES:
        # never act on a spec we cannot read: hold (to the progress deadline when the rest of it
        # still reads, see `reconcile`)
        message = f"{message}; holding until it is fixed"
        status.message = message
    else:
        status.phase, status.reason, status.message = FAILED, Reason.INVALID_SPEC, message
    events = [] if stored.message == message else [Event(Reason.INVALID_SPEC, message, "Warning")]
    status.observed_generation = int(body["metadata"].get("generation") or 0)
    status.refresh_conditions(now)   # so `kubectl wait --for=condition=...` ends on a refused rollout
    return Result(status, events)


def annotation_manager(meta: dict[str, Any], key: str) -> str | None:
    """Who last set the annotation `key`, as far as the object tells: the field manager that owns it
    in `metadata.managedFields` (`kubectl-annotate`, `kubectl-edit`, a client's own name) and when.
    The authenticated user is in the API server's audit log, not in the object; None when no entry
    owns the annotation (an API server that keeps no managedFields)."""
    owners = []
    for entry in meta.get("managedFields") or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("manager"), str):
            continue
        fields = entry.get("fieldsV1") or {}
        annotations = (fields.get("f:metadata") or {}).get("f:annotations") if isinstance(fields, dict) else None
        if isinstance(annotations, dict) and f"f:{key}" in annotations:
            owners.append((str(entry.get("time") or ""), entry["manager"]))
    if not owners:
        return None
    when, manager = max(owners)
    return f"{manager} at {when}" if when else manager


def _without_templates(body: dict[str, Any]) -> RolloutSpec | None:
    """The spec read without its analysis templates (their checks dropped), or None when it is
    invalid even so: enough to abort a rollout whose template was deleted while it ran."""
    spec = dict(body.get("spec") or {})
    analysis = spec.get("analysis")
    if not isinstance(analysis, dict) or "templates" not in analysis:
        return None
    spec["analysis"] = {k: v for k, v in analysis.items() if k not in ("templates", "args")}
    try:
        return parse_spec(spec)
    except SpecError:
        return None


def _past_deadline(stored: RolloutStatus, spec: RolloutSpec, now: float) -> bool:
    since = stored.step_started_at or stored.started_at
    return since is not None and now >= since + spec.progress_deadline


async def _write(runtime: Runtime, body: dict[str, Any], stored: RolloutStatus, result: Result) -> Result:
    new = result.status.to_dict()
    if new != stored.to_dict() or body.get("status") is None:
        meta = body["metadata"]
        await runtime.kube.merge_patch(rollout_path(meta["namespace"], meta["name"]) + "/status", {"status": new})
    return result


class Reconciliation:
    """One reconciliation of one rollout: the `graft.rollout.loop.Effects` of the shared loop (rounds of
    observe, decide and act until the decision asks for nothing more), remembering within it what the
    engines answered so that no pod is asked twice. Pod actions go to the one `PodExecutor`."""

    def __init__(self, runtime: Runtime, spec: RolloutSpec, body: dict[str, Any], now: float, abort: bool):
        self.runtime, self.spec, self.body, self.now, self.abort = runtime, spec, body, now, abort
        meta = body["metadata"]
        self.namespace, self.name = meta["namespace"], meta["name"]
        self.router: Router = router_for(spec.traffic_routing, runtime.kube, self.namespace)
        self.pods: dict[str, dict[str, Any]] = {}       # the engine pods the selector picks
        self.workloads = podsmod.Workloads(runtime.kube, self.namespace, runtime.settings.admin_port)
        self.answered: dict[str, str] = {}       # revisions the engines gave back this tick
        self.errors: dict[str, PodError] = {}
        self.problem: Problem | None = None
        # a Prometheus the operator may not ask fails the rollout before anything is read or sent
        self.refusal = runtime.prometheus_refusal(spec.analysis.prometheus, self.namespace) or \
            runtime.web_refusal([c for c in spec.analysis.checks if c.web is not None], self.namespace) or \
            runtime.job_refusal([c for c in spec.analysis.checks if c.job is not None])
        self.executor = PodExecutor(runtime, self.namespace, self.workloads, self.pods, classify=self.pod_error)
        self.recorded: tuple[PatchSpec, ...] | None = None   # the fleet's patches, once read
        self.overlap = ""                        # why `start` found the rollout's pods shared with another fleet
        self.promote_done = False                # a promote control acts once, not once per round
        self.resume_done = False                 # and so does a resume
        self.hook_answers: dict[str, HookAnswer] = {}   # what the gate webhooks said this tick
        self.questions = asyncio.Semaphore(runtime.settings.fleet_admin_concurrency)   # engines asked at once
        self.hold: tuple[str, str] | None = None        # why `start` held a Pending rollout (reason, message)
        self.refused_start: HookAnswer | None = None    # a pre-rollout webhook that failed
        self.status = RolloutStatus()

    async def run(self, status: RolloutStatus) -> tuple[RolloutStatus, list[Event]]:
        pending = status.copy() if status.phase == PENDING else None
        if status.phase == PENDING:
            await self.wait_for_turn()
        due = self.refusal is None and analysis_due(self.spec, status, self.now)
        measurements = await self.measure(status) if due else None
        await self.ask(gates_due(self.spec, status, self.now, due))
        done = await loop.tick(self.spec, status, self.now, self, measurements)
        if done.held:
            if self.refused_start is not None:
                # a pre-rollout webhook said no: the rollout ends before any pod is touched
                a = self.refused_start
                message = f"pre-rollout webhook {a.hook} failed: {a.message}; no pod was touched"
                pending.phase, pending.reason, pending.message = FAILED, Reason.PRE_ROLLOUT_FAILED, message
                pending.refresh_conditions(self.now)
                return pending, [Event(Reason.PRE_ROLLOUT_FAILED, message, "Warning")]
            # a confirm-rollout webhook did not say yes, or a race lost with a rollout over
            # overlapping pods starting at the same moment: nothing is touched, the next tick asks again
            reason, message = self.hold or (Reason.FLEET_OVERLAP, self.overlap)
            events = [Event(reason, message)] if pending.reason != reason else []
            pending.reason, pending.message = reason, message
            return pending, events
        status = done.status
        try:
            if status.phase != PENDING and not status.fleet:
                status.fleet = await find_or_create_fleet(self.runtime.kube, self.namespace, self.spec.selector,
                                                          status.stable_revision, self.runtime.pod_cache)
            elif status.phase == PENDING and status.reason == Reason.NO_PODS:
                # pods held by the readiness gate need a fleet before this rollout can see them Ready
                await create_for_gated_pods(self.runtime, self.namespace, self.spec.selector,
                                            list(self.pods.values()), self.workloads)
        except FleetOverlap:
            pass        # a started rollout keeps going without one; a pending one holds on it next tick
        return status, self.strangers_reported() + done.events

    def strangers_reported(self) -> list[Event]:
        """A Warning Event, once per pod, for each pod the selector picks that is no engine of a
        workload: it is left alone (no label, no admin call) and counts as no member of the fleet."""
        out = []
        for pod, why in sorted(self.workloads.refused.items()):
            if self.runtime.report_once(f"PatchRollout {self.namespace}/{self.name}", self.workloads.uid(pod)):
                out.append(Event(Reason.NOT_AN_ENGINE, f"pod {pod} is left alone (no label, no admin call): {why}",
                                 "Warning"))
        return out

    async def start(self, status: RolloutStatus) -> bool:
        """Before a starting rollout touches a pod: its confirm-rollout webhooks must answer 2xx and its
        pre-rollout webhooks succeed (`self.hold`, `self.refused_start` say otherwise); then record its
        fleet and store the status, so that the fleet controller, seeing a pod run this rollout's patch,
        also sees this rollout active on the fleet (and leaves that patch and the pods' labels to it)
        rather than reverting it as drift. False when another fleet turned out to select some of its
        pods (`self.overlap` says which)."""
        if not await self.cleared_to_start(status):
            return False
        try:
            if not status.fleet:
                status.fleet = await find_or_create_fleet(self.runtime.kube, self.namespace, self.spec.selector,
                                                          status.stable_revision, self.runtime.pod_cache)
        except FleetOverlap as e:
            self.overlap = str(e)
            return False
        await self.runtime.kube.merge_patch(rollout_path(self.namespace, self.name) + "/status",
                                            {"status": status.to_dict()})
        return True

    async def cleared_to_start(self, status: RolloutStatus) -> bool:
        body = rollout_payload(self.body, status.to_dict(), "started")
        confirm = self.spec.hooks_of(HookType.CONFIRM_ROLLOUT)
        answers = await asyncio.gather(*(self.runtime.hooks.ask(h, body) for h in confirm))
        refused = [a for a in answers if not a.ok]
        if refused:
            said = "; ".join(f"webhook {a.hook} ({a.message})" for a in refused)
            self.hold = (Reason.AWAITING_CONFIRMATION, f"waiting for confirmation to start: {said}")
            return False
        for h in self.spec.hooks_of(HookType.PRE_ROLLOUT):
            answer = await self.runtime.hooks.ask(h, body)
            if not answer.ok:
                self.refused_start = answer
                return False
        return True

    async def ask(self, hooks) -> None:
        """Ask this tick's gate webhooks at once; their answers go to every observation of the tick."""
        if not hooks:
            return
        body = self.body
        answers = await asyncio.gather(*(self.runtime.hooks.ask(h, rollout_payload(body, body.get("status") or {},
                                                                                    h.type.value)) for h in hooks))
        self.hook_answers = {a.hook: a for a in answers}

    async def wait_for_turn(self) -> None:
        """One rollout per fleet at a time: a second one waits, Pending (Queued), for the first to end.
        One whose pods another fleet also selects holds, Pending (FleetOverlap)."""
        try:
            fleet = await find_fleet(self.runtime.kube, self.namespace, self.spec.selector, self.runtime.pod_cache)
        except FleetOverlap as e:
            self.problem = Problem(Reason.FLEET_OVERLAP, f"holding: {e}")
            return
        if fleet is None:
            return
        other = await active_rollout(self.runtime.kube, self.namespace, fleet)
        if other is not None and other["metadata"]["name"] != self.name:
            self.problem = Problem(Reason.QUEUED, f"queued: PatchRollout {other['metadata']['name']} is active on "
                                           f"fleet {fleet}; this one starts when it ends")

    # observing
    async def measure(self, status: RolloutStatus) -> list[Measurement]:
        """Every check's Measurement, in the plan's order, each from its provider (`Series.provider`)."""
        plan = plan_run(self.spec, status, self.namespace, self.now)
        by_provider: dict[str, list] = {}
        for check, series in plan:
            name = next((s.provider for s in series if s.provider != "prometheus"), "prometheus")
            by_provider.setdefault(name, []).append((check, series))
        providers = {"prometheus": self.measure_prometheus, "web": self.measure_web,
                     "job": lambda part: self.measure_jobs(part, status)}
        found = await asyncio.gather(*(providers[name](part) for name, part in by_provider.items()))
        by_key = {m.check: m for measured in found for m in measured}
        return [by_key[check.key] for check, _ in plan]

    async def measure_prometheus(self, plan: list) -> list[Measurement]:
        try:
            provider = await self.runtime.provider(self.spec.analysis.prometheus, self.namespace)
        except (SecretError, PrometheusRefused) as e:
            return [Measurement(check.key, error=e.problem.message) for check, _ in plan]
        except ProviderError as e:      # a client certificate that does not load: an error, not a crash
            return [Measurement(check.key, error=str(e)) for check, _ in plan]
        return await provider.measure(plan)

    async def measure_jobs(self, plan: list, status: RolloutStatus) -> list[Measurement]:
        refusal = self.runtime.job_refusal([check for check, _ in plan])
        if refusal is not None:     # refused at the start already (self.refusal): nothing is made
            return [Measurement(check.key, error=refusal.message) for check, _ in plan]
        meta = self.body["metadata"]
        owner = {"name": meta["name"], "uid": meta.get("uid") or meta["name"]}
        # a comparison with no stable pod left is skipped (analysis.judge): no Job is made for it
        stable = any(p.track == STABLE for p in status.pods)

        async def one(check, series) -> Measurement:
            if check.comparison and not stable:
                return Measurement(check.key, {"value": None})
            return await self.runtime.jobs.measure(self.runtime.kube, check.key, series[0].job,
                                                   namespace=self.namespace, owner=owner, check=check.name,
                                                   step=status.step_index, step_started=status.step_started_at)
        return list(await asyncio.gather(*(one(check, series) for check, series in plan)))

    async def measure_web(self, plan: list) -> list[Measurement]:
        refusal = self.runtime.web_refusal([check for check, _ in plan], self.namespace)
        if refusal is not None:     # refused at the start already (self.refusal): nothing is sent
            return [Measurement(check.key, error=refusal.message) for check, _ in plan]

        async def one(check, series) -> Measurement:
            for s in series:    # as filled with this run's revisions: still under the allow-list
                if not allowed_url(s.web.url, self.runtime.settings.web_allowed):
                    return Measurement(check.key, error=f"check {check.name}: {s.web.url} is not an address "
                                                        "this operator may ask (GRAFT_WEB_ALLOWED)")
            try:
                headers = [await self.runtime.web_headers(s.web, self.namespace) for s in series]
            except SecretError as e:
                return Measurement(check.key, error=e.problem.message)
            return await self.runtime.web.measure(check.key, series, headers)
        return list(await asyncio.gather(*(one(check, series) for check, series in plan)))

    async def observe(self, status: RolloutStatus, measurements: list[Measurement] | None) -> Observation:
        problem = self.refusal or self.problem
        admin = None
        try:
            admin = await self.runtime.admin()
        except TokenError as e:
            problem = problem or e.problem
        # from the operator's watch of the namespace (graft.operator.podcache), not a list per round
        picked = await self.runtime.pod_cache.pods(self.namespace, self.spec.selector)
        raw = await self.workloads.engines(picked)
        self.pods = self.executor.pods = {p["metadata"]["name"]: p for p in raw}
        if not raw and picked:
            left = "; ".join(f"pod {p['metadata']['name']}: {self.workloads.refused[p['metadata']['name']]}"
                             for p in picked[:3])
            problem = problem or Problem(Reason.NOT_AN_ENGINE, f"no engine pod matches the selector "
                                                        f"{self.spec.selector.to_query()}, only pods left alone ({left})")
        # each pod version is read once (PodCache.derived), and a copy filled in for this round
        observed = [copy.copy(self.runtime.pod_cache.derived(p, podsmod.observe_pod)) for p in raw]
        asks = [pod for pod in observed if self.settle(status, pod, admin)]
        # a rollout starts from what the engines say: the book may be as old as the slow resync
        await asyncio.gather(*(self.revision(pod, admin, fresh=not status.pods) for pod in asks))
        problem = problem or self.problem         # what the engines' answers showed (check_code)
        route_weight = None
        try:
            route_weight = await self.router.get_weight()
        except RouteError as e:
            problem = problem or Problem(e.reason, e.message)
        annotations = self.body["metadata"].get("annotations") or {}
        controls = Controls(promote=None if self.promote_done else annotations.get(PROMOTE_ANNOTATION) or None,
                            abort=self.abort or annotations.get(ABORT_ANNOTATION, "").lower() == "true",
                            resume=not self.resume_done and annotations.get(RESUME_ANNOTATION, "").lower() == "true",
                            promoted_by=annotation_manager(self.body["metadata"], PROMOTE_ANNOTATION))
        return Observation(observed, measurements, route_weight, controls, problem,
                           from_time(self.body["metadata"].get("creationTimestamp")) or self.now,
                           int(self.body["metadata"].get("generation") or 0), self.name,
                           await self.stable_patch(status), hooks=self.hook_answers)

    def settle(self, status: RolloutStatus, pod: PodObservation, admin: AdminClient | None) -> bool:
        """Fill in what is known of the pod's engine without asking it: this tick's answers, the
        status's record of this very container, the operator's revision book. True: ask the engine."""
        pod.revision = self.answered.get(pod.name) or known_revision(status, pod)
        pod.error = self.errors.get(pod.name)
        if pod.revision is not None or not pod.ready or admin is None or pod.error is not None:
            return False
        if not status.pods:
            # a rollout starts from what the engines say, not from memory: the book may be as old as
            # the slow resync, and what a rollout takes for stable decides what it applies and judges
            return True
        address = self.workloads.address(self.pods[pod.name])
        known = self.runtime.revisions.known(address, Container.of(pod)) if address is not None else None
        if known is None:
            return True
        pod.revision = known.revision
        self.check_code(pod.name, known)
        return False

    async def revision(self, pod: PodObservation, admin: AdminClient, fresh: bool = False) -> None:
        """Ask the pod's engine what it runs (GET /admin/patches), a few engines at a time."""
        try:
            # what the operator knows of this very container (its own applies, the fleet's answers)
            # first, unless `fresh`; an engine is asked only beyond it, a few at a time
            answer = await engine_answer(self.runtime.revisions, admin, self.executor.address(pod.name),
                                         Container.of(pod), self.questions, fresh=fresh)
            pod.revision = answer.revision
            self.runtime.unauthorized.pop(f"{self.namespace}/{pod.name}", None)
        except (AdminError, AddressError) as e:
            pod.error = self.pod_error(pod.name, e)
            return
        self.check_code(pod.name, answer)

    def check_code(self, pod: str, answer: EngineAnswer) -> None:
        """One `name@version` names one code: an engine that runs this rollout's name@version from a
        bundle of another digest (a re-packed bundle under the same version) would be taken for
        patched, and its metrics for the canary's; the rollout stops there instead (VersionReused)."""
        patch = self.spec.patch
        pinned = patch.source.digest
        running = answer.digests.get(patch.name)
        if self.spec.action == REVERT or pinned is None or running is None \
                or not has_patch(answer.revision, patch.ref) or running.lower() == pinned.lower():
            return
        self.problem = self.problem or Problem(
            Reason.VERSION_REUSED, f"pod {pod} runs {patch.ref} from a bundle of digest {running}, but this rollout "
                            f"pins {pinned}: one name@version must name one code (the revision, its metrics "
                            "and every pod's state say which version runs); give the re-packed bundle a new "
                            "version", permanent=True)

    async def stable_patch(self, status: RolloutStatus) -> PatchSpec | None:
        """The version an upgrade goes back to, as the fleet records it (read once a reconciliation);
        None when the rollout is no upgrade or the fleet does not record that version."""
        if not status.stable_patch or not status.fleet:
            return None
        if self.recorded is None:
            fleet = await self.runtime.kube.get(fleet_path(self.namespace, status.fleet))
            try:
                self.recorded = parse_fleet_spec((fleet or {}).get("spec") or {}).patches
            except SpecError:
                self.recorded = ()
        return next((p for p in self.recorded if p.ref == status.stable_patch), None)

    # acting
    async def execute(self, status: RolloutStatus, actions: list[Action]) -> None:
        """Runs the actions in order; a run of actions of one kind goes out concurrently. Once an action
        meets a problem (a route update refused, no token, no bundle) the rest wait for the next decision:
        a rollback must not revert the canaries while the route still sends them traffic."""
        self.status = status
        for _, group in itertools.groupby(actions, key=type):
            group = list(group)
            if isinstance(group[0], PodAction):
                for outcome in await self.executor.run_all(group):
                    self.take(outcome)
            else:
                for action in group:
                    await self.act(action)
            if self.problem is not None:
                break

    def take(self, outcome: Outcome) -> None:
        """What a pod action's outcome tells the next decision."""
        if outcome.revision is not None:
            self.answered[outcome.pod] = outcome.revision
        if outcome.error is not None:
            self.errors[outcome.pod] = outcome.error
        if outcome.problem is not None:
            self.problem = self.problem or outcome.problem

    async def act(self, action: Action) -> None:
        match action:
            case SetWeight(weight):
                try:
                    await self.router.set_weight(weight)
                except RouteError as e:
                    self.problem = self.problem or Problem(e.reason, e.message)
            case RecordPromotion():
                if self.status.fleet:
                    await record_promotion(self.runtime.kube, self.namespace, self.status.fleet, self.spec.patch,
                                           revert=self.spec.action == REVERT)
            case ClearResume():
                self.resume_done = True
                await self.runtime.kube.merge_patch(rollout_path(self.namespace, self.name),
                                                    {"metadata": {"annotations": {RESUME_ANNOTATION: None}}})
            case ClearPromote():
                self.promote_done = True
                await self.runtime.kube.merge_patch(rollout_path(self.namespace, self.name),
                                                    {"metadata": {"annotations": {PROMOTE_ANNOTATION: None}}})
            case _:
                raise TypeError(f"not a rollout action: {action!r}")

    def pod_error(self, pod: str, e: AdminError | AddressError) -> PodError:
        """What an admin call's failure means for the rollout. A refused token (401/403) is final only
        once the engine has refused it for `admin_token_grace` seconds and on UNAUTHORIZED_TICKS
        ticks in a row: a rotated Secret reaches the operator (which re-reads it at once) and the
        engines (kubelet refreshes their mounted file within a minute or two) at different moments.
        The time is what a rotation needs; the ticks keep one slow tick from ending it early."""
        key = f"{self.namespace}/{pod}"
        if isinstance(e, AdminError) and e.kind == UNAUTHORIZED:
            self.runtime.invalidate_token()
            now = time.monotonic()
            since, seen = self.runtime.unauthorized.get(key, (now, 0))
            seen += 1
            self.runtime.unauthorized[key] = (since, seen)
            grace = self.runtime.settings.admin_token_grace
            if seen < UNAUTHORIZED_TICKS or now - since < grace:
                return PodError(UNREACHABLE, f"{e.message} (the admin token may be rotating: refused for "
                                             f"{now - since:.0f} s of {grace:g} s)")
            return PodError(UNAUTHORIZED, f"{e.message} (refused for {now - since:.0f} s)")
        self.runtime.unauthorized.pop(key, None)
        return _pod_error(e)


UNAUTHORIZED, UNAUTHORIZED_TICKS = "unauthorized", 3


def _pod_error(e: AdminError | AddressError) -> PodError:
    return PodError(e.kind, e.message)
