"""A PatchRollout's status as a person reads it on a terminal.

`graft rollout status` and `graft demo`'s live view both show a rollout through `render_status`, so
the two never disagree on what a status says. It takes what both can read from the API server: the
rollout, the Events posted on it, and the pods its selector matches (optional: without them the
count of Ready pods is not shown).

A rollout at a manual step (`untilApproved: true`, or `pause: {}`) whose analysis passed shows since
when it waits and the command that approves it; the steps line marks every manual step.

A rollout that carries the Warning `CoarseSteps` (pod-ratio routing over fewer pods than its first
step can split: one pod is already more than that step asks for) is shown with that warning and
the traffic the canary really gets next to the weight the step asks for.

The analysis table fits the width it is drawn at (a `status -w` view is redrawn at the terminal's
width each time): where its Detail column would be narrower than `DETAIL_MIN` characters, each
check's sentence would wrap a word or two a line, so the details go under the table instead, as
numbered notes at the full width, and the table's last column (Note) holds the note's number.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from graft.api import FINAL_PHASES as FINAL
from graft.api import Reason
from graft.operator.pods import is_ready
from graft.rollout.spec import DEFAULT_STEPS

PHASE_STYLE = {"Progressing": "cyan", "Paused": "yellow", "Promoted": "green", "RollingBack": "red",
               "RolledBack": "red", "Failed": "bold red", "Pending": "dim"}
VERDICT_STYLE = {"Successful": "green", "Failed": "red", "Inconclusive": "yellow", "Error": "magenta",
                 "Skipped": "dim"}
# The narrowest Detail column that still reads as sentences (half an 80-column line); narrower, the
# details are folded under the analysis table. A detail shorter than this needs only its own length.
DETAIL_MIN = 40
ANALYSIS_COLUMNS = ("Check", "Role", "Value", "Threshold", "Window", "Verdict", "Breaches")
WRAPPING = ("Value", "Threshold")   # the columns a folded table may wrap


def render_status(obj: dict[str, Any], *, events: Sequence[dict[str, Any]] = (),
                  pods: Sequence[dict[str, Any]] | None = None) -> Group:
    """The rollout `obj`: summary (with any CoarseSteps warning), its pods, its last analysis."""
    parts: list[Any] = [_summary(obj, ready_count(pods) if pods is not None else None, events),
                        _pods(obj.get("status") or {}), Analysis(obj.get("status") or {})]
    return Group(*parts)


def ready_count(pods: Sequence[dict[str, Any]]) -> int:
    """Pods that take traffic, as the operator counts them: Ready, and not being deleted."""
    return sum(1 for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp"))


def steps_of(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The rollout's steps; the defaults when it names none (the operator applies them, not the CRD)."""
    return (obj.get("spec") or {}).get("steps") or DEFAULT_STEPS


def manual_step(step: dict[str, Any]) -> bool:
    """A step that waits for a person's approval, in either spelling (`untilApproved: true`, `pause: {}`)."""
    return step.get("untilApproved") is True or step.get("pause") == {}


def step_weights(steps: Sequence[dict[str, Any]]) -> str:
    """The steps' weights in order, a manual step marked: `1% → 20% (approval) → 100%`."""
    return " → ".join(f"{s.get('weight')}%" + (" (approval)" if manual_step(s) else "") for s in steps)


