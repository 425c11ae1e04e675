"""What the operator refuses, and how it says so: a phase, a message and an Event."""
import base64

import pytest

from graft.api import digest_of
from graft.operator.kube import KubeError, rollout_path

from operator_cluster import create, events_with, get_rollout, manifest, phase_is, until

pytestmark = pytest.mark.timeout(120)


async def test_invalid_manifest_is_refused_by_the_api_server_naming_the_field(cluster, namespace, prometheus):
    body = manifest(prometheus, steps=[{"weight": 150}])
    body["spec"]["patch"]["source"] = {"configMap": {"name": "b", "key": "k"}, "digest": "sha256:nothex"}
    with pytest.raises(KubeError) as info:
        await create(cluster, namespace, body)
    assert info.value.status == 422
    assert "spec.steps[0].weight" in info.value.message and "spec.patch.source.digest" in info.value.message


async def test_spec_the_schema_lets_through_is_refused_by_the_operator(cluster, namespace, operator, prometheus):
    """Decreasing steps: a CEL rule on a real API server, the operator's own check everywhere."""
    await operator()
    body = manifest(prometheus, steps=[{"weight": 50}, {"weight": 20}, {"weight": 100}])
    try:
        await create(cluster, namespace, body)
    except KubeError as e:
        assert e.status == 422 and "spec.steps" in e.message
        return
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 20)
    assert obj["status"]["reason"] == "InvalidSpec"
    assert "spec.steps[1].weight: must be greater than the previous step's weight (50)" in obj["status"]["message"]
    events = await until(lambda: events_with(cluster, namespace, "InvalidSpec"), 10)
    assert "spec.steps[1].weight" in events[0]["message"]
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align"),
                                   {"spec": {"steps": [{"weight": 20}, {"weight": 50}, {"weight": 100}]}})
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Pending"), 20, what="a fixed spec to start")
    assert obj["status"]["reason"] == "NoPods"


async def test_selector_matching_no_pods_waits_pending_with_an_event(cluster, namespace, operator, prometheus):
    await operator()
    await create(cluster, namespace, manifest(prometheus, selector={"matchLabels": {"app": "nothing-here"}}))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Pending"), 20)
    assert obj["status"]["message"] == "no ready pods match the selector app=nothing-here"
    events = await until(lambda: events_with(cluster, namespace, "NoPods"), 10)
    assert len([e for e in events if e["reason"] == "NoPods"]) == 1


async def test_unknown_patch_fails_the_rollout_with_an_event(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2, available=())
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 20)
    assert obj["status"]["reason"] == "UnknownPatch"
    assert "404 no built-in patch kv-align@3.2.1" in obj["status"]["message"]
    await until(lambda: events_with(cluster, namespace, "UnknownPatch"), 10)
    assert sum(e.posts for e in engines) == 1, "stops at the first refusal"


async def test_missing_token_secret_waits_with_a_message_until_it_appears(cluster, namespace, fleet, operator,
                                                                         prometheus):
    engines = await fleet(2)
    await operator(admin_token=None, admin_token_secret=f"{namespace}/graft-admin", admin_token_ttl=0.0)
    await create(cluster, namespace, manifest(prometheus))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Pending"), 20)

    async def explained():
        o = await get_rollout(cluster.kube, namespace, "kv-align")
        return o if (o.get("status") or {}).get("reason") == "AdminTokenMissing" else None

    obj = await until(explained, 20)
    assert obj["status"]["message"] == f"Secret {namespace}/graft-admin (the engines' admin token) not found"
    await until(lambda: events_with(cluster, namespace, "AdminTokenMissing"), 10)
    await cluster.kube.create(f"/api/v1/namespaces/{namespace}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "graft-admin"},
        "data": {"token": base64.b64encode(engines[0].token.encode()).decode()}})
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Progressing", "Promoted"), 20)
    # a starting rollout stores its status (and claims its fleet) before it touches a pod: the patch
    # follows within the same tick, not necessarily before the status is seen
    await until(lambda: sum(e.revision != "base" for e in engines) >= 1, 10, what="a canary patched")


