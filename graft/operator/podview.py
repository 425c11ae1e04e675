"""Typed views of the Kubernetes object fields Graft reads, and the one way it builds a condition.

A `PodView` holds what Graft reads of a pod (phase, IP, conditions, readiness gates, container
statuses, labels, annotations, owner, deletion) read once from the API server's JSON, absent
fields as their empty values; the JSON itself stays the record that is patched back.
`condition(obj, type)` reads one condition of any object's status (a pod's Ready, a PatchFleet's
Converged); `make_condition` builds one as the API server stores it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from graft.rollout.status import to_time


@dataclass(frozen=True, slots=True)
class Condition:
    """One entry of `status.conditions`."""

    type: str
    status: str = "Unknown"                 # "True", "False" or "Unknown", as the API stores it
    reason: str | None = None
    message: str | None = None
    last_transition_time: str | None = None

    @property
    def true(self) -> bool:
        return self.status == "True"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Condition":
        return cls(type=str(raw.get("type") or ""), status=str(raw.get("status") or "Unknown"),
                   reason=raw.get("reason"), message=raw.get("message"),
                   last_transition_time=raw.get("lastTransitionTime"))


def conditions_of(obj: dict[str, Any] | None) -> dict[str, Condition]:
    """Every condition of an object's status, by type."""
    raw = ((obj or {}).get("status") or {}).get("conditions") or []
    return {c.type: c for c in (Condition.from_dict(r) for r in raw if isinstance(r, dict))}


def condition(obj: dict[str, Any] | None, kind: str) -> Condition | None:
    """The condition `kind` of an object's status, or None when it has none."""
    return conditions_of(obj).get(kind)


def make_condition(kind: str, value: bool | str, reason: str | None = None, message: str | None = None,
                   at: float | None = None) -> dict[str, Any]:
    """A condition as stored in `status.conditions`: `value` True/False (or "Unknown"), its
    lastTransitionTime `at` (seconds since the epoch; now by default)."""
    status = value if isinstance(value, str) else ("True" if value else "False")
    out: dict[str, Any] = {"type": kind, "status": status}
    if reason is not None:
        out["reason"] = reason
    if message is not None:
        out["message"] = message
    out["lastTransitionTime"] = to_time(time.time() if at is None else at)
    return out


@dataclass(frozen=True, slots=True)
class ContainerStatus:
    """One entry of `status.containerStatuses`."""

    name: str
    ready: bool = False
    started: bool = False
    restart_count: int = 0
    container_id: str = ""
    running_since: str | None = None        # state.running.startedAt, when running
    waiting_reason: str | None = None       # state.waiting.reason, when waiting

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ContainerStatus":
        state = raw.get("state") or {}
        return cls(name=str(raw.get("name") or ""), ready=raw.get("ready") is True, started=raw.get("started") is True,
                   restart_count=int(raw.get("restartCount") or 0), container_id=raw.get("containerID") or "",
                   running_since=(state.get("running") or {}).get("startedAt") if "running" in state else None,
                   waiting_reason=(state.get("waiting") or {}).get("reason") if "waiting" in state else None)

    @property
    def running(self) -> bool:
        return self.running_since is not None


@dataclass(frozen=True, slots=True)
class PodView:
    """What Graft reads of a pod."""

    name: str
    namespace: str = ""
    uid: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    deleting: bool = False                  # metadata.deletionTimestamp is set
    phase: str | None = None
    pod_ip: str | None = None
    conditions: dict[str, Condition] = field(default_factory=dict)
    readiness_gates: tuple[str, ...] = ()   # spec.readinessGates' condition types
    containers: tuple[str, ...] = ()        # spec.containers' names, in order
    statuses: tuple[ContainerStatus, ...] = ()

    @classmethod
    def of(cls, pod: dict[str, Any]) -> "PodView":
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        return cls(
            name=meta.get("name") or "", namespace=meta.get("namespace") or "", uid=meta.get("uid") or "",
            labels=dict(meta.get("labels") or {}), annotations=dict(meta.get("annotations") or {}),
            deleting=bool(meta.get("deletionTimestamp")), phase=status.get("phase"), pod_ip=status.get("podIP") or None,
            conditions=conditions_of(pod),
            readiness_gates=tuple(g.get("conditionType") or "" for g in spec.get("readinessGates") or []),
            containers=tuple(c.get("name") or "" for c in spec.get("containers") or []),
            statuses=tuple(ContainerStatus.from_dict(s) for s in status.get("containerStatuses") or []))

    def condition(self, kind: str) -> Condition | None:
        return self.conditions.get(kind)

    def is_true(self, kind: str) -> bool:
        """Whether the pod's condition `kind` is there and True."""
        found = self.conditions.get(kind)
        return found is not None and found.true

    @property
    def ready(self) -> bool:
        """Running, with an IP, and its Ready condition True (every readiness gate included)."""
        return self.phase == "Running" and bool(self.pod_ip) and self.is_true("Ready")

    def container_status(self, name: str | None) -> ContainerStatus | None:
        """The status of container `name`, else the first one's (None when there is none)."""
        found = next((s for s in self.statuses if name is not None and s.name == name), None)
        return found or (self.statuses[0] if self.statuses else None)
