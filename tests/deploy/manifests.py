"""Reading, rendering and checking the Kubernetes objects the project ships."""
from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml

from graft.devcluster.crd import CrdVersion, served_versions

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "graft"
CRDS = ROOT / "crds"
EXAMPLES = ROOT / "examples"
DEPLOY = ROOT / "deploy"
KUBE_VERSION = "1.32"
RELEASE, NAMESPACE = "graft", "graft-system"

# Kinds whose CRDs the project does not ship and kubernetes-validate does not know; each has
# its own test of the fields that matter.
THIRD_PARTY = {
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}

Obj = dict[str, Any]


def load_docs(text: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all(text) if d]


def load_file(path: Path) -> list[Obj]:
    return load_docs(path.read_text(encoding="utf-8"))


def render(chart: helm.Chart, values: dict | None = None) -> list[Obj]:
    """Every object the chart renders for `values` (NOTES.txt left out)."""
    out = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return [d for name, text in sorted(out.items()) if not name.endswith("NOTES.txt")
            for d in load_docs(text)]


def notes(chart: helm.Chart, values: dict | None = None) -> str:
    out = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return next(text for name, text in out.items() if name.endswith("NOTES.txt"))


def of_kind(objs: Iterable[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: Iterable[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in of_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def crd_versions() -> dict[tuple[str, str], CrdVersion]:
    """(apiVersion, kind) -> the served CRD version, for every CRD under crds/."""
    versions = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in load_file(path):
            for v in served_versions(crd):
                versions[(f"{v.group}/{v.version}", v.kind)] = v
    return versions


def crd_errors(obj: Obj, version: CrdVersion) -> list[str]:
    """What a real API server with strict field validation (kubectl's default) says to `obj`."""
    body = copy.deepcopy(obj)
    unknown = version.prune(body)
    version.default(body)
    return [f"{path}: unknown field" for path in unknown] + [str(e) for e in version.validate(body)]


def k8s_errors(obj: Obj) -> list[str] | None:
    """kubernetes-validate's complaint about a built-in object, strict about unknown fields;
    None when the kind is not a built-in one."""
    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return None
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path) or "<root>"
        return [f"{where}: {e.message}"]
    return []


def validation_errors(obj: Obj, crds: dict[tuple[str, str], CrdVersion]) -> list[str]:
    """Errors for any object: built-in kinds by the Kubernetes schemas, ours by their CRD."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    name = f'{key[1]} {obj.get("metadata", {}).get("name")}'
    if key in crds:
        errors = crd_errors(obj, crds[key])
    elif key in THIRD_PARTY:
        errors = []
    else:
        errors = k8s_errors(obj)
        if errors is None:
            errors = [f"no schema for {key[0]} {key[1]}"]
    return [f"{name}: {e}" for e in errors]


def pod_template(workload: Obj) -> Obj:
    return workload["spec"]["template"]


def containers(workload: Obj) -> list[Obj]:
    spec = pod_template(workload)["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
