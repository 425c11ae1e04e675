"""A PatchRollout's status as a person reads it on a terminal.

`graft rollout status` and `graft demo`'s live view both show a rollout through `render_status`, so
the two never disagree on what a status says. It takes what both can read from the API server: the
rollout, the Events posted on it, and the pods its selector matches (optional: without them the
count of Ready pods is not shown).

A rollout that carries the Warning `CoarseSteps` (pod-ratio routing over fewer pods than its first
step can split: one pod is already more than that step asks for) is shown with that warning and
the traffic the canary really gets next to the weight the step asks for.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from graft.api import FINAL_PHASES as FINAL
from graft.operator.pods import is_ready
from graft.rollout.spec import DEFAULT_STEPS

COARSE_STEPS = "CoarseSteps"
PHASE_STYLE = {"Progressing": "cyan", "Paused": "yellow", "Promoted": "green", "RollingBack": "red",
               "RolledBack": "red", "Failed": "bold red", "Pending": "dim"}
VERDICT_STYLE = {"Successful": "green", "Failed": "red", "Inconclusive": "yellow", "Error": "magenta",
                 "Skipped": "dim"}


def render_status(obj: dict[str, Any], *, events: Sequence[dict[str, Any]] = (),
                  pods: Sequence[dict[str, Any]] | None = None) -> Group:
    """The rollout `obj`: summary (with any CoarseSteps warning), its pods, its last analysis."""
    parts: list[Any] = [_summary(obj, ready_count(pods) if pods is not None else None, events),
                        _pods(obj.get("status") or {}), _analysis(obj.get("status") or {})]
    return Group(*parts)


def ready_count(pods: Sequence[dict[str, Any]]) -> int:
    """Pods that take traffic, as the operator counts them: Ready, and not being deleted."""
    return sum(1 for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp"))


def steps_of(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The rollout's steps; the defaults when it names none (the operator applies them, not the CRD)."""
    return (obj.get("spec") or {}).get("steps") or DEFAULT_STEPS


def coarse_steps(obj: dict[str, Any], events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The latest CoarseSteps Event posted on this rollout (not on an earlier one of the same name)."""
    meta = obj["metadata"]
    found = [e for e in events if e.get("reason") == COARSE_STEPS and _about(e, meta)]
    return max(found, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "") if found else None


def _about(event: dict[str, Any], meta: dict[str, Any]) -> bool:
    ref = event.get("involvedObject") or {}
    if ref.get("kind", "PatchRollout") != "PatchRollout" or ref.get("name") != meta.get("name"):
        return False
    return not (ref.get("uid") and meta.get("uid")) or ref["uid"] == meta["uid"]


def coarse_steps_warning(obj: dict[str, Any], event: dict[str, Any], ready: int | None) -> Text:
    """The warning with the numbers: the weight the step asks for and what the canary really gets."""
    status = obj.get("status") or {}
    phase = status.get("phase", "Pending")
    text = Text()
    if phase not in FINAL and status.get("canaryPods"):
        steps = steps_of(obj)
        index = status.get("stepIndex", 0)
        asked = steps[index]["weight"] if 0 <= index < len(steps) else status.get("weight", 0)
        pods = f"{status['canaryPods']} of {ready} Ready pods" if ready else f"{status['canaryPods']} canary pods"
        text.append(f"step {index + 1} asks for {asked}% of the traffic; the canary gets "
                    f"{status.get('trafficShare', 0):g}% ({pods})\n", style="bold yellow")
    text.append(event.get("message") or "", style="yellow")
    return text


def _summary(obj: dict[str, Any], ready: int | None, events: Sequence[dict[str, Any]]) -> Table:
    meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
    phase = status.get("phase", "Pending")
    steps = steps_of(obj)
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    patch = spec.get("patch") or {}
    summary.add_row("Rollout", f"{meta.get('namespace')}/{meta['name']}")
    summary.add_row("Patch", f"{patch.get('name')}@{patch.get('version')}")
    summary.add_row("Phase", Text(phase + (" (paused)" if spec.get("paused") and phase != "Paused" else ""),
                                  style=PHASE_STYLE.get(phase, "")))
    summary.add_row("Step", f"{status.get('stepIndex', 0) + 1}/{len(steps)}  (weights "
                            + " → ".join(f"{s['weight']}%" for s in steps) + ")")
    summary.add_row("Weight", f"{status.get('weight', 0)}%")
    if ready is not None:
        summary.add_row("Ready pods", str(ready))
    summary.add_row("Stable", status.get("stableRevision") or "-")
    summary.add_row("Canary", status.get("canaryRevision") or "-")
    if status.get("message"):
        summary.add_row("Message", status["message"])
    for c in status.get("pauseConditions") or []:
        summary.add_row(Text("Paused by", style="bold yellow"),
                        f"{c.get('reason')} since {c.get('startTime')}: graft rollout resume {meta['name']} "
                        "(or the annotation graft.dev/resume=true) ends it")
    coarse = coarse_steps(obj, events)
    if coarse is not None:
        summary.add_row(Text(f"Warning {COARSE_STEPS}", style="bold yellow"),
                        coarse_steps_warning(obj, coarse, ready))
    return summary


def _pods(status: dict[str, Any]) -> Table:
    pods = Table(title="Pods", title_justify="left")
    for column in ("Pod", "Track", "Revision", "Restarts", "Patched at"):
        pods.add_column(column)
    for p in status.get("pods") or []:
        pods.add_row(p["name"], Text(p.get("track", ""), style="cyan" if p.get("track") == "canary" else ""),
                     p.get("revision") or "?", str(p.get("restartCount", 0)), p.get("patchedAt") or "-")
    return pods


def _value(result: dict[str, Any]) -> str:
    """A check's value as its table cell: output-divergence as the divergent share with its counts
    (`3 of 3` says more than `1`), any other check as its number."""
    value, numbers = result.get("value"), result.get("numbers") or {}
    if value is None:
        return "-"
    if "compared" in numbers and "divergent" in numbers:
        return f"{value * 100:.3g}% ({numbers['divergent']:.0f} of {numbers['compared']:.0f})"
    return f"{value:.4g}"


def _analysis(status: dict[str, Any]) -> Table:
    analysis = status.get("analysis") or {}
    metrics = Table(title=f"Analysis (last run {analysis.get('lastRun') or 'never'}: "
                          f"{analysis.get('verdict') or '-'})", title_justify="left")
    for column in ("Check", "Role", "Value", "Threshold", "Window", "Verdict", "Breaches", "Detail"):
        metrics.add_column(column)
    for r in analysis.get("results") or []:
        verdict = r.get("verdict", "")
        role = r.get("role", "breaker")
        metrics.add_row(r["name"] + (" (dry run)" if r.get("dryRun") else ""), role,
                        _value(r), r.get("threshold", ""), r.get("window", ""),
                        Text(verdict, style=VERDICT_STYLE.get(verdict, "")),
                        str(r.get("breaches", 0)) if role == "breaker" else "", r.get("message", ""))
    return metrics
