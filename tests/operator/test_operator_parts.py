"""The operator's parts on their own: admin API client, pods, Gateway API router, bundles, settings."""
import json

import httpx
import pytest

from graft.operator.admin import AdminClient, AdminError
from graft.api import digest_of
from graft.operator.bundles import BundleError, load_source
from graft.operator.kube import Kube
from graft.operator.pods import admin_address, is_ready, observe_pod
from graft.operator.routers import RouteError
from graft.operator.routers.gatewayapi import GatewayAPIRouter
from graft.operator.settings import OperatorSettings
from graft.rollout.spec import PatchSource, PatchSpec, TrafficRouting


def admin_with(handler, **kwargs) -> AdminClient:
    return AdminClient("tok", transport=httpx.MockTransport(handler), backoff=0.001, **kwargs)


@pytest.mark.parametrize("status,kind", [(400, "malformed"), (401, "unauthorized"), (403, "unauthorized"),
                                         (404, "unknown-patch"), (409, "conflict"), (422, "verify-failed")])
async def test_engine_refusals_map_to_error_kinds_without_retry(status, kind):
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(status, json={"error": {"code": status, "message": "nope"}})

    with pytest.raises(AdminError) as info:
        await admin_with(handler).apply("10.0.0.1", 8081, "kv", "1", {"builtin": True})
    assert info.value.kind == kind and "nope" in info.value.message and len(calls) == 1


async def test_unreachable_engine_is_retried_with_backoff_then_reported():
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) < 3:
            return httpx.Response(503, json={"error": {"message": "draining"}})
        return httpx.Response(200, json={"revision": "kv@1"})

    client = admin_with(handler, retries=2)
    assert await client.apply("10.0.0.1", 8081, "kv", "1", {"builtin": True}) == "kv@1"
    assert len(calls) == 3
    assert calls[0].headers["authorization"] == "Bearer tok"
    assert calls[0].url == "http://10.0.0.1:8081/admin/patches"

    def refuse(request):
        raise httpx.ConnectError("connection refused")

    with pytest.raises(AdminError) as info:
        await admin_with(refuse, retries=1).revision("10.0.0.2", 8081)
    assert info.value.kind == "unreachable" and "10.0.0.2:8081" in info.value.message


async def test_reverting_a_patch_that_is_not_applied_counts_as_reverted():
    def handler(request):
        if request.method == "DELETE":
            return httpx.Response(404, json={"error": {"message": "no patch named kv is applied"}})
        return httpx.Response(200, json={"revision": "base"})

    assert await admin_with(handler).revert("10.0.0.1", 8081, "kv") == "base"


def pod(**changes):
    p = {"metadata": {"name": "engine-0", "uid": "u1", "labels": {"graft.dev/track": "canary"},
                      "annotations": {"graft.dev/patches": "kv@1"}},
         "spec": {"containers": [{"name": "sidecar"},
                                 {"name": "engine", "ports": [{"name": "admin", "containerPort": 9001}]}]},
         "status": {"phase": "Running", "podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}],
                    "containerStatuses": [{"name": "sidecar", "containerID": "c://s", "restartCount": 7},
                                          {"name": "engine", "containerID": "c://e", "restartCount": 2}]}}
    for key, value in changes.items():
        p[key] = {**p[key], **value}
    return p


def test_pod_observation_uses_the_engine_container():
    obs = observe_pod(pod())
    assert (obs.name, obs.uid, obs.container_id, obs.restart_count) == ("engine-0", "u1", "c://e", 2)
    assert obs.ready and obs.track == "canary" and obs.patches == "kv@1"


def test_the_admin_address_is_the_pod_ip_on_the_port_given():
    assert admin_address(pod(), 8081) == ("10.1.2.3", 8081)
    assert admin_address(pod(status={"podIP": None}), 8081) is None


def test_readiness_needs_running_an_ip_and_the_ready_condition():
    assert is_ready(pod())
    assert not is_ready(pod(status={"conditions": [{"type": "Ready", "status": "False"}]}))
    assert not is_ready(pod(status={"phase": "Pending"}))


def kube_serving(objects: dict[str, dict], patches: list | None = None) -> Kube:
    def handler(request):
        if request.method == "PATCH":
            patches.append(request)
            return httpx.Response(200, json={})
        obj = objects.get(request.url.path)
        return httpx.Response(200, json=obj) if obj is not None else httpx.Response(404, json={"message": "nf"})
    return Kube("http://api", transport=httpx.MockTransport(handler))


