"""Every query the analysis can plan is accepted by a real Prometheus (the Debian package's), and the
built-in cpu and output-divergence checks are evaluated on real scrapes."""
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
    checks = every_check()
    assert {c.metric for c in checks} == {*BUILTIN_METRICS, "custom"}, "every built-in check is planned"
    for check in checks:
        for series in plan(check, ctx, 90.0):
            r = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": series.promql}).json()
            assert r["status"] == "success", (check.key, series.key, series.promql, r.get("error"))
            seen += 1
    assert seen >= 20


class MetricsTargets:
    """Engines' /metrics as Prometheus scrapes them, each on a thread of its own: `body(seconds)`
    gives an engine's exposition `seconds` after the start."""

    def __init__(self, *bodies):
        self.started = time.monotonic()
        self.servers = [self._serve(body) for body in bodies]

    def _serve(self, body) -> ThreadingHTTPServer:
        started = self.started

        class Metrics(BaseHTTPRequestHandler):
            def do_GET(self):
                text = body(time.monotonic() - started).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(text)

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


def shadow_engine(revision: str, per_second: dict[str, float]):
    """An engine's shadow comparison counter: `per_second` comparisons of each result."""
    def body(seconds: float) -> str:
        return "".join(f'graft_shadow_requests_total{{revision="{revision}",result="{result}"}} {rate * seconds:.3f}\n'
                       for result, rate in per_second.items())
    return body


def test_the_builtin_output_divergence_check_counts_the_canarys_comparisons_alone(prometheus):
    """The output-divergence queries, planned as the analysis plans them, count the canary engine's
    agreeing and divergent comparisons (not its failed ones, not the stable engine's), and the share
    they give is judged: 1 divergent a second of 4 compared is a quarter, shown above 5% by the 10 of
    40 a 10 s window holds."""
    targets = MetricsTargets(
        shadow_engine("kv-align@3.2.1", {"agree": 3.0, "divergent": 1.0, "error": 5.0}),
        shadow_engine("base", {"agree": 0.0, "divergent": 10.0, "error": 0.0}))
    try:
        prometheus.set_targets([(a, {"namespace": "llm"}) for a in targets.addresses])
        analysis = parse_spec({"selector": {"matchLabels": {"app": "llm"}},
                               "patch": {"name": "kv-align", "version": "3.2.1"}}).analysis
        (check,) = [c for c in analysis.breakers if c.name == "output-divergence"]
        series = plan(check, Context("llm", "kv-align@3.2.1", "base", "kv-align", "3.2.1"), 10.0)
        deadline, values = time.monotonic() + 40, {}
        # increase() extrapolates to the window's edges: the counts read about 40 and 10, the share 0.25
        while not values or values["canary_compared"] < 30 or \
                abs(values["canary_divergent"] / values["canary_compared"] - 0.25) > 0.03:
            assert time.monotonic() < deadline, values
            values = {}
            for s in series:
                result = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": s.promql}).json()
                assert result["status"] == "success", result
                got = result["data"]["result"]
                values[s.key] = float(got[0]["value"][1]) if got else 0.0
            time.sleep(0.5)
        r = judge(check, Measurement(check.key, values), analysis, previous=None, stable_pods=True)
        assert (r.verdict, r.breaches) == ("Failed", 1), r.message
        assert r.numbers["share"] == pytest.approx(0.25, abs=0.03)
    finally:
        prometheus.set_targets([])
        targets.close()


def cpu_engine(revision: str, cores: float):
    """An engine using `cores` of its 2-core quota's seconds each second."""
    def body(seconds: float) -> str:
        return (f"process_cpu_seconds_total {cores * seconds:.6f}\n"
                "graft_cpu_quota_cores 2\n"
                f'graft_engine_revision_info{{revision="{revision}"}} 1\n')
    return body


def test_the_builtin_cpu_check_is_evaluated_on_the_canary_engines_alone(prometheus):
    """The cpu breaker's query, planned as the analysis plans it, answers the canary's share of its
    quota from real scrapes (not the stable engine's, not an average of both), and is judged."""
    # the canary uses 0.5 of its 2-core quota's seconds each second (a share of 0.25), the stable one 1.8 (0.9)
    targets = MetricsTargets(cpu_engine("kv-align@3.2.1", 0.5), cpu_engine("base", 1.8))
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


def requests_engine(revision: str, per_second: dict[str, float]):
    """An engine's request counter: `per_second` requests of each status."""
    def body(seconds: float) -> str:
        return "".join(f'graft_requests_total{{revision="{revision}",status="{status}"}} {rate * seconds:.3f}\n'
                       for status, rate in per_second.items())
    return body


def test_a_client_hang_up_is_neither_an_error_nor_an_answered_request(prometheus):
    """The error-rate, success-rate and error-rate-delta queries, evaluated on a canary answering 4
    requests a second (1 an error, 1 ended at the engine's timeout) while clients hang up on 6 more:
    the rates are over the 4 answered, so hang-ups neither count as failures nor dilute the share
    (1/2 failed, 1/2 successes, not 2/10 and 2/10), in the comparison as in the absolute checks."""
    targets = MetricsTargets(requests_engine("kv-align@3.2.1", {"ok": 2.0, "error": 1.0, "timeout": 1.0,
                                                                "abandoned": 4.0, "cancelled": 2.0}))
    try:
        prometheus.set_targets([(a, {"namespace": "llm"}) for a in targets.addresses])
        analysis = parse_spec({"selector": {"matchLabels": {"app": "llm"}},
                               "patch": {"name": "kv-align", "version": "3.2.1"},
                               "analysis": {"breakers": [{"name": "error-rate", "max": 0.5}],
                                            "gates": [{"name": "success-rate", "min": 0.5},
                                                      {"name": "error-rate-delta", "max": 0.5}]}}).analysis
        ctx = Context("llm", "kv-align@3.2.1", "base", "kv-align", "3.2.1")
        for check, share, key in ((analysis.breakers[0], 1 / 2, "canary_matching"),
                                  (analysis.gates[0], 1 / 2, "canary_matching"),
                                  (analysis.gates[1], 1 / 2, "canary_errors")):
            series = [s for s in plan(check, ctx, 10.0) if s.side == "canary"]
            deadline, values = time.monotonic() + 40, {}
            while not values or values["canary_requests"] < 20 or \
                    abs(values[key] / values["canary_requests"] - share) > 0.03:
                assert time.monotonic() < deadline, (check.name, values)
                values = {}
                for s in series:
                    result = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": s.promql}).json()
                    assert result["status"] == "success", result
                    got = result["data"]["result"]
                    values[s.key] = float(got[0]["value"][1]) if got else 0.0
                time.sleep(0.5)
    finally:
        prometheus.set_targets([])
        targets.close()
