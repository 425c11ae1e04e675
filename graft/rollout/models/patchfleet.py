"""PatchFleet: the durable patch state of a set of engine pods. Promotions write it; the operator
converges every matching pod to it, continuously (new pods, restarted containers, pods missed by a
rollout)."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from graft.rollout.models.base import Column, Kind, Says, StatusModel, described, refuse
from graft.rollout.models.common import CONDITIONS_LIST, LIST_MAP_NAME, Condition, LabelSelector, Patch
from graft.rollout.models.base import ApiModel

DEFAULT_REVISION_HISTORY_LIMIT = 10   # finished PatchRollouts a PatchFleet keeps
MAX_PATCHES = 32


class FleetSelector(LabelSelector):
    """The engine pods of the fleet (as their Deployment's selector)."""


class PatchFleetSpec(ApiModel):
    """The pods the fleet covers and the patches they all run (its stable revision)."""

    selector: FleetSelector = described(FleetSelector.__doc__)
    patches: Annotated[list[Patch], Field(max_length=MAX_PATCHES, json_schema_extra=LIST_MAP_NAME),
                       Says.of(too_long=f"must be a list of at most {MAX_PATCHES} patches",
                               list_type=f"must be a list of at most {MAX_PATCHES} patches")] | None = described(
        "The fleet's stable revision: the patches every pod runs. Written by promotions (a new version replaces the "
        "old) and by revert rollouts.", default=None)
    revision_history_limit: Annotated[int, Field(ge=0)] = described(
        "How many finished PatchRollouts (Promoted, RolledBack, Failed) of this fleet to keep; the oldest finished "
        "ones beyond it are deleted. The rollouts that promoted the patches the fleet runs now are kept first. "
        "Active rollouts are never deleted. 0: none kept.", default=DEFAULT_REVISION_HISTORY_LIMIT)

    def rules(self) -> None:
        # a list-map key: the API server refuses a name twice (x-kubernetes-list-type: map)
        seen: set[str] = set()
        for i, patch in enumerate(self.patches or ()):
            if patch.name in seen:
                raise refuse(f"duplicate patch {patch.name!r}: a fleet runs one version of each",
                             at=f"patches[{i}].name")
            seen.add(patch.name)


class PendingPod(StatusModel):
    """A pod that does not run the fleet's revision yet."""

    name: str | None = described("The pod's name.", default=None)
    reason: str | None = described("Why it is not there yet.", default=None)


class PatchFleetStatus(StatusModel):
    """How far the fleet's pods are from its revision."""

    revision: str | None = described("The revision spec.patches spells (sorted name@version, or base).", default=None)
    observed_generation: int | None = described("The spec's generation the status was written from.", default=None)
    pods: int | None = described("Pods the selector matches.", default=None)
    converged: int | None = described("Pods whose engine runs the fleet's revision.", default=None)
    pending: list[PendingPod] | None = described("Pods not there yet, each with why.", default=None)
    active_rollout: str | None = described("The PatchRollout acting on this fleet now, if any.", default=None)
    conditions: Annotated[list[Condition], Field(json_schema_extra=CONDITIONS_LIST)] | None = described(
        "Converged, as the Kubernetes API conventions spell conditions.", default=None)


KIND = Kind(
    kind="PatchFleet", plural="patchfleets", short_names=("pfl",),
    description="The durable patch state of a set of engine pods: the patches every pod the selector picks runs "
                "outside a rollout's canaries. A promotion records its patch here; the operator converges every "
                "matching pod to it, whatever the phase of any rollout.",
    spec=PatchFleetSpec, spec_description=PatchFleetSpec.__doc__,
    status=PatchFleetStatus, status_description=PatchFleetStatus.__doc__,
    columns=(Column("Revision", "string", ".status.revision"), Column("Pods", "integer", ".status.pods"),
             Column("Converged", "integer", ".status.converged"),
             Column("Rollout", "string", ".status.activeRollout"),
             Column("Age", "date", ".metadata.creationTimestamp")))
