"""The README's dev-cluster quick start, run as a user runs it.

`graft dev-cluster --traffic 2` as a real process (the API server emulator, three `graft serve`
pods with the real model, a real Prometheus, the operator it starts, two BBH requests a second),
then the real kubectl with the kubeconfig it writes: `apply -f examples/rollout-dev-cluster.yaml`,
`wait --for=condition=Promoted`, `get prl`. The commands are the README's, word for word, run in a
folder of their own (so `.graft-dev/` and `examples/` are that folder's). Two things differ: the
example's pauses, shortened from 30 s to 2 s in the copy written there, and the wait's timeout.
The checks and thresholds are the example's: the operator must promote it on its own judgement.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from tests.devcluster.kubectl_cli import kubectl_binary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/rollout-dev-cluster.yaml"
NAME = "kv-align-3-2-1-dev"
KUBECONFIG = ".graft-dev/kubeconfig"
# the README's quick start, verbatim
DEV_CLUSTER = "graft dev-cluster --traffic 2"
APPLY = f"kubectl --kubeconfig {KUBECONFIG} apply -f {EXAMPLE}"
WAIT = f"kubectl --kubeconfig {KUBECONFIG} wait --for=condition=Promoted prl/{NAME} --timeout=10m"
GET = f"kubectl --kubeconfig {KUBECONFIG} get prl"

PAUSE = "2s"            # each step's pause in the test's copy of the example (the file has 30s)
PROMOTED_WITHIN = 300   # seconds the wait may take here; 105-110 s were measured on a busy two-core machine
UP_WITHIN = 240         # seconds for the dev cluster to say it is up (three models load on two cores)
STOP_WITHIN = 90        # seconds for Ctrl-C to stop it (in-flight requests finish, pods drain)


@pytest.fixture(autouse=True)
def clean_slate() -> None:
    """This module starts its own dev cluster, as a process: not the package's shared fleet, which
    the autouse fixture of the same name in conftest.py would start and reset for each test."""


def printer_columns() -> list[str]:
    """The header `kubectl get prl` prints: NAME, then the CRD's printer columns of priority 0."""
    crd = yaml.safe_load((ROOT / "crds" / "patchrollout.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served", True) and v.get("storage")]
    return ["NAME", *(c["name"].upper() for c in version["additionalPrinterColumns"] if not c.get("priority"))]


def argv(command: str) -> list[str]:
    """A README command as this test runs it: `graft` from this interpreter's environment, kubectl
    from PATH (the test fails, naming it, when kubectl is missing)."""
    words = shlex.split(command)
    program = {"graft": str(Path(sys.executable).with_name("graft")), "kubectl": kubectl_binary()}[words[0]]
    return [program, *words[1:]]


def run(command: str, folder: Path, timeout: float = 30) -> subprocess.CompletedProcess:
    """A kubectl command in `folder`, with kubectl's discovery cache there too."""
    return subprocess.run(argv(command), cwd=folder, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "KUBECACHEDIR": str(folder / "kubectl-cache")})


def with_pauses(manifest: str, pause: str) -> str:
    """The example with every step's pause set to `pause`: nothing else changes."""
    rollout = yaml.safe_load(manifest)
    rollout["spec"]["steps"] = [{**s, "pause": pause} if "pause" in s else s for s in rollout["spec"]["steps"]]
    return yaml.safe_dump(rollout, sort_keys=False)


