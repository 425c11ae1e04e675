"""What the operator saw this tick, as plain data: pods, engine revisions, metrics, user controls."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from graft.api import Reason
from graft.rollout.hooks import HookAnswer
from graft.rollout.spec import PatchSpec

# Admin API answers, by how the rollout treats them.
PERMANENT_ERRORS = {
    "malformed": Reason.PATCH_REFUSED,            # 400
    "unauthorized": Reason.UNAUTHORIZED,          # 401 / 403 (wrong token, untrusted bundle)
    "unknown-patch": Reason.UNKNOWN_PATCH,        # 404
    "conflict": Reason.PATCH_CONFLICT,            # 409
    "misconfigured": Reason.POD_MISCONFIGURED,    # an engine the operator cannot call as it is declared
}
MISCONFIGURED = "misconfigured"
VERIFY_FAILED = "verify-failed"         # 422: the engine reverted it already
UNREACHABLE = "unreachable"             # connection errors, timeouts, 5xx: tried again next tick
BAD_ANSWER = "bad-answer"               # a 2xx whose body is not the API's (no revision): tried again next tick


@dataclass(slots=True)
class PodError:
    kind: str           # a key of PERMANENT_ERRORS, VERIFY_FAILED or UNREACHABLE
    message: str

    @property
    def permanent(self) -> bool:
        return self.kind in PERMANENT_ERRORS


@dataclass(slots=True)
class PodObservation:
    """One pod matching the selector. `revision` is the engine's own answer (None: unknown this tick)."""

    name: str
    uid: str = ""
    container_id: str = ""
    restart_count: int = 0
    ready: bool = True
    track: str | None = None           # label graft.dev/track
    patches: str | None = None         # annotation graft.dev/patches
    revision: str | None = None
    error: PodError | None = None


@dataclass(slots=True)
class Measurement:
    """One check's numbers, as its plan names them (graft.rollout.analysis.plan_run).

    `check` is the check's key (`breaker/error-rate`, `gate/tpot-p99`). A value of None: the query
    returned nothing. `error`: the provider failed (unreachable, a bad query, a timeout); `outage`:
    it failed because Prometheus could not be reached or answered 5xx, which passes by itself (the
    rollout holds and goes on), unlike a refused query or a non-finite answer (the check is wrong).
    `pending`: the number is on its way (a job check's Job runs), said in words; the check waits,
    holding the step whatever its role. `final`: the number is all the step will get (a job's), so a
    gate it breaches rolls back as a conclusive gate does.
    """

    check: str
    values: dict[str, float | None] = field(default_factory=dict)
    error: str | None = None
    outage: bool = False
    pending: str | None = None
    final: bool = False

    def __post_init__(self) -> None:
        """Whatever the provider: NaN reads as no data, an infinite number makes the measurement an
        error naming it (no check can judge it, and a status cannot hold it)."""
        if self.values is None:
            self.values = {}
        for key, value in list(self.values.items()):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                self.error, self.outage = self.error or f"{key} is {value!r:.60}, not a number", False
                self.values[key] = None
            elif math.isnan(value):
                self.values[key] = None
            elif math.isinf(value):
                self.error, self.outage = self.error or f"{key} is {value}, not a finite number", False
                self.values[key] = None

    def get(self, key: str) -> float | None:
        return self.values.get(key)


@dataclass(slots=True)
class Problem:
    """Something outside the pods that stops the rollout from acting (a missing Secret, a bad bundle)."""

    reason: str
    message: str
    permanent: bool = False


@dataclass(slots=True)
class Controls:
    promote: str | None = None          # annotation graft.dev/promote: step | full
    abort: bool = False                 # annotation graft.dev/abort: "true"
    resume: bool = False                # annotation graft.dev/resume: ends a pause the controller decided
    promoted_by: str | None = None      # who set graft.dev/promote, where the object tells (its field manager)


@dataclass(slots=True)
class Observation:
    pods: list[PodObservation] = field(default_factory=list)
    measurements: list[Measurement] | None = None   # None: no analysis ran this tick
    route_weight: int | None = None                 # the router's canary weight; None: pod ratio
    controls: Controls = field(default_factory=Controls)
    problem: Problem | None = None
    created_at: float = 0.0
    generation: int = 0
    name: str = ""                                  # the rollout's own name (for the hints it gives)
    # the version an upgrade goes back to as the fleet records it (its source and config); None: a
    # built-in of status.stablePatch's version
    stable_patch: PatchSpec | None = None
    # what the rollout's gate webhooks answered this tick, by hook name (graft.rollout.hooks); a gate
    # not asked this tick has no entry
    hooks: dict[str, HookAnswer] = field(default_factory=dict)

    def pod(self, name: str) -> PodObservation | None:
        return next((p for p in self.pods if p.name == name), None)
