"""The operator end to end: kopf against the API server, fake engines, a real Prometheus."""
import asyncio
import base64
import re
import time

import pytest
from aiohttp import web

from graft.operator.kube import rollout_path

from operator_cluster import (CHECKS, create, events_of, events_with, get_rollout, manifest, phase_is, rollout_cli,
                              set_pod_status, until)
from operator_fakes import Health

pytestmark = pytest.mark.timeout(120)


async def test_rollout_is_promoted_step_by_step(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(3)
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    seen_steps = set()

    async def promoted():
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        status = obj.get("status") or {}
        if status.get("phase") == "Progressing":
            seen_steps.add((status["stepIndex"], sum(e.revision != "base" for e in engines)))
        return obj if status.get("phase") == "Promoted" else None

    obj = await until(promoted, 60, what="Promoted")
    assert all(e.revision == "kv-align@3.2.1" and e.posts == 1 for e in engines)
    assert {(0, 1), (1, 2)} <= seen_steps
    status = obj["status"]
    assert status["stableRevision"] == status["canaryRevision"] == "kv-align@3.2.1" and status["weight"] == 100
    pods = await cluster.kube.list(f"/api/v1/namespaces/{namespace}/pods")
    assert {p["metadata"]["labels"]["graft.dev/track"] for p in pods} == {"stable"}
    assert {p["metadata"]["annotations"]["graft.dev/patches"] for p in pods} == {"kv-align@3.2.1"}
    reasons = [e["reason"] for e in await until(lambda: events_with(cluster, namespace, "Promoted"), 10)]
    for reason in ("StepStarted", "PodsPatched", "WeightSet", "AnalysisPassed", "Promoted"):
        assert reason in reasons


async def test_failing_breaker_rolls_back(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(3, health={"kv-align@3.2.1": Health(error_ratio=0.5)})
    await operator()
    # the breakers alone (error-rate-delta would roll back at once on such evidence: a conclusive gate)
    breakers = {"breakers": CHECKS["breakers"]}
    await create(cluster, namespace, manifest(prometheus, analysis=breakers))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "RolledBack", "Promoted"), 60)
    assert obj["status"]["phase"] == "RolledBack" and obj["status"]["reason"] == "AnalysisFailed"
    assert obj["status"]["stepIndex"] == 0
    # Prometheus extrapolates increase() to the window's edges: half the requests failing reads 45-55%
    share = re.search(r"breaker error-rate ([0-9.]+)% \(", obj["status"]["message"])
    assert share and 45 <= float(share.group(1)) <= 55, obj["status"]["message"]
    assert "(breach 2/2)" in obj["status"]["message"]
    assert all(e.revision == "base" for e in engines) and sum(e.posts for e in engines) == 1
    events = await until(lambda: events_with(cluster, namespace, "RolledBack"), 10)
    failed = [e["message"] for e in events if e["reason"] == "AnalysisFailed"]
    assert failed and all("above the error rate 5% at 0.999 confidence" in m for m in failed)
    assert sorted(m[m.index("(breach"):] for m in failed) == ["(breach 1/2)", "(breach 2/2)"]


async def test_no_traffic_holds_the_first_step_then_pauses(cluster, namespace, fleet, operator, prometheus):
    """No requests at all: nothing is judged on data, so not even the 1% step passes (a step never
    advances on no evidence); inconclusiveLimit runs past its pause, then the rollout pauses for a person."""
    engines = await fleet(2, rps=0.0)
    await operator()
    body = manifest(prometheus)
    body["spec"]["analysis"]["inconclusiveLimit"] = 4
    await create(cluster, namespace, body)

    async def held():
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        s = obj.get("status") or {}
        return obj if s.get("stepIndex") == 0 and (s.get("analysis") or {}).get("verdict") == "Inconclusive" else None

    obj = await until(held, 30, what="an Inconclusive analysis at step 1")
    results = {(r["role"], r["name"]): r for r in obj["status"]["analysis"]["results"]}
    gate = results[("gate", "error-rate-delta")]
    assert gate["verdict"] == "Inconclusive" and gate["short"] and "no canary requests" in gate["message"]
    breaker = results[("breaker", "error-rate")]
    assert "no canary requests" in breaker["message"] and "noData: hold" in breaker["message"]
    await until(lambda: events_with(cluster, namespace, "AnalysisInconclusive"), 10)
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Paused"), 30, what="an analysis pause")
    assert obj["status"]["reason"] == "InconclusiveLimit" and obj["spec"]["paused"] is False
    assert [c["reason"] for c in obj["status"]["pauseConditions"]] == ["InconclusiveLimit"]
    assert "inconclusiveLimit 4" in obj["status"]["message"] and obj["status"]["stepIndex"] == 0
    await until(lambda: events_with(cluster, namespace, "InconclusiveLimit"), 10)
    assert sum(e.revision != "base" for e in engines) == 1, "held, not rolled back: a person decides"


