"""The operator's Events for what goes wrong, end to end: kopf against the API server emulator and
fake engines. A Gateway API rollout rolled back leaves its HTTPRoute at (100, 0); an HTTPRoute the
API server will not take is reported and blocks the rollback until it is fixed; the engines'
refusals each fail the rollout with their own reason; engines nobody can reach hold the start.

Every test here runs on an API server emulator of its own, even when GRAFT_E2E_KUBECONFIG names a
real cluster: the engines are fakes behind pods the test creates, and one test replaces the
cluster-wide HTTPRoute CRD, neither of which is a test's to do to a shared cluster."""
from pathlib import Path

import pytest

from graft.devcluster.apiserver import ApiServer
from graft.operator.kube import Kube, rollout_path
from graft.operator.reconcile import UNAUTHORIZED_TICKS

from operator_cluster import Cluster, create, events_of, events_with, get_rollout, manifest, phase_is, until

pytestmark = pytest.mark.timeout(120)

ROUTING = {"gatewayAPI": {"httpRoute": "llm", "stableService": "llm-stable", "canaryService": "llm-canary"}}
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
HTTPROUTE_CRD = "httproutes.gateway.networking.k8s.io"
CRD_DIR = Path(__file__).resolve().parents[2] / "crds"


@pytest.fixture
async def cluster():
    """This module's own emulator, with Graft's CRDs, in place of the suite's `cluster` (which is
    a real cluster under GRAFT_E2E_KUBECONFIG): what these tests change is theirs alone."""
    async with ApiServer(crd_paths=[CRD_DIR]) as api:
        kube = Kube(api.url)
        yield Cluster(kube, api.url, None)
        await kube.aclose()


def routes_path(namespace: str) -> str:
    return f"/apis/gateway.networking.k8s.io/v1/namespaces/{namespace}/httproutes"


async def create_route(cluster, namespace, stable: int = 100, canary: int = 0):
    await cluster.kube.create(routes_path(namespace), {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "llm"},
        "spec": {"parentRefs": [{"name": "gateway"}], "rules": [{"backendRefs": [
            {"name": "llm-stable", "port": 8000, "weight": stable},
            {"name": "llm-canary", "port": 8000, "weight": canary}]}]}})


async def route_weights(cluster, namespace) -> tuple[int, ...]:
    route = await cluster.kube.get(f"{routes_path(namespace)}/llm")
    return tuple(r["weight"] for r in route["spec"]["rules"][0]["backendRefs"])


def httproute_crd(max_weight: int) -> dict:
    """An HTTPRoute schema whose backend weights may not exceed `max_weight`: stands in for any
    admission rule that refuses the operator's update of the route."""
    ref = {"type": "object", "properties": {"name": {"type": "string"}, "port": {"type": "integer"},
                                            "weight": {"type": "integer", "minimum": 0, "maximum": max_weight}}}
    spec = {"type": "object", "properties": {
        "parentRefs": {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
        "rules": {"type": "array", "items": {"type": "object", "properties": {
            "backendRefs": {"type": "array", "items": ref}}}}}}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": HTTPROUTE_CRD},
            "spec": {"group": "gateway.networking.k8s.io", "scope": "Namespaced",
                     "names": {"plural": "httproutes", "singular": "httproute", "kind": "HTTPRoute"},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": spec}}}}]}}


async def test_a_rolled_back_gateway_rollout_leaves_the_route_at_100_0(cluster, namespace, fleet, operator,
                                                                       prometheus):
    engines = await fleet(2)
    await create_route(cluster, namespace)
    await operator()
    await create(cluster, namespace, manifest(prometheus, trafficRouting=ROUTING,
                                              steps=[{"weight": 10, "pause": "1h"}, {"weight": 100}]))
    await until(lambda: events_with(cluster, namespace, "WeightSet"), 20, what="the first step in place")
    assert await route_weights(cluster, namespace) == (90, 10)
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align"),
                                   {"metadata": {"annotations": {"graft.dev/abort": "true"}}})
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "RolledBack", "Failed"), 20)
    assert obj["status"]["phase"] == "RolledBack" and obj["status"]["reason"] == "Aborted"
    assert await route_weights(cluster, namespace) == (100, 0)
    assert all(e.revision == "base" for e in engines)
    reasons = {e["reason"] for e in await events_of(cluster.kube, namespace, "kv-align")}
    assert "CoarseSteps" not in reasons, "a Gateway API route splits traffic finer than pods"


