"""`graft rollout simulate`: the real decision code against a simulated fleet, for many seeds.

A rollout's thresholds are a bet on traffic: how many requests a step sees, how noisy latency is, how
often a background error happens. This module plays that bet out before a real rollout does. It
drives `decide()` through the operator's own loop (`graft.rollout.loop.tick`: measure when an
analysis is due, then decide and act until nothing is left to do, a tick every few seconds) and
carries out every action the operator does, against a fleet whose engines, routing, metrics and
PatchFleet record are simulated:

- traffic: Poisson arrivals at `rps`, split by the router (pod ratio: evenly over ready pods; Gateway
  API: the route's weight to canary pods, the rest to stable pods);
- outcomes: a background error rate on every revision, plus the patch's regression (extra errors,
  slower first tokens or tokens, divergent outputs) once the rollout reaches the step it starts at;
- latency: TTFT and TPOT drawn from log-normal distributions into the engine's own histogram buckets,
  with per-pod spikes (a pod's latency multiplied for a while, as a noisy neighbour does);
- shadow comparisons: an engine that took the patch while it ran (so it still holds the table it ran
  before) compares a share of its finished requests with that table, at least `shadow_floor` a
  minute (never more than it finishes), as graft.engine.shadow does; a background share of them is
  divergent (a good bf16 patch flags a few long requests near ties), and the patch's own share
  replaces it once its regression starts. Stable pods, pods restarted into the patch and pods it was
  taken out of have nothing to compare against and compare nothing;
- Prometheus: counters kept per revision and read back over each check's window, quantiles computed
  as `histogram_quantile` does (linear inside the bucket); an outage makes every query fail;
- pods: restarts at random (an engine comes back running its `graft.dev/patches` annotation, as the
  Downward API gives it, and is un-Ready for a while);
- people: a manual step (`untilApproved: true`, `pause: {}`) waits, once its analysis passed, for an
  approval; a simulated person gives it `approve_after` seconds into the wait (the annotation
  graft.dev/promote, as `graft rollout promote` sets it), the analysis going on meanwhile, so a
  regression can still be caught while the step waits. With `approve_after` None nobody approves:
  the run ends at the first wait, Progressing with reason AwaitingApproval (counted apart, as
  awaiting approval).

The numbers the analysis needs are the ones `graft.rollout.analysis.plan_run` lists; the simulator
computes each from its counters instead of asking Prometheus, and hands them to the same judge.
Custom PromQL checks cannot be simulated and are left out (the report says so).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from graft.rollout import analysis as judge
from graft.rollout.actions import ApplyPatch, LabelPod, RevertPatch, SetPatched
from graft.rollout.decision import Action, ClearPromote, ClearResume, RecordPromotion, SetWeight
from graft.rollout.fleet import with_promoted, without
from graft.rollout.loop import run_now, tick
from graft.rollout.machine import analysis_due, known_revision
from graft.rollout.observation import Controls, Measurement, Observation, PodObservation
from graft.rollout.queries import CANARY, DIVERGENT, FAILED, Series
from graft.api import BASE, FINAL_PHASES, Reason, has_patch, with_patch, without_patch
from graft.rollout.spec import REVERT, PatchSpec, RolloutSpec
from graft.rollout.status import PAUSED, PROMOTED, RolloutStatus


def _geometric(start: float, stop: float, factor: float) -> tuple[float, ...]:
    n = round(math.log(stop / start) / math.log(factor))
    return tuple(float(f"{start * factor ** i:.4g}") for i in range(n + 1))


# the engine's histogram buckets (graft.engine.metrics; a test keeps the two equal)
TOKEN_BUCKETS = _geometric(0.001, 5.0, 1.2)
LATENCY_BUCKETS = _geometric(0.005, 120.0, 1.25)


@dataclass(slots=True)
class Traffic:
    """The fleet's traffic and how it behaves with no patch at all."""

    rps: float = 100.0
    error_rate: float = 0.0001            # background, on every revision
    ttft_median: float = 0.25             # seconds
    ttft_sigma: float = 0.5               # log-normal shape
    tpot_median: float = 0.03             # seconds per output token
    tpot_sigma: float = 0.25
    tokens: int = 64                      # output tokens per request
    spike_per_hour: float = 0.0           # latency spikes per pod per hour
    spike_factor: float = 1.8
    spike_seconds: float = 30.0
    cpu: float = 0.5                      # CPU utilisation of an engine (fraction of its quota)
    shadow_rate: float = 0.1              # share of a patched engine's finished requests it compares
    shadow_floor: float = 6.0             # comparisons per pod a minute at least (up to all it finishes)
    divergence: float = 0.005             # background share of compared requests that are divergent


