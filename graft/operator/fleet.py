"""The fleet controller: every PatchFleet's pods converged to its patches, for good.

Each tick (a kopf timer per PatchFleet) it reads the pods the fleet's selector matches (from the
operator's watch of the namespace, graft.operator.podcache: no list per tick), keeps the
engines of a workload among them (`graft.operator.pods.Workloads`: any other pod is left alone and
reported once, in a Warning Event NotAnEngine), learns what each running engine runs (from what the
operator did and the container's identity, asking the engine only when that is missing or stale:
graft.operator.revisions), calls the
pure `graft.rollout.fleet.converge`, and carries out what it returns through the one executor of
pod actions (`graft.operator.executor`): pod labels and annotations first, then one admin call per
pod, then the pod's readiness-gate condition `graft.dev/patched`. While a rollout is active on the
fleet (its `status.fleet` names it), the rollout's patch is left alone, and so are the labels and
annotations of the pods it acts on (`graft.rollout.fleet.rollout_labels`: one writer at a time).
An action that fails keeps its pod pending, the reason in the fleet's status; one that fails
unexpectedly is also posted as a Warning Event (ActionFailed).

The rollout side (graft.operator.reconcile) finds or creates the fleet when a rollout starts, and
records the patch in the fleet when the rollout is promoted.

Fleets are told apart by the pods they select, not by their selector's text: a rollout's fleet is
the one with the same selector (spelled any way) or, failing that, the one selecting exactly the
same pods. Two fleets that share a pod would each take the other's patches for drift and revert
them, so they are refused: the younger fleet acts on no pod while the overlap lasts (its condition
says which fleet and pods), and a rollout whose pods another fleet also selects holds, Pending, with
reason FleetOverlap until the selectors are made apart or its progress deadline ends it. Overlap
is judged on members, the engines of a workload a selector picks: a pod that is no engine (a trap
pod carrying two fleets' labels) belongs to neither and can make no fleet stand down.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

from graft.operator import pods as podsmod
from graft.operator.admin import AdminError
from graft.operator.executor import PodExecutor
from graft.operator.kube import Kube, KubeError, fleet_path, rollouts_path
from graft.operator.podcache import PodCache, read_pods
from graft.operator.revisions import Container, RevisionBook, engine_answer
from graft.operator.runtime import Runtime, TokenError
from graft.rollout.actions import ApplyPatch, LabelPod, RevertPatch, SetPatched
from graft.rollout.fleet import (PATCHED_CONDITION, FleetPod, adopt, converge, desired_revision, rollout_labels,
                                 with_promoted, without)
from graft.api import ACTIVE_PHASES, Reason
from graft.rollout.spec import (FleetSpec, LabelSelector, PatchSpec, SpecError, parse_fleet_spec,
                                parse_selector, patch_to_dict)
from graft.rollout.observation import PodObservation
from graft.rollout.status import PENDING, from_time, to_time


class FleetOverlap(Exception):
    """The pods a selector picks are shared with a fleet that does not pick exactly them."""


@dataclass(slots=True)
class _Fleet:
    name: str
    selector: LabelSelector
    created: str
    pods: frozenset[str]

    @property
    def age(self) -> tuple[str, str]:
        return (self.created, self.name)      # older first; the name breaks a tie


async def _fleets(kube: Kube, namespace: str, bodies: list[dict[str, Any]] | None = None,
                  cache: PodCache | None = None) -> tuple[list[_Fleet], list[dict[str, Any]]]:
    """Every valid fleet of the namespace (`bodies`, when already read) with the engines it selects
    now, and those engines (the pods from `cache`, the operator's, when given).

    Membership is judged as everywhere else (`Workloads.vet`): a pod that is no engine of a workload
    belongs to no fleet, so a pod labelled into two fleets' selectors cannot make one stand down."""
    pods = await podsmod.Workloads(kube, namespace, 0).engines(await read_pods(cache, kube, namespace, None))
    out = []
    for fleet in bodies if bodies is not None else await kube.list(fleet_path(namespace)):
        try:
            selector = parse_fleet_spec(fleet.get("spec") or {}).selector
        except SpecError:
            continue
        out.append(_Fleet(fleet["metadata"]["name"], selector, fleet["metadata"].get("creationTimestamp") or "",
                          _selected(selector, pods)))
    return out, pods


def _selected(selector: LabelSelector, pods: list[dict[str, Any]]) -> frozenset[str]:
    return frozenset(p["metadata"]["name"] for p in pods if selector.matches(p["metadata"].get("labels") or {}))


def _names(pods) -> str:
    names = sorted(pods)
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


@dataclass(slots=True)
class FleetResult:
    status: dict[str, Any]
    events: list[tuple[str, str, str]] = field(default_factory=list)   # (reason, message, type)


def _containers_running(pod: dict[str, Any]) -> bool:
    """The engine container is up: ready, or started and running though its readiness probe fails
    (an engine waiting for a bundle answers /ready 503 until the operator applies it again)."""
    status = pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    if conditions.get("ContainersReady") == "True" or conditions.get("Ready") == "True":
        return True
    statuses = status.get("containerStatuses") or []
    return bool(statuses) and all(cs.get("started") and "running" in (cs.get("state") or {}) for cs in statuses)


def _patched(pod: dict[str, Any]) -> bool | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == PATCHED_CONDITION:
            return c.get("status") == "True"
    return None


def _gate_outlived(pod: dict[str, Any]) -> bool:
    """The gate graft.dev/patched is open, but for an earlier container: one running now started
    at or after the gate opened (a restart; timestamps of whole seconds, so the same second counts).
    What a restarted engine runs is what its annotation said at the restart, checked by no one yet."""
    gate = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == PATCHED_CONDITION),
                None)
    opened = from_time(gate.get("lastTransitionTime")) if gate and gate.get("status") == "True" else None
    if opened is None:
        return False
    started = [from_time(((cs.get("state") or {}).get("running") or {}).get("startedAt"))
               for cs in (pod.get("status") or {}).get("containerStatuses") or []]
    return any(t is not None and t >= math.floor(opened) for t in started)


