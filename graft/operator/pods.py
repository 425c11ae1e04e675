"""Engine pods as the operator sees them.

A pod takes part in a rollout or a fleet (it is labelled, its engine gets admin calls with the
fleet's admin token, it counts as a member) only when it matches the selector and is an engine of
a workload (`Workloads.vet`):
- its controller ownerReference (`controller: true`) names an apps/v1 ReplicaSet, StatefulSet or
  Deployment, which exists with that very uid (each owner read once per tick);
- its containers are the ones of the owner's pod template: the same names, images, commands and
  args, so a pod that copies an ownerReference cannot run other code.

A pod that is none is left alone (no label, no call, no token) and reported as `Reason.NOT_AN_ENGINE`.
Its engine's admin API is at the pod IP, on the port of the container port named `admin` in the
owner's pod template, else on the operator's default (`GRAFT_ADMIN_PORT`, 8081): never on a port
the pod itself names. The engine container is the one declaring that port (else the first
container); its `containerID` and `restartCount` tell a restart apart.

An address that cannot be known yet is an `AddressError`: `NoPodIP` while the pod has none (tried
again next tick).

The operator writes back:
- label `graft.dev/track: canary|stable` (what a canary Service selects on);
- annotation `graft.dev/patches: <revision>` (what a restarted engine applies at start-up,
  through `GRAFT_PATCHES` from the Downward API).
"""
from __future__ import annotations

from typing import Any

from graft.operator.kube import Kube, deployment_path, pods_path, replicaset_path, statefulset_path
from graft.operator.podview import PodView
from graft.rollout.observation import UNREACHABLE, PodObservation

TRACK_LABEL = "graft.dev/track"
PATCHES_ANNOTATION = "graft.dev/patches"
ADMIN_PORT_NAME = "admin"
WORKLOAD_KINDS = ("ReplicaSet", "StatefulSet", "Deployment")      # apps/v1 controllers of engine pods


class AddressError(Exception):
    """The operator cannot tell where a pod's admin API is; `kind` is an observation error kind."""

    kind = UNREACHABLE

    @property
    def message(self) -> str:
        return str(self)


class NoPodIP(AddressError):
    """The pod has no IP yet: it will have one, so this is asked again next tick."""