@dataclass(slots=True)
class Regression:
    """What the patch does wrong, from step `from_step` (counted from 1) on."""

    errors: float = 0.0                   # extra error rate on patched pods
    ttft: float = 1.0                     # TTFT multiplier
    tpot: float = 1.0                     # TPOT multiplier
    cpu: float = 0.0                      # extra CPU utilisation
    divergence: float = 0.0               # share of the canary's compared requests that are divergent
    from_step: int = 1

    @property
    def neutral(self) -> bool:
        return self.errors == 0 and self.ttft == 1 and self.tpot == 1 and self.cpu == 0 and self.divergence == 0

    def describe(self) -> str:
        if self.neutral:
            return "neutral patch"
        parts = []
        if self.errors:
            parts.append(f"+{self.errors * 100:g}% errors")
        if self.ttft != 1:
            parts.append(f"TTFT x{self.ttft:g}")
        if self.tpot != 1:
            parts.append(f"TPOT x{self.tpot:g}")
        if self.cpu:
            parts.append(f"+{self.cpu * 100:g}% CPU")
        if self.divergence:
            parts.append(f"{self.divergence * 100:g}% divergent outputs")
        return ", ".join(parts) + (f" from step {self.from_step}" if self.from_step > 1 else "")


@dataclass(slots=True)
class Scenario:
    pods: int = 10
    gateway: bool = False
    traffic: Traffic = field(default_factory=Traffic)
    regression: Regression = field(default_factory=Regression)
    restarts_per_hour: float = 0.0        # per pod
    restart_seconds: float = 20.0         # un-Ready after a restart
    outage: tuple[float, float] | None = None    # Prometheus unreachable from..until (seconds)
    tick: float = 5.0
    horizon: float = 6 * 3600.0
    approve_after: float | None = 0.0     # a manual step's wait before a person approves; None: never


@dataclass(slots=True)
class Outcome:
    phase: str                            # Promoted, RolledBack, Failed, Paused, or Progressing at the horizon
    reason: str
    seconds: float                        # time to the decision
    step: int                             # the step (from 1) it ended at
    message: str = ""
    reasons: list[str] = field(default_factory=list)


class _Pod:
    def __init__(self, name: str, revision: str):
        self.name, self.revision = name, revision
        self.container, self.restarts = 1, 0
        self.track: str | None = None
        self.patches: str | None = None
        self.unready_until = -1.0
        self.spike_until = -1.0
        self.compares = False             # holds the table it ran before the patch: shadow comparisons

    def ready(self, now: float) -> bool:
        return now >= self.unready_until


