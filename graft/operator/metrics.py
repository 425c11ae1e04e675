"""The operator's own metrics: what each rollout is doing and what its analysis judged.

Served on `GRAFT_METRICS_PORT` (the chart's PodMonitor scrapes it), so the dashboard shows the
numbers behind each decision next to the engines' own:

- `graft_rollout_phase{namespace,rollout,phase}`: 1 for the rollout's current phase, 0 for the others;
- `graft_rollout_weight{namespace,rollout}` and `graft_rollout_step{namespace,rollout}` (from 1);
- `graft_analysis_value{namespace,rollout,role,check}`: the latest value each check was judged on;
- `graft_analysis_verdicts_total{namespace,rollout,role,check,verdict}`: every check's verdicts, by run;
- `graft_analysis_bound{namespace,rollout,role,check,bound}`: what the latest value was held against:
  `limit` (the threshold in the value's units) and, for checks judged on counts, the confidence
  bounds `lower` and `upper`; with the value, one series per run is the analysis history in Grafana;
- `graft_analysis_runs_total{namespace,rollout,verdict}` and `graft_analysis_last_run_timestamp_seconds`:
  analysis runs by the run's verdict, and when the latest was.
"""
from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from graft.rollout.status import PHASES, RolloutStatus

BOUNDS = ("limit", "lower", "upper")   # CheckResult.numbers shown beside the value


class OperatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.phase = Gauge("graft_rollout_phase", "1 for the rollout's current phase.",
                           ["namespace", "rollout", "phase"], registry=r)
        self.weight = Gauge("graft_rollout_weight", "The canary weight in effect, percent.",
                            ["namespace", "rollout"], registry=r)
        self.step = Gauge("graft_rollout_step", "The rollout's step, from 1.", ["namespace", "rollout"], registry=r)
        self.value = Gauge("graft_analysis_value", "The latest value a check was judged on.",
                           ["namespace", "rollout", "role", "check"], registry=r)
        self.verdicts = Counter("graft_analysis_verdicts", "Check verdicts, one per analysis run.",
                                ["namespace", "rollout", "role", "check", "verdict"], registry=r)
        self.bound = Gauge("graft_analysis_bound",
                           "What the latest value was held against: limit, and the confidence bounds lower/upper.",
                           ["namespace", "rollout", "role", "check", "bound"], registry=r)
        self.runs = Counter("graft_analysis_runs", "Analysis runs, by the run's verdict.",
                            ["namespace", "rollout", "verdict"], registry=r)
        self.last_run = Gauge("graft_analysis_last_run_timestamp_seconds", "When the latest analysis run was.",
                              ["namespace", "rollout"], registry=r)
        self._last_run: dict[tuple[str, str], float | None] = {}

    def observe(self, namespace: str, rollout: str, status: RolloutStatus) -> None:
        """Record a rollout's status after a reconciliation; verdicts count once per analysis run."""
        for phase in PHASES:
            self.phase.labels(namespace, rollout, phase).set(1 if status.phase == phase else 0)
        self.weight.labels(namespace, rollout).set(status.weight)
        self.step.labels(namespace, rollout).set(status.step_index + 1)
        a = status.analysis
        key = (namespace, rollout)
        if a.last_run is None or self._last_run.get(key) == a.last_run:
            return
        self._last_run[key] = a.last_run
        self.last_run.labels(namespace, rollout).set(a.last_run)
        if a.verdict:
            self.runs.labels(namespace, rollout, a.verdict).inc()
        for result in a.results:
            ids = (namespace, rollout, result.role, result.name)
            if result.value is not None:
                self.value.labels(*ids).set(result.value)
            for bound in BOUNDS:
                number = result.numbers.get(bound)
                if number is not None and math.isfinite(number):
                    self.bound.labels(*ids, bound).set(number)
                elif (*ids, bound) in self.bound._metrics:   # noqa: SLF001 (a bound this run lacks is not shown stale)
                    self.bound.remove(*ids, bound)
            self.verdicts.labels(*ids, result.verdict).inc()

    def forget(self, namespace: str, rollout: str) -> None:
        """Drop a deleted rollout's series."""
        self._last_run.pop((namespace, rollout), None)
        for metric in (self.phase, self.weight, self.step, self.value, self.verdicts, self.bound, self.runs,
                       self.last_run):
            for labels in list(metric._metrics):         # noqa: SLF001 (prometheus_client has no public way)
                if labels[:2] == (namespace, rollout):
                    metric.remove(*labels)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
