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


def test_each_run_shows_its_limit_and_bounds_beside_the_value_and_counts_runs_by_verdict():
    """Grafana's analysis history: per run, the value with what it was held against."""
    m = OperatorMetrics()
    ids = dict(namespace="llm", rollout="kv")
    rate = CheckResult("error-rate", "Inconclusive", "<= 0.01", "step", value=0.004, role="gate",
                       numbers={"requests": 400, "errors": 2, "lower": 0.0012, "upper": 0.018, "limit": 0.01})
    status = RolloutStatus(phase="Progressing", step_index=0, weight=1,
                           analysis=AnalysisStatus(last_run=100.0, verdict="Inconclusive", results=[rate]))
    m.observe("llm", "kv", status)
    gate = dict(**ids, role="gate", check="error-rate")
    assert sample(m, "graft_analysis_bound", **gate, bound="limit") == 0.01
    assert sample(m, "graft_analysis_bound", **gate, bound="upper") == 0.018
    assert sample(m, "graft_analysis_bound", **gate, bound="lower") == 0.0012
    assert sample(m, "graft_analysis_runs_total", **ids, verdict="Inconclusive") == 1
    assert sample(m, "graft_analysis_last_run_timestamp_seconds", **ids) == 100.0
    # the next run has no bounds (no traffic yet judged): the old ones are not left standing
    status.analysis.last_run, status.analysis.verdict = 130.0, "Successful"
    status.analysis.results = [CheckResult("error-rate", "Successful", "<= 0.01", "step", value=0.0, role="gate",
                                           numbers={"limit": 0.01})]
    m.observe("llm", "kv", status)
    assert sample(m, "graft_analysis_bound", **gate, bound="upper") is None
    assert sample(m, "graft_analysis_bound", **gate, bound="limit") == 0.01
    assert sample(m, "graft_analysis_runs_total", **ids, verdict="Successful") == 1
    m.forget("llm", "kv")
    assert b'rollout="kv"' not in generate_latest(m.registry)


def test_quantile_and_value_checks_report_their_limit_in_the_value_s_units():
    from graft.rollout.analysis import judge
    from graft.rollout.observation import Measurement
    from graft.rollout.spec import parse_spec

    spec = parse_spec({"selector": {"matchLabels": {"app": "e"}}, "patch": {"name": "p", "version": "1"},
                       "analysis": {"breakers": [
                           {"name": "tpot-p99", "maxRatio": 1.3},
                           {"name": "queue", "query": 'sum(q{namespace="{{namespace}}"})', "max": 5}]}})
    ratio, custom = (c for c in spec.analysis.checks if c.name in ("tpot-p99", "queue"))
    m = Measurement(ratio.key, {"canary_quantile": 0.05, "stable_quantile": 0.04,
                                "canary_samples": 5000, "stable_samples": 5000})
    kw = dict(previous=None, stable_pods=True)
    assert judge(ratio, m, spec.analysis, **kw).numbers["limit"] == 1.3
    assert judge(custom, Measurement(custom.key, {"value": 7.0}), spec.analysis, **kw).numbers["limit"] == 5
