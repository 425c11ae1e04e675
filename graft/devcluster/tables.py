"""Server-side tables (``meta.k8s.io`` ``Table``), the columns ``kubectl get`` prints.

kubectl asks for ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io`` and prints the columns
the server chooses: without a table it can only show NAME and AGE. A custom resource gets NAME,
then its version's ``additionalPrinterColumns`` (each ``jsonPath`` evaluated, ``date`` columns as
an age such as ``5m``), as kube-apiserver's CRD table convertor does; Pods, Namespaces, Services,
ConfigMaps, Secrets and Deployments get kube-apiserver's own columns (without the node columns a
cluster without nodes leaves empty); every other kind gets NAME and AGE.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

_NAME = {"name": "Name", "type": "string", "format": "name", "priority": 0,
         "description": "Name must be unique within a namespace. Cannot be updated."}
_AGE = {"name": "Age", "type": "string", "format": "", "priority": 0,
        "description": "CreationTimestamp is a timestamp representing the server time when this object was created."}
_STEP = re.compile(r"\.([A-Za-z0-9_-]+)|\['([^']*)'\]|\[(\d+)\]")

Cells = Callable[[dict[str, Any]], list[Any]]


def table_version(accept: str) -> str | None:
    """``v1`` or ``v1beta1`` when the ``Accept`` header asks for a ``meta.k8s.io`` Table, else ``None``."""
    for media in accept.split(","):
        parts = [p.strip() for p in media.split(";")]
        params = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        if (parts[0] in ("application/json", "*/*") and params.get("as") == "Table"
                and params.get("g") == "meta.k8s.io" and params.get("v") in ("v1", "v1beta1")):
            return params["v"]
        if parts[0] in ("application/json", "*/*") and "as" not in params:
            return None  # a plain object was preferred
    return None


def human_duration(seconds: float) -> str:
    """An age as kubectl prints it (``k8s.io/apimachinery/pkg/util/duration.HumanDuration``)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes, hours = s // 60, s // 3600
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def age(timestamp: Any) -> str:
    """The age of an RFC 3339 timestamp, ``<unknown>`` without one, ``<invalid>`` when it does not parse."""
    if not timestamp:
        return "<unknown>"
    try:
        then = datetime.datetime.fromisoformat(str(timestamp).replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    return human_duration((datetime.datetime.now(datetime.UTC) - then).total_seconds())


def json_path(obj: Any, path: str) -> Any:
    """A printer column's simple JSONPath (``.status.phase``, ``.a['b.c']``, ``.items[0]``); ``None`` if absent."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    at = 0
    while at < len(path):
        m = _STEP.match(path, at)
        if m is None:
            return None
        key, quoted, index = m.groups()
        if index is not None:
            obj = obj[int(index)] if isinstance(obj, list) and int(index) < len(obj) else None
        else:
            obj = obj.get(key if key is not None else quoted) if isinstance(obj, dict) else None
        if obj is None:
            return None
        at = m.end()
    return obj


def crd_columns(columns: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], Cells]:
    """Column definitions and a row function for a CRD version's ``additionalPrinterColumns``."""
    columns = list(columns)
    definitions = [_NAME] + [{"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
                              "description": c.get("description", ""), "priority": int(c.get("priority", 0))}
                             for c in columns]

    def cells(obj: dict[str, Any]) -> list[Any]:
        return [obj["metadata"].get("name")] + [_cell(c.get("type", "string"), json_path(obj, c["jsonPath"]))
                                                for c in columns]
    return definitions, cells


def _cell(kind: str, value: Any) -> Any:
    """A printer column's cell as kube-apiserver types it (``cellForJSONValue``)."""
    if value is None:
        return None
    if kind == "string":
        return value if isinstance(value, str) else json.dumps(value)
    if kind == "integer" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind == "boolean" and isinstance(value, bool):
        return value
    if kind == "date" and isinstance(value, str):
        return age(value)
    return None


# built-in kinds, as kube-apiserver's printers (pkg/printers/internalversion) print them

def _column(name: str, description: str = "") -> dict[str, Any]:
    return {"name": name, "type": "string", "format": "", "description": description, "priority": 0}


def _pod_cells(pod: dict[str, Any]) -> list[Any]:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    reason = status.get("reason") or status.get("phase") or "Pending"
    restarts, ready, running = 0, 0, False
    for c in reversed(containers):
        restarts += int(c.get("restartCount") or 0)
        state = c.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif (state.get("terminated") or {}).get("reason"):
            reason = state["terminated"]["reason"]
        elif "terminated" in state:
            signal = state["terminated"].get("signal")
            reason = f"Signal:{signal}" if signal else f"ExitCode:{state['terminated'].get('exitCode', 0)}"
        elif "running" in state and c.get("ready"):
            running = True
        ready += bool(c.get("ready"))
    if reason == "Completed" and running:
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or ()}
        reason = "Running" if conditions.get("Ready") == "True" else "NotReady"
    if meta.get("deletionTimestamp"):
        reason = "Unknown" if status.get("reason") == "NodeLost" else "Terminating"
    total = len(spec.get("containers") or []) or len(containers)
    return [meta["name"], f"{ready}/{total}", reason, str(restarts), age(meta.get("creationTimestamp"))]