def coarse_steps(obj: dict[str, Any], events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The latest CoarseSteps Event posted on this rollout (not on an earlier one of the same name)."""
    meta = obj["metadata"]
    found = [e for e in events if e.get("reason") == Reason.COARSE_STEPS and _about(e, meta)]
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
    summary.add_row("Step", f"{status.get('stepIndex', 0) + 1}/{len(steps)}  (weights {step_weights(steps)})")
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
    if status.get("awaitingApprovalSince") and phase not in FINAL:
        summary.add_row(Text("Waiting for", style="bold yellow"),
                        f"approval since {status['awaitingApprovalSince']}: graft rollout promote {meta['name']} "
                        f"(or the annotation graft.dev/promote=step) approves step {status.get('stepIndex', 0) + 1}; "
                        f"graft rollout abort {meta['name']} rolls back")
    coarse = coarse_steps(obj, events)
    if coarse is not None:
        summary.add_row(Text(f"Warning {Reason.COARSE_STEPS}", style="bold yellow"),
                        coarse_steps_warning(obj, coarse, ready))
    return summary


def _pods(status: dict[str, Any]) -> Table:
    """The rollout's pods. On a narrow terminal the revision and the time give way, folded onto
    more lines; a pod name, a track and a count are never cut (a pod is told apart by its last
    characters)."""
    pods = Table(title="Pods", title_justify="left")
    for column in ("Pod", "Track", "Revision", "Restarts", "Patched at"):
        pods.add_column(column, **({"overflow": "fold"} if column in ("Revision", "Patched at") else {"no_wrap": True}))
    for p in status.get("pods") or []:
        pods.add_row(p["name"], Text(p.get("track", ""), style="cyan" if p.get("track") == "canary" else ""),
                     p.get("revision") or "?", str(p.get("restartCount", 0)), p.get("patchedAt") or "-")
    return pods


def value_text(result: dict[str, Any]) -> str:
    """A check's value as its table cell: output-divergence as the divergent share with its counts
    (`3 of 3` says more than `1`), any other check as its number."""
    value, numbers = result.get("value"), result.get("numbers") or {}
    if value is None:
        return "-"
    if "compared" in numbers and "divergent" in numbers:
        return f"{value * 100:.3g}% ({numbers['divergent']:.0f} of {numbers['compared']:.0f})"
    return f"{value:.4g}"


class Analysis:
    """The last analysis run: a row per check, its detail (the sentence the check judged with) in
    the Detail column where that column gets at least `DETAIL_MIN` characters, else folded under
    the table as numbered notes. Decided at each render, for the width it is drawn at."""

    def __init__(self, status: dict[str, Any]):
        analysis = status.get("analysis") or {}
        self.title = (f"Analysis (last run {analysis.get('lastRun') or 'never'}: "
                      f"{analysis.get('verdict') or '-'})")
        self.results: list[dict[str, Any]] = list(analysis.get("results") or [])
        # the note number of each row with a detail, counted down the table
        with_detail = [i for i, r in enumerate(self.results) if r.get("message")]
        self.note = {row: number for number, row in enumerate(with_detail, 1)}

    def table(self, details: str = "inline") -> Table:
        """The table with each detail in its Detail column (`inline`), with the number of its note
        in a Note column instead (`notes`), or with neither (`none`)."""
        inline = details == "inline"
        # Folded, the table is as narrow as it can be without cutting a word: no rules between the
        # columns, and only Value and Threshold (short phrases) wrap; a dry run's mark goes under
        # its check's name.
        metrics = Table(title=self.title, title_justify="left",
                        **({} if inline else {"box": box.SIMPLE_HEAD, "show_edge": False, "padding": (0, 0)}))
        last = {"inline": ("Detail",), "notes": ("Note",), "none": ()}[details]
        for column in ANALYSIS_COLUMNS + last:
            metrics.add_column(column, no_wrap=not inline and column not in WRAPPING)
        for row, r in enumerate(self.results):
            verdict = r.get("verdict", "")
            role = r.get("role", "breaker")
            dry = ((" " if inline else "\n") + "(dry run)") if r.get("dryRun") else ""
            cells: list[Any] = [r["name"] + dry, role, value_text(r), r.get("threshold", ""), r.get("window", ""),
                                Text(verdict, style=VERDICT_STYLE.get(verdict, "")),
                                str(r.get("breaches", 0)) if role == "breaker" else ""]
            if details == "inline":
                cells.append(Text(r.get("message") or ""))
            elif details == "notes":
                cells.append(Text(f"[{self.note[row]}]" if row in self.note else ""))
            metrics.add_row(*cells)
        return metrics

    def notes(self) -> Table:
        """Each check's detail as a numbered note, its lines wrapped under its first word."""
        notes = Table.grid(padding=(0, 1))
        notes.add_column(no_wrap=True, justify="right", style="dim")
        notes.add_column()
        for row, number in self.note.items():
            notes.add_row(Text(f"[{number}]"), Text(self.results[row]["message"]))
        return notes

    def inline_fits(self, console: Console, options: ConsoleOptions) -> bool:
        """Whether the Detail column gets `DETAIL_MIN` characters (or the longest detail's length,
        if shorter) next to the other columns at their natural width: the column's own padding
        and rule take 3 more."""
        longest = max((len(r.get("message") or "") for r in self.results), default=0)
        if longest == 0:
            return True
        others = Measurement.get(console, options, self.table("none")).maximum
        return options.max_width - others - 3 >= min(DETAIL_MIN, longest)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.inline_fits(console, options):
            yield self.table("inline")
        else:
            yield self.table("notes")
            yield self.notes()

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.table("inline"))


