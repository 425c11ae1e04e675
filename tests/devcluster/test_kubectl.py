"""kubectl against the emulator as it would run against a cluster: apply with its default
validation, server-side tables, explain, and the API server's refusals as kubectl prints them."""

import queue
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from graft.rollout.spec import SELECTOR_MUST_NAME

from .kubectl_cli import emulator_kubeconfig, kubectl_binary, run_kubectl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rollout-builtin.yaml"


@pytest.fixture(scope="module")
def kubeconfig(tmp_path_factory) -> Path:
    with emulator_kubeconfig(tmp_path_factory.mktemp("kubectl"), ROOT / "crds") as config:
        yield config


def kubectl(config: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return run_kubectl(config, *args, stdin=stdin)


def example(name: str, **spec) -> str:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return yaml.safe_dump(doc)


def columns(output: str) -> list[list[str]]:
    return [line.split() for line in output.strip().splitlines()]


def test_kubectl_apply_validates_without_validate_false(kubeconfig):
    applied = kubectl(kubeconfig, "apply", "-f", str(EXAMPLE))
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.strip() == "patchrollout.graft.dev/kv-align-3-2-1 created"
    again = kubectl(kubeconfig, "apply", "-f", str(EXAMPLE))
    assert again.stdout.strip() == "patchrollout.graft.dev/kv-align-3-2-1 unchanged", again.stderr

    unknown = example("with-colour", colour="red")
    refused = kubectl(kubeconfig, "apply", "-f", "-", stdin=unknown)
    assert refused.returncode != 0
    assert 'strict decoding error: unknown field "spec.colour"' in refused.stderr
    assert kubectl(kubeconfig, "get", "prl", "with-colour", "-n", "llm").returncode != 0


def test_kubectl_shows_the_cel_rule_that_refused_a_manifest(kubeconfig):
    refused = kubectl(kubeconfig, "apply", "-f", "-", stdin=example("empty-selector", selector={"matchLabels": {}}))
    assert refused.returncode != 0
    assert ('The PatchRollout "empty-selector" is invalid: spec.selector: Invalid value: "object": '
            f"{SELECTOR_MUST_NAME}") in refused.stderr


def test_kubectl_get_prints_the_crd_printer_columns(kubeconfig):
    kubectl(kubeconfig, "apply", "-f", "-", stdin=example("columns"))
    status = '{"status": {"phase": "Progressing", "stepIndex": 0, "step": 1, "weight": 5, "canaryRevision": "kv-align@3.2.1"}}'
    patched = kubectl(kubeconfig, "patch", "prl", "columns", "-n", "llm", "--subresource=status", "--type=merge",
                      "-p", status)
    assert patched.returncode == 0, patched.stderr
    table = columns(kubectl(kubeconfig, "get", "prl", "columns", "-n", "llm").stdout)
    assert table[0] == ["NAME", "PHASE", "STEP", "WEIGHT", "CANARY", "STABLE", "AGE"]
    name, phase, step, weight, canary, age = table[1]  # STABLE is empty
    assert (name, phase, step, weight, canary) == ("columns", "Progressing", "1", "5", "kv-align@3.2.1")
    assert age.endswith("s") and age[:-1].isdigit()
    everywhere = columns(kubectl(kubeconfig, "get", "patchrollouts", "-A").stdout)
    assert everywhere[0][:3] == ["NAMESPACE", "NAME", "PHASE"] and ["llm", "columns"] in [r[:2] for r in everywhere]


def test_kubectl_get_prints_the_pod_columns(kubeconfig):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "engine-0", "namespace": "llm"},
           "spec": {"containers": [{"name": "engine", "image": "graft"}]}}
    assert kubectl(kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump(pod)).returncode == 0
    assert columns(kubectl(kubeconfig, "get", "pods", "-n", "llm").stdout)[1][:4] == ["engine-0", "0/1", "Pending", "0"]
    running = ('{"status": {"phase": "Running", "containerStatuses": [{"name": "engine", "ready": true, '
               '"restartCount": 2, "state": {"running": {}}}]}}')
    kubectl(kubeconfig, "patch", "pod", "engine-0", "-n", "llm", "--subresource=status", "--type=merge", "-p", running)
    table = columns(kubectl(kubeconfig, "get", "pods", "-n", "llm").stdout)
    assert table[0] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert table[1][:4] == ["engine-0", "1/1", "Running", "2"]


def test_kubectl_get_watch_prints_rows_as_they_change(kubeconfig):
    kubectl(kubeconfig, "apply", "-f", "-", stdin=example("watched"))
    watcher = subprocess.Popen(["timeout", "-k", "5", "20", kubectl_binary(), f"--kubeconfig={kubeconfig}",
                                f"--cache-dir={kubeconfig.parent / 'kubectl-cache'}", "get", "prl", "watched",
                                "-n", "llm", "-w"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.split()) for line in watcher.stdout], daemon=True).start()
    try:
        assert lines.get(timeout=15)[:2] == ["NAME", "PHASE"]
        assert lines.get(timeout=15)[0] == "watched"
        kubectl(kubeconfig, "patch", "prl", "watched", "-n", "llm", "--subresource=status", "--type=merge",
                "-p", '{"status": {"phase": "Paused"}}')
        assert lines.get(timeout=15)[:2] == ["watched", "Paused"]  # no second header
    finally:
        watcher.terminate()
        watcher.wait(10)


def test_kubectl_explain_prints_the_crd_field_descriptions(kubeconfig):
    explained = kubectl(kubeconfig, "explain", "patchrollouts.spec.steps")
    assert explained.returncode == 0, explained.stderr
    text = " ".join(explained.stdout.split())
    assert "KIND: PatchRollout" in text and "FIELD: steps <[]Object>" in text
    assert "Traffic steps; weights strictly increase and the last is 100." in text
    assert "weight <integer> -required-" in text
    pods = kubectl(kubeconfig, "explain", "pods.spec.containers.image")
    assert pods.returncode == 0 and "Container image name." in " ".join(pods.stdout.split())


def test_kubectl_applies_built_in_kinds_with_validation(kubeconfig):
    objects = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bundle", "namespace": "llm"},
                "data": {"patch.py": "x = 1"}},
               {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "llm-engine", "namespace": "llm"},
                "spec": {"selector": {"app": "llm-engine"}, "ports": [{"port": 8000}]}},
               {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "llm-engine", "namespace": "llm"},
                "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "llm-engine"}},
                         "template": {"metadata": {"labels": {"app": "llm-engine"}},
                                      "spec": {"containers": [{"name": "engine", "image": "graft"}]}}}}]
    applied = kubectl(kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump_all(objects))
    assert applied.returncode == 0, applied.stderr
    objects[2]["spec"]["replicas"] = 3
    assert kubectl(kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump_all(objects)).returncode == 0
    table = columns(kubectl(kubeconfig, "get", "deployments,services,configmaps", "-n", "llm").stdout)
    assert ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"] in table
    assert ["deployment.apps/llm-engine", "0/3", "0", "0"] in [row[:4] for row in table]
    assert ["service/llm-engine", "ClusterIP"] in [row[:2] for row in table]
    assert ["configmap/bundle", "1"] in [row[:2] for row in table]