class Workloads:
    """Which pods are engines of a workload, and their admin ports: each owner is read (GET) once,
    so one `Workloads` serves one tick. `ports` (pod name -> admin port) holds the engines vetted,
    `refused` (pod name -> why) the pods left alone."""

    def __init__(self, kube: Kube, namespace: str, default_port: int):
        self.kube, self.namespace, self.default_port = kube, namespace, default_port
        self._owners: dict[tuple[str, str], dict[str, Any] | None] = {}
        self.ports: dict[str, int] = {}
        self.refused: dict[str, str] = {}
        self._uids: dict[str, str] = {}

    async def engines(self, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The engine pods among `pods`, in their order; the others are noted in `refused`."""
        out = []
        for pod in pods:
            why = await self.vet(pod)
            if why is None:
                out.append(pod)
            else:
                self.refused[pod["metadata"]["name"]] = why
                self._uids[pod["metadata"]["name"]] = pod["metadata"].get("uid") or pod["metadata"]["name"]
        return out

    def uid(self, pod: str) -> str:
        """The uid of a pod left alone (its name when it has none)."""
        return self._uids.get(pod, pod)

    async def vet(self, pod: dict[str, Any]) -> str | None:
        """None when the pod is an engine of its workload (its admin port then in `ports`), else why not."""
        name = pod["metadata"]["name"]
        refs = [r for r in pod["metadata"].get("ownerReferences") or [] if r.get("controller") is True]
        if not refs:
            return "it has no controller ownerReference (an engine is a pod of a Deployment, ReplicaSet or StatefulSet)"
        ref = refs[0]
        kind, owner_name, uid = ref.get("kind"), ref.get("name") or "", ref.get("uid") or ""
        what = f"{kind} {owner_name}"
        if ref.get("apiVersion") != "apps/v1" or kind not in WORKLOAD_KINDS:
            return f"its controller is {ref.get('apiVersion')} {what}, not an apps/v1 Deployment, ReplicaSet or StatefulSet"
        if not owner_name:
            return f"its controller ownerReference ({kind}) names no object"
        key = (kind, owner_name)
        if key not in self._owners:
            path = (replicaset_path(self.namespace, owner_name) if kind == "ReplicaSet" else
                    statefulset_path(self.namespace, owner_name) if kind == "StatefulSet" else
                    deployment_path(self.namespace, owner_name))
            self._owners[key] = await self.kube.get(path)
        owner = self._owners[key]
        if owner is None:
            return f"its controller {what} does not exist"
        if (owner.get("metadata") or {}).get("uid") != uid:
            return f"its controller ownerReference names {what} of uid {uid or '(none)'}, but {what} has another uid"
        template = ((owner.get("spec") or {}).get("template") or {}).get("spec") or {}
        differs = _containers_differ((pod.get("spec") or {}).get("containers") or [], template.get("containers") or [])
        if differs:
            return f"its containers are not those of {what}'s pod template: {differs}"
        port = _template_admin_port(template)
        if port is None:
            return f"the container port named {ADMIN_PORT_NAME} of {what}'s pod template is no port number"
        self.ports[name] = port or self.default_port
        return None

    def address(self, pod: dict[str, Any]) -> tuple[str, int] | None:
        """(pod IP, admin port) of a vetted engine pod, or None while it has no IP."""
        return admin_address(pod, self.ports[pod["metadata"]["name"]])


def _run_as(container: dict[str, Any]) -> tuple:
    return (container.get("image"), list(container.get("command") or []), list(container.get("args") or []))


def _containers_differ(pod: list[dict[str, Any]], template: list[dict[str, Any]]) -> str | None:
    """How the pod's containers differ from the template's (names, images, command, args), or None."""
    mine = {c.get("name"): c for c in pod}
    theirs = {c.get("name"): c for c in template}
    if list(mine) != list(theirs) or len(mine) != len(pod) or len(theirs) != len(template):
        return f"containers {sorted(map(str, mine))}, not {sorted(map(str, theirs))}"
    for name, c in mine.items():
        for what, a, b in zip(("image", "command", "args"), _run_as(c), _run_as(theirs[name])):
            if a != b:
                return f"container {name} has {what} {a!r:.120}, not {b!r:.120}"
    return None


def _template_admin_port(template: dict[str, Any]) -> int | None:
    """The pod template's container port named `admin`: its number, 0 when it names none, None
    when it is no port number."""
    for c in template.get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == ADMIN_PORT_NAME:
                port = p.get("containerPort")
                return port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None
    return 0


async def list_pods(kube: Kube, namespace: str, selector: str) -> list[dict[str, Any]]:
    """The pods matching `selector`, without the ones being deleted."""
    pods = await kube.list(pods_path(namespace), label_selector=selector)
    return sorted((p for p in pods if not p["metadata"].get("deletionTimestamp")),
                  key=lambda p: p["metadata"]["name"])


def is_ready(pod: dict[str, Any]) -> bool:
    """Running, with an IP, and Ready (every readiness gate included)."""
    return PodView.of(pod).ready


def _engine_container(pod: dict[str, Any]) -> dict[str, Any] | None:
    containers = (pod.get("spec") or {}).get("containers") or []
    for c in containers:
        if any(p.get("name") == ADMIN_PORT_NAME for p in c.get("ports") or []):
            return c
    return containers[0] if containers else None


def admin_address(pod: dict[str, Any], port: int) -> tuple[str, int] | None:
    """(pod IP, `port`), or None while the pod has no IP."""
    ip = (pod.get("status") or {}).get("podIP")
    return (ip, port) if ip else None


def observe_pod(pod: dict[str, Any]) -> PodObservation:
    """The Kubernetes half of a pod's observation; the engine's revision is filled in by the caller."""
    view = PodView.of(pod)
    container = _engine_container(pod)
    cs = view.container_status(container.get("name") if container else None)
    return PodObservation(
        name=view.name, uid=view.uid,
        container_id=cs.container_id if cs else "", restart_count=cs.restart_count if cs else 0,
        ready=view.ready, track=view.labels.get(TRACK_LABEL), patches=view.annotations.get(PATCHES_ANNOTATION),
    )


async def label_pod(kube: Kube, namespace: str, name: str, track: str, revision: str) -> dict[str, Any] | None:
    """Label and annotate the pod; the pod as the API server answered (None: gone)."""
    return await kube.merge_patch(pods_path(namespace, name), {"metadata": {
        "labels": {TRACK_LABEL: track}, "annotations": {PATCHES_ANNOTATION: revision}}})
