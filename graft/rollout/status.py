"""The PatchRollout `status`: where a rollout stands, kept in the object so a restarted operator
resumes the same step without re-patching anything.

Times are epoch seconds in memory and RFC 3339 strings (UTC, milliseconds) in the object.
"""
from __future__ import annotations

import copy
import pickle
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from graft.api import FINAL_PHASES, Phase, Track

# plain strings, as the object stores them (YAML and JSON writers take no enum)
PENDING, PROGRESSING, PAUSED = Phase.PENDING.value, Phase.PROGRESSING.value, Phase.PAUSED.value
PROMOTED, ROLLING_BACK = Phase.PROMOTED.value, Phase.ROLLING_BACK.value
ROLLED_BACK, FAILED = Phase.ROLLED_BACK.value, Phase.FAILED.value
PHASES = tuple(p.value for p in Phase)
CANARY, STABLE = Track.CANARY.value, Track.STABLE.value


def to_time(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def from_time(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass(slots=True)
class PodRecord:
    """One engine pod as the rollout last saw it: which track it is on and what it runs."""

    name: str
    uid: str = ""
    container_id: str = ""
    restart_count: int = 0
    track: str = STABLE
    revision: str | None = None        # the engine's revision when last confirmed
    patched_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return _compact({"name": self.name, "uid": self.uid, "containerID": self.container_id,
                         "restartCount": self.restart_count, "track": self.track,
                         "revision": self.revision, "patchedAt": to_time(self.patched_at)})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PodRecord":
        return cls(d["name"], d.get("uid", ""), d.get("containerID", ""), int(d.get("restartCount", 0)),
                   d.get("track", STABLE), d.get("revision"), from_time(d.get("patchedAt")))


@dataclass(slots=True)
class CheckResult:
    """One check of the latest analysis run, with the numbers it was judged on."""

    name: str
    verdict: str
    threshold: str
    window: str
    value: float | None = None
    breaches: int = 0
    dry_run: bool = False
    message: str = ""
    role: str = "breaker"              # breaker | gate
    conclusive: bool = False           # a gate's failure strong enough to roll back
    short: bool = False                # Inconclusive for lack of traffic (not for lack of data)
    numbers: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return _compact({"name": self.name, "role": self.role, "value": _finite(self.value),
                         "threshold": self.threshold, "window": self.window, "verdict": self.verdict,
                         "breaches": self.breaches, "dryRun": self.dry_run or None,
                         "conclusive": self.conclusive or None, "short": self.short or None,
                         "message": self.message,
                         "numbers": {k: float(f"{v:.6g}") for k, v in self.numbers.items()
                                     if _finite(v) is not None} or None})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CheckResult":
        return cls(d["name"], d.get("verdict", ""), d.get("threshold", ""), d.get("window", ""),
                   d.get("value"), int(d.get("breaches", 0)), bool(d.get("dryRun", False)),
                   d.get("message", ""), d.get("role", "breaker"), bool(d.get("conclusive", False)),
                   bool(d.get("short", False)), dict(d.get("numbers") or {}))

    def to_record(self) -> dict[str, Any]:
        """The check as `status.analysisHistory` keeps it: its numbers without the sentence (a run of
        forty checks a hundred times over must stay far below the object's size limit)."""
        d = self.to_dict()
        d.pop("message", None)
        d.pop("short", None)
        return d


@dataclass(slots=True)
class AnalysisRun:
    """One past analysis run, as `graft rollout history` shows it: when, at which step (counted from
    1), its verdict and each check's numbers."""

    time: float
    step: int
    verdict: str
    results: list[CheckResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"time": to_time(self.time), "step": self.step, "verdict": self.verdict,
                "results": [r.to_record() for r in self.results]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AnalysisRun":
        return cls(from_time(d.get("time")) or 0.0, int(d.get("step") or 0), d.get("verdict") or "",
                   [CheckResult.from_dict(r) for r in d.get("results") or [] if isinstance(r, dict) and "name" in r])


@dataclass(slots=True)
class AnalysisStatus:
    last_run: float | None = None
    verdict: str | None = None
    results: list[CheckResult] = field(default_factory=list)
    inconclusive_runs: int = 0         # holding runs in a row since the step's pause ended
    error_runs: int = 0                # runs in a row the provider failed, outages aside
    outage_since: float | None = None  # since when Prometheus cannot be reached (the step holds)
    outage_seconds: float = 0.0        # outage time in this step that ended: the deadline waits for it

    def held_by_outage(self, now: float) -> float:
        """Seconds this step has held for Prometheus, the outage going on included."""
        return self.outage_seconds + (now - self.outage_since if self.outage_since is not None else 0.0)

    def result(self, name: str, role: str | None = None) -> CheckResult | None:
        return next((r for r in self.results if r.name == name and (role is None or r.role == role)), None)

    def to_dict(self) -> dict[str, Any]:
        # outageSince is written when None too: the status is merge-patched, and null clears it
        return {**_compact({"lastRun": to_time(self.last_run), "verdict": self.verdict,
                            "inconclusiveRuns": self.inconclusive_runs, "errorRuns": self.error_runs,
                            "outageSeconds": round(self.outage_seconds, 3),
                            "results": [r.to_dict() for r in self.results]}),
                "outageSince": to_time(self.outage_since)}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "AnalysisStatus":
        d = d or {}
        return cls(from_time(d.get("lastRun")), d.get("verdict"),
                   [CheckResult.from_dict(r) for r in d.get("results") or []],
                   int(d.get("inconclusiveRuns") or 0), int(d.get("errorRuns") or 0),
                   from_time(d.get("outageSince")), float(d.get("outageSeconds") or 0.0))


@dataclass(slots=True)
class RolloutStatus:
    phase: str = PENDING
    reason: str = ""
    message: str = ""
    patch: str = ""                     # name@version this rollout applies
    step_index: int = 0
    weight: int = 0                     # the traffic share in effect
    stable_revision: str = ""
    canary_revision: str = ""
    started_at: float | None = None
    step_started_at: float | None = None
    step_ready_at: float | None = None  # when the step's pods and route were in place
    end_phase: str = ""                 # where RollingBack settles: RolledBack or Failed
    cause: str = ""                     # why it is rolling back
    full_promotion: bool = False
    observed_generation: int = 0
    # an untilApproved step whose analysis passed: since when it waits for a person (graft.dev/promote)
    awaiting_approval_since: float | None = None
    # pauses the controller decided (the analysis could not): kept here, never in spec.paused, so a
    # GitOps tool's self-heal cannot resume them; the annotation graft.dev/resume ends them
    pause_conditions: list[dict[str, Any]] = field(default_factory=list)
    fleet: str = ""                     # the PatchFleet this rollout acts on
    stable_patch: str = ""              # an upgrade: the version of the patch the stable side runs
    canary_pods: int = 0                # Ready pods on the canary track
    traffic_share: float = 0.0          # the canary's real share of traffic, percent
    conditions: list[dict[str, Any]] = field(default_factory=list)
    pods: list[PodRecord] = field(default_factory=list)
    analysis: AnalysisStatus = field(default_factory=AnalysisStatus)
    # the latest analysis runs, oldest first, at most spec.analysis.measurementRetention of them
    analysis_history: list[AnalysisRun] = field(default_factory=list)

    def record_analysis(self, retention: int) -> None:
        """Keep the analysis run just made (status.analysis) in the history, trimmed to `retention` runs."""
        a = self.analysis
        if a.last_run is not None and a.verdict is not None:
            self.analysis_history.append(AnalysisRun(a.last_run, self.step_index + 1, a.verdict,
                                                     copy.deepcopy(a.results)))
        del self.analysis_history[:max(0, len(self.analysis_history) - retention)]

    def pod(self, name: str) -> PodRecord | None:
        return next((p for p in self.pods if p.name == name), None)

    def copy(self) -> "RolloutStatus":
        """A copy to change; the kept analysis runs are shared, never changed once kept (a copy of
        each on every decision would cost the simulator, which decides thousands of times a run)."""
        history, self.analysis_history = self.analysis_history, []
        try:
            # a deep copy; pickle's round trip makes it several times faster than copy.deepcopy
            out = pickle.loads(pickle.dumps(self, pickle.HIGHEST_PROTOCOL))
        finally:
            self.analysis_history = history
        out.analysis_history = list(history)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The status as stored; fields with no value are written as None so a merge patch clears them."""
        return {
            "phase": self.phase, "reason": self.reason, "message": self.message, "patch": self.patch,
            "stepIndex": self.step_index, "weight": self.weight,
            "stableRevision": self.stable_revision, "canaryRevision": self.canary_revision,
            "startedAt": to_time(self.started_at), "stepStartedAt": to_time(self.step_started_at),
            "stepReadyAt": to_time(self.step_ready_at), "endPhase": self.end_phase or None, "cause": self.cause or None,
            "fullPromotion": self.full_promotion, "observedGeneration": self.observed_generation,
            "awaitingApprovalSince": to_time(self.awaiting_approval_since),
            "pauseConditions": self.pause_conditions or None, "fleet": self.fleet or None,
            "stablePatch": self.stable_patch or None,
            "step": self.step_index + 1, "canaryPods": self.canary_pods, "trafficShare": self.traffic_share,
            "pods": [p.to_dict() for p in self.pods],
            "analysis": self.analysis.to_dict(),
            "analysisHistory": [r.to_dict() for r in self.analysis_history] or None,
            "conditions": self.conditions or None,
        }

    def refresh_conditions(self, now: float) -> None:
        """Conditions as the Kubernetes API conventions spell them; a transition time moves only when
        a condition's status does (so `kubectl wait --for=condition=Promoted` works)."""
        verdict = self.analysis.verdict
        wanted = [
            ("Progressing", self.phase in (PROGRESSING, ROLLING_BACK),
             self.reason or self.phase, self.message),
            ("Promoted", self.phase == PROMOTED, "Promoted" if self.phase == PROMOTED else self.phase,
             self.message if self.phase == PROMOTED else ""),
            ("Healthy", verdict in (None, "Successful"), verdict or "NotAnalysed",
             "; ".join(r.message for r in self.analysis.results if r.verdict not in ("Successful", "Skipped")
                       and not r.dry_run)[:1024]),
            ("Completed", self.phase in FINAL_PHASES, self.reason or self.phase, self.message if self.phase in FINAL_PHASES else ""),
        ]
        old = {c.get("type"): c for c in self.conditions}
        out = []
        for kind, ok, reason, message in wanted:
            status = "True" if ok else "False"
            before = old.get(kind)
            moved = before is None or before.get("status") != status
            out.append({"type": kind, "status": status, "reason": _reason(reason), "message": message,
                        "lastTransitionTime": to_time(now) if moved else before.get("lastTransitionTime"),
                        "observedGeneration": self.observed_generation})
        self.conditions = out

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "RolloutStatus":
        d = d or {}
        return cls(
            phase=d.get("phase") or PENDING, reason=d.get("reason") or "", message=d.get("message") or "",
            patch=d.get("patch") or "", step_index=int(d.get("stepIndex") or 0),
            weight=int(d.get("weight") or 0), stable_revision=d.get("stableRevision") or "",
            canary_revision=d.get("canaryRevision") or "", started_at=from_time(d.get("startedAt")),
            step_started_at=from_time(d.get("stepStartedAt")), step_ready_at=from_time(d.get("stepReadyAt")),
            end_phase=d.get("endPhase") or "", cause=d.get("cause") or "", full_promotion=bool(d.get("fullPromotion")),
            observed_generation=int(d.get("observedGeneration") or 0),
            awaiting_approval_since=from_time(d.get("awaitingApprovalSince")),
            pause_conditions=[dict(c) for c in d.get("pauseConditions") or [] if isinstance(c, dict)],
            fleet=d.get("fleet") or "", stable_patch=d.get("stablePatch") or "", canary_pods=int(d.get("canaryPods") or 0),
            traffic_share=float(d.get("trafficShare") or 0.0),
            conditions=[dict(c) for c in d.get("conditions") or []],
            pods=[PodRecord.from_dict(p) for p in d.get("pods") or []],
            analysis=AnalysisStatus.from_dict(d.get("analysis")),
            analysis_history=[AnalysisRun.from_dict(r) for r in d.get("analysisHistory") or [] if isinstance(r, dict)],
        )


def _reason(text: str) -> str:
    """A condition reason is CamelCase, no spaces (the API conventions)."""
    return "".join(ch for ch in text if ch.isalnum()) or "Unknown"


def _finite(value: float | None) -> float | None:
    """A number a status can hold (JSON has no NaN or Inf): non-finite values are written as none."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _compact(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}
