"""The operator end to end: kopf against the API server, fake engines, a real Prometheus."""
import pytest

from graft.operator.kube import rollout_path

from operator_cluster import (create, events_of, events_with, get_rollout, manifest, phase_is, set_pod_status,
                              until)
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


async def test_failing_metric_rolls_back(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(3, health={"kv-align@3.2.1": Health(error_ratio=0.5)})
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "RolledBack", "Promoted"), 60)
    assert obj["status"]["phase"] == "RolledBack" and obj["status"]["reason"] == "AnalysisFailed"
    assert "error-rate" in obj["status"]["message"]
    assert all(e.revision == "base" for e in engines) and sum(e.posts for e in engines) == 1
    events = await until(lambda: events_with(cluster, namespace, "RolledBack"), 10)
    failed = [e["message"] for e in events if e["reason"] == "AnalysisFailed"]
    assert failed and "breaches <= 0.05" in failed[0]


async def test_no_data_holds_the_step(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2, rps=0.0)
    await operator()
    await create(cluster, namespace, manifest(prometheus))

    async def held():
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        analysis = (obj.get("status") or {}).get("analysis") or {}
        return obj if analysis.get("verdict") == "Inconclusive" else None

    obj = await until(held, 30, what="an Inconclusive analysis")
    await until(lambda: events_with(cluster, namespace, "AnalysisInconclusive"), 10)
    obj = await get_rollout(cluster.kube, namespace, "kv-align")
    status = obj["status"]
    assert status["phase"] == "Progressing" and status["stepIndex"] == 0
    assert sum(e.revision != "base" for e in engines) == 1
    messages = [r["message"] for r in status["analysis"]["results"]]
    assert any("fewer than minRequests 10" in m and "noData: hold" in m for m in messages)


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


async def test_unreachable_prometheus_holds_and_never_promotes(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2)
    await operator()
    body = manifest(prometheus, steps=[{"weight": 50, "pause": "500ms"}, {"weight": 100}])
    body["spec"]["analysis"]["prometheus"]["address"] = "http://127.0.0.1:9"    # nothing listens there
    await create(cluster, namespace, body)

    async def erred():
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        return obj if ((obj.get("status") or {}).get("analysis") or {}).get("verdict") == "Error" else None

    obj = await until(erred, 30, what="an Error analysis")
    assert obj["status"]["phase"] == "Progressing" and obj["status"]["stepIndex"] == 0
    assert all(r["verdict"] == "Error" and "ConnectionError" in r["message"]
               for r in obj["status"]["analysis"]["results"])
    assert sum(e.revision != "base" for e in engines) == 1
