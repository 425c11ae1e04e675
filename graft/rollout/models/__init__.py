"""Graft's Kubernetes API as typed models: one module per kind, `common` and `base` shared.

These models are the API's one definition: graft.rollout.crdgen writes crds/*.yaml from them, and
graft.rollout.spec validates manifests through them before what no schema can say.
"""
from graft.rollout.models import analysistemplate, patchfleet, patchrollout

# each CRD file and the kinds it holds, in order
FILES = {
    "patchrollout.yaml": (patchrollout.KIND,),
    "patchfleet.yaml": (patchfleet.KIND,),
    "patchanalysistemplate.yaml": (analysistemplate.KIND, analysistemplate.CLUSTER_KIND),
}
KINDS = tuple(k for kinds in FILES.values() for k in kinds)