class _Counters:
    """Cumulative counters per (revision, pod), snapshotted each tick, read back over a window."""

    def __init__(self) -> None:
        self.now: dict[tuple[str, str], dict[str, np.ndarray]] = {}
        self.history: list[tuple[float, dict[tuple[str, str], dict[str, np.ndarray]]]] = []

    def series(self, revision: str, pod: str) -> dict[str, np.ndarray]:
        key = (revision, pod)
        if key not in self.now:
            self.now[key] = {"requests": np.zeros(1), "errors": np.zeros(1),
                             "compared": np.zeros(1), "divergent": np.zeros(1),
                             "ttft": np.zeros(len(LATENCY_BUCKETS) + 1),
                             "tpot": np.zeros(len(TOKEN_BUCKETS) + 1)}
        return self.now[key]

    def snapshot(self, t: float) -> None:
        self.history.append((t, {k: {n: v.copy() for n, v in s.items()} for k, s in self.now.items()}))

    def per_pod(self, revision: str, key: str, now: float, window: float) -> list[np.ndarray]:
        """What each pod's counter gained over (now - window, now]; [] when the revision has no series."""
        start = now - window
        before: dict = {}
        for t, snap in reversed(self.history):
            if t <= start + 1e-9:
                before = snap
                break
        out = []
        for k, series in self.now.items():
            if k[0] != revision:
                continue
            old = before.get(k)
            out.append(series[key] - old[key] if old is not None else series[key].copy())
        return out

    def increase(self, revision: str, key: str, now: float, window: float) -> np.ndarray | None:
        parts = self.per_pod(revision, key, now, window)
        return sum(parts[1:], parts[0].copy()) if parts else None


def histogram_quantile(q: float, bounds: tuple[float, ...], counts: np.ndarray) -> float:
    """Prometheus' histogram_quantile over per-bucket (not cumulative) counts, the last being +Inf."""
    total = float(counts.sum())
    if total <= 0:
        return math.nan
    cumulative = np.cumsum(counts)
    rank = q * total
    i = int(np.searchsorted(cumulative, rank, side="left"))
    if i >= len(bounds):
        return bounds[-1]
    lower = 0.0 if i == 0 else bounds[i - 1]
    before = 0.0 if i == 0 else float(cumulative[i - 1])
    inside = float(counts[i])
    if inside <= 0:
        return bounds[i]
    return lower + (bounds[i] - lower) * (rank - before) / inside


def _bucket_probabilities(bounds: tuple[float, ...], median: float, sigma: float) -> np.ndarray:
    from scipy.stats import lognorm
    cdf = lognorm.cdf(np.array(bounds), s=sigma, scale=median)
    return np.diff(np.concatenate([[0.0], cdf, [1.0]]))