def _renewed_gates(outlived_pods: list[dict[str, Any]], pods: list[FleetPod], converged: list[str]) -> list[SetPatched]:
    """Gates that vouch for a container that is gone (`outlived_pods`, `_gate_outlived`): closed
    until the new one is seen running the fleet's revision (so it is not Ready, and takes no
    traffic, before its engine has been checked; a container that runs counts as running before it
    is ready, so "not converged yet" is what closes the gate, not "not running"), renewed once it does."""
    outlived = {p["metadata"]["name"] for p in outlived_pods}
    done = set(converged)
    out = []
    for pod in pods:
        if pod.name not in outlived:
            continue
        if pod.name in done:
            out.append(SetPatched(pod.name, True, f"runs {pod.revision}"))
        else:
            out.append(SetPatched(pod.name, False, "its container restarted: checked again once it runs"))
    return out


async def active_rollout(kube: Kube, namespace: str, fleet: str,
                         selector: LabelSelector | None = None) -> dict[str, Any] | None:
    """The rollout acting on `fleet` now (oldest first), or None.

    With `selector` (the fleet's), a rollout still Pending on that selector counts too: it patches
    its first canaries in the very tick it starts, before its status names the fleet, and those
    canaries must not be taken for drift. A Queued one does not: it waits for the active one.
    """
    rollouts = await kube.list(rollouts_path(namespace))
    order = lambda r: (r["metadata"].get("creationTimestamp") or "", r["metadata"]["name"])   # noqa: E731
    active = sorted((r for r in rollouts if (r.get("status") or {}).get("fleet") == fleet
                     and (r.get("status") or {}).get("phase") in ACTIVE_PHASES), key=order)
    if active or selector is None:
        return active[0] if active else None
    query = selector.to_query()
    starting = []
    for r in rollouts:
        status = r.get("status") or {}
        if status.get("phase", PENDING) != PENDING or status.get("reason") == Reason.QUEUED:
            continue
        try:
            if parse_selector((r.get("spec") or {}).get("selector")).to_query() == query:
                starting.append(r)
        except SpecError:
            continue
    return min(starting, key=order) if starting else None


