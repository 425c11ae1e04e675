"""Engine pods as the operator sees them.

A pod takes part in a rollout when it matches the rollout's selector. Its engine's admin API is at
the pod IP, on the port of the container port named `admin` (the one every engine Deployment
declares), or on the port in the pod annotation `graft.dev/admin-port` when set (it wins), or on
the operator's default (`GRAFT_ADMIN_PORT`, 8081). The engine container is the one declaring that
port (else the first container); its `containerID` and `restartCount` tell a restart apart.

An address that cannot be known is an `AddressError` saying how a rollout treats it: `NoPodIP`
while the pod has none yet (tried again next tick), `BadAdminPort` for an annotation that is no
port number (permanent: nothing changes it but an edit of the pod, so retrying only waits for the
deadline).

The operator writes back:
- label `graft.dev/track: canary|stable` (what a canary Service selects on);
- annotation `graft.dev/patches: <revision>` (what a restarted engine applies at start-up,
  through `GRAFT_PATCHES` from the Downward API).
"""
from __future__ import annotations

from typing import Any

from graft.operator.kube import Kube, pods_path
from graft.rollout.observation import MISCONFIGURED, UNREACHABLE, PodObservation

TRACK_LABEL = "graft.dev/track"
PATCHES_ANNOTATION = "graft.dev/patches"
ADMIN_PORT_ANNOTATION = "graft.dev/admin-port"
ADMIN_PORT_NAME = "admin"


class AddressError(Exception):
    """The operator cannot tell where a pod's admin API is; `kind` is an observation error kind."""

    kind = UNREACHABLE

    @property
    def message(self) -> str:
        return str(self)


class NoPodIP(AddressError):
    """The pod has no IP yet: it will have one, so this is asked again next tick."""


class BadAdminPort(AddressError, ValueError):
    """The pod's admin-port annotation is no port number: permanent until someone edits the pod."""

    kind = MISCONFIGURED


async def list_pods(kube: Kube, namespace: str, selector: str) -> list[dict[str, Any]]:
    """The pods matching `selector`, without the ones being deleted."""
    pods = await kube.list(pods_path(namespace), label_selector=selector)
    return sorted((p for p in pods if not p["metadata"].get("deletionTimestamp")),
                  key=lambda p: p["metadata"]["name"])


def is_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return status.get("phase") == "Running" and bool(status.get("podIP")) and conditions.get("Ready") == "True"


def _engine_container(pod: dict[str, Any]) -> dict[str, Any] | None:
    containers = (pod.get("spec") or {}).get("containers") or []
    for c in containers:
        if any(p.get("name") == ADMIN_PORT_NAME for p in c.get("ports") or []):
            return c
    return containers[0] if containers else None


def admin_address(pod: dict[str, Any], default_port: int) -> tuple[str, int] | None:
    """(pod IP, admin port), or None while the pod has no IP; BadAdminPort for a malformed annotation."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    annotated = ((pod["metadata"].get("annotations") or {}).get(ADMIN_PORT_ANNOTATION) or "").strip()
    if annotated:
        if not annotated.isdigit() or not 0 < int(annotated) < 65536:
            raise BadAdminPort(f"annotation {ADMIN_PORT_ANNOTATION} must be a port number (1-65535), "
                               f"got {annotated!r}; fix the pod template")
        return ip, int(annotated)
    container = _engine_container(pod) or {}
    for port in container.get("ports") or []:
        if port.get("name") == ADMIN_PORT_NAME:
            return ip, int(port["containerPort"])
    return ip, default_port


def observe_pod(pod: dict[str, Any]) -> PodObservation:
    """The Kubernetes half of a pod's observation; the engine's revision is filled in by the caller."""
    meta = pod["metadata"]
    container = _engine_container(pod)
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    cs = next((s for s in statuses if container and s.get("name") == container.get("name")), None)
    cs = cs or (statuses[0] if statuses else {})
    return PodObservation(
        name=meta["name"], uid=meta.get("uid", ""),
        container_id=cs.get("containerID") or "", restart_count=int(cs.get("restartCount") or 0),
        ready=is_ready(pod),
        track=(meta.get("labels") or {}).get(TRACK_LABEL),
        patches=(meta.get("annotations") or {}).get(PATCHES_ANNOTATION),
    )


async def label_pod(kube: Kube, namespace: str, name: str, track: str, revision: str) -> None:
    await kube.merge_patch(pods_path(namespace, name), {"metadata": {
        "labels": {TRACK_LABEL: track}, "annotations": {PATCHES_ANNOTATION: revision}}})