async def test_pause_promote_resume_and_abort(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(4)
    await operator()
    slow = [{"weight": 1, "pause": "1h"}, {"weight": 50, "pause": "1h"}, {"weight": 100}]
    await create(cluster, namespace, manifest(prometheus, steps=slow))
    path = rollout_path(namespace, "kv-align")

    async def at(step, phase="Progressing"):
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        s = obj.get("status") or {}
        return obj if s.get("stepIndex") == step and s.get("phase") == phase and s.get("stepReadyAt") else None

    await until(lambda: at(0), 20)
    await cluster.kube.merge_patch(path, {"spec": {"paused": True}})
    await until(lambda: at(0, "Paused"), 20)
    await cluster.kube.merge_patch(path, {"metadata": {"annotations": {"graft.dev/promote": "step"}}})
    obj = await until(lambda: at(1, "Paused"), 20, what="step 1, still paused")
    assert "graft.dev/promote" not in obj["metadata"].get("annotations", {}), "the control is consumed"
    assert sum(e.revision != "base" for e in engines) == 2
    await cluster.kube.merge_patch(path, {"spec": {"paused": False}})
    await until(lambda: at(1), 20)
    await cluster.kube.merge_patch(path, {"metadata": {"annotations": {"graft.dev/abort": "true"}}})
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "RolledBack"), 20)
    assert obj["status"]["reason"] == "Aborted"
    assert all(e.revision == "base" for e in engines)
    reasons = {e["reason"] for e in await until(lambda: events_with(cluster, namespace, "RolledBack"), 10)}
    assert {"Paused", "PromotedByUser", "Resumed", "Aborted", "RollingBack", "RolledBack"} <= reasons
    promotions = [e for e in await events_of(cluster.kube, namespace, "kv-align") if e["reason"] == "PromotedByUser"]
    assert len(promotions) == 1, "one promote annotation, one promotion"


async def test_promote_full_skips_the_remaining_steps(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(3)
    await operator()
    await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 1, "pause": "1h"}, {"weight": 100}]))
    await until(lambda: events_with(cluster, namespace, "PodsPatched"), 20)
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align"),
                                   {"metadata": {"annotations": {"graft.dev/promote": "full"}}})
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), 20)
    assert all(e.revision == "kv-align@3.2.1" for e in engines)


async def test_operator_restart_resumes_without_repatching(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(3)
    first = await operator()
    steps = [{"weight": 1, "pause": "1s"}, {"weight": 50, "pause": "3s"}, {"weight": 100}]
    await create(cluster, namespace, manifest(prometheus, steps=steps))

    async def step_one_in_place():
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        s = obj.get("status") or {}
        return s.get("stepIndex") == 1 and s.get("stepReadyAt")

    await until(step_one_in_place, 30)
    await first.stop()
    posts = [e.posts for e in engines]
    assert sum(posts) == 2
    await operator()
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), 40)
    assert [e.posts for e in engines] == [1, 1, 1], "each engine patched once, across both operators"


async def test_restarted_canary_is_patched_again(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(3)
    await operator()
    await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 1, "pause": "1h"}, {"weight": 100}]))
    await until(lambda: events_with(cluster, namespace, "PodsPatched"), 20)
    index, canary = next((i, e) for i, e in enumerate(engines) if e.revision != "base")
    canary.restart()
    await set_pod_status(cluster.kube, namespace, f"engine-{index}", canary)
    await until(lambda: events_with(cluster, namespace, "PodRepatched"), 20)
    await until(lambda: (canary.revision == "kv-align@3.2.1"), 10)
    assert canary.posts == 2 and sum(e.posts for e in engines) == 2
    obj = await get_rollout(cluster.kube, namespace, "kv-align")
    record = next(p for p in obj["status"]["pods"] if p["name"] == f"engine-{index}")
    assert record["restartCount"] == 1 and record["containerID"].endswith("-1")


