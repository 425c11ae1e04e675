"""Check verdicts and the PromQL each check runs."""
import math

import pytest

from graft.rollout import analysis
from graft.rollout.observation import Measurement
from graft.rollout.queries import BUILTIN_QUERIES, build_queries, is_comparison, render
from graft.rollout.status import CheckResult

from rollout_fleet import make_spec

SPEC = make_spec()
A = SPEC.analysis
ERR = next(c for c in A.metrics if c.name == "error-rate")
CPU = next(c for c in A.metrics if c.name == "cpu")
DELTA = next(c for c in A.metrics if c.name == "error-rate-delta")


def judge(check, m, previous=None, stable_pods=True, analysis_spec=A):
    return analysis.judge(check, m, analysis_spec, previous=previous, stable_pods=stable_pods)


def test_within_threshold_is_successful_and_resets_breaches():
    prev = CheckResult("error-rate", "Failed", "", "", breaches=2)
    r = judge(ERR, Measurement("error-rate", 0.001, 500), prev)
    assert (r.verdict, r.breaches, r.value, r.threshold, r.window) == ("Successful", 0, 0.001, "<= 0.005", "60s")


def test_breach_counts_up():
    r = judge(ERR, Measurement("error-rate", 0.02, 500), CheckResult("error-rate", "Failed", "", "", breaches=1))
    assert (r.verdict, r.breaches) == ("Failed", 2) and "breach 2/3" in r.message


@pytest.mark.parametrize("m,why", [
    (Measurement("error-rate", None, 500), "no data"),
    (Measurement("error-rate", math.nan, 500), "no data"),
    (Measurement("error-rate", 0.0, 3), "fewer than minRequests 20"),
])
def test_no_data_holds_without_touching_breaches(m, why):
    r = judge(ERR, m, CheckResult("error-rate", "Failed", "", "", breaches=1))
    assert (r.verdict, r.breaches) == ("Inconclusive", 1) and why in r.message


def test_cpu_is_not_gated_by_requests():
    assert judge(CPU, Measurement("cpu", 0.5, None)).verdict == "Successful"


def test_comparison_needs_stable_traffic_and_is_skipped_without_stable_pods():
    assert judge(DELTA, Measurement("error-rate-delta", 0.0, 500, 2)).verdict == "Inconclusive"
    assert judge(DELTA, Measurement("error-rate-delta", 0.0, 500, 500), stable_pods=False).verdict == "Skipped"


def test_provider_error_is_error():
    r = judge(ERR, Measurement("error-rate", error="connection refused"))
    assert r.verdict == "Error" and r.message == "connection refused"
    assert judge(ERR, None).verdict == "Error"


def test_run_verdicts():
    ok = [Measurement(c.name, 0.0 if c.max is not None else 1.0, 100, 100) for c in A.metrics]
    assert analysis.run(A, ok, [], stable_pods=True)[0] == "Successful"
    one_breach = [*ok[1:], Measurement("error-rate", 1.0, 100)]
    assert analysis.run(A, one_breach, [], stable_pods=True)[0] == "Inconclusive", "1 of 3 breaches holds"
    lat = [m if m.name != "latency-p99" else Measurement("latency-p99", 9.0, 100) for m in ok]
    verdict, results = analysis.run(A, lat, [], stable_pods=True)
    assert verdict == "Failed" and [r.name for r in analysis.failing(A, results)] == ["latency-p99"]
    down = [Measurement(c.name, error="down") for c in A.metrics]
    assert analysis.run(A, down, [], stable_pods=True)[0] == "Error"


def test_builtin_queries_select_by_namespace_and_revision():
    queries = {q.name: q for q in build_queries(A.metrics, namespace="llm", canary="kv@1", stable="base",
                                                 patch_name="kv", patch_version="1")}
    err = queries["error-rate"]
    assert 'graft_requests_total{namespace="llm",revision="kv@1",status="error"}[60s]' in err.value
    assert "or vector(0)" in err.value, "no error series yet means zero errors, not no data"
    assert err.requests == 'sum(increase(graft_requests_total{namespace="llm",revision="kv@1"}[60s]))'
    assert err.stable_requests is None
    assert 'revision="base"' in queries["error-rate-delta"].value
    assert queries["error-rate-delta"].stable_requests.endswith('revision="base"}[60s]))')
    assert "histogram_quantile(0.99" in queries["latency-p99"].value and "[30s]" in queries["latency-p99"].value
    assert queries["cpu"].requests is None and 'graft_engine_revision_info{namespace="llm",revision="kv@1"}' in \
        queries["cpu"].value
    assert "{{" not in "".join(q.value for q in queries.values())


def test_custom_query_templating_and_escaping():
    spec = make_spec(analysis_metrics=[{"name": "ttft", "max": 1, "window": "1.5s",
                                        "query": 'x{ns="{{namespace}}",r="{{canaryRevision}}",'
                                                 'p="{{patchName}}"}[{{window}}]'}])
    (q,) = build_queries(spec.analysis.metrics, namespace='a"b', canary="kv@1", stable="base",
                         patch_name="kv", patch_version="1")
    assert q.value == 'x{ns="a\\"b",r="kv@1",p="kv"}[1500ms]' and q.requests is not None
    assert is_comparison("{{ stableRevision }}") and not is_comparison(BUILTIN_QUERIES["error-rate"])
    with pytest.raises(KeyError, match="pod"):
        render("{{pod}}", {})