def _rollout_labels(rollout: dict[str, Any] | None, pods: list[FleetPod]) -> frozenset[str]:
    """The pods whose label and annotation `rollout` (the active one, or None) writes: not ours."""
    if rollout is None:
        return frozenset()
    status = rollout.get("status") or {}
    recorded = [p.get("name") for p in status.get("pods") or [] if isinstance(p, dict)]
    return rollout_labels(status.get("phase") or PENDING, recorded, pods)


async def reconcile_fleet(runtime: Runtime, body: dict[str, Any]) -> FleetResult:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    old_status = body.get("status") or {}
    try:
        spec = parse_fleet_spec(body.get("spec") or {})
    except SpecError as e:
        return await _write(runtime, body, {**old_status, "conditions": _conditions(
            old_status, False, Reason.INVALID_SPEC, f"invalid spec: {e}", meta)},
            [(Reason.INVALID_SPEC, f"invalid spec: {e}", "Warning")])
    workloads = podsmod.Workloads(runtime.kube, namespace, runtime.settings.admin_port)
    # from the operator's watch of the namespace (graft.operator.podcache): no list per tick
    raw = await workloads.engines(await runtime.pod_cache.pods(namespace, spec.selector))
    strangers = [(Reason.NOT_AN_ENGINE, f"pod {pod} is left alone (no label, no admin call): {why}", "Warning")
                 for pod, why in sorted(workloads.refused.items())
                 if runtime.report_once(f"PatchFleet {namespace}/{name}", workloads.uid(pod))]
    stand_down = await _overlapped(runtime.kube, namespace, body, raw, runtime.pod_cache)
    if stand_down is not None:
        before = next((c for c in old_status.get("conditions") or [] if c.get("type") == "Converged"), {})
        events = strangers + ([] if before.get("reason") == Reason.FLEET_OVERLAP and before.get("message") == stand_down
                              else [(Reason.FLEET_OVERLAP, stand_down, "Warning")])
        return await _write(runtime, body, {**old_status, "activeRollout": None, "conditions": _conditions(
            old_status, False, Reason.FLEET_OVERLAP, stand_down, meta)}, events)
    try:
        admin = await runtime.admin()
    except TokenError as e:
        return await _write(runtime, body, {**old_status, "conditions": _conditions(
            old_status, False, e.problem.reason, e.problem.message, meta)}, strangers)
    # engines are asked only where the operator's knowledge is missing or stale (graft.operator.revisions)
    runtime.revisions.prune()
    limit = asyncio.Semaphore(runtime.settings.fleet_admin_concurrency)
    seen = [_observe(workloads, p, runtime.revisions, runtime.pod_cache) for p in raw]
    # only the engines the book does not know are asked (a task each): at rest, a few a tick
    await asyncio.gather(*(_ask(fp, admin, *question, runtime.revisions, limit) for fp, question in seen if question))
    fleet_pods = [fp for fp, _ in seen]
    # The rollout and the fleet's patches are read only now, after the engines: a rollout stores its
    # status (active, on this fleet) before it touches a pod, and records a promotion here before it
    # stores Promoted, so an engine seen running a rollout's patch is never taken for drift and reverted.
    rollout = await active_rollout(runtime.kube, namespace, name, spec.selector)
    rollout_patch = ((rollout.get("spec") or {}).get("patch") or {}).get("name") if rollout else None
    spec = await _reread(runtime, namespace, name, spec)
    plan = converge(spec.patches, list(fleet_pods), rollout_patch=rollout_patch,
                    rollout_pods=_rollout_labels(rollout, fleet_pods))
    plan.actions += _renewed_gates([p for p in raw if runtime.pod_cache.derived(p, _facts).outlived], fleet_pods,
                                   plan.converged)
    executor = PodExecutor(runtime, namespace, workloads, {p["metadata"]["name"]: p for p in raw})
    errors: dict[str, str] = {}
    failed: list[str] = []
    # labels and annotations first, then the engines, then the gates
    for kind in (LabelPod, ApplyPatch | RevertPatch, SetPatched):
        for outcome in await executor.run_all(a for a in plan.actions if isinstance(a, kind)):
            if not outcome.ok:
                errors.setdefault(outcome.pod, outcome.message)
            if outcome.problem is not None and outcome.problem.reason == Reason.ACTION_FAILED:
                failed.append(outcome.message)
    # a pod an action failed on is not converged, whatever it runs: its reason shows in the status
    pending = [{"name": n, "reason": errors.get(n, plan.pending.get(n))}
               for n in sorted(set(plan.pending) | set(errors))]
    revision = desired_revision(spec.patches)
    converged = len([n for n in plan.converged if n not in errors])
    ok = not pending
    message = (f"all {len(raw)} pods run {revision}" if ok else
               f"{converged} of {len(raw)} pods run {revision}; pending: "
               + ", ".join(f"{p['name']} ({p['reason']})" for p in pending))
    status = {"revision": revision, "observedGeneration": meta.get("generation", 0), "pods": len(raw),
              "converged": converged, "pending": pending,
              "activeRollout": rollout["metadata"]["name"] if rollout else None,
              "conditions": _conditions(old_status, ok, Reason.CONVERGED if ok else Reason.CONVERGING, message, meta)}
    events = strangers
    reported = {p.get("reason") for p in old_status.get("pending") or []}
    events += [(Reason.ACTION_FAILED, message, "Warning") for message in failed if message not in reported]
    if (old_status.get("converged"), old_status.get("pods"), old_status.get("revision")) != (converged, len(raw), revision):
        events.append((Reason.FLEET_CONVERGED if ok else Reason.FLEET_CONVERGING, message, "Normal"))
    return await _write(runtime, body, status, events)


