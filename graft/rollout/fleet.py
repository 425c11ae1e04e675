"""A fleet's durable patch state: what every engine pod of a fleet runs outside a rollout's canaries.

A `PatchFleet` records, for one set of engine pods (its selector), the patches they run: the fleet's
stable revision. A promotion writes it; the fleet controller converges every matching pod to it,
continuously and whatever happens to the pods (scale-up, eviction, a restarted container, a pod that
was not Ready while a rollout acted):

1. the pod's `graft.dev/patches` annotation and `graft.dev/track: stable` label are made right first,
   so a container that restarts comes back with the fleet's patches (through `GRAFT_PATCHES`);
2. then its engine, one admin call per pod per tick: a missing patch is applied (another version of
   the same patch is replaced), a patch the fleet does not hold is reverted;
3. once the engine answers with the fleet's revision, the pod's readiness gate condition
   `graft.dev/patched` is set True: with the gate declared, the pod takes no traffic before then.

A restarted engine whose `GRAFT_PATCHES` names a bundle's patch waits for it, not ready (the engine
keeps no code it was sent; its `awaiting` entries): the fleet's version of it is applied again,
and any other awaited entry (a canary's patch from a rollout, which the pod rejoins without) is
reverted, which lets the engine in without it. Nothing else would: the rollout acts on Ready pods
only, and such an engine never turns ready by itself.

While a rollout is active on the fleet, the patch it rolls out belongs to it: the fleet controller
neither applies nor reverts that patch (by name) on any pod; everything else still converges. A
pod's label and annotation have one writer at a time (`rollout_labels`): the rollout's for the pods
it acts on, the fleet's for every other pod. `converge` is pure: the operator observes, calls it,
and carries out the actions (`graft.rollout.actions`, the rollout's own vocabulary too).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from collections.abc import Collection, Iterable

from graft.api import ACTIVE_PHASES, Phase, config_digest, patch_ref, patches_of, revision_of
from graft.rollout.actions import ApplyPatch, LabelPod, RevertPatch, SetPatched, apply_patch
from graft.rollout.spec import PatchSpec

PATCHED_CONDITION = "graft.dev/patched"
STABLE = "stable"


FleetAction = ApplyPatch | RevertPatch | LabelPod | SetPatched


@dataclass(slots=True)
class FleetPod:
    """One matching pod: what Kubernetes says and what its engine answered (None: not known)."""

    name: str
    running: bool = True                 # the engine container is up (Ready or held by the gate)
    ready: bool = True                   # the pod's Ready condition
    track: str | None = None
    patches: str | None = None           # annotation graft.dev/patches
    patched: bool | None = None          # condition graft.dev/patched
    revision: str | None = None
    error: str | None = None
    awaiting: tuple[str, ...] = ()       # start-up entries from a bundle the engine waits for (not ready)
    configs: dict[str, str] = field(default_factory=dict)   # applied patch name -> its config digest
    digests: dict[str, str] = field(default_factory=dict)   # applied patch name -> its code digest


@dataclass(slots=True)
class FleetPlan:
    actions: list[FleetAction] = field(default_factory=list)
    converged: list[str] = field(default_factory=list)
    pending: dict[str, str] = field(default_factory=dict)   # pod -> why it is not there yet


def desired_revision(patches: list[PatchSpec] | tuple[PatchSpec, ...]) -> str:
    return revision_of(p.ref for p in patches)


def rollout_labels(phase: str, recorded: Iterable[str], pods: Iterable[FleetPod]) -> frozenset[str]:
    """The pods whose label graft.dev/track and annotation graft.dev/patches an active rollout writes,
    and the fleet controller leaves alone; the fleet controller writes those of every other pod.

    While the rollout runs (Progressing, Paused, RollingBack) it writes those of every pod it records
    (`recorded`, its status.pods), Ready or not: its canaries keep the canary label while they
    restart, and nothing relabels them back and forth. While it starts (Pending, on the fleet's
    selector) it writes those of the Ready pods, which it labels in the very tick it starts, before
    its status records them. A pod it does not record (one that arrived since) stays the fleet's
    until it does, and a finished rollout writes none."""
    if phase in ACTIVE_PHASES:
        return frozenset(recorded)
    if phase == Phase.PENDING:
        return frozenset(p.name for p in pods if p.ready)
    return frozenset()


def converge(patches: list[PatchSpec] | tuple[PatchSpec, ...], pods: list[FleetPod], *,
             rollout_patch: str | None = None, rollout_pods: Collection[str] = ()) -> FleetPlan:
    """The actions that bring every pod to the fleet's patches.

    `rollout_patch`: the name of the patch an active rollout on this fleet owns (left alone), or None.
    `rollout_pods`: the pods whose label and annotation that rollout writes (`rollout_labels`).
    """
    plan = FleetPlan()
    wanted = {p.name: p for p in patches if p.name != rollout_patch}
    target = desired_revision(patches)
    for pod in sorted(pods, key=lambda p: p.name):
        if pod.name not in rollout_pods:
            # the annotation first: a restart must bring back the right code, whatever happens next
            annotation = _with_rollout_patch(target, pod.revision, rollout_patch)
            if pod.patches != annotation or pod.track != STABLE:
                plan.actions.append(LabelPod(pod.name, STABLE, annotation))
        if not pod.running:
            plan.pending[pod.name] = "not running"
            continue
        if pod.revision is None:
            plan.pending[pod.name] = pod.error or "the engine did not answer"
            continue
        step = _next_step(wanted, pod, rollout_patch) or _awaited(patches, pod)
        if step is not None:
            plan.actions.append(step)
            plan.pending[pod.name] = (f"applying {step.patch.ref}" if isinstance(step, ApplyPatch)
                                      else f"reverting {step.name}")
            if pod.patched:
                plan.actions.append(SetPatched(pod.name, False, f"converging to {target}"))
            continue
        plan.converged.append(pod.name)
        if pod.patched is not True:
            plan.actions.append(SetPatched(pod.name, True, f"runs {pod.revision}"))
    return plan


def _next_step(wanted: dict[str, PatchSpec], pod: FleetPod, rollout_patch: str | None) -> FleetAction | None:
    running = {ref.partition("@")[0]: ref for ref in patches_of(pod.revision or "")}
    for name, patch in sorted(wanted.items()):
        if running.get(name) != patch.ref:
            return apply_patch(pod.name, patch, pod.revision)
        # the right version with another config (a restart brought a built-in back with its defaults:
        # GRAFT_PATCHES names versions only): swapped for the fleet's config
        if pod.configs.get(name, config_digest(patch.config)) != config_digest(patch.config):
            return apply_patch(pod.name, patch, pod.revision)
        # the right version from other code (a bundle re-packed under the same version): the fleet's
        pinned = patch.source.digest
        if pinned and pod.digests.get(name, pinned).lower() != pinned.lower():
            return apply_patch(pod.name, patch, pod.revision)
    for name in sorted(running):
        if name not in wanted and name != rollout_patch:
            return RevertPatch(pod.name, name)
    return None


def _awaited(patches: list[PatchSpec] | tuple[PatchSpec, ...], pod: FleetPod) -> FleetAction | None:
    """What a not-ready engine waiting for start-up bundle entries needs: the fleet's version
    applied again, or the entry reverted (the engine then stops waiting for it)."""
    if pod.ready:
        return None
    fleet = {p.ref: p for p in patches}
    for ref in pod.awaiting:
        if ref in patches_of(pod.revision or ""):
            continue
        if ref in fleet:
            return apply_patch(pod.name, fleet[ref], pod.revision)
        return RevertPatch(pod.name, ref.partition("@")[0])
    return None


def _with_rollout_patch(target: str, revision: str | None, rollout_patch: str | None) -> str:
    """The annotation for a pod outside the rollout's hands: the fleet's patches, plus the rollout's
    patch as the engine runs it now (the rollout decides about that one)."""
    if rollout_patch is None or revision is None:
        return target
    keep = [ref for ref in patches_of(revision) if ref.partition("@")[0] == rollout_patch]
    others = [ref for ref in patches_of(target) if ref.partition("@")[0] != rollout_patch]
    return revision_of(others + keep)


def with_promoted(patches: list[PatchSpec] | tuple[PatchSpec, ...], patch: PatchSpec) -> list[PatchSpec]:
    """The fleet's patches once `patch` is promoted: it replaces any other version of itself."""
    return sorted([p for p in patches if p.name != patch.name] + [patch], key=lambda p: p.name)


def without(patches: list[PatchSpec] | tuple[PatchSpec, ...], name: str) -> list[PatchSpec]:
    """The fleet's patches once the patch `name` is undone."""
    return [p for p in patches if p.name != name]


def adopt(revision: str) -> list[PatchSpec]:
    """Patches for a new fleet from what its pods run already (built-in sources assumed), so creating
    a fleet never reverts a patch applied before it existed."""
    from graft.rollout.spec import PatchSource
    out = []
    for ref in patches_of(revision):
        name, _, version = ref.partition("@")
        out.append(PatchSpec(name, version, PatchSource(builtin=True)))
    return out


__all__ = ["FleetPod", "FleetPlan", "converge", "rollout_labels", "desired_revision", "with_promoted", "without",
           "adopt", "PATCHED_CONDITION", "patch_ref"]
