"""PatchAnalysisTemplate and ClusterPatchAnalysisTemplate: breakers and gates kept once and referenced
by name from PatchRollouts (spec.analysis.templates), so each new patch version does not copy the list."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from graft.rollout.models.base import ApiModel, Column, Kind, Says, described
from graft.rollout.models.common import LIST_MAP_NAME, BreakerList, GateList, TemplateArg


class AnalysisTemplateSpec(ApiModel):
    """The template's checks and the placeholders its queries use."""

    args: Annotated[list[TemplateArg], Field(max_length=32, json_schema_extra=LIST_MAP_NAME),
                    Says.of(too_long="must be a list of at most 32 arguments")] | None = described(
        "Placeholders its queries use as {{args.NAME}}, with optional default values; a rollout gives the rest.",
        default=None)
    breakers: BreakerList | None = described(
        "Absolute limits that roll back (as a PatchRollout's spec.analysis.breakers).", default=None)
    gates: GateList | None = described(
        "Criteria a step must meet to advance (as a PatchRollout's spec.analysis.gates).", default=None)


_AGE = (Column("Age", "date", ".metadata.creationTimestamp"),)
KIND = Kind(
    kind="PatchAnalysisTemplate", plural="patchanalysistemplates", short_names=("pat",),
    description="Reusable analysis: breakers and gates that PatchRollouts reference by name in this namespace.",
    spec=AnalysisTemplateSpec, spec_description=AnalysisTemplateSpec.__doc__, columns=_AGE)
CLUSTER_KIND = Kind(
    kind="ClusterPatchAnalysisTemplate", plural="clusterpatchanalysistemplates", short_names=("cpat",),
    description="Reusable analysis: breakers and gates that PatchRollouts reference by name from any namespace. "
                "Its queries, the cluster administrator's, may read any namespace.",
    spec=AnalysisTemplateSpec, spec_description=AnalysisTemplateSpec.__doc__, namespaced=False, columns=_AGE)
