"""The operator's own metrics follow the rollouts it judges."""
from __future__ import annotations

from prometheus_client import generate_latest

from graft.operator.metrics import OperatorMetrics
from graft.rollout.status import AnalysisStatus, CheckResult, RolloutStatus


def sample(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_phase_weight_values_and_verdicts_follow_the_status():
    m = OperatorMetrics()
    results = [CheckResult("error-rate-delta", "Successful", "<= 0.001", "step", value=0.0002, role="gate"),
               CheckResult("tpot-p99", "Failed", "<= 1.3 x stable", "30s", value=1.5, breaches=1, role="breaker")]
    status = RolloutStatus(phase="Progressing", step_index=1, weight=5,
                           analysis=AnalysisStatus(last_run=100.0, verdict="Inconclusive", results=results))
    m.observe("llm", "kv", status)
    m.observe("llm", "kv", status)      # the same run observed twice counts once
    ids = dict(namespace="llm", rollout="kv")
    assert sample(m, "graft_rollout_phase", **ids, phase="Progressing") == 1
    assert sample(m, "graft_rollout_phase", **ids, phase="Promoted") == 0
    assert sample(m, "graft_rollout_weight", **ids) == 5
    assert sample(m, "graft_rollout_step", **ids) == 2
    assert sample(m, "graft_analysis_value", **ids, role="breaker", check="tpot-p99") == 1.5
    assert sample(m, "graft_analysis_verdicts_total", **ids, role="breaker", check="tpot-p99", verdict="Failed") == 1
    status.analysis.last_run = 130.0
    m.observe("llm", "kv", status)
    assert sample(m, "graft_analysis_verdicts_total", **ids, role="gate", check="error-rate-delta",
                  verdict="Successful") == 2
    m.forget("llm", "kv")
    assert b'rollout="kv"' not in generate_latest(m.registry)