class Simulation:
    """One simulated rollout of `spec` on `scenario`, seeded."""

    def __init__(self, spec: RolloutSpec, scenario: Scenario, seed: int):
        self.spec, self.sc = spec, scenario
        self.rng = np.random.default_rng(seed)
        # shadow comparisons draw from their own stream: the rest of a seeded run stays as it was
        self.shadow_rng = np.random.default_rng([seed, 1])
        self.pods = {f"engine-{i}": _Pod(f"engine-{i}", BASE) for i in range(scenario.pods)}
        self.route_weight = 0 if scenario.gateway else None
        self.generation = 1
        self.counters = _Counters()
        self.status = RolloutStatus()
        self.events: list = []
        self.ref = spec.patch.ref
        self.promote: str | None = None       # the annotation graft.dev/promote, as the simulated person sets it
        self.fleet: list[PatchSpec] = []      # the PatchFleet's patches, as promotions record them
        self._probabilities: dict[tuple, np.ndarray] = {}

    # the fleet
    def _probs(self, bounds, median, sigma) -> np.ndarray:
        key = (bounds is TOKEN_BUCKETS, round(median, 9), round(sigma, 6))
        if key not in self._probabilities:
            self._probabilities[key] = _bucket_probabilities(bounds, median, sigma)
        return self._probabilities[key]

    def _regressed(self, pod: _Pod) -> bool:
        return has_patch(pod.revision, self.ref) and self.status.step_index + 1 >= self.sc.regression.from_step

    def _shares(self, now: float) -> dict[str, float]:
        """Requests per second each ready pod receives from the router."""
        ready = [p for p in self.pods.values() if p.ready(now)]
        if not ready:
            return {}
        if self.route_weight is None:
            return {p.name: self.sc.traffic.rps / len(ready) for p in ready}
        canary = [p for p in ready if p.track == "canary"]
        stable = [p for p in ready if p.track != "canary"]
        w = self.route_weight / 100 if canary else 0.0
        if not stable:
            w = 1.0
        out = {p.name: self.sc.traffic.rps * w / len(canary) for p in canary}
        out.update({p.name: self.sc.traffic.rps * (1 - w) / len(stable) for p in stable})
        return out

    def _serve(self, now: float, dt: float) -> None:
        t, reg, rng = self.sc.traffic, self.sc.regression, self.rng
        spike_chance = t.spike_per_hour * dt / 3600
        for name, rate in self._shares(now).items():
            pod = self.pods[name]
            if spike_chance and rng.random() < spike_chance:
                pod.spike_until = now + t.spike_seconds
            n = int(rng.poisson(rate * dt))
            if n == 0:
                continue
            bad = self._regressed(pod)
            p_err = min(1.0, t.error_rate + (reg.errors if bad else 0.0))
            slow = t.spike_factor if now < pod.spike_until else 1.0
            c = self.counters.series(pod.revision, pod.name)
            errors = rng.binomial(n, p_err)
            c["requests"] += n
            c["errors"] += errors
            if pod.compares:
                self._compare(c, n - errors, rate, bad)
            ttft = t.ttft_median * slow * (reg.ttft if bad else 1.0)
            tpot = t.tpot_median * slow * (reg.tpot if bad else 1.0)
            c["ttft"] += rng.multinomial(n, self._probs(LATENCY_BUCKETS, ttft, t.ttft_sigma))
            c["tpot"] += rng.multinomial(n * t.tokens, self._probs(TOKEN_BUCKETS, tpot, t.tpot_sigma))

    def _compare(self, c: dict[str, np.ndarray], finished: int, rate: float, bad: bool) -> None:
        """Shadow comparisons of a patched engine's `finished` requests (it served `rate` a second)."""
        t, reg, rng = self.sc.traffic, self.sc.regression, self.shadow_rng
        share = min(1.0, max(t.shadow_rate, t.shadow_floor / 60 / rate)) if rate > 0 else 0.0
        compared = int(rng.binomial(finished, share))
        divergent = reg.divergence if bad and reg.divergence else t.divergence
        c["compared"] += compared
        c["divergent"] += rng.binomial(compared, min(1.0, divergent))

    def _churn(self, now: float, dt: float) -> None:
        chance = self.sc.restarts_per_hour * dt / 3600
        if not chance:
            return
        for pod in self.pods.values():
            if pod.ready(now) and self.rng.random() < chance:
                pod.container += 1
                pod.restarts += 1
                # the container comes back with what its annotation says (GRAFT_PATCHES), and with
                # no earlier table to compare against
                pod.revision = pod.patches or BASE
                pod.compares = False
                pod.unready_until = now + self.sc.restart_seconds

    # the operator
    def _measure(self, now: float) -> list[Measurement]:
        out = []
        outage = self.sc.outage
        down = outage is not None and outage[0] <= now < outage[1]
        for check, series in judge.plan_run(self.spec, self.status, "sim", now):
            if down:
                out.append(Measurement(check.key, error="Prometheus is unreachable (simulated outage)", outage=True))
                continue
            out.append(Measurement(check.key, {s.key: self._value(s, now) for s in series}))
        return out

    def _value(self, s: Series, now: float) -> float | None:
        revision = self.status.canary_revision if s.side == CANARY else self.status.stable_revision
        if s.kind == "count":
            key = "errors" if s.status in ("error", FAILED) else "requests"
            got = self.counters.increase(revision, key, now, s.window)
            if got is None:
                return None
            if s.status == "ok":
                errors = self.counters.increase(revision, "errors", now, s.window)
                return float(got[0] - errors[0])
            return float(got[0])
        if s.kind in ("quantile", "samples"):
            key = "tpot" if s.metric == "graft_inter_token_latency_seconds" else "ttft"
            got = self.counters.increase(revision, key, now, s.window)
            if got is None:
                return None
            if s.kind == "samples":
                return float(got.sum())
            bounds = TOKEN_BUCKETS if key == "tpot" else LATENCY_BUCKETS
            per_pod = [histogram_quantile(s.q, bounds, c) for c in self.counters.per_pod(revision, key, now, s.window)]
            per_pod = [v for v in per_pod if not math.isnan(v)]
            return float(np.quantile(per_pod, 0.5)) if per_pod else None
        if s.kind == "shadow":
            got = self.counters.increase(revision, "divergent" if s.status == DIVERGENT else "compared",
                                         now, s.window)
            return None if got is None else float(got[0])
        if s.kind == "cpu":
            pods = [p for p in self.pods.values() if p.revision == revision and p.ready(now)]
            if not pods:
                return None
            base = self.sc.traffic.cpu + (self.sc.regression.cpu if self._regressed(pods[0]) else 0.0)
            return float(np.clip(base + self.rng.normal(0, 0.03), 0, None))
        raise ValueError(f"the simulator cannot compute a {s.kind!r} series ({s.key})")

    def _observe(self, now: float, measurements, answered: dict[str, str]) -> Observation:
        pods = []
        for p in self.pods.values():
            obs = PodObservation(p.name, f"uid-{p.name}", f"sim://{p.name}/{p.container}", p.restarts,
                                 p.ready(now), p.track, p.patches)
            obs.revision = answered.get(p.name) or known_revision(self.status, obs)
            if obs.revision is None and obs.ready:
                obs.revision = p.revision
            pods.append(obs)
        self._approve(now)
        return Observation(pods, measurements, self.route_weight, Controls(promote=self.promote), None, 0.0,
                           self.generation)

    def _approve(self, now: float) -> None:
        """The simulated person sets graft.dev/promote (as `graft rollout promote` does) `approve_after`
        into a manual step's wait; the operator removes it once acted on (ClearPromote)."""
        since, after = self.status.awaiting_approval_since, self.sc.approve_after
        if since is not None and after is not None and now >= since + after:
            self.promote = "step"

    def _execute(self, actions: list[Action], answered: dict[str, str]) -> None:
        """Every action the operator carries out, on the simulated fleet."""
        for a in actions:
            match a:
                case ApplyPatch(name, patch, _):
                    self._swap(name, with_patch(self.pods[name].revision, patch.ref), answered)
                case RevertPatch(name, patch_name):
                    self._swap(name, without_patch(self.pods[name].revision, patch_name), answered)
                case LabelPod(name, track, revision):
                    self.pods[name].track, self.pods[name].patches = track, revision
                case SetPatched():
                    pass                      # the simulated pods declare no readiness gate
                case SetWeight(weight):
                    self.route_weight = weight
                case ClearPromote():
                    self.promote = None
                case ClearResume():
                    pass                      # nobody resumes here: a run ends at a pause for a person
                case RecordPromotion():
                    self.fleet = (without(self.fleet, self.spec.patch.name) if self.spec.action == REVERT
                                  else with_promoted(self.fleet, self.spec.patch))
                case _:
                    raise TypeError(f"the simulator cannot carry out {a!r}")

    def _swap(self, name: str, revision: str, answered: dict[str, str]) -> None:
        pod = self.pods[name]
        pod.revision = answered[name] = revision
        # an engine the patch was swapped into while it ran holds the table it ran before, and
        # compares; one it was taken out of compares nothing
        pod.compares = has_patch(revision, self.ref) != (self.spec.action == REVERT)

    def _tick(self, now: float) -> None:
        measurements = self._measure(now) if analysis_due(self.spec, self.status, now) else None
        done = run_now(tick(self.spec, self.status, now, _Effects(self, now), measurements))
        self.status = done.status
        self.events += done.events

    def run(self) -> Outcome:
        sc, now = self.sc, 0.0
        self.counters.snapshot(now)
        self._tick(now)
        while now < sc.horizon:
            now += sc.tick
            self._churn(now, sc.tick)
            self._serve(now, sc.tick)
            self.counters.snapshot(now)
            self._tick(now)
            s = self.status
            if s.phase in FINAL_PHASES or (s.phase == PAUSED and s.pause_conditions):
                break
            if s.awaiting_approval_since is not None and sc.approve_after is None:
                break       # nobody approves: the run ends waiting for a person
        s = self.status
        return Outcome(s.phase, s.reason, now, s.step_index + 1, s.message, [e.reason for e in self.events])


