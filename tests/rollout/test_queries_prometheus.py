"""Every query the analysis can plan is accepted by a real Prometheus (the Debian package's)."""
from __future__ import annotations

import httpx
import pytest

from graft.devcluster.prometheus import PrometheusServer
from graft.rollout.queries import Context, plan
from graft.rollout.spec import BUILTIN_METRICS, parse_spec


def every_check():
    breakers = []
    for name, builtin in BUILTIN_METRICS.items():
        check = {"name": name, "max": 0.5} if name != "success-rate" else {"name": name, "min": 0.5}
        if builtin["kind"] == "quantile":
            check = {"name": name, "maxRatio": 1.5, "max": 2.0}
        breakers.append(check)
    breakers.append({"name": "custom-one", "query": 'sum(rate(graft_requests_total{namespace="{{namespace}}",'
                                                    'revision="{{stableRevision}}"}[{{window}}]))', "max": 1,
                     "minSamples": 10})
    spec = parse_spec({"selector": {"matchLabels": {"app": "llm"}}, "patch": {"name": "kv-align", "version": "3.2.1"},
                       "analysis": {"breakers": breakers}})
    return spec.analysis.checks


@pytest.fixture(scope="module")
def prometheus():
    server = PrometheusServer([], scrape_interval=1.0)
    server.start()
    yield server
    server.close()


def test_every_planned_query_is_valid_promql(prometheus):
    ctx = Context("llm", 'kv-align@3.2.1,"odd"', "base", "kv-align", "3.2.1")
    seen = 0
    for check in every_check():
        for series in plan(check, ctx, 90.0):
            r = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": series.promql}).json()
            assert r["status"] == "success", (check.key, series.key, series.promql, r.get("error"))
            seen += 1
    assert seen >= 20
