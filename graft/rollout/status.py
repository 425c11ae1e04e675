"""The PatchRollout `status`: where a rollout stands, kept in the object so a restarted operator
resumes the same step without re-patching anything.

The operator works on the dataclasses here; what the object holds is the status model
(graft.rollout.models.patchrollout.PatchRolloutStatus, from which the CRD's status schema is
generated): `to_dict` writes a status through it and `from_dict` reads one through it, field by field
by the same names, so a field the operator writes is one the schema declares. Times are epoch
seconds in memory and RFC 3339 strings (UTC, milliseconds) in the object.
"""
from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from graft.api import FINAL_PHASES, Phase, Track
from graft.rollout.models import patchrollout as model
from graft.rollout.models.base import from_time, to_time

__all__ = ["to_time", "from_time", "PodRecord", "CheckResult", "AnalysisRun", "AnalysisStatus", "RolloutStatus"]

# plain strings, as the object stores them (YAML and JSON writers take no enum)
PENDING, PROGRESSING, PAUSED = Phase.PENDING.value, Phase.PROGRESSING.value, Phase.PAUSED.value
PROMOTED, ROLLING_BACK = Phase.PROMOTED.value, Phase.ROLLING_BACK.value
ROLLED_BACK, FAILED = Phase.ROLLED_BACK.value, Phase.FAILED.value
PHASES = tuple(p.value for p in Phase)
CANARY, STABLE = Track.CANARY.value, Track.STABLE.value


def _write(model: type[BaseModel], obj: Any) -> dict[str, Any]:
    """`obj` (a dataclass here) as the status model writes it: the model's names, its encodings."""
    return model.model_validate(obj).model_dump(mode="json", by_alias=True)


def _read(model: type[BaseModel], d: Any) -> BaseModel:
    return model.model_validate(d if isinstance(d, dict) else {})


def _given(m: BaseModel, *names: str) -> dict[str, Any]:
    """The fields of model object `m` that hold a value, by their Python names (the dataclass's)."""
    return {n: getattr(m, n) for n in names if getattr(m, n) is not None}


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
        return _write(model.PodStatus, self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PodRecord":
        return cls._of(_read(model.PodStatus, d))

    @classmethod
    def _of(cls, m: model.PodStatus) -> "PodRecord":
        return cls(**_given(m, *POD_FIELDS))


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
    pending: bool = False              # Inconclusive while its number is made (a job check's Job runs)

    def to_dict(self) -> dict[str, Any]:
        return _write(model.CheckStatus, self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CheckResult":
        return cls._of(_read(model.CheckStatus, d))

    @classmethod
    def _of(cls, m: model.CheckRecord) -> "CheckResult":
        return cls(**_given(m, *(f for f in CHECK_FIELDS if f in type(m).model_fields)))

    def to_record(self) -> dict[str, Any]:
        """The check as `status.analysisHistory` keeps it (CheckRecord): its numbers without the
        sentence (a run of forty checks a hundred times over must stay far below the object's size limit)."""
        return _write(model.CheckRecord, self)


@dataclass(slots=True)
class AnalysisRun:
    """One past analysis run, as `graft rollout history` shows it: when, at which step (counted from
    1), its verdict and each check's numbers."""

    time: float
    step: int
    verdict: str
    results: list[CheckResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return _write(model.AnalysisRunStatus, self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AnalysisRun":
        return cls._of(_read(model.AnalysisRunStatus, d))

    @classmethod
    def _of(cls, m: model.AnalysisRunStatus) -> "AnalysisRun":
        return cls(m.time or 0.0, m.step or 0, m.verdict or "", [CheckResult._of(r) for r in m.results or ()])


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
        # outageSince is written when None too (the model's `always`): the status is merge-patched, and
        # null clears it
        return _write(model.AnalysisStatus, self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "AnalysisStatus":
        return cls._of(_read(model.AnalysisStatus, d))

    @classmethod
    def _of(cls, m: model.AnalysisStatus | None) -> "AnalysisStatus":
        if m is None:
            return cls()
        plain = _given(m, "last_run", "verdict", "inconclusive_runs", "error_runs", "outage_since", "outage_seconds")
        return cls(**plain, results=[CheckResult._of(r) for r in m.results or ()])


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
    # where each pod's record was last found in `pods` (a hint, checked on every use): a lookup by
    # name per pod per decision would otherwise scan the list, quadratic in the fleet's size
    _pod_at: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def record_analysis(self, retention: int) -> None:
        """Keep the analysis run just made (status.analysis) in the history, trimmed to `retention` runs."""
        a = self.analysis
        if a.last_run is not None and a.verdict is not None:
            self.analysis_history.append(AnalysisRun(a.last_run, self.step_index + 1, a.verdict,
                                                     copy.deepcopy(a.results)))
        del self.analysis_history[:max(0, len(self.analysis_history) - retention)]

    def pod(self, name: str) -> PodRecord | None:
        """The record of pod `name`, or None. `pods` is changed in place (appended, removed, sorted,
        replaced), so the position remembered for a name is only a hint: it is used when the record
        there still has that name, and all positions are taken anew when it has not."""
        pods, at = self.pods, self._pod_at.get(name)
        if at is not None and at < len(pods) and pods[at].name == name:
            return pods[at]
        self._pod_at = {p.name: i for i, p in enumerate(pods)}
        at = self._pod_at.get(name)
        return pods[at] if at is not None else None

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

    @property
    def step(self) -> int:
        """The current step counted from 1, as Events, the CLI and `status.step` count it."""
        return self.step_index + 1

    def to_dict(self) -> dict[str, Any]:
        """The status as stored; fields with no value are written as None so a merge patch clears them."""
        return _write(model.PatchRolloutStatus, self)

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
        m = _read(model.PatchRolloutStatus, d)
        plain = _given(m, *(f.name for f in dataclasses.fields(cls)
                            if f.name not in ("pods", "analysis", "analysis_history", "pause_conditions", "conditions", "_pod_at")))
        return cls(**plain,
                   pods=[PodRecord._of(p) for p in m.pods or ()],
                   analysis=AnalysisStatus._of(m.analysis),
                   analysis_history=[AnalysisRun._of(r) for r in m.analysis_history or ()],
                   pause_conditions=[c.model_dump(by_alias=True) for c in m.pause_conditions or ()],
                   conditions=[c.model_dump(by_alias=True) for c in m.conditions or ()])


def _reason(text: str) -> str:
    """A condition reason is CamelCase, no spaces (the API conventions)."""
    return "".join(ch for ch in text if ch.isalnum()) or "Unknown"


POD_FIELDS = tuple(f.name for f in dataclasses.fields(PodRecord))
CHECK_FIELDS = tuple(f.name for f in dataclasses.fields(CheckResult))