async def _bundle(cluster, namespace, source: str, signature: str | None = None):
    data = {"patch.py": source}
    if signature:
        data["patch.py.sig"] = signature
    await cluster.kube.create(f"/api/v1/namespaces/{namespace}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kv-bundle"}, "data": data})


BUNDLE = "PATCHES = []  # kv-align 3.2.1\n"


async def test_bundle_with_a_wrong_digest_is_never_sent(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2)
    await _bundle(cluster, namespace, BUNDLE)
    await operator()
    body = manifest(prometheus)
    body["spec"]["patch"]["source"] = {"configMap": {"name": "kv-bundle", "key": "patch.py"},
                                       "digest": digest_of(BUNDLE + "tampered")}
    await create(cluster, namespace, body)
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 20)
    assert obj["status"]["reason"] == "DigestMismatch" and digest_of(BUNDLE) in obj["status"]["message"]
    assert sum(e.posts for e in engines) == 0
    await until(lambda: events_with(cluster, namespace, "DigestMismatch"), 10)


async def test_bundle_is_sent_with_its_digest_and_signature(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2)
    await _bundle(cluster, namespace, BUNDLE, signature="c2lnbmF0dXJl")
    await operator()
    body = manifest(prometheus, steps=[{"weight": 50, "pause": "1h"}, {"weight": 100}])
    body["spec"]["patch"]["source"] = {"configMap": {"name": "kv-bundle", "key": "patch.py"},
                                       "digest": digest_of(BUNDLE)}
    await create(cluster, namespace, body)
    await until(lambda: events_with(cluster, namespace, "PodsPatched"), 20)
    (sent,) = [b for e in engines for b in e.bundles]
    assert sent == {"module": BUNDLE, "digest": digest_of(BUNDLE), "signature": "c2lnbmF0dXJl"}


async def test_gateway_api_route_weights_follow_the_steps(cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2)
    route_path = f"/apis/gateway.networking.k8s.io/v1/namespaces/{namespace}/httproutes"
    await cluster.kube.create(route_path, {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "llm"},
        "spec": {"parentRefs": [{"name": "gateway"}], "rules": [{"backendRefs": [
            {"name": "llm-stable", "port": 8000, "weight": 100}, {"name": "llm-canary", "port": 8000, "weight": 0}]}]}})
    await operator()
    routing = {"gatewayAPI": {"httpRoute": "llm", "stableService": "llm-stable", "canaryService": "llm-canary"}}
    await create(cluster, namespace, manifest(prometheus, trafficRouting=routing,
                                              steps=[{"weight": 10, "pause": "1s"}, {"weight": 100}]))
    seen = set()

    async def promoted():
        route = await cluster.kube.get(f"{route_path}/llm")
        seen.add(tuple(r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]))
        return await phase_is(cluster, namespace, "kv-align", "Promoted", "RolledBack")

    obj = await until(promoted, 40)
    assert obj["status"]["phase"] == "Promoted"
    assert (90, 10) in seen and (0, 100) in seen
    route = await cluster.kube.get(f"{route_path}/llm")
    assert [r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]] == [100, 0]
    assert all(e.revision == "kv-align@3.2.1" for e in engines)


async def test_gateway_api_without_the_route_says_so(cluster, namespace, fleet, operator, prometheus):
    await fleet(1)
    await operator()
    routing = {"gatewayAPI": {"httpRoute": "missing", "stableService": "a", "canaryService": "b"}}
    await create(cluster, namespace, manifest(prometheus, trafficRouting=routing))

    async def explained():
        o = await get_rollout(cluster.kube, namespace, "kv-align")
        return o if (o.get("status") or {}).get("reason") == "HTTPRouteMissing" else None

    obj = await until(explained, 20)
    assert obj["status"]["phase"] == "Pending"
    assert obj["status"]["message"] == f"HTTPRoute {namespace}/missing not found"


