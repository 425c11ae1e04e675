"""The real kubectl, found on PATH, for the dev cluster tests."""

import shutil
import subprocess
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
