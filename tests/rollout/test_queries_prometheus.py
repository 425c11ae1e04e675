"""Every query the analysis can plan is accepted by a real Prometheus (the Debian package's), and the
built-in cpu check is evaluated on real scrapes."""
from __future__ import annotations

import dataclasses
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from graft.devcluster.prometheus import PrometheusServer
from graft.rollout.analysis import judge
from graft.rollout.observation import Measurement
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


class CpuTargets:
    """Two engines' /metrics as Prometheus scrapes them, on threads of their own: the canary uses
    0.5 of its 2-core quota's seconds each second (a share of 0.25), the stable one 1.8 (0.9)."""

    def __init__(self):
        self.started = time.monotonic()
        self.servers = [self._serve("kv-align@3.2.1", 0.5), self._serve("base", 1.8)]

    def _serve(self, revision: str, cores: float) -> ThreadingHTTPServer:
        started = self.started

        class Metrics(BaseHTTPRequestHandler):
            def do_GET(self):
                body = (f"process_cpu_seconds_total {cores * (time.monotonic() - started):.6f}\n"
                        "graft_cpu_quota_cores 2\n"
                        f'graft_engine_revision_info{{revision="{revision}"}} 1\n').encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass
        server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.server_address[1]}" for s in self.servers]

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


def test_the_builtin_cpu_check_is_evaluated_on_the_canary_engines_alone(prometheus):
    """The cpu breaker's query, planned as the analysis plans it, answers the canary's share of its
    quota from real scrapes (not the stable engine's, not an average of both), and is judged."""
    targets = CpuTargets()
    try:
        prometheus.set_targets([(a, {"namespace": "llm"}) for a in targets.addresses])
        analysis = parse_spec({"selector": {"matchLabels": {"app": "llm"}},
                               "patch": {"name": "kv-align", "version": "3.2.1"},
                               "analysis": {"breakers": [{"name": "cpu", "max": 0.2}]}}).analysis
        (check,) = [c for c in analysis.checks if c.name == "cpu"]
        (series,) = plan(check, Context("llm", "kv-align@3.2.1", "base", "kv-align", "3.2.1"), 4.0)
        deadline, value = time.monotonic() + 30, None
        # rate() averages over its window: a series younger than the window reads low until then
        while value is None or abs(value - 0.25) > 0.03:
            assert time.monotonic() < deadline, f"{series.promql} answered {value}"
            result = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": series.promql}).json()
            assert result["status"] == "success", result
            value = float(result["data"]["result"][0]["value"][1]) if result["data"]["result"] else None
            time.sleep(0.5)
        measured = Measurement(check.key, {series.key: value})
        r = judge(check, measured, analysis, previous=None, stable_pods=True)
        assert (r.verdict, r.breaches) == ("Failed", 1), r.message       # 0.25 breaches max 0.2
        default = dataclasses.replace(check, max=0.92)                     # the default limit
        assert judge(default, measured, analysis, previous=None, stable_pods=True).verdict == "Successful"
    finally:
        prometheus.set_targets([])
        targets.close()
