"""The operator's own metrics: what each rollout is doing and what its analysis judged.

Served on `GRAFT_METRICS_PORT` (the chart's PodMonitor scrapes it), so the dashboard shows the
numbers behind each decision next to the engines' own:

- `graft_rollout_phase{namespace,rollout,phase}`: 1 for the rollout's current phase, 0 for the others;
- `graft_rollout_weight{namespace,rollout}` and `graft_rollout_step{namespace,rollout}` (from 1);
- `graft_analysis_value{namespace,rollout,role,check}`: the latest value each check was judged on;
- `graft_analysis_verdicts_total{namespace,rollout,role,check,verdict}`: every check's verdicts, by run.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from graft.rollout.status import PHASES, RolloutStatus


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
        for result in a.results:
            if result.value is not None:
                self.value.labels(namespace, rollout, result.role, result.name).set(result.value)
            self.verdicts.labels(namespace, rollout, result.role, result.name, result.verdict).inc()

    def forget(self, namespace: str, rollout: str) -> None:
        """Drop a deleted rollout's series."""
        self._last_run.pop((namespace, rollout), None)
        for metric in (self.phase, self.weight, self.step, self.value, self.verdicts):
            for labels in list(metric._metrics):         # noqa: SLF001 (prometheus_client has no public way)
                if labels[:2] == (namespace, rollout):
                    metric.remove(*labels)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