class _Effects:
    """The operator's part in one simulated tick, for `graft.rollout.loop.tick`."""

    def __init__(self, sim: Simulation, now: float):
        self.sim, self.now = sim, now
        self.answered: dict[str, str] = {}     # revisions the engines gave back this tick

    async def observe(self, status: RolloutStatus, measurements: list[Measurement] | None) -> Observation:
        self.sim.status = status
        return self.sim._observe(self.now, measurements, self.answered)

    async def start(self, status: RolloutStatus) -> bool:
        return True                            # one rollout, one fleet: nothing to claim

    async def execute(self, status: RolloutStatus, actions: list[Action]) -> None:
        self.sim.status = status
        self.sim._execute(actions, self.answered)


def simulatable(spec: RolloutSpec) -> tuple[RolloutSpec, list[str]]:
    """`spec` without the checks a simulation cannot compute (custom PromQL), and their names."""
    a = spec.analysis
    dropped = [c.key for c in a.checks if c.metric == "custom"]
    if not dropped:
        return spec, []
    keep = dataclasses.replace(a, breakers=tuple(c for c in a.breakers if c.metric != "custom"),
                               gates=tuple(c for c in a.gates if c.metric != "custom"))
    return dataclasses.replace(spec, analysis=keep), dropped


def simulate(spec: RolloutSpec, scenario: Scenario, seeds: int | list[int] = 20,
             progress=None) -> list[Outcome]:
    """Run `scenario` once per seed; `progress(i)` is called after each run."""
    spec, _ = simulatable(spec)
    spec = dataclasses.replace(spec, paused=False)
    out = []
    for i, seed in enumerate(range(seeds) if isinstance(seeds, int) else seeds):
        out.append(Simulation(spec, scenario, seed).run())
        if progress is not None:
            progress(i)
    return out


