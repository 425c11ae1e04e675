"""What Graft does to one pod: the actions both the rollout (`graft.rollout.machine`) and the fleet
(`graft.rollout.fleet`) decide, and one executor (`graft.operator.executor`) carries out.

An engine's patches change through its admin API (`ApplyPatch`, `RevertPatch`); Kubernetes holds
the pod's `graft.dev/track` label and `graft.dev/patches` annotation (`LabelPod`) and its readiness
gate condition `graft.dev/patched` (`SetPatched`). Who may write the label and annotation of a pod,
and when, is `graft.rollout.fleet.rollout_labels`: one writer at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

from graft.api import patches_of
from graft.rollout.spec import PatchSpec


@dataclass(slots=True, frozen=True)
class ApplyPatch:
    """POST the patch to the pod's engine. `replace`: a version of it is applied there, which the
    engine swaps out in the same step (without it the engine refuses: 409)."""
    pod: str
    patch: PatchSpec
    replace: bool = False


@dataclass(slots=True, frozen=True)
class RevertPatch:
    """DELETE the patch named `name` from the pod's engine (one not applied counts as reverted)."""
    pod: str
    name: str


@dataclass(slots=True, frozen=True)
class LabelPod:
    """Set the pod's label graft.dev/track and its annotation graft.dev/patches (what a restarted
    engine applies at start-up, through GRAFT_PATCHES)."""
    pod: str
    track: str
    revision: str


@dataclass(slots=True, frozen=True)
class SetPatched:
    """Set the pod's readiness-gate condition graft.dev/patched."""
    pod: str
    value: bool
    message: str = ""


PodAction = ApplyPatch | RevertPatch | LabelPod | SetPatched


def apply_patch(pod: str, patch: PatchSpec, running: str | None) -> ApplyPatch:
    """Apply `patch` on a pod whose engine runs `running` (None: not known): any version of it
    applied there (another one, or the same under another config or code) is replaced in one swap,
    never removed first, so the pod serves neither version for no moment."""
    names = {ref.partition("@")[0] for ref in patches_of(running or "")}
    return ApplyPatch(pod, patch, replace=patch.name in names)


def describe(action: PodAction) -> str:
    """The action in words, for a message about it."""
    match action:
        case ApplyPatch(pod, patch, replace):
            return f"{'replacing with' if replace else 'applying'} {patch.ref} on pod {pod}"
        case RevertPatch(pod, name):
            return f"reverting {name} on pod {pod}"
        case LabelPod(pod, track, revision):
            return f"labelling pod {pod} {track} ({revision})"
        case SetPatched(pod, value, _):
            return f"setting graft.dev/patched={value} on pod {pod}"
    return repr(action)