def _service_cells(svc: dict[str, Any]) -> list[Any]:
    spec = svc.get("spec") or {}
    ports = ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or ()) or "<none>"
    external = ",".join(spec.get("externalIPs") or ()) or "<none>"
    return [svc["metadata"]["name"], spec.get("type", "ClusterIP"), spec.get("clusterIP") or "<none>", external,
            ports, age(svc["metadata"].get("creationTimestamp"))]


def _deployment_cells(deploy: dict[str, Any]) -> list[Any]:
    spec, status = deploy.get("spec") or {}, deploy.get("status") or {}
    return [deploy["metadata"]["name"], f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 1)}",
            status.get("updatedReplicas", 0), status.get("availableReplicas", 0),
            age(deploy["metadata"].get("creationTimestamp"))]


_BUILTIN: dict[tuple[str, str], tuple[list[dict[str, Any]], Cells]] = {
    ("", "pods"): ([_NAME, _column("Ready", "The aggregate readiness state of this pod for accepting traffic."),
                    _column("Status", "The aggregate status of the containers in this pod."),
                    _column("Restarts", "The number of times the containers in this pod have been restarted."),
                    _AGE], _pod_cells),
    ("", "namespaces"): ([_NAME, _column("Status", "The status of the namespace"), _AGE],
                         lambda ns: [ns["metadata"]["name"], (ns.get("status") or {}).get("phase", "Active"),
                                     age(ns["metadata"].get("creationTimestamp"))]),
    ("", "services"): ([_NAME, _column("Type"), _column("Cluster-IP"), _column("External-IP"), _column("Port(s)"),
                        _AGE], _service_cells),
    ("", "configmaps"): ([_NAME, {**_column("Data"), "type": "integer"}, _AGE],
                         lambda cm: [cm["metadata"]["name"],
                                     len(cm.get("data") or {}) + len(cm.get("binaryData") or {}),
                                     age(cm["metadata"].get("creationTimestamp"))]),
    ("", "secrets"): ([_NAME, _column("Type"), {**_column("Data"), "type": "integer"}, _AGE],
                      lambda s: [s["metadata"]["name"], s.get("type", "Opaque"), len(s.get("data") or {}),
                                 age(s["metadata"].get("creationTimestamp"))]),
    ("apps", "deployments"): ([_NAME, _column("Ready"), {**_column("Up-to-date"), "type": "integer"},
                               {**_column("Available"), "type": "integer"}, _AGE], _deployment_cells),
}
_DEFAULT = ([_NAME, _AGE], lambda obj: [obj["metadata"]["name"], age(obj["metadata"].get("creationTimestamp"))])


def builtin_columns(group: str, plural: str) -> tuple[list[dict[str, Any]], Cells]:
    """Column definitions and a row function for a built-in kind (NAME and AGE for those not listed)."""
    return _BUILTIN.get((group, plural), _DEFAULT)


def table(version: str, columns: tuple[list[dict[str, Any]], Cells], objects: Iterable[dict[str, Any]],
          metadata: dict[str, Any], include_object: str = "Metadata", headers: bool = True) -> dict[str, Any]:
    """A ``Table`` of ``objects``; ``include_object`` is the request's ``includeObject`` (None, Metadata, Object).

    ``headers=False`` leaves out the column definitions, as in every watch event after the first.
    """
    definitions, cells = columns
    rows = []
    for obj in objects:
        row: dict[str, Any] = {"cells": cells(obj)}
        if include_object == "Object":
            row["object"] = obj
        elif include_object != "None":
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": f"meta.k8s.io/{version}",
                             "metadata": obj["metadata"]}
        rows.append(row)
    return {"kind": "Table", "apiVersion": f"meta.k8s.io/{version}", "metadata": metadata,
            "columnDefinitions": definitions if headers else [], "rows": rows}