@dataclass(slots=True)
class Summary:
    runs: int
    promoted: int
    rolled_back: int
    paused: int
    undecided: int
    median_seconds: float
    steps: dict[int, int]                 # rollbacks by step (from 1)
    awaiting: int = 0                     # ended waiting for an approval nobody gave (approve_after None)
    approvals: int = 0                    # manual steps approved, over every run

    @property
    def promote_rate(self) -> float:
        return self.promoted / self.runs if self.runs else 0.0

    @property
    def catch_rate(self) -> float:
        """Runs the analysis kept from promoting: a run that reached a person (awaiting approval) is not
        caught, whatever that person would decide."""
        return (self.runs - self.promoted - self.awaiting) / self.runs if self.runs else 0.0


def summarise(outcomes: list[Outcome]) -> Summary:
    promoted = sum(o.phase == PROMOTED for o in outcomes)
    rolled = [o for o in outcomes if o.phase in ("RolledBack", "Failed")]
    paused = sum(o.phase == PAUSED for o in outcomes)
    awaiting = sum(o.phase not in FINAL_PHASES and o.reason == Reason.AWAITING_APPROVAL for o in outcomes)
    steps: dict[int, int] = {}
    for o in rolled:
        steps[o.step] = steps.get(o.step, 0) + 1
    decided = [o.seconds for o in outcomes if o.phase in FINAL_PHASES or o.phase == PAUSED]
    return Summary(len(outcomes), promoted, len(rolled), paused,
                   len(outcomes) - promoted - len(rolled) - paused - awaiting,
                   statistics.median(decided) if decided else math.nan, dict(sorted(steps.items())),
                   awaiting, sum(o.reasons.count(Reason.APPROVED) for o in outcomes))
