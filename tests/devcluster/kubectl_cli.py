"""The real kubectl, found on PATH, for the dev cluster tests."""

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def kubectl_binary() -> str:
    """kubectl's path; the test fails (it does not skip) without it: kubectl is what users run."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is not on PATH: the dev cluster tests drive the API server emulator with the real "
                    "kubectl (v1.32); install it (https://kubernetes.io/docs/tasks/tools/) or put it on PATH",
                    pytrace=False)
    return path


def run_kubectl(kubeconfig: Path, *args: str, stdin: str | None = None, timeout: int = 20) -> subprocess.CompletedProcess:
    """``kubectl --kubeconfig=... args``, with its discovery and OpenAPI cache beside the kubeconfig."""
    cache = kubeconfig.parent / "kubectl-cache"
    return subprocess.run(["timeout", "-k", "5", str(timeout), kubectl_binary(), f"--kubeconfig={kubeconfig}",
                           f"--cache-dir={cache}", *args], input=stdin, capture_output=True, text=True)


@contextmanager
def emulator_kubeconfig(folder: Path, crds: Path) -> Iterator[Path]:
    """The API server emulator as its own process serving `crds`, and the kubeconfig it writes."""
    config, log = folder / "kubeconfig", folder / "apiserver.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "graft.devcluster.apiserver", "--crds", str(crds),
                                    "--namespace", "llm", "--kubeconfig", str(config)],
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not config.exists():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the API server did not start"
            time.sleep(0.05)
        yield config
    finally:
        process.terminate()
        process.wait(10)
