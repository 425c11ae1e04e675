"""What each of `graft rollout`'s steering verbs changes on a PatchRollout, given a client: one
implementation for the CLI (graft.operator.cli) and the dashboard (graft.dashboard).

Each verb changes one field and the operator does the rest: `pause` sets `spec.paused`, `resume`
clears it and sets the annotation `graft.dev/resume: "true"` (which also ends a pause the analysis
decided, kept in status.pauseConditions), `promote` sets `graft.dev/promote` (`step` or `full`),
`abort` sets `graft.dev/abort: "true"`, `retry` clears those annotations and the status of a
RolledBack or Failed rollout, and `undo` creates the rollout that takes a Promoted one's patch out
again (or applies a reverted one again), step by step.

`api` is a synchronous client with `get`, `create` and `merge_patch` (graft.operator.kube.SyncKube).
A verb answers `Done` (the sentence to show, and notes on what it could not check) or raises
ActionError with the reason: the rollout is missing, in a phase the verb does not apply to, or the
API server refused.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from graft.api import API_VERSION, FINAL_PHASES
from graft.operator.kube import KubeError, fleet_path, rollout_path, rollouts_path

UNDO_OF = "graft.dev/undo-of"   # on a rollout `graft rollout undo` created: the rollout it undoes


class ActionError(Exception):
    """The verb was refused or failed; the message says why."""


@dataclass
class Done:
    message: str
    notes: list[str] = field(default_factory=list)
    name: str = ""          # the rollout acted on (undo: the one it created)


def refusal(e: KubeError) -> str:
    return f"{e.status} {e.reason or 'refused'}: {e.message}" if e.message else f"{e.status} {e.reason}"


def read(api, namespace: str, name: str) -> dict[str, Any] | None:
    """The rollout, or None when there is none of that name."""
    try:
        return api.get(rollout_path(namespace, name))
    except KubeError as e:
        raise ActionError(f"cannot read PatchRollout {namespace}/{name}: {refusal(e)}") from None


def get(api, namespace: str, name: str) -> dict[str, Any]:
    obj = read(api, namespace, name)
    if obj is None:
        raise ActionError(f"PatchRollout {namespace}/{name} not found")
    return obj


def list_of(api, namespace: str | None, path: Callable[[str | None], str], what: str) -> list[dict[str, Any]]:
    """The objects at `path(namespace)` (None: every namespace); ActionError when refused or when the
    API server knows no such kind (its CRD is not installed)."""
    where = "" if namespace is None else f" in {namespace}"
    try:
        got = api.get(path(namespace))
    except KubeError as e:
        raise ActionError(f"cannot list {what}{where}: {refusal(e)}") from None
    if got is None:
        raise ActionError(f"cannot list {what}{where}: 404 NotFound (is its CRD installed?)")
    return got.get("items") or []


def _patch(api, namespace: str, name: str, body: dict[str, Any], subresource: str = "") -> dict[str, Any]:
    """A merge patch of the rollout (or of its `subresource`); ActionError when it is gone or refused."""
    get(api, namespace, name)
    what = f"the {subresource} of " if subresource else ""
    try:
        patched = api.merge_patch(rollout_path(namespace, name) + (f"/{subresource}" if subresource else ""), body)
    except KubeError as e:
        raise ActionError(f"cannot change {what}PatchRollout {namespace}/{name}: {refusal(e)}") from None
    if patched is None:
        raise ActionError(f"PatchRollout {namespace}/{name} not found")
    return patched


def _phase(obj: dict[str, Any]) -> str | None:
    return (obj.get("status") or {}).get("phase")


def ref(patch: dict[str, Any]) -> str:
    return f"{patch.get('name')}@{patch.get('version')}" if patch.get("name") else ""


def pause(api, namespace: str, name: str) -> Done:
    """Hold at the current step (spec.paused)."""
    _patch(api, namespace, name, {"spec": {"paused": True}})
    return Done(f"PatchRollout {namespace}/{name} paused", name=name)


def resume(api, namespace: str, name: str) -> Done:
    """Carry on from a pause, the user's (spec.paused) or the analysis' (status.pauseConditions)."""
    status = get(api, namespace, name).get("status") or {}
    _patch(api, namespace, name, {"spec": {"paused": False}, "metadata": {"annotations": {"graft.dev/resume": "true"}}})
    ended = ", ".join(str(c.get("reason")) for c in status.get("pauseConditions") or [])
    return Done(f"PatchRollout {namespace}/{name} resumed" + (f" (ends its {ended} pause)" if ended else ""), name=name)


def promote(api, namespace: str, name: str, full: bool = False) -> Done:
    """Skip the rest of the current step (approve a manual one), or with `full` every remaining step."""
    phase = _phase(get(api, namespace, name))
    if phase in FINAL_PHASES:
        raise ActionError(f"PatchRollout {namespace}/{name} is {phase}: nothing to promote")
    _patch(api, namespace, name, {"metadata": {"annotations": {"graft.dev/promote": "full" if full else "step"}}})
    return Done(f"PatchRollout {namespace}/{name}: "
                + ("full promotion requested" if full else "promotion of the current step requested"), name=name)


def abort(api, namespace: str, name: str) -> Done:
    """Roll back now."""
    phase = _phase(get(api, namespace, name))
    if phase in FINAL_PHASES:
        raise ActionError(f"PatchRollout {namespace}/{name} is {phase}: nothing to abort")
    _patch(api, namespace, name, {"metadata": {"annotations": {"graft.dev/abort": "true"}}})
    return Done(f"PatchRollout {namespace}/{name}: abort requested", name=name)


def retry(api, namespace: str, name: str) -> Done:
    """Start a RolledBack or Failed rollout again from its first step: its controls and status cleared."""
    phase = _phase(get(api, namespace, name))
    if phase not in ("RolledBack", "Failed"):
        raise ActionError(f"PatchRollout {namespace}/{name} is {phase or 'Pending'}: only a RolledBack or "
                          "Failed rollout can be retried")
    _patch(api, namespace, name, {"metadata": {"annotations": {"graft.dev/abort": None, "graft.dev/promote": None,
                                                               "graft.dev/resume": None}}})
    _patch(api, namespace, name, {"status": None}, subresource="status")
    return Done(f"PatchRollout {namespace}/{name}: retrying from its first step (was {phase})", name=name)


def undo(api, namespace: str, name: str) -> Done:
    """Create the rollout that undoes a Promoted one: its spec with the other action (apply <-> revert),
    not paused, named NAME-undo (NAME-undo-2, -3, ... when taken), annotated with the rollout it
    undoes. Refused: a rollout that is not Promoted (abort stops one in flight; one that rolled back
    left nothing to undo), an upgrade (a revert would leave the pods with neither version), a fleet
    that no longer runs what the rollout left (a later rollout changed it), and a rollout that an
    earlier undo is still undoing."""
    obj = get(api, namespace, name)
    where = f"PatchRollout {namespace}/{name}"
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    phase = status.get("phase") or "Pending"
    if phase != "Promoted":
        why = ("nothing of it stays on the pods" if phase in FINAL_PHASES
               else f"graft rollout abort {name} rolls it back")
        raise ActionError(f"{where} is {phase}: only a Promoted rollout can be undone ({why})")
    action = spec.get("action", "apply")
    patch = ref(spec.get("patch") or {})
    if action == "apply" and status.get("stablePatch"):
        raise ActionError(f"{where} replaced {status['stablePatch']} with {patch}: a revert would leave the pods "
                          f"with neither; roll {status['stablePatch']} out again with a PatchRollout of its own")
    notes = _fleet_still_runs(api, namespace, status.get("fleet"), patch, action, where)
    rollouts = list_of(api, namespace, rollouts_path, "PatchRollouts")
    busy = next((o for o in rollouts if (o["metadata"].get("annotations") or {}).get(UNDO_OF) == name
                 and _phase(o) not in FINAL_PHASES), None)
    if busy is not None:
        raise ActionError(f"{where} is being undone already by PatchRollout {namespace}/{busy['metadata']['name']} "
                          f"({_phase(busy) or 'Pending'})")
    other = "apply" if action == "revert" else "revert"
    body = {"apiVersion": API_VERSION, "kind": "PatchRollout",
            "metadata": {"annotations": {UNDO_OF: name}},
            "spec": {**{k: v for k, v in spec.items() if k not in ("paused", "action")}, "action": other}}
    taken = {o["metadata"]["name"] for o in rollouts}
    for new in _undo_names(name):
        if new in taken:
            continue
        body["metadata"]["name"] = new
        try:
            api.create(rollouts_path(namespace), body)
        except KubeError as e:
            if e.status == 409:        # created meanwhile: the next name
                continue
            raise ActionError(f"cannot create PatchRollout {namespace}/{new}: {refusal(e)}") from None
        return Done(f"PatchRollout {namespace}/{new} created: it {'reverts' if other == 'revert' else 'applies'}"
                    f" {patch} step by step, undoing {name}", notes, name=new)
    raise ActionError(f"no free name for the undo of {where}")


def _undo_names(name: str) -> Iterator[str]:
    yield f"{name}-undo"
    for i in range(2, 1000):
        yield f"{name}-undo-{i}"


def _fleet_still_runs(api, namespace: str, fleet: str | None, patch: str, action: str, where: str) -> list[str]:
    """Refuse when the rollout's PatchFleet runs something else now than what the rollout left: undoing
    it would take out (or put back) what a later rollout decided. A fleet that cannot be read is not
    checked (said so in the notes answered)."""
    if not fleet:
        return []
    try:
        obj = api.get(fleet_path(namespace, fleet))
    except KubeError as e:
        obj, why = None, refusal(e)
    else:
        why = "404 NotFound"
    if obj is None:
        return [f"PatchFleet {namespace}/{fleet} not checked ({why})"]
    running = {p.get("name"): ref(p) for p in (obj.get("spec") or {}).get("patches") or []}
    patch_name = patch.partition("@")[0]
    runs = f"PatchFleet {namespace}/{fleet} runs {running[patch_name]}" if patch_name in running else \
        f"PatchFleet {namespace}/{fleet} runs no version of {patch_name}"
    if action == "apply" and running.get(patch_name) != patch:
        raise ActionError(f"{runs} now, not the {patch} that {where} applied: a later rollout changed it, "
                          "undo that one")
    if action == "revert" and patch_name in running:
        raise ActionError(f"{runs} again since {where} reverted it: nothing to apply again")
    return []


# the verbs by name, as `graft rollout VERB` and the dashboard's buttons call them
VERBS: dict[str, Callable[..., Done]] = {"promote": promote, "pause": pause, "resume": resume, "abort": abort,
                                         "retry": retry, "undo": undo}
