"""What the dashboard shows of a PatchRollout or a PatchFleet, as plain JSON for the page.

Everything here is read from the objects as the API server returns them (the rollout's spec and
status, the Events posted on it): the step ladder with the time spent on each step, every check's
value over the kept analysis runs (`status.analysisHistory`) against the limit and the bounds the
decision used, canary against stable latency, and the output divergence check. The page only draws
these; the wording of values reuses the terminal's (graft.operator.render), so `graft rollout
status` and the dashboard never disagree.
"""
from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

from graft.api import FINAL_PHASES
from graft.operator.verbs import VERBS
from graft.operator.render import bounds_text, counts_text, manual_step, steps_of, value_text
from graft.rollout.status import from_time

ACTIONS = tuple(VERBS)          # the verbs a page may ask for, by name
_NUMBER = re.compile(r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?")
_STEP = re.compile(r"^step (\d+)/\d+")


def event_time(event: dict[str, Any]) -> float | None:
    """When an Event last happened: the newest of its timestamps the API server kept."""
    for key in ("lastTimestamp", "eventTime", "firstTimestamp"):
        try:
            t = from_time(event.get(key))
        except (TypeError, ValueError):
            t = None
        if t is not None:
            return t
    try:
        return from_time((event.get("metadata") or {}).get("creationTimestamp"))
    except (TypeError, ValueError):
        return None


def about(event: dict[str, Any], kind: str, name: str) -> bool:
    involved = event.get("involvedObject") or {}
    return involved.get("kind") == kind and involved.get("name") == name


def event_view(event: dict[str, Any]) -> dict[str, Any]:
    return {"time": event_time(event), "type": event.get("type") or "Normal", "reason": event.get("reason") or "",
            "message": event.get("message") or "", "count": event.get("count") or 1}


def rollout_row(obj: dict[str, Any]) -> dict[str, Any]:
    """The rollout's line in the list: phase, step, weight, revisions."""
    meta, status = obj["metadata"], obj.get("status") or {}
    steps = len(steps_of(obj))
    index = status.get("stepIndex")
    step = min(int(index) + 1, steps) if isinstance(index, int) and status.get("phase") else 0
    patch = (obj.get("spec") or {}).get("patch") or {}
    return {"kind": "PatchRollout", "name": meta["name"], "namespace": meta.get("namespace", ""),
            "phase": status.get("phase") or "Pending", "reason": status.get("reason") or "",
            "message": status.get("message") or "", "step": step, "steps": steps,
            "weight": status.get("weight", 0), "trafficShare": status.get("trafficShare"),
            "canaryRevision": status.get("canaryRevision") or "", "stableRevision": status.get("stableRevision") or "",
            "patch": status.get("patch") or (f"{patch.get('name')}@{patch.get('version')}" if patch.get("name") else ""),
            "action": (obj.get("spec") or {}).get("action", "apply"), "paused": bool((obj.get("spec") or {}).get("paused")),
            "created": meta.get("creationTimestamp"), "resourceVersion": meta.get("resourceVersion")}


def fleet_row(obj: dict[str, Any]) -> dict[str, Any]:
    """A fleet's line: its Converged condition as its phase, the revision every pod runs."""
    meta, status = obj["metadata"], obj.get("status") or {}
    converged = next((c for c in status.get("conditions") or [] if c.get("type") == "Converged"), None)
    phase = ("Pending" if converged is None else "Converged" if converged.get("status") == "True"
             else converged.get("reason") or "Converging")
    return {"kind": "PatchFleet", "name": meta["name"], "namespace": meta.get("namespace", ""), "phase": phase,
            "message": (converged or {}).get("message") or "", "step": None, "steps": None, "weight": None,
            "revision": status.get("revision") or "", "pods": status.get("pods"), "converged": status.get("converged"),
            "activeRollout": status.get("activeRollout") or "",
            "patches": [f"{p.get('name')}@{p.get('version')}" for p in (obj.get("spec") or {}).get("patches") or []],
            "created": meta.get("creationTimestamp"), "resourceVersion": meta.get("resourceVersion")}


def step_ladder(obj: dict[str, Any], events: Sequence[dict[str, Any]], now: float | None = None) -> list[dict[str, Any]]:
    """Every step with its weight, whether it waits for approval, its state (done, current, next) and
    the seconds spent on it: from the StepStarted Events (the time each step began) and
    status.stepStartedAt for the current one; a step left by a promotion or a rollback ends where
    the next began or where the rollout finished."""
    now = time.time() if now is None else now
    status = obj.get("status") or {}
    phase = status.get("phase")
    current = status.get("stepIndex") if phase else None
    started: dict[int, float] = {}
    for e in sorted(events, key=lambda e: event_time(e) or 0.0):
        m = _STEP.match(e.get("message") or "") if e.get("reason") == "StepStarted" else None
        t = event_time(e)
        if m and t is not None:
            started[int(m.group(1)) - 1] = t       # a step started again (after a retry): its latest start
    try:
        current_start = from_time(status.get("stepStartedAt"))
    except ValueError:
        current_start = None
    if isinstance(current, int) and current_start is not None:
        started.setdefault(current, current_start)
    finished = _finished_at(obj, events)
    out = []
    steps = steps_of(obj)
    for i, step in enumerate(steps):
        begin = started.get(i)
        later = [t for j, t in started.items() if j > i and begin is not None and t >= begin]
        end = min(later) if later else (finished if finished is not None else now)
        if not isinstance(current, int) or (i > current and phase not in ("Promoted",)):
            state = "next"
        elif i < current or phase == "Promoted":
            state = "done"
        else:
            state = "current" if phase not in FINAL_PHASES else "left"
        seconds = None if begin is None or state == "next" else max(0.0, end - begin)
        pause = step.get("pause")
        out.append({"index": i + 1, "weight": step.get("weight"), "manual": manual_step(step),
                    "pause": pause if isinstance(pause, str) else None, "state": state, "seconds": seconds,
                    "startedAt": begin})
    return out


def _finished_at(obj: dict[str, Any], events: Sequence[dict[str, Any]]) -> float | None:
    status = obj.get("status") or {}
    if status.get("phase") not in FINAL_PHASES:
        return None
    done = next((c for c in status.get("conditions") or [] if c.get("type") == "Completed"
                 and c.get("status") == "True"), None)
    try:
        t = from_time((done or {}).get("lastTransitionTime"))
    except ValueError:
        t = None
    if t is None:
        times = [event_time(e) for e in events if e.get("reason") in ("Promoted", "RolledBack", "Failed")]
        t = max((x for x in times if x is not None), default=None)
    return t


def check_series(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Each check (by role and name) over the kept analysis runs, oldest first: the value judged,
    the limit, and the bounds the decision used (the confidence interval of a rate or a difference;
    none for a quantile, judged on the value itself); with the counts it rested on and its verdict."""
    by_key: dict[tuple[str, str], dict[str, Any]] = {}
    for run in (obj.get("status") or {}).get("analysisHistory") or []:
        try:
            t = from_time(run.get("time"))
        except ValueError:
            t = None
        if t is None:
            continue
        for r in run.get("results") or []:
            if not isinstance(r, dict) or "name" not in r:
                continue
            role = r.get("role", "breaker")
            numbers = r.get("numbers") or {}
            series = by_key.setdefault((role, r["name"]), {
                "name": r["name"], "role": role, "threshold": r.get("threshold", ""), "kind": _kind(numbers),
                "dryRun": bool(r.get("dryRun")), "points": []})
            series["threshold"] = r.get("threshold", "") or series["threshold"]
            if series["kind"] == "value":
                series["kind"] = _kind(numbers)
            series["points"].append({
                "time": t, "step": run.get("step"), "runVerdict": run.get("verdict"), "verdict": r.get("verdict", ""),
                "value": r.get("value"), "limit": _limit(r), "lower": numbers.get("lower"),
                "upper": numbers.get("upper"), "canary": numbers.get("canary_quantile"),
                "stable": numbers.get("stable_quantile"), "text": value_text(r), "counts": counts_text(numbers),
                "bounds": bounds_text(numbers), "breaches": r.get("breaches", 0)})
    return list(by_key.values())


def _kind(numbers: dict[str, Any]) -> str:
    """What the check measures, for how the page draws it."""
    if "compared" in numbers:
        return "divergence"
    if "canary_quantile" in numbers:
        return "latency"
    if "difference" in numbers:
        return "difference"
    if "requests" in numbers:
        return "rate"
    return "value"


def _limit(result: dict[str, Any]) -> float | None:
    """The limit the value was held against: the one the judge recorded, else the threshold's number
    (`<= 0.5`, `<= 1.5 x stable`)."""
    limit = (result.get("numbers") or {}).get("limit")
    if isinstance(limit, (int, float)):
        return float(limit)
    m = _NUMBER.search(result.get("threshold") or "")
    return float(m.group()) if m else None


def latency(series: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latency checks that measured both sides (canary and stable quantiles), for their chart."""
    return [s for s in series if s["kind"] == "latency" and any(p["stable"] is not None for p in s["points"])]


def actions(obj: dict[str, Any]) -> list[str]:
    """The CLI's verbs that apply to the rollout in its phase (the CLI refuses the others)."""
    status, spec = obj.get("status") or {}, obj.get("spec") or {}
    phase = status.get("phase") or "Pending"
    if phase == "Promoted":
        return ["undo"]
    if phase in ("RolledBack", "Failed"):
        return ["retry"]
    out = ["promote", "abort"]
    out.insert(1, "resume" if spec.get("paused") or status.get("pauseConditions") or phase == "Paused" else "pause")
    return out


def rollout_view(obj: dict[str, Any], events: Sequence[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """Everything the rollout's page shows."""
    status = obj.get("status") or {}
    mine = sorted((e for e in events if about(e, "PatchRollout", obj["metadata"]["name"])),
                  key=lambda e: event_time(e) or 0.0)
    series = check_series(obj)
    analysis = status.get("analysis") or {}
    return {**rollout_row(obj), "ladder": step_ladder(obj, mine, now), "checks": series, "latency": latency(series),
            "divergence": [s for s in series if s["kind"] == "divergence"],
            "lastRun": {"time": analysis.get("lastRun"), "verdict": analysis.get("verdict"),
                        "results": [{"name": r.get("name"), "role": r.get("role", "breaker"),
                                     "verdict": r.get("verdict"), "value": value_text(r),
                                     "threshold": r.get("threshold", ""), "message": r.get("message", ""),
                                     "bounds": bounds_text(r.get("numbers") or {}),
                                     "counts": counts_text(r.get("numbers") or {})}
                                    for r in analysis.get("results") or []]},
            "history": status.get("analysisHistory") or [],
            "retention": ((obj.get("spec") or {}).get("analysis") or {}).get("measurementRetention", 10),
            "awaitingApprovalSince": status.get("awaitingApprovalSince"),
            "pauseConditions": status.get("pauseConditions") or [], "cause": status.get("cause") or "",
            "pods": status.get("pods") or [], "events": [event_view(e) for e in mine], "actions": actions(obj)}


def fleet_view(obj: dict[str, Any], events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    mine = sorted((e for e in events if about(e, "PatchFleet", obj["metadata"]["name"])),
                  key=lambda e: event_time(e) or 0.0)
    return {**fleet_row(obj), "events": [event_view(e) for e in mine], "actions": []}