ROUTING = TrafficRouting("gatewayAPI", "llm", "llm-stable", "llm-canary")
ROUTE_PATH = "/apis/gateway.networking.k8s.io/v1/namespaces/ns/httproutes/llm"


async def test_gateway_router_reports_a_missing_route_and_missing_backend_refs():
    with pytest.raises(RouteError) as info:
        await GatewayAPIRouter(kube_serving({}), "ns", ROUTING).get_weight()
    assert info.value.reason == "HTTPRouteMissing"
    route = {"metadata": {"resourceVersion": "1"}, "spec": {"rules": [{"backendRefs": [{"name": "llm-stable"}]}]}}
    with pytest.raises(RouteError) as info:
        await GatewayAPIRouter(kube_serving({ROUTE_PATH: route}), "ns", ROUTING).set_weight(5)
    assert info.value.reason == "BackendRefsMissing" and "llm-canary" in info.value.message


async def test_gateway_router_sets_both_weights_with_the_resource_version():
    patches: list = []
    route = {"metadata": {"resourceVersion": "42"}, "spec": {"rules": [{"backendRefs": [
        {"name": "llm-stable", "weight": 100}, {"name": "llm-canary", "weight": 0}, {"name": "other", "weight": 3}]}]}}
    router = GatewayAPIRouter(kube_serving({ROUTE_PATH: route}, patches), "ns", ROUTING)
    assert await router.get_weight() == 0
    await router.set_weight(20)
    body = json.loads(patches[0].content)
    assert patches[0].headers["content-type"] == "application/merge-patch+json"
    assert body["metadata"]["resourceVersion"] == "42"
    assert [r["weight"] for r in body["spec"]["rules"][0]["backendRefs"]] == [80, 20, 3]


BUNDLE = "PATCHES = []\n"
SOURCE = PatchSpec("kv", "1", PatchSource(False, "bundle", "patch.py", digest_of(BUNDLE)))
CM_PATH = "/api/v1/namespaces/ns/configmaps/bundle"


async def test_bundle_source_carries_digest_and_signature():
    kube = kube_serving({CM_PATH: {"data": {"patch.py": BUNDLE, "patch.py.sig": "c2ln\n"}}})
    assert await load_source(kube, "ns", SOURCE) == {"module": BUNDLE, "digest": digest_of(BUNDLE), "signature": "c2ln"}
    fresh = "v2:4000000000:c2ln"
    kube = kube_serving({CM_PATH: {"data": {"patch.py": BUNDLE, "patch.py.sig": fresh}}})
    assert (await load_source(kube, "ns", SOURCE))["signature"] == fresh


@pytest.mark.parametrize("objects,reason,permanent", [
    ({}, "BundleMissing", False),
    ({CM_PATH: {"data": {"other.py": BUNDLE}}}, "BundleMissing", False),
    ({CM_PATH: {"data": {"patch.py": BUNDLE + "# changed"}}}, "DigestMismatch", True),
    ({CM_PATH: {"data": {"patch.py": BUNDLE, "patch.py.sig": "v2:1000000000:c2ln"}}}, "SignatureExpired", False),
])
async def test_bundle_problems(objects, reason, permanent):
    with pytest.raises(BundleError) as info:
        await load_source(kube_serving(objects), "ns", SOURCE)
    assert (info.value.problem.reason, info.value.problem.permanent) == (reason, permanent)


def test_settings_from_environment():
    s = OperatorSettings.from_env({"GRAFT_NAMESPACES": "llm, other", "GRAFT_TICK_SECONDS": "2",
                                   "GRAFT_ADMIN_TOKEN_SECRET": "graft/admin", "GRAFT_ADMIN_PORT": "9000",
                                   "GRAFT_ADMIN_CA_FILE": "/ca.pem", "GRAFT_ADMIN_TOKEN_GRACE": "30"})
    assert s.namespaces == ["llm", "other"] and s.tick == 2 and s.admin_port == 9000
    assert s.admin_token_grace == 30 and s.admin_scheme == "https"
    assert s.admin_token_secret == "graft/admin" and s.admin_token_key == "token"
    with pytest.raises(ValueError, match="namespace/name"):
        OperatorSettings.from_env({"GRAFT_ADMIN_TOKEN_SECRET": "admin"})
    with pytest.raises(ValueError, match="GRAFT_TICK_SECONDS"):
        OperatorSettings.from_env({"GRAFT_TICK_SECONDS": "soon"})
