"""`kubectl explain` on every Graft kind, run for real against the API server emulator serving the
generated CRDs: the kind itself, its spec and status, and fields deep inside them say what the
models say (graft.rollout.models: one description per field, in one place)."""
from __future__ import annotations

from pathlib import Path

import pytest

from graft.rollout.models import analysistemplate, common, patchfleet, patchrollout

from .kubectl_cli import emulator_kubeconfig, run_kubectl

ROOT = Path(__file__).resolve().parents[2]


def words(model, field: str) -> str:
    return " ".join(model.model_fields[field].description.split())


# (what kubectl is asked, the type it shows, the words the models give it)
CASES = [
    ("patchrollouts", "PatchRollout", patchrollout.KIND.description),
    ("patchrollouts.spec", "<Object>", patchrollout.KIND.spec_description),
    ("patchrollouts.status", "<Object>", " ".join(patchrollout.KIND.status_description.split())),
    ("patchrollouts.spec.selector.matchExpressions.operator", "<string>",
     words(common.SelectorRequirement, "operator")),
    ("patchrollouts.spec.steps.untilApproved", "<boolean>", words(patchrollout.Step, "until_approved")),
    ("patchrollouts.spec.analysis.prometheus.caSecret.key", "<string>", words(patchrollout.SecretKeyRef, "key")),
    ("patchrollouts.spec.analysis.breakers.window", "<string>", words(common.Check, "window")),
    ("patchrollouts.spec.analysis.measurementRetention", "<integer>", words(patchrollout.Analysis,
                                                                             "measurement_retention")),
    ("patchrollouts.status.analysis.outageSince", "<string>", words(patchrollout.AnalysisStatus, "outage_since")),
    ("patchrollouts.status.analysisHistory.results.numbers", "<map[string]number>",
     words(patchrollout.CheckRecord, "numbers")),
    ("patchrollouts.status.stablePatch", "<string>", words(patchrollout.PatchRolloutStatus, "stable_patch")),
    ("patchfleets", "PatchFleet", patchfleet.KIND.description),
    ("patchfleets.spec.patches.source.digest", "<string>", words(common.PatchSource, "digest")),
    ("patchfleets.status.pending.reason", "<string>", words(patchfleet.PendingPod, "reason")),
    ("patchanalysistemplates", "PatchAnalysisTemplate", analysistemplate.KIND.description),
    ("patchanalysistemplates.spec.gates.consecutive", "<integer>", words(common.Check, "consecutive")),
    ("clusterpatchanalysistemplates", "ClusterPatchAnalysisTemplate", analysistemplate.CLUSTER_KIND.description),
    ("clusterpatchanalysistemplates.spec.args.value", "<string>", words(common.TemplateArg, "value")),
]


@pytest.fixture(scope="module")
def kubeconfig(tmp_path_factory) -> Path:
    with emulator_kubeconfig(tmp_path_factory.mktemp("explain"), ROOT / "crds") as config:
        yield config


@pytest.mark.parametrize("field, shown, text", CASES, ids=[c[0] for c in CASES])
def test_kubectl_explain_prints_the_models_description(kubeconfig, field, shown, text):
    explained = run_kubectl(kubeconfig, "explain", field)
    assert explained.returncode == 0, explained.stderr
    out = " ".join(explained.stdout.split())
    assert text and text in out, out
    assert shown in out, out


@pytest.mark.parametrize("resource, fields", [
    ("patchrollouts.status", ["analysisHistory", "awaitingApprovalSince", "stablePatch", "pauseConditions"]),
    ("patchrollouts.status.analysis", ["inconclusiveRuns", "errorRuns", "outageSince", "outageSeconds"]),
    ("patchfleets.status", ["activeRollout", "converged", "pending", "revision"]),
])
def test_kubectl_explain_lists_every_status_field(kubeconfig, resource, fields):
    explained = run_kubectl(kubeconfig, "explain", resource)
    assert explained.returncode == 0, explained.stderr
    listed = {line.split()[0] for line in explained.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert set(fields) <= listed, explained.stdout