async def test_a_bundle_re_packed_under_an_applied_version_fails_the_rollout_before_any_pod(
        cluster, namespace, fleet, operator, prometheus):
    """The pods run kv-align@3.2.1 from one bundle; a rollout pins another bundle under the same
    version. Taking those pods for patched would promote code that never ran, and judge the old
    code's metrics as the canary's: the rollout fails at once, naming both digests."""
    engines = await fleet(2)
    for e in engines:
        e.applied, e.digests = {"kv-align": "3.2.1"}, {"kv-align": digest_of(BUNDLE)}
    repacked = BUNDLE + "# re-packed\n"
    await cluster.kube.create(f"/api/v1/namespaces/{namespace}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kv-bundle"}, "data": {"patch.py": repacked}})
    await operator()
    body = manifest(prometheus)
    body["spec"]["patch"]["source"] = {"configMap": {"name": "kv-bundle", "key": "patch.py"},
                                       "digest": digest_of(repacked)}
    await create(cluster, namespace, body)
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed", "Promoted", "RolledBack"), 20)
    status = obj["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "VersionReused"), status
    assert digest_of(BUNDLE) in status["message"] and digest_of(repacked) in status["message"]
    assert "give the re-packed bundle a new version" in status["message"]
    # nothing was applied, and no engine ever ran the re-packed code; the fleet controller may take
    # out a patch no PatchFleet records (these engines were patched behind the operator's back)
    assert sum(e.posts for e in engines) == 0
    assert all(e.digests.get("kv-align") in (None, digest_of(BUNDLE)) for e in engines)


class Listener:
    """A TCP listener on 127.0.0.1 that records every connection made to it (and answers none)."""

    def __init__(self):
        self.connections, self.url = 0, ""

    async def __aenter__(self):
        import asyncio

        async def accept(reader, writer):
            self.connections += 1
            writer.close()
        self.server = await asyncio.start_server(accept, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()


async def test_a_prometheus_outside_the_allow_list_fails_the_rollout_and_is_never_asked(cluster, namespace, fleet,
                                                                                        operator):
    engines = await fleet(2)
    await operator(prometheus_secret_namespaces=[namespace])
    await cluster.kube.create(f"/api/v1/namespaces/{namespace}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "prom-token"},
        "data": {"token": base64.b64encode(b"s3cret").decode()}})
    async with Listener() as listener:
        analysis = {"prometheus": {"address": listener.url,
                                   "bearerTokenSecret": {"name": "prom-token", "key": "token"}},
                    "breakers": [{"name": "error-rate", "max": 0.05}]}
        await create(cluster, namespace, manifest(listener, analysis=analysis))
        obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 20)
        assert obj["status"]["reason"] == "PrometheusNotAllowed"
        assert obj["status"]["message"].startswith(f"spec.analysis.prometheus.address: {listener.url} is not a "
                                                   "Prometheus this operator may ask")
        await until(lambda: events_with(cluster, namespace, "PrometheusNotAllowed"), 10)
    assert listener.connections == 0, "the operator connected to a Prometheus it may not ask"
    assert sum(e.posts for e in engines) == 0, "refused before any pod is patched"


async def test_prometheus_secrets_where_the_operator_reads_none_fail_the_rollout(cluster, namespace, operator):
    await operator()
    analysis = {"prometheus": {"caSecret": {"name": "prom-ca", "key": "ca.crt"}},
                "breakers": [{"name": "error-rate", "max": 0.05}]}
    await create(cluster, namespace, manifest(Listener(), analysis=analysis))   # the prometheus key is replaced
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 20)
    assert obj["status"]["reason"] == "PrometheusSecretsNotAllowed"
    assert f"reads no Prometheus Secrets in namespace {namespace}" in obj["status"]["message"]
