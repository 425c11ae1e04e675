"""What a rollout tells the people and systems around it: the moments worth a message, and the
messages themselves (a documented JSON payload, and its Slack rendering).

Pure: the operator (graft.operator.notify) decides *when* from two statuses, the one before a
reconciliation and the one after, and sends what these functions build. Moments are transitions,
never states, so a rollout that holds on a step for an hour sends one `paused`, not one a tick.

The payload (docs/architecture.md, "Notifications and webhooks") is the same for every receiver
and every webhook: a receiver that reads `moment`, `rollout`, `phase`, `step` and `analysis`
needs nothing else. Its renderings for chat tools live with the sender (graft.operator.notify).
"""
from __future__ import annotations

from enum import StrEnum
from typing import Any

from graft.api import Phase

PAYLOAD_VERSION = "graft.dev/v1alpha1"


class Moment(StrEnum):
    """A transition of a rollout that a notification can be asked for (spelled as in a manifest)."""

    STARTED = "started"          # the first step begins
    STEP = "step"                # a later step begins
    PAUSED = "paused"            # the rollout stops and waits: for a person, or past a limit
    PROMOTED = "promoted"        # every pod runs the patch
    ROLLED_BACK = "rolledBack"   # the patch is reverted everywhere (the analysis or a person said so)
    FAILED = "failed"            # the rollout ended Failed (a refused spec, a deadline, an engine's refusal)


# what a receiver gets when neither the chart nor the rollout says otherwise: the endings and the
# holds a person must act on; steps would be noise in a shared channel
DEFAULT_MOMENTS = (Moment.PAUSED, Moment.PROMOTED, Moment.ROLLED_BACK, Moment.FAILED)


def moments(before: dict[str, Any] | None, after: dict[str, Any]) -> list[Moment]:
    """The moments between two stored statuses (`status` as the object keeps it), in order.

    A status that did not change phase or step yields nothing, however often it is reconciled."""
    before = before or {}
    was, now = before.get("phase") or Phase.PENDING.value, after.get("phase") or Phase.PENDING.value
    step_was, step_now = int(before.get("stepIndex") or 0), int(after.get("stepIndex") or 0)
    out: list[Moment] = []
    began = was == Phase.PENDING.value and now != Phase.PENDING.value and bool(after.get("startedAt"))
    if began:
        out.append(Moment.STARTED)
    if now in (Phase.PROGRESSING.value, Phase.PAUSED.value) and (step_now > step_was) and not (began and step_now == 0):
        out.append(Moment.STEP)
    waiting_now = bool(after.get("awaitingApprovalSince"))
    waiting_was = bool(before.get("awaitingApprovalSince"))
    if (now == Phase.PAUSED.value and was != Phase.PAUSED.value) or (waiting_now and not waiting_was):
        out.append(Moment.PAUSED)
    if now != was:
        if now == Phase.PROMOTED.value:
            out.append(Moment.PROMOTED)
        elif now == Phase.ROLLED_BACK.value:
            out.append(Moment.ROLLED_BACK)
        elif now == Phase.FAILED.value:
            out.append(Moment.FAILED)
    return out


def payload(rollout: dict[str, Any], status: dict[str, Any], moment: str, *,
            reason: str | None = None, message: str = "", event_type: str = "", now: str = "") -> dict[str, Any]:
    """The JSON body every receiver and webhook gets: who, what patch, where the rollout stands, and
    the last analysis in numbers. `rollout` is the PatchRollout object (metadata and spec)."""
    meta, spec = rollout.get("metadata") or {}, rollout.get("spec") or {}
    patch = spec.get("patch") or {}
    analysis = status.get("analysis") or {}
    steps = spec.get("steps") or []
    return {
        "apiVersion": PAYLOAD_VERSION,
        "moment": str(moment),
        "time": now,
        "rollout": meta.get("name", ""),
        "namespace": meta.get("namespace", ""),
        "uid": meta.get("uid", ""),
        "patch": {"name": patch.get("name", ""), "version": patch.get("version", ""),
                  "ref": status.get("patch") or f"{patch.get('name', '')}@{patch.get('version', '')}"},
        "phase": status.get("phase") or Phase.PENDING.value,
        "reason": reason or status.get("reason") or "",
        "message": message or status.get("message") or "",
        "type": event_type,
        "step": int(status.get("stepIndex") or 0) + 1,
        "steps": len(steps),
        "weight": int(status.get("weight") or 0),
        "trafficShare": status.get("trafficShare"),
        "canaryRevision": status.get("canaryRevision") or "",
        "stableRevision": status.get("stableRevision") or "",
        "analysis": {
            "lastRun": analysis.get("lastRun"),
            "verdict": analysis.get("verdict"),
            "results": [_result(r) for r in analysis.get("results") or [] if isinstance(r, dict)],
        },
    }


def _result(r: dict[str, Any]) -> dict[str, Any]:
    out = {k: r.get(k) for k in ("name", "role", "verdict", "value", "threshold", "window") if r.get(k) is not None}
    if r.get("numbers"):
        out["numbers"] = dict(r["numbers"])
    return out

