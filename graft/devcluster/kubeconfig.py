"""A kubeconfig file for the local API server, so kubectl and Kubernetes clients can reach it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml


def kubeconfig(server: str, *, name: str = "graft-dev", namespace: str = "default") -> dict[str, Any]:
    """A one-cluster, one-context kubeconfig for ``server`` (plain HTTP, no credentials)."""
    if not server.startswith(("http://", "https://")):
        raise ValueError(f"server must be an http(s) URL, got {server!r}")
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server}}],
        "users": [{"name": name, "user": {}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}],
        "current-context": name,
        "preferences": {},
    }


def write_kubeconfig(path: str | os.PathLike[str], server: str, *, name: str = "graft-dev",
                     namespace: str = "default") -> Path:
    """Write a kubeconfig for ``server`` to ``path`` atomically (mode 0600) and return the path.

    Atomic so that a process waiting for the file never reads half of it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(kubeconfig(server, name=name, namespace=namespace), sort_keys=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