async def test_vanished_canary_is_dropped_and_replaced(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(3)
    await operator()
    await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 1, "pause": "1h"}, {"weight": 100}]))
    await until(lambda: events_with(cluster, namespace, "PodsPatched"), 20)
    index = next(i for i, e in enumerate(engines) if e.revision != "base")
    await cluster.kube.delete(f"/api/v1/namespaces/{namespace}/pods/engine-{index}")
    await until(lambda: events_with(cluster, namespace, "PodDropped"), 20)
    others = [e for i, e in enumerate(engines) if i != index]
    await until(lambda: (sum(e.revision != "base" for e in others) == 1), 10, what="a new canary")
    obj = await get_rollout(cluster.kube, namespace, "kv-align")
    assert f"engine-{index}" not in [p["name"] for p in obj["status"]["pods"]]


async def test_deleting_a_rollout_in_flight_reverts_its_canaries(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2)
    await operator()
    await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 50, "pause": "1h"}, {"weight": 100}]))
    await until(lambda: (any(e.revision != "base" for e in engines)), 20)
    await cluster.kube.delete(rollout_path(namespace, "kv-align"))

    async def gone():
        return await get_rollout(cluster.kube, namespace, "kv-align") is None

    await until(gone, 20, what="the rollout to be gone")
    assert all(e.revision == "base" for e in engines)


async def test_a_prometheus_outage_holds_the_step_and_the_rollout_goes_on_by_itself(
        cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2)
    await operator()
    await asyncio.to_thread(prometheus.stop)
    try:
        await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 50, "pause": "1s"}, {"weight": 100}]))

        async def unavailable():
            obj = await get_rollout(cluster.kube, namespace, "kv-align")
            return obj if (obj.get("status") or {}).get("reason") == "AnalysisUnavailable" else None

        obj = await until(unavailable, 30, what="the step held for Prometheus")
        status = obj["status"]
        assert status["phase"] == "Progressing" and status["stepIndex"] == 0 and status["analysis"]["outageSince"]
        assert "holding until it answers" in status["message"]
        assert all(r["verdict"] == "Error" and f"Prometheus at {prometheus.url} is unreachable" in r["message"]
                   for r in status["analysis"]["results"])
        events = await until(lambda: events_with(cluster, namespace, "AnalysisUnavailable"), 10)
        (held,) = [e for e in events if e["reason"] == "AnalysisUnavailable"]
        assert held["type"] == "Warning" and "pausing after 10m" in held["message"]
        await asyncio.sleep(6)            # past errorLimit (4) runs of 1 s: an outage is not a broken check
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        assert obj["status"]["phase"] == "Progressing" and obj["status"]["stepIndex"] == 0
        assert obj["spec"]["paused"] is False and not obj["status"].get("pauseConditions")
        assert sum(e.revision != "base" for e in engines) == 1, "held where it was, nothing reverted"
    finally:
        await asyncio.to_thread(prometheus.start)
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted", "RolledBack", "Paused"), 60)
    assert obj["status"]["phase"] == "Promoted", obj["status"]["message"]
    assert obj["status"]["analysis"].get("outageSince") is None
    reasons = [e["reason"] for e in await events_of(cluster.kube, namespace, "kv-align")]
    assert {"AnalysisUnavailable", "AnalysisAvailable", "Promoted"} <= set(reasons)
    assert "Paused" not in reasons and "Resumed" not in reasons, "nobody had to do anything"
    assert all(e.revision == "kv-align@3.2.1" for e in engines)


async def test_an_outage_past_its_limit_pauses_in_status_and_graft_rollout_resume_ends_it(
        cluster, namespace, fleet, operator, prometheus, tmp_path):
    engines = await fleet(2)
    await operator()
    await asyncio.to_thread(prometheus.stop)
    try:
        body = manifest(prometheus, steps=[{"weight": 50, "pause": "1s"}, {"weight": 100}])
        body["spec"]["analysis"]["outageLimit"] = "3s"
        await create(cluster, namespace, body)
        obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Paused"), 30, what="an outage pause")
        status = obj["status"]
        assert status["reason"] == "AnalysisOutageLimit" and status["stepIndex"] == 0
        assert "(outageLimit 3s)" in status["message"] and "graft.dev/resume" in status["message"]
        assert [c["reason"] for c in status["pauseConditions"]] == ["AnalysisOutageLimit"]
        assert obj["spec"]["paused"] is False, "the spec stays as its author wrote it"
        assert sum(e.revision != "base" for e in engines) == 1, "held where it was, nothing reverted"
    finally:
        await asyncio.to_thread(prometheus.start)
    await asyncio.to_thread(prometheus.wait_for_targets, len(engines), 30)
    await asyncio.sleep(2)
    assert (await phase_is(cluster, namespace, "kv-align", "Paused")), "back, but a person decides"
    code, out = await rollout_cli(cluster, namespace, tmp_path, "resume", "kv-align")
    assert code == 0 and "ends its AnalysisOutageLimit pause" in out, out
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted", "RolledBack"), 60)
    assert obj["status"]["phase"] == "Promoted" and not obj["status"].get("pauseConditions")
    assert "graft.dev/resume" not in (obj["metadata"].get("annotations") or {}), "the control is consumed"
    reasons = [e["reason"] for e in await events_of(cluster.kube, namespace, "kv-align")]
    assert {"AnalysisUnavailable", "AnalysisOutageLimit", "PauseEnded", "Resumed", "Promoted"} <= set(reasons)
    assert all(e.revision == "kv-align@3.2.1" for e in engines)