async def test_a_route_the_api_server_refuses_holds_the_step_and_blocks_the_rollback(cluster, namespace, fleet,
                                                                                    operator, prometheus):
    engines = await fleet(2)
    await cluster.kube.create(CRDS, httproute_crd(max_weight=99))
    await create_route(cluster, namespace, 99, 1)
    await operator()
    await create(cluster, namespace, manifest(prometheus, trafficRouting=ROUTING,
                                              steps=[{"weight": 10, "pause": "1s"}, {"weight": 100}]))
    # the last step asks for (0, 100): refused, so the rollout holds at 10% and says why, once
    events = await until(lambda: events_with(cluster, namespace, "HTTPRouteUpdateFailed"), 30)
    (failed,) = [e for e in events if e["reason"] == "HTTPRouteUpdateFailed"]
    assert failed["type"] == "Warning" and f"HTTPRoute {namespace}/llm" in failed["message"]
    assert "less than or equal to 99" in failed["message"]
    obj = await get_rollout(cluster.kube, namespace, "kv-align")
    assert obj["status"]["phase"] == "Progressing" and obj["status"]["reason"] == "HTTPRouteUpdateFailed"
    assert await route_weights(cluster, namespace) == (90, 10)
    # rolling back asks for (100, 0): refused as well, so the canary keeps its patch until the route is back
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align"),
                                   {"metadata": {"annotations": {"graft.dev/abort": "true"}}})
    events = await until(lambda: events_with(cluster, namespace, "RollbackBlocked"), 20)
    (blocked,) = [e for e in events if e["reason"] == "RollbackBlocked"]
    assert blocked["type"] == "Warning" and "less than or equal to 99" in blocked["message"]
    obj = await get_rollout(cluster.kube, namespace, "kv-align")
    assert obj["status"]["phase"] == "RollingBack" and obj["status"]["reason"] == "Aborted"
    assert "rolling back, but HTTPRoute" in obj["status"]["message"]
    assert sum(e.revision != "base" for e in engines) == 2, "traffic leaves the canaries before their patch does"
    # the admission rule relaxed: the rollback finishes, route first
    crd = await cluster.kube.get(f"{CRDS}/{HTTPROUTE_CRD}")
    await cluster.kube.merge_patch(f"{CRDS}/{HTTPROUTE_CRD}",
                                   {"spec": {"versions": httproute_crd(100)["spec"]["versions"]},
                                    "metadata": {"resourceVersion": crd["metadata"]["resourceVersion"]}})
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "RolledBack"), 20)
    assert obj["status"]["reason"] == "Aborted" and obj["status"]["message"] == "aborted by the user"
    assert await route_weights(cluster, namespace) == (100, 0)
    assert all(e.revision == "base" for e in engines)


# a refused token is asked again for a few ticks (a rotated Secret reaches the operator and the
# engines at different moments); every other refusal is final at once
@pytest.mark.parametrize("status,reason,posts", [(400, "PatchRefused", 1), (403, "Unauthorized", UNAUTHORIZED_TICKS),
                                                 (409, "PatchConflict", 1)])
async def test_an_engine_refusal_fails_the_rollout_with_its_reason(cluster, namespace, fleet, operator, prometheus,
                                                                   status, reason, posts):
    engines = await fleet(2, refuse=status)
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 20)
    assert obj["status"]["reason"] == reason
    assert f"{status} refused kv-align@3.2.1" in obj["status"]["message"]
    events = await until(lambda: events_with(cluster, namespace, "RolledBack"), 10)
    (refusal,) = [e for e in events if e["reason"] == reason]
    assert refusal["type"] == "Warning" and f"{status} refused kv-align@3.2.1" in refusal["message"]
    # two pods at a first step of 1%: one pod is half the traffic, and the rollout said so when it started
    (coarse,) = [e for e in events if e["reason"] == "CoarseSteps"]
    assert "pod-ratio routing over 2 pods" in coarse["message"] and "50% of the traffic" in coarse["message"]
    assert sum(e.posts for e in engines) == posts, "stops at the first final refusal"
    assert all(e.revision == "base" for e in engines)


async def test_engines_nobody_can_reach_hold_the_start_with_an_event(cluster, namespace, fleet, operator, prometheus):
    (engine,) = await fleet(1)
    await engine.stop()
    await operator()
    await create(cluster, namespace, manifest(prometheus))

    async def unreachable():
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        return obj if (obj.get("status") or {}).get("reason") == "EnginesUnreachable" else None

    obj = await until(unreachable, 20, what="reason EnginesUnreachable")
    assert obj["status"]["phase"] == "Pending"
    assert obj["status"]["message"].startswith("cannot read the revision of any engine (engine-0: ")
    events = await until(lambda: events_with(cluster, namespace, "EnginesUnreachable"), 10)
    assert [e["type"] for e in events if e["reason"] == "EnginesUnreachable"] == ["Warning"]
    assert engine.posts == 0
