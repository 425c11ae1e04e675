"""A fake fleet of engine pods and a fake operator loop around `decide`, for the state machine tests."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from graft.rollout.actions import ApplyPatch, LabelPod, RevertPatch
from graft.rollout.decision import ClearPromote, ClearResume, Decision, SetWeight
from graft.rollout.loop import run_now, tick
from graft.rollout.machine import known_revision
from graft.rollout.observation import Controls, Measurement, Observation, PodError, PodObservation, Problem
from graft.api import has_patch, with_patch, without_patch
from graft.rollout.spec import RolloutSpec, parse_spec
from graft.rollout.status import RolloutStatus

BASE = {
    "selector": {"matchLabels": {"app": "llm-engine"}},
    "patch": {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}},
    "steps": [{"weight": 1, "pause": "10s"}, {"weight": 50, "pause": "10s"}, {"weight": 100}],
    "analysis": {"interval": "5s"},
    "progressDeadline": "2m",
}


def make_spec(**changes):
    spec = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for key, value in changes.items():
        if key.startswith("analysis_"):
            spec["analysis"] = {**spec["analysis"], key.removeprefix("analysis_"): value}
        else:
            spec[key] = value
    return parse_spec(spec)


@dataclass
class FakePod:
    name: str
    revision: str = "base"
    uid: str = ""
    container: int = 1
    restarts: int = 0
    ready: bool = True
    track: str | None = None
    patches: str | None = None
    refuse: PodError | None = None       # the engine answers POST with this error
    unreachable: bool = False

    @property
    def container_id(self) -> str:
        return f"containerd://{self.name}-{self.container}"


@dataclass
class Fleet:
    spec: RolloutSpec
    pods: dict[str, FakePod] = field(default_factory=dict)
    route_weight: int | None = None
    promote: str | None = None
    abort: bool = False
    resume: bool = False           # the annotation graft.dev/resume
    problem: Problem | None = None
    posts: dict[str, int] = field(default_factory=dict)
    deletes: dict[str, int] = field(default_factory=dict)
    events: list = field(default_factory=list)
    created_at: float = 0.0
    generation: int = 1
    name: str = ""                 # the rollout's name, as the operator hands it to `decide`
    promoted_by: str | None = None  # who set graft.dev/promote, as the object's managedFields tell
    hooks: dict = field(default_factory=dict)   # gate webhooks' answers, by hook name, as the operator asks them

    @classmethod
    def of(cls, spec: RolloutSpec, n: int, gateway: bool = False) -> "Fleet":
        fleet = cls(spec, route_weight=0 if gateway else None)
        for i in range(n):
            fleet.add(f"pod-{i}")
        return fleet

    def add(self, name: str, revision: str = "base") -> None:
        self.pods[name] = FakePod(name, revision, uid=f"uid-{name}")

    def restart(self, name: str, keep_patch: bool = False) -> None:
        pod = self.pods[name]
        pod.container += 1
        pod.restarts += 1
        if not keep_patch:
            pod.revision = without_patch(pod.revision, self.spec.patch.ref)

    @property
    def ref(self) -> str:
        return self.spec.patch.ref

    def patched(self) -> set[str]:
        return {n for n, p in self.pods.items() if has_patch(p.revision, self.ref)}

    def observe(self, status: RolloutStatus, errors: dict[str, PodError],
                measurements: list[Measurement] | None, answered: dict[str, str] | None = None) -> Observation:
        """What the operator sees: recorded revisions, the engines' answers this tick, else a GET."""
        pods = []
        for p in self.pods.values():
            obs = PodObservation(p.name, p.uid, p.container_id, p.restarts, p.ready, p.track, p.patches)
            obs.revision = (answered or {}).get(p.name) or known_revision(status, obs)
            if obs.revision is None:
                if p.unreachable:
                    obs.error = PodError("unreachable", "connection refused")
                else:
                    obs.revision = p.revision
            if p.name in errors:
                obs.error = errors[p.name]
                if obs.error.kind == "unreachable":
                    obs.revision = None         # the answer never came: state unknown
            pods.append(obs)
        return Observation(pods, measurements, self.route_weight,
                           Controls(self.promote, self.abort, self.resume, self.promoted_by),
                           self.problem, self.created_at, self.generation, self.name, hooks=dict(self.hooks))

    def execute(self, d: Decision, answered: dict[str, str]) -> dict[str, PodError]:
        errors = {}
        for a in d.actions:
            if isinstance(a, ApplyPatch | RevertPatch):
                pod = self.pods[a.pod]
                count = self.posts if isinstance(a, ApplyPatch) else self.deletes
                count[a.pod] = count.get(a.pod, 0) + 1
                if pod.unreachable:
                    errors[a.pod] = PodError("unreachable", "connection refused")
                elif pod.refuse is not None and self._to_canary(a):
                    errors[a.pod] = pod.refuse
                elif isinstance(a, ApplyPatch):
                    pod.revision = answered[a.pod] = with_patch(pod.revision, a.patch.ref)
                else:
                    pod.revision = answered[a.pod] = without_patch(pod.revision, a.name)
            elif isinstance(a, LabelPod):
                self.pods[a.pod].track, self.pods[a.pod].patches = a.track, a.revision
            elif isinstance(a, SetWeight):
                self.route_weight = a.weight
            elif isinstance(a, ClearPromote):
                self.promote = None
            elif isinstance(a, ClearResume):
                self.resume = False
        return errors

    def _to_canary(self, a: ApplyPatch | RevertPatch) -> bool:
        """The call that brings a pod to the canary form (what a refusing engine refuses)."""
        if self.spec.action == "revert":
            return isinstance(a, RevertPatch)
        return isinstance(a, ApplyPatch) and a.patch.ref == self.ref

    def tick(self, status: RolloutStatus, now: float,
             measurements: list[Measurement] | None = None) -> RolloutStatus:
        """One operator tick through the operator's own loop (`graft.rollout.loop.tick`): decide, act,
        decide again until nothing is left to do. The measurements are the test's own, given to the
        first decision; engine errors from acting are seen by the next one."""
        done = run_now(tick(self.spec, status, now, _Effects(self), measurements))
        self.events += done.events
        return done.status

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]

    def set_paused(self, paused: bool) -> None:
        """A person edits spec.paused (`graft rollout pause|resume`): a new generation."""
        self.spec = dataclasses.replace(self.spec, paused=paused)
        self.generation += 1


