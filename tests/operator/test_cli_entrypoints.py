"""The installed commands as a person runs them: the `graft` console script's `rollout` verbs and the
kubectl plug-in `kubectl-graft` (directly, and through kubectl's plug-in lookup), each a process of
its own against the API server emulator."""
import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from graft.devcluster.kubeconfig import write_kubeconfig
from graft.operator.kube import rollout_path
from tests.devcluster.kubectl_cli import kubectl_binary

from operator_cluster import create, get_rollout, manifest

pytestmark = pytest.mark.timeout(60)
BIN = Path(sys.executable).parent
VERBS = ("list", "status", "pause", "resume", "promote", "abort", "retry", "undo", "history", "lint", "simulate")
ROOT = Path(__file__).resolve().parents[2]


def script(name: str) -> str:
    path = shutil.which(name, path=str(BIN))
    assert path, f"the console script {name} is not installed next to {sys.executable}"
    return path


def run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # a wide terminal so that rich does not wrap what the test looks for
    env = {**os.environ, "COLUMNS": "200", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, timeout=45, env=env)


@pytest.fixture
async def kubeconfig(cluster, namespace, prometheus, tmp_path):
    await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 50, "pause": "1h"}, {"weight": 100}]))
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align") + "/status", {"status": {
        "phase": "Progressing", "reason": "Progressing", "message": "step 1/2: weight 50%, 1 of 2 pods canary",
        "patch": "kv-align@3.2.1", "stepIndex": 0, "weight": 50, "stableRevision": "base",
        "canaryRevision": "kv-align@3.2.1"}})
    return cluster.kubeconfig or str(write_kubeconfig(tmp_path / "kubeconfig", cluster.url, namespace=namespace))


@pytest.mark.parametrize("argv", [["kubectl-graft", "--help"], ["graft", "rollout", "--help"]])
def test_help_names_every_verb(argv):
    out = run(script(argv[0]), *argv[1:])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: graft rollout")
    for verb in VERBS:
        assert verb in out.stdout, verb
    # the exit codes, the same for every verb
    assert "exit codes: 0 done; 1 refused or failed" in " ".join(out.stdout.split())
    assert "2 usage" in out.stdout


@pytest.mark.parametrize("name", ["kubectl-graft", "graft"])
def test_lint_checks_against_the_crds_through_either_command(name, tmp_path):
    """The installed commands hand lint the API server's reviewer: a field the CRD does not declare is
    refused as the API server refuses it (the operator's modules alone cannot import that reviewer)."""
    path = tmp_path / "r.yaml"
    path.write_text((ROOT / "examples" / "rollout-builtin.yaml").read_text().replace(
        "spec:\n", "spec:\n  colour: blue\n", 1))
    argv = [script(name), *(["rollout"] if name == "graft" else []), "lint", "-f", str(path)]
    out = run(*argv)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "spec.colour: unknown field (strict decoding error) (API server)" in out.stdout
    out = run(*argv[:-1], str(ROOT / "examples" / "rollout-builtin.yaml"))
    assert out.returncode == 0 and "kind: PatchRollout" in out.stdout, out.stdout + out.stderr
    assert "not checked against the CRDs' schemas" not in out.stdout


def test_a_verb_without_its_rollout_is_a_usage_error():
    out = run(script("kubectl-graft"), "pause")
    assert out.returncode == 2 and "the following arguments are required: name" in out.stderr


async def test_kubectl_graft_pauses_and_graft_rollout_resumes(cluster, namespace, kubeconfig):
    out = await asyncio.to_thread(run, script("kubectl-graft"), "pause", "kv-align", "-n", namespace,
                                  "--kubeconfig", kubeconfig)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"PatchRollout {namespace}/kv-align paused" in out.stdout
    assert (await get_rollout(cluster.kube, namespace, "kv-align"))["spec"]["paused"] is True
    out = await asyncio.to_thread(run, script("graft"), "rollout", "resume", "kv-align", "-n", namespace,
                                  "--kubeconfig", kubeconfig)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (await get_rollout(cluster.kube, namespace, "kv-align"))["spec"]["paused"] is False


async def test_status_through_kubectl_and_the_kubeconfig_namespace(cluster, namespace, kubeconfig):
    kubectl = kubectl_binary()      # fails, never skips, without kubectl: it is what users run
    # no -n: the namespace comes from the kubeconfig's context, as kubectl's own commands take it
    out = await asyncio.to_thread(run, kubectl, "graft", "status", "kv-align", "--kubeconfig", kubeconfig)
    assert out.returncode == 0, out.stdout + out.stderr
    for text in ("kv-align", "Progressing", "50%", "kv-align@3.2.1"):
        assert text in out.stdout, text


async def test_an_unknown_rollout_exits_1_with_the_reason(cluster, namespace, kubeconfig):
    out = await asyncio.to_thread(run, script("kubectl-graft"), "abort", "nope", "-n", namespace,
                                  "--kubeconfig", kubeconfig)
    assert out.returncode == 1
    assert f"PatchRollout {namespace}/nope not found" in out.stdout
    obj = await get_rollout(cluster.kube, namespace, "kv-align")
    assert "graft.dev/abort" not in (obj["metadata"].get("annotations") or {})


def test_without_kubectl_on_path_a_kubectl_test_fails_instead_of_skipping(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match="kubectl is not on PATH"):
        kubectl_binary()