# -- tables of `graft rollout list` and `graft rollout history` ---------------------------------------

def print_table(console: Console, columns: Sequence[str], rows: Sequence[Sequence[str]],
                styles: Sequence[dict[int, str]] | None = None, sections: Sequence[int] = ()) -> None:
    """Rows under their column names: on a terminal a rich table (`styles`: per row, a style per
    column index; `sections`: the rows a rule goes above); otherwise plain text as kubectl prints
    it (upper-case names, columns three spaces apart, no colour, no wrapping), for `grep`, `awk`
    and `column` alike."""
    if console.is_terminal:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for name in columns:
            table.add_column(name, overflow="fold")
        for i, row in enumerate(rows):
            if i in sections and i:
                table.add_section()
            style = styles[i] if styles else {}
            table.add_row(*(Text(cell, style=style.get(j, "")) for j, cell in enumerate(row)))
        console.print(table)
        return
    header = [c.upper() for c in columns]
    widths = [max(len(str(r[j])) for r in [header, *rows]) for j in range(len(columns))]
    for row in [header, *rows]:
        console.out("   ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip(), highlight=False)


def age(seconds: float) -> str:
    """An age as `kubectl get` shows one: 45s, 5m30s, 12m, 3h20m, 20h, 3d4h, 12d, 2y30d."""
    s = int(max(0.0, seconds))
    m, h, d = s // 60, s // 3600, s // 86400
    if s < 120:
        return f"{s}s"
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if h < 3:
        return f"{m}m"
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if d < 8:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    if d < 730:
        return f"{d}d"
    return f"{d // 365}y{d % 365}d" if d % 365 else f"{d // 365}y"


def counts_text(numbers: dict[str, float]) -> str:
    """The counts a check was judged on: errors of requests, divergent of compared requests,
    each side's errors, or each side's latency samples."""
    n = {k: f"{v:.0f}" for k, v in numbers.items()}
    if "compared" in n and "divergent" in n:
        return f"{n['divergent']}/{n['compared']} divergent"
    if "requests" in n and "errors" in n:
        return f"{n['errors']}/{n['requests']} bad"
    if "canary_requests" in n and "stable_requests" in n:
        return (f"canary {n.get('canary_errors', '0')}/{n['canary_requests']}, "
                f"stable {n.get('stable_errors', '0')}/{n['stable_requests']} errors")
    if "canary_samples" in n:
        return f"{n['canary_samples']} canary" + (f", {n['stable_samples']} stable" if "stable_samples" in n else "") \
            + " samples"
    return ""


def bounds_text(numbers: dict[str, float]) -> str:
    """The confidence bounds a check was judged on (rates and differences), as [lower, upper]."""
    if "lower" not in numbers and "upper" not in numbers:
        return ""
    low, high = numbers.get("lower"), numbers.get("upper")
    return f"[{'-' if low is None else f'{low:.3g}'}, {'-' if high is None else f'{high:.3g}'}]"


HISTORY_COLUMNS = ("Time", "Step", "Run", "Check", "Role", "Value", "Threshold", "Counts", "Bounds", "Verdict")


def history_rows(obj: dict[str, Any]) -> tuple[list[list[str]], list[dict[int, str]], list[int]]:
    """`status.analysisHistory` as rows of HISTORY_COLUMNS, a row per check, the run's time, step and
    verdict on its first row; with each row's styles and the rows that open a run."""
    steps = len(steps_of(obj))
    rows: list[list[str]] = []
    styles: list[dict[int, str]] = []
    starts: list[int] = []
    for run in (obj.get("status") or {}).get("analysisHistory") or []:
        starts.append(len(rows))
        verdict = run.get("verdict") or ""
        head = [run.get("time") or "-", f"{run.get('step', 0)}/{steps}", verdict]
        results = run.get("results") or [{}]
        for i, r in enumerate(results):
            numbers = r.get("numbers") or {}
            name = r.get("name", "") + (" (dry run)" if r.get("dryRun") else "")
            rows.append((head if i == 0 else ["", "", ""])
                        + [name, r.get("role", "breaker") if r else "", value_text(r) if r else "",
                           r.get("threshold", ""), counts_text(numbers), bounds_text(numbers), r.get("verdict", "")])
            styles.append({2: VERDICT_STYLE.get(verdict, "") if i == 0 else "",
                           9: VERDICT_STYLE.get(r.get("verdict", ""), "")})
    return rows, styles, starts