class _Effects:
    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.errors: dict[str, PodError] = {}
        self.answered: dict[str, str] = {}

    async def observe(self, status, measurements):
        return self.fleet.observe(status, self.errors, measurements, self.answered)

    async def start(self, status):
        return True

    async def execute(self, status, actions):
        self.errors.update(self.fleet.execute(Decision(status, actions), self.answered))


def _passing(check, requests: float) -> dict[str, float]:
    """Numbers that pass `check` comfortably, with `requests` behind every count."""
    n = float(requests)
    match check.kind:
        case "rate" if check.metric == "output-divergence":
            return {"canary_compared": n / 10, "canary_divergent": 0.0}
        case "rate":
            return {"canary_requests": n, "canary_matching": n if check.metric == "success-rate" else 0.0}
        case "difference":
            return {"canary_requests": n, "canary_errors": 0.0, "stable_requests": n, "stable_errors": 0.0}
        case "quantile":
            return {"canary_quantile": 0.05, "canary_samples": n * 10, "stable_quantile": 0.05, "stable_samples": n * 10}
    if check.max is not None and check.min is not None:
        value = (check.max + check.min) / 2
    elif check.max is not None:
        value = check.max / 2
    else:
        value = check.min + abs(check.min) + 1
    return {"value": value, "canary_requests": n}


def _failing(check, requests: float) -> dict[str, float]:
    """Numbers that fail `check` beyond doubt (conclusively, for a gate on counts)."""
    n = float(requests)
    values = _passing(check, requests)
    match check.kind:
        case "rate" if check.metric == "output-divergence":
            values["canary_divergent"] = values["canary_compared"] / 2
        case "rate":
            values["canary_matching"] = n / 2
        case "difference":
            values["canary_errors"] = n / 2
        case "quantile":
            values["canary_quantile"] = 50.0
        case _:
            values["value"] = check.max * 10 + 1 if check.max is not None else check.min - abs(check.min) - 1
    return values


def healthy(spec: RolloutSpec, requests: float = 100_000) -> list[Measurement]:
    """A measurement for every check that passes it with room to spare."""
    return [Measurement(c.key, _passing(c, requests)) for c in spec.analysis.checks]


def with_values(spec: RolloutSpec, changed: dict[str, dict[str, float | None]],
                requests: float = 100_000) -> list[Measurement]:
    """Every check healthy except those in `changed` (check key -> the numbers to report)."""
    out = healthy(spec, requests)
    for m in out:
        if m.check in changed:
            m.values = dict(changed[m.check])
    return out


def no_data(spec: RolloutSpec) -> list[Measurement]:
    """Every query answered, none with any data (an empty result, as for a revision with no series)."""
    return [Measurement(c.key, {}) for c in spec.analysis.checks]


def provider_down(spec: RolloutSpec, why: str = "Prometheus refused the query (bad_data: parse error)") -> list[Measurement]:
    """Every query failed, not for an outage: a check that cannot be judged as written."""
    return [Measurement(c.key, error=why) for c in spec.analysis.checks]


def prometheus_down(spec: RolloutSpec, why: str = "Prometheus at http://prometheus:9090 is unreachable") \
        -> list[Measurement]:
    """Every query failed to reach Prometheus: an outage, which passes by itself."""
    return [Measurement(c.key, error=why, outage=True) for c in spec.analysis.checks]


def breaching(spec: RolloutSpec, name: str, requests: float = 100_000, role: str | None = None) -> list[Measurement]:
    """Every check passing but the one called `name` (the breaker of that name, unless `role` says)."""
    out = healthy(spec, requests)
    check = next(c for c in spec.analysis.checks if c.name == name and (role is None or c.role == role))
    for m in out:
        if m.check == check.key:
            m.values = _failing(check, requests)
    return out