async def _overlapped(kube: Kube, namespace: str, body: dict[str, Any], raw: list[dict[str, Any]],
                      cache: PodCache | None) -> str | None:
    """Why this fleet must act on no pod (an older fleet selects some of its pods), or None."""
    meta = body["metadata"]
    me = (meta.get("creationTimestamp") or "", meta["name"])
    # only an older fleet makes this one stand down: with none, every pod of the namespace need not
    # be listed and vetted on every tick (the oldest fleet, and a namespace's only one, never is)
    bodies = await kube.list(fleet_path(namespace))
    if not any(((f["metadata"].get("creationTimestamp") or ""), f["metadata"]["name"]) < me
               for f in bodies if f["metadata"]["name"] != meta["name"]):
        return None
    mine = frozenset(p["metadata"]["name"] for p in raw)
    fleets, _ = await _fleets(kube, namespace, bodies, cache)
    older = sorted((f for f in fleets if f.name != meta["name"] and f.pods & mine and f.age < me), key=lambda f: f.age)
    if not older:
        return None
    other = older[0]
    return (f"acts on no pod: the older PatchFleet {other.name} ({other.selector.to_query()}) also selects "
            f"{_names(other.pods & mine)}, and two fleets over one pod would revert each other's patches; "
            "make the selectors pick apart")


async def _reread(runtime: Runtime, namespace: str, name: str, spec: FleetSpec) -> FleetSpec:
    """The fleet's spec as stored now (`spec`, read before, if it is gone or no longer valid)."""
    body = await runtime.kube.get(fleet_path(namespace, name))
    try:
        return parse_fleet_spec((body or {}).get("spec") or {}) if body is not None else spec
    except SpecError:
        return spec


@dataclass(frozen=True, slots=True)
class _Facts:
    """What a fleet tick reads of one version of a pod (worked out once per version: `PodCache.derived`)."""
    obs: PodObservation
    running: bool
    patched: bool | None
    outlived: bool


def _facts(pod: dict[str, Any]) -> _Facts:
    return _Facts(podsmod.observe_pod(pod), _containers_running(pod), _patched(pod), _gate_outlived(pod))


def _observe(workloads: podsmod.Workloads, pod: dict[str, Any], book: RevisionBook,
             cache: PodCache) -> tuple[FleetPod, tuple[tuple[str, int], Container] | None]:
    """The pod as the fleet sees it, what its engine runs filled in from `book` when known; and
    the question to ask its engine (its address and container) when not, else None."""
    facts = cache.derived(pod, _facts)
    obs = facts.obs
    fp = FleetPod(obs.name, running=facts.running, ready=obs.ready, track=obs.track,
                  patches=obs.patches, patched=facts.patched)
    if not fp.running:
        return fp, None
    try:
        address = workloads.address(pod)
    except podsmod.AddressError as e:
        fp.error = str(e)
        return fp, None
    if address is None:
        fp.error = "no pod IP yet"
        return fp, None
    container = Container.of(obs)
    known = book.known(address, container)
    if known is None:
        return fp, (address, container)
    _runs(fp, known)
    return fp, None


