"""The `web` metric provider: a check's number from any HTTP service answering JSON. The path
reader, every way an answer can go wrong (each its kind: no data, an error, an outage), the
request as the check describes it (placeholders escaped, a header from a Secret), the allow-list,
and, through the real operator, a web breaker rolling a rollout back and a web gate promoting one."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from graft.operator.prometheus import HTTP, PARSE, TRANSPORT, ProviderError
from graft.operator.runtime import Runtime
from graft.operator.settings import OperatorSettings
from graft.operator.web import MISSING, WebProvider, json_path
from graft.rollout.analysis import plan_run
from graft.rollout.spec import SpecError, parse_spec
from graft.rollout.status import RolloutStatus

from operator_cluster import create, manifest, phase_is, until
from test_prometheus_auth import Secrets


class Service:
    """An evaluation service on 127.0.0.1: answers each path with what the test set, records requests."""

    def __init__(self):
        self.answers: dict[str, tuple[int, bytes, float]] = {}
        self.seen: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.seen.append({"method": self.command, "path": self.path, "body": body.decode(),
                                   "headers": dict(self.headers)})
                code, payload, delay = outer.answers.get(self.path.split("?")[0], (404, b"{}", 0.0))
                time.sleep(delay)
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def set(self, path: str, doc, code: int = 200, delay: float = 0.0) -> None:
        self.answers[path] = (code, doc if isinstance(doc, bytes) else json.dumps(doc).encode(), delay)


@pytest.fixture
def service():
    s = Service()
    yield s
    s.httpd.shutdown()


BASE = {"selector": {"matchLabels": {"app": "e"}}, "patch": {"name": "kv-align", "version": "3.2.1"}}


def web_spec(service, **web):
    return parse_spec({**BASE, "analysis": {"gates": [{"name": "accuracy", "min": 0.8,
                                                       "web": {"url": f"{service.url}/score", "jsonPath": "$.score",
                                                               **web}}]}})


def request(spec, canary="kv-align@3.2.1", stable="base"):
    ((check, (series,)),) = plan_run(spec, RolloutStatus(canary_revision=canary, stable_revision=stable), "team-a",
                                     100.0)
    return check, series


def test_the_path_reader_reads_fields_indexes_and_quoted_names_and_nothing_else():
    doc = {"data": {"result": [{"value": [0, "0.93"]}], "odd key": 3}}
    assert json_path(doc, "$.data.result[0].value[1]") == "0.93"
    assert json_path(doc, "$['data']['odd key']") == 3
    assert json_path(doc, "$.data.result[5]") is MISSING and json_path(doc, "$.nothing") is MISSING
    assert json_path(doc, "$") is doc
    for bad in ("data.result", "$..value", "$.data[*]", "$.a;import os"):
        with pytest.raises(ValueError):
            json_path(doc, bad)


@pytest.mark.parametrize("answer,code,value", [
    ({"score": 0.91}, 200, 0.91), ({"score": "0.5"}, 200, 0.5), ({"score": True}, 200, 1.0),
    ({"other": 1}, 200, None), ({"score": None}, 200, None)])
async def test_a_number_true_false_or_nothing(service, answer, code, value):
    service.set("/score", answer, code)
    provider = WebProvider()
    try:
        _, series = request(web_spec(service))
        assert await provider.number(series.web, {}) == value
    finally:
        await provider.aclose()


@pytest.mark.parametrize("answer,code,delay,kind,outage,needle", [
    ({"score": "high"}, 200, 0, PARSE, False, "'high' at $.score, not a number"),
    ({"score": [1]}, 200, 0, PARSE, False, "a JSON list at $.score"),
    (b"<html>", 200, 0, PARSE, False, "without JSON"),
    ({}, 500, 0, HTTP, True, "answered HTTP 500"),
    ({}, 403, 0, HTTP, False, "answered HTTP 403"),
    ({"score": 1}, 200, 1.5, TRANSPORT, True, "did not answer within 1s"),
])
async def test_every_failure_has_its_kind(service, answer, code, delay, kind, outage, needle):
    service.set("/score", answer, code, delay)
    provider = WebProvider()
    try:
        _, series = request(web_spec(service, timeout="1s"))
        with pytest.raises(ProviderError) as failed:
            await provider.number(series.web, {})
        assert (failed.value.kind, failed.value.outage) == (kind, outage) and needle in str(failed.value)
        m = await provider.measure("gate/accuracy", [series], [{}])
        assert m.error and m.outage == outage, "a failed request is the check's error, not a crash"
    finally:
        await provider.aclose()


async def test_the_request_is_the_checks_with_placeholders_escaped_and_a_header_from_a_secret(service):
    service.set("/score", {"score": 0.9})
    spec = parse_spec({**BASE, "analysis": {"args": [{"name": "suite", "value": 'bbh "hard"'}], "gates": [{
        "name": "accuracy", "min": 0.8, "web": {
            "url": f"{service.url}/score?canary={{{{canaryRevision}}}}&suite={{{{args.suite}}}}",
            "method": "POST", "body": '{"revision": "{{canaryRevision}}", "suite": "{{args.suite}}"}',
            "jsonPath": "$.score",
            "headers": [{"name": "X-Team", "value": "llm"},
                        {"name": "Authorization", "valueFrom": {"secretKeyRef": {"name": "evals", "key": "token"}}}]}}]}})
    _, series = request(spec, canary='kv-align@3.2.1,"x"')
    rt = Runtime(OperatorSettings(prometheus_secret_namespaces=["team-a"], web_allowed=[service.url]))
    rt.kube = Secrets(evals={"token": "Bearer e-token\n"})
    try:
        headers = await rt.web_headers(series.web, "team-a")
        assert await rt.web.number(series.web, headers) == 0.9
    finally:
        await rt.close()
    (seen,) = service.seen
    assert seen["method"] == "POST"
    assert seen["path"] == "/score?canary=kv-align%403.2.1%2C%22x%22&suite=bbh%20%22hard%22"
    assert json.loads(seen["body"]) == {"revision": 'kv-align@3.2.1,"x"', "suite": 'bbh "hard"'}
    assert seen["headers"]["X-Team"] == "llm" and seen["headers"]["Authorization"] == "Bearer e-token"


def test_the_allow_list_and_the_secret_namespaces_are_the_administrators():
    spec = parse_spec({**BASE, "analysis": {"breakers": [{"name": "q", "max": 1, "web": {
        "url": "http://evals.ml:8080/q", "jsonPath": "$.q",
        "headers": [{"name": "Authorization", "valueFrom": {"secretKeyRef": {"name": "e", "key": "t"}}}]}}]}})
    checks = spec.analysis.checks
    refused = Runtime(OperatorSettings()).web_refusal(checks, "team-a")
    assert refused.reason == "WebNotAllowed" and refused.permanent and "allowed: none" in refused.message
    elsewhere = Runtime(OperatorSettings(web_allowed=["http://evals.ml:8080"])).web_refusal(checks, "team-a")
    assert elsewhere.reason == "PrometheusSecretsNotAllowed" and "web.headers" in elsewhere.message
    allowed = Runtime(OperatorSettings(web_allowed=["http://evals.ml:8080"], prometheus_secret_namespaces=["team-a"]))
    assert allowed.web_refusal(checks, "team-a") is None
    with pytest.raises(ValueError, match="GRAFT_WEB_ALLOWED"):
        OperatorSettings.from_env({"GRAFT_WEB_ALLOWED": "evals.ml:8080", "GRAFT_ADMIN_CA_FILE": "/ca.pem"})


@pytest.mark.parametrize("check,needle", [
    ({"name": "q", "max": 1, "query": 'up{namespace="{{namespace}}"}', "web": {"url": "http://e/q", "jsonPath": "$"}},
     "a check has one source"),
    ({"name": "q", "max": 1, "web": {"url": "http://e/q", "jsonPath": "$", "body": "{}"}}, "only a POST has a body"),
    ({"name": "q", "max": 1, "web": {"url": "http://e/q", "jsonPath": "$.a", "timeout": "2m"}}, "web.timeout"),
    ({"name": "q", "max": 1, "web": {"url": "http://e/q", "jsonPath": "$..a"}}, "web.jsonPath"),
    ({"name": "q", "max": 1, "web": {"url": "http://e/{{args.missing}}", "jsonPath": "$"}}, "args.missing"),
])
def test_a_web_check_the_api_server_would_refuse_is_refused_by_name(check, needle):
    with pytest.raises(SpecError, match=needle.replace(".", r"\.").replace("$", r"\$")):
        parse_spec({**BASE, "analysis": {"breakers": [check]}})


# ---- through the real operator ----

def web_checks(service, role: str, **limits) -> dict:
    return {role: [{"name": "quality", **limits, "web": {"url": f"{service.url}/quality?canary={{{{canaryRevision}}}}",
                                                         "jsonPath": "$.difference", "timeout": "2s"}}]}


async def test_a_web_breaker_rolls_back_and_a_web_gate_promotes(cluster, namespace, fleet, operator, prometheus,
                                                                  service):
    engines = await fleet(2)
    await operator(web_allowed=[service.url])
    service.set("/quality", {"difference": 0.25})
    await create(cluster, namespace, manifest(prometheus, "worse", analysis=web_checks(service, "breakers", max=0.1)))
    final = await until(lambda: phase_is(cluster, namespace, "worse", "RolledBack", "Promoted", "Failed"), 60)
    status = final["status"]
    assert status["phase"] == "RolledBack", status
    (result,) = status["analysis"]["results"]
    assert (result["name"], result["verdict"], result["value"]) == ("quality", "Failed", 0.25)
    assert any("canary=kv-align%403.2.1" in s["path"] for s in service.seen), "asked about the canary's revision"
    assert all(not e.applied for e in engines), "every engine back at base"

    service.set("/quality", {"difference": 0.0})
    await create(cluster, namespace, manifest(prometheus, "same", analysis=web_checks(service, "gates", max=0.1)))
    final = await until(lambda: phase_is(cluster, namespace, "same", "RolledBack", "Promoted", "Failed"), 60)
    assert final["status"]["phase"] == "Promoted", final["status"]
    assert all(e.applied == {"kv-align": "3.2.1"} for e in engines)