async def test_rollout_naming_a_template_is_judged_by_its_checks(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2, health={"kv-align@3.2.1": Health(error_ratio=0.5)})
    await cluster.kube.create(f"/apis/graft.dev/v1alpha1/namespaces/{namespace}/patchanalysistemplates", {
        "apiVersion": "graft.dev/v1alpha1", "kind": "PatchAnalysisTemplate", "metadata": {"name": "fleet-checks"},
        "spec": {"breakers": [{"name": "error-rate", "max": 0.2, "window": "2s", "consecutive": 1}],
                 "gates": [{"name": "success-rate", "min": 0.9, "window": "2s"}]}})
    await operator()
    await create(cluster, namespace, manifest(prometheus, analysis={"templates": [{"name": "fleet-checks"}]}))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "RolledBack", "Promoted", "Failed"), 40)
    status = obj["status"]
    assert status["phase"] == "RolledBack" and status["reason"] == "AnalysisFailed", status["message"]
    assert {(r["role"], r["name"]) for r in status["analysis"]["results"]} == {
        ("breaker", "error-rate"), ("gate", "success-rate")}, "the template's checks, and no default one"
    assert "above the error rate 20%" in status["message"] and "(breach 1/1)" in status["message"]
    assert all(e.revision == "base" for e in engines)


async def test_a_missing_template_is_an_invalid_spec(cluster, namespace, operator, prometheus):
    await operator()
    await create(cluster, namespace, manifest(prometheus, analysis={"templates": [{"name": "nowhere"}]}))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 20)
    assert obj["status"]["reason"] == "InvalidSpec"
    assert "spec.analysis.templates: namespaced analysis template 'nowhere' was not found" in obj["status"]["message"]


class FakePrometheus:
    """`/api/v1/query` answering every count with 100 requests and no error, recording each request's
    headers: stands in for a Prometheus behind an authenticating proxy."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> "FakePrometheus":
        app = web.Application()
        app.router.add_get("/api/v1/query", self._query)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()

    async def _query(self, request: web.Request) -> web.Response:
        self.seen.append(dict(request.headers))
        value = "0" if re.search(r'status=~?"error', request.query["query"]) else "100"
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {}, "value": [time.time(), value]}]}})


async def test_bearer_token_secret_and_headers_reach_prometheus(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2)
    async with FakePrometheus() as prom:
        await operator(prometheus_allowed=[prom.url], prometheus_secret_namespaces=[namespace])
        analysis = {"prometheus": {"address": prom.url, "bearerTokenSecret": {"name": "prom-token", "key": "token"},
                                   "headers": [{"name": "X-Scope-OrgID", "value": "llm"}]},
                    "interval": "1s", "breakers": [{"name": "error-rate", "max": 0.05, "window": "2s"}]}
        await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 50, "pause": "1s"}, {"weight": 100}],
                                                  analysis=analysis))

        async def secret_missing():
            obj = await get_rollout(cluster.kube, namespace, "kv-align")
            results = ((obj.get("status") or {}).get("analysis") or {}).get("results") or []
            return results if results and all(r["verdict"] == "Error" for r in results) else None

        (result,) = await until(secret_missing, 20, what="an Error run for the missing Secret")
        assert result["message"] == (f"error-rate: spec.analysis.prometheus.bearerTokenSecret: Secret "
                                     f"{namespace}/prom-token not found")
        assert prom.seen == [], "no query goes out without its credentials"
        await cluster.kube.create(f"/api/v1/namespaces/{namespace}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "prom-token"},
            "data": {"token": base64.b64encode(b"s3cret\n").decode()}})
        obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted", "RolledBack", "Paused"), 30)
        assert obj["status"]["phase"] == "Promoted", obj["status"]["message"]
    assert prom.seen and all(h.get("Authorization") == "Bearer s3cret" and h.get("X-Scope-OrgID") == "llm"
                             for h in prom.seen)
    assert all(e.revision == "kv-align@3.2.1" for e in engines)