async def _ask(fp: FleetPod, admin, address: tuple[str, int], container: Container, book: RevisionBook,
               limit: asyncio.Semaphore) -> None:
    try:
        _runs(fp, await engine_answer(book, admin, address, container, limit))
    except AdminError as e:
        fp.error = str(e)


def _runs(fp: FleetPod, answer) -> None:
    fp.revision, fp.awaiting, fp.configs, fp.digests = answer.revision, answer.awaiting, answer.configs, answer.digests


def _conditions(old: dict[str, Any], ok: bool, reason: str, message: str, meta: dict[str, Any]) -> list[dict]:
    import time
    before = next((c for c in old.get("conditions") or [] if c.get("type") == "Converged"), None)
    status = "True" if ok else "False"
    changed = before is None or before.get("status") != status
    return [{"type": "Converged", "status": status, "reason": reason, "message": message,
             "lastTransitionTime": to_time(time.time()) if changed else before.get("lastTransitionTime"),
             "observedGeneration": meta.get("generation", 0)}]


async def _write(runtime: Runtime, body: dict[str, Any], status: dict[str, Any], events) -> FleetResult:
    meta = body["metadata"]
    # a merge patch removes the keys it sets to null: compare with what is stored, or every tick
    # would write a status that only looks changed (activeRollout: null with no rollout)
    if {k: v for k, v in status.items() if v is not None} != (body.get("status") or {}):
        await runtime.kube.merge_patch(fleet_path(meta["namespace"], meta["name"]) + "/status", {"status": status})
    return FleetResult(status, events)


# the rollout side
def fleet_name_for(selector: LabelSelector) -> str:
    """A readable name for a new fleet: the selector's app label, else a hash of the selector."""
    labels = selector.match_labels
    for key in ("app.kubernetes.io/name", "app"):
        value = labels.get(key, "")
        if value and len(value) <= 63 and value[0].isalnum():
            return value.lower()
    return "fleet-" + hashlib.sha256(selector.to_query().encode()).hexdigest()[:10]


async def find_fleet(kube: Kube, namespace: str, selector: LabelSelector, cache: PodCache | None = None) -> str | None:
    """The fleet of the pods `selector` picks, if one exists: the fleet with the same selector, else
    the one selecting exactly the same pods. FleetOverlap when any other fleet selects some of them.
    Pods come from `cache` (the operator's) when given, else are listed."""
    fleets, pods = await _fleets(kube, namespace, cache=cache)
    return _fleet_of(selector, fleets, _selected(selector, pods))


def _fleet_of(selector: LabelSelector, fleets: list[_Fleet], mine: frozenset[str]) -> str | None:
    query = selector.to_query()
    ours = next((f for f in fleets if f.selector.to_query() == query), None)
    if ours is None and mine:
        ours = min((f for f in fleets if f.pods == mine), key=lambda f: f.age, default=None)
    clash = sorted((f for f in fleets if f is not ours and f.pods & mine), key=lambda f: f.age)
    if clash:
        other = clash[0]
        raise FleetOverlap(
            f"PatchFleet {other.name} ({other.selector.to_query()}) also selects {_names(other.pods & mine)}, "
            f"which the selector {query} picks" + (f" for PatchFleet {ours.name}" if ours else "")
            + "; two fleets over one pod would revert each other's patches: make the selectors pick apart "
              "(or the same pods)")
    return ours.name if ours else None