@contextlib.contextmanager
def dev_cluster(folder: Path) -> Iterator[subprocess.Popen]:
    """`graft dev-cluster --traffic 2` in `folder` until it prints that it is up; Ctrl-C at the end."""
    out = folder / "dev-cluster.out"
    with open(out, "wb") as sink:
        process = subprocess.Popen(argv(DEV_CLUSTER), cwd=folder, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + UP_WITHIN
        while "dev cluster up" not in out.read_text():
            assert process.poll() is None, f"graft dev-cluster exited with {process.returncode}:\n{out.read_text()}"
            assert time.monotonic() < deadline, f"graft dev-cluster not up after {UP_WITHIN}s:\n{out.read_text()}"
            time.sleep(0.5)
        yield process
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops it; if it hangs, kill it and every process it started (each pod, the
    operator and Prometheus run in sessions of their own, so they would outlive it)."""
    if process.poll() is not None:
        return
    children = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGINT)
    try:
        process.wait(STOP_WITHIN)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def traffic_summary(folder: Path) -> tuple[int, int]:
    """(sent, failed) from the line the dev cluster prints when it stops."""
    found = re.search(r"client traffic: (\d+) requests, (\d+) failed", (folder / "dev-cluster.out").read_text())
    assert found, (folder / "dev-cluster.out").read_text()
    return int(found[1]), int(found[2])


def test_readme_quick_start_is_what_this_test_runs():
    readme = (ROOT / "README.md").read_text()
    for command in (DEV_CLUSTER, APPLY, WAIT, GET):
        assert f"\n{command}\n" in readme, f"README.md no longer says `{command}`"
    steps = yaml.safe_load((ROOT / EXAMPLE).read_text())["spec"]["steps"]
    assert [s.get("pause") for s in steps] == ["60s"] + ["30s"] * 3 + [None], \
        "the README and the example's comment say 60s, then 30s"
    assert "30 s pauses (60 s at the first step" in readme


def test_dev_cluster_promotes_the_example(tmp_path: Path):
    (tmp_path / "examples").mkdir()
    (tmp_path / EXAMPLE).write_text(with_pauses((ROOT / EXAMPLE).read_text(), PAUSE))
    started = time.monotonic()
    with dev_cluster(tmp_path):
        up = time.monotonic()
        applied = run(APPLY, tmp_path)
        assert applied.returncode == 0, applied.stderr
        assert applied.stdout.strip() == f"patchrollout.graft.dev/{NAME} created"

        wait = WAIT.replace("--timeout=10m", f"--timeout={PROMOTED_WITHIN}s")
        assert wait != WAIT
        waited = run(wait, tmp_path, timeout=PROMOTED_WITHIN + 30)
        described = run(f"kubectl --kubeconfig {KUBECONFIG} describe prl {NAME}", tmp_path).stdout
        assert waited.returncode == 0, f"{waited.stdout}{waited.stderr}\n{described}"
        assert waited.stdout.strip() == f"patchrollout.graft.dev/{NAME} condition met"
        promoted = time.monotonic()

        listed = run(GET, tmp_path)
        assert listed.returncode == 0, listed.stderr
        header, row = [line.split() for line in listed.stdout.strip().splitlines()]
        assert header == printer_columns()
        shown = dict(zip(header, row))
        assert {k: shown[k] for k in ("NAME", "PHASE", "STEP", "WEIGHT", "CANARY", "STABLE")} == {
            "NAME": NAME, "PHASE": "Promoted", "STEP": "5", "WEIGHT": "100",
            "CANARY": "kv-align@3.2.1", "STABLE": "kv-align@3.2.1"}

        # promoted on the example's own judgement: at 50% the gate had its evidence
        passed = [line for line in described.splitlines() if "AnalysisPassed" in line and "step 4/5" in line]
        assert any(re.search(r"error-rate-delta: canary \d+/\d+ errors .* within \+5 pp at 0\.95 confidence", line)
                   for line in passed), described
    sent, failed = traffic_summary(tmp_path)
    stopped = time.monotonic()
    print(f"up {up - started:.0f}s, promoted {promoted - up:.0f}s later, stopped {stopped - promoted:.0f}s later; "
          f"client traffic {sent} requests, {failed} failed")
    # requests queued at a pod still cold on a busy machine may outlast the client's 60 s (4-10% were
    # seen); with prompts that defeat the engines' prefix cache every one of them did
    assert sent > 0
    assert failed <= sent // 4, f"{failed} of {sent} client requests failed"