async def find_or_create_fleet(kube: Kube, namespace: str, selector: LabelSelector, stable_revision: str,
                               cache: PodCache | None = None) -> str:
    """The fleet whose selector is `selector`; created, adopting what its pods run, when none is."""
    found = await find_fleet(kube, namespace, selector, cache)
    if found is not None:
        return found
    query = selector.to_query()
    name = fleet_name_for(selector)
    taken = await kube.get(fleet_path(namespace, name))
    if taken is not None:
        if _selects(taken, query):
            return name      # another rollout on this selector created it since we looked
        name = "fleet-" + hashlib.sha256(query.encode()).hexdigest()[:10]
    spec: dict[str, Any] = {"selector": _selector_dict(selector),
                            "patches": [patch_to_dict(p) for p in adopt(stable_revision)]}
    try:
        created = await kube.create(fleet_path(namespace), {
            "apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec})
    except KubeError as e:
        # another rollout on this selector created it since we looked (two starting or ending at once)
        found = await find_fleet(kube, namespace, selector, cache) if e.status == 409 else None
        if found is None:
            raise
        return found
    # two rollouts over overlapping pods, starting in the same moment, may each have created one:
    # the younger fleet goes again, and its rollout holds as if it had seen the other in time
    fleets, pods = await _fleets(kube, namespace, cache=cache)
    mine = next((f for f in fleets if f.name == name), None)
    older = [f for f in fleets if mine is not None and f.name != name and f.pods & mine.pods and f.age < mine.age]
    if older:
        uid = (created.get("metadata") or {}).get("uid")
        try:
            await kube.delete(fleet_path(namespace, name), preconditions={"uid": uid} if uid else None)
        except KubeError:
            pass
        raise FleetOverlap(f"PatchFleet {older[0].name} ({older[0].selector.to_query()}) also selects "
                           f"{_names(older[0].pods & mine.pods)}, which the selector {query} picks")
    return name


def _selects(fleet: dict[str, Any], query: str) -> bool:
    try:
        return parse_fleet_spec(fleet.get("spec") or {}).selector.to_query() == query
    except SpecError:
        return False


def _selector_dict(selector: LabelSelector) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if selector.match_labels:
        out["matchLabels"] = dict(selector.match_labels)
    if selector.match_expressions:
        out["matchExpressions"] = [{"key": k, "operator": op, **({"values": list(v)} if v else {})}
                                   for k, op, v in selector.match_expressions]
    return out


def _gated(pod: dict[str, Any]) -> bool:
    """Whether the pod declares the readiness gate the fleet controller opens."""
    gates = (pod.get("spec") or {}).get("readinessGates") or []
    return any(g.get("conditionType") == PATCHED_CONDITION for g in gates)


async def create_for_gated_pods(runtime: Runtime, namespace: str, selector: LabelSelector,
                                pods: list[dict[str, Any]], workloads: podsmod.Workloads) -> str | None:
    """The fleet of pods that wait, behind the readiness gate graft.dev/patched, for a fleet that
    does not exist yet; created, adopting what their engines run, when they all run the same.

    Without it a rollout over such pods would wait for Ready pods forever: only the fleet
    controller opens the gate, and a rollout creates its fleet only once it has started.
    `pods` are engine pods `workloads` vetted.
    """
    running = [p for p in pods if _gated(p) and _containers_running(p)]
    if not running or any(podsmod.is_ready(p) for p in pods):
        return None
    found = await find_fleet(runtime.kube, namespace, selector, runtime.pod_cache)
    if found is not None:
        return found
    addresses = [workloads.address(p) for p in running]
    try:
        admin = await runtime.admin()
        revisions = {await admin.revision(*address) for address in addresses if address is not None}
    except (TokenError, AdminError):
        return None          # an engine not answering yet: the next tick asks again
    if len(revisions) != 1:
        return None          # adopting one of several revisions would revert the others
    return await find_or_create_fleet(runtime.kube, namespace, selector, revisions.pop(), runtime.pod_cache)


async def record_promotion(kube: Kube, namespace: str, fleet: str, patch: PatchSpec, *, revert: bool = False) -> None:
    """Write a promoted patch into the fleet (replacing another version of it), or, for a promoted
    revert, take it out."""
    body = await kube.get(fleet_path(namespace, fleet))
    if body is None:
        return
    current = parse_fleet_spec(body.get("spec") or {})
    patches = without(current.patches, patch.name) if revert else with_promoted(current.patches, patch)
    await kube.merge_patch(fleet_path(namespace, fleet), {"spec": {"patches": [patch_to_dict(p) for p in patches]}})


__all__ = ["reconcile_fleet", "find_or_create_fleet", "create_for_gated_pods", "record_promotion", "active_rollout",
           "FleetSpec", "PENDING"]
