"""The local API server behaves like kube-apiserver for kopf, kubectl and Kubernetes clients."""

import asyncio
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import kmock
import kopf
import pytest
import yaml

from graft.devcluster.apiserver import ApiServer

from .kubectl_cli import kubectl_binary, run_kubectl

GROUP = "devcluster.graft.dev"
WIDGETS = f"/apis/{GROUP}/v1/namespaces/default/widgets"
WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wg"]},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "subresources": {"status": {}},
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {
                    "spec": {
                        "type": "object",
                        "required": ["size"],
                        "properties": {
                            "size": {"type": "integer", "minimum": 1, "maximum": 10},
                            "mode": {"type": "string", "enum": ["fast", "safe"], "default": "safe"},
                            "limits": {"type": "object", "default": {},
                                       "properties": {"cpu": {"type": "number", "default": 0.9}}},
                            "steps": {
                                "type": "array",
                                "default": [{"weight": 50}, {"weight": 100}],
                                "items": {"type": "object", "required": ["weight"], "properties": {
                                    "weight": {"type": "integer", "minimum": 0, "maximum": 100},
                                    "pause": {"type": "string", "default": "1m"}}},
                            },
                        },
                    },
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
            }},
        }],
    },
}


def widget(name: str, size: int = 3, **extra) -> dict:
    return {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": name, **extra},
            "spec": {"size": size}}


@pytest.fixture
def crd_file(tmp_path: Path) -> Path:
    path = tmp_path / "widgets.yaml"
    path.write_text(yaml.safe_dump(WIDGET_CRD))
    return path


@pytest.fixture
async def api(crd_file):
    async with ApiServer(crd_paths=[crd_file]) as server:
        yield server
        assert not server.errors, f"the emulator failed on its own: {server.errors}"


@pytest.fixture
async def http(api):
    # force_close: no idle keep-alive connections left for kopf's shutdown to wait for.
    async with aiohttp.ClientSession(api.url, connector=aiohttp.TCPConnector(force_close=True)) as session:
        yield session


async def call(http, method: str, path: str, body=None, *, patch: str = "merge", params=None):
    headers = {"Content-Type": f"application/{patch}-patch+json"} if method == "PATCH" else {}
    async with http.request(method, path, json=body, params=params, headers=headers) as reply:
        text = await reply.text()
        return reply.status, json.loads(text) if text else None


async def eventually(probe, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        result = await probe()
        if result or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.05)


# discovery and namespaces

async def test_discovery_answers_with_and_without_the_trailing_slash(http):
    for path in ("/version", "/version/"):
        assert (await call(http, "GET", path))[1]["gitVersion"].startswith("v1.")
    for path in ("/api", "/api/"):
        assert (await call(http, "GET", path))[1]["versions"] == ["v1"]
    for path in ("/apis", "/apis/"):
        groups = {g["name"] for g in (await call(http, "GET", path))[1]["groups"]}
        assert {GROUP, "gateway.networking.k8s.io", "coordination.k8s.io", "events.k8s.io"} <= groups
    _, core = await call(http, "GET", "/api/v1")
    assert core["groupVersion"] == "v1"
    assert {"pods", "pods/status", "services", "configmaps", "secrets", "namespaces", "events"} <= {
        r["name"] for r in core["resources"]}
    _, custom = await call(http, "GET", f"/apis/{GROUP}/v1")
    assert {(r["name"], r["kind"], r["namespaced"]) for r in custom["resources"]} == {
        ("widgets", "Widget", True), ("widgets/status", "Widget", True)}


async def test_default_namespace_exists_and_objects_need_an_existing_namespace(http):
    status, namespaces = await call(http, "GET", "/api/v1/namespaces")
    assert status == 200 and namespaces["kind"] == "NamespaceList"
    assert {"default", "kube-system"} <= {ns["metadata"]["name"] for ns in namespaces["items"]}
    status, default = await call(http, "GET", "/api/v1/namespaces/default")
    assert status == 200 and default["status"]["phase"] == "Active"

    status, refused = await call(http, "POST", "/api/v1/namespaces/llm/configmaps", {"metadata": {"name": "c"}})
    assert status == 404 and refused["message"] == 'namespaces "llm" not found'
    assert (await call(http, "POST", "/api/v1/namespaces", {"metadata": {"name": "llm"}}))[0] == 201
    assert (await call(http, "POST", "/api/v1/namespaces/llm/configmaps", {"metadata": {"name": "c"}}))[0] == 201
    protobuf = {"Content-Type": "application/vnd.kubernetes.protobuf"}
    async with http.post("/api/v1/namespaces", data=b"k8s\x00", headers=protobuf) as reply:
        assert reply.status == 415


# objects and resource versions

async def test_create_fills_metadata_and_every_write_bumps_the_resource_version(http):
    status, first = await call(http, "POST", WIDGETS, widget("w1"))
    assert status == 201
    meta = first["metadata"]
    assert meta["namespace"] == "default" and meta["generation"] == 1
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    _, second = await call(http, "POST", WIDGETS, widget("", generateName="w-"))
    assert second["metadata"]["name"].startswith("w-") and len(second["metadata"]["name"]) == 7
    assert int(second["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert (await call(http, "POST", WIDGETS, widget("w1")))[1]["reason"] == "AlreadyExists"

    _, patched = await call(http, "PATCH", f"{WIDGETS}/w1", {"spec": {"size": 4}})
    assert int(patched["metadata"]["resourceVersion"]) > int(second["metadata"]["resourceVersion"])
    assert patched["metadata"]["generation"] == 2
    _, listed = await call(http, "GET", WIDGETS)
    assert listed["kind"] == "WidgetList" and listed["apiVersion"] == f"{GROUP}/v1"
    assert listed["metadata"]["resourceVersion"] == patched["metadata"]["resourceVersion"]
    assert [w["metadata"]["name"] for w in listed["items"]] == sorted(["w1", second["metadata"]["name"]])
    _, page = await call(http, "GET", WIDGETS, params={"limit": "1"})
    _, rest = await call(http, "GET", WIDGETS, params={"limit": "1", "continue": page["metadata"]["continue"]})
    assert page["items"] + rest["items"] == listed["items"]


async def test_put_replaces_and_stale_writes_are_refused(http):
    _, created = await call(http, "POST", WIDGETS, widget("w1", labels={"a": "b"}))
    rv = created["metadata"]["resourceVersion"]
    status, replaced = await call(http, "PUT", f"{WIDGETS}/w1", widget("w1", size=7))
    assert status == 200 and replaced["spec"]["size"] == 7 and "labels" not in replaced["metadata"]
    assert replaced["metadata"]["uid"] == created["metadata"]["uid"]

    stale = widget("w1", size=8, resourceVersion=rv)
    assert (await call(http, "PUT", f"{WIDGETS}/w1", stale))[0] == 409
    stale_test = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                  {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}]
    status, refused = await call(http, "PATCH", f"{WIDGETS}/w1", stale_test, patch="json")
    assert status == 422 and refused["kind"] == "Status"
    fresh_test = [{**stale_test[0], "value": replaced["metadata"]["resourceVersion"]}, stale_test[1]]
    status, accepted = await call(http, "PATCH", f"{WIDGETS}/w1", fresh_test, patch="json")
    assert status == 200 and accepted["metadata"]["finalizers"] == ["x"]
    assert (await call(http, "PUT", f"{WIDGETS}/nope", widget("nope")))[0] == 404


async def test_finalizers_hold_deletion_until_released(http):
    await call(http, "POST", WIDGETS, widget("w1", finalizers=["graft.dev/cleanup"]))
    status, deleting = await call(http, "DELETE", f"{WIDGETS}/w1")
    assert status == 200 and deleting["metadata"]["deletionTimestamp"]
    assert (await call(http, "GET", f"{WIDGETS}/w1"))[0] == 200
    more = {"metadata": {"finalizers": ["a", "graft.dev/cleanup"]}}
    status, refused = await call(http, "PATCH", f"{WIDGETS}/w1", more)
    assert status == 422 and "no new finalizers" in refused["message"]
    await call(http, "PATCH", f"{WIDGETS}/w1", {"metadata": {"finalizers": None}})
    assert (await call(http, "GET", f"{WIDGETS}/w1"))[0] == 404



async def test_delete_preconditions_refuse_a_recreated_or_changed_object(http):
    _, first = await call(http, "POST", WIDGETS, widget("w1"))
    await call(http, "DELETE", f"{WIDGETS}/w1")
    _, second = await call(http, "POST", WIDGETS, widget("w1"))           # the same name, a new object
    old_uid, uid, rv = first["metadata"]["uid"], second["metadata"]["uid"], second["metadata"]["resourceVersion"]

    status, refused = await call(http, "DELETE", f"{WIDGETS}/w1", {"preconditions": {"uid": old_uid}})
    assert status == 409 and refused["reason"] == "Conflict", refused
    assert refused["message"] == (f'Operation cannot be fulfilled on Widget.{GROUP} "w1": the UID in the precondition '
                                  f"({old_uid}) does not match the UID in record ({uid}). The object might have "
                                  "been deleted and then recreated")
    assert refused["details"] == {"name": "w1", "group": GROUP, "kind": "Widget"}
    _, changed = await call(http, "PATCH", f"{WIDGETS}/w1", {"spec": {"size": 4}})
    stale = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid, "resourceVersion": rv}}
    status, refused = await call(http, "DELETE", f"{WIDGETS}/w1", stale)
    assert status == 409 and "The object might have been modified" in refused["message"], refused
    assert (await call(http, "GET", f"{WIDGETS}/w1"))[1]["spec"]["size"] == 4        # both refusals kept it

    current = {"preconditions": {"uid": uid, "resourceVersion": changed["metadata"]["resourceVersion"]}}
    assert (await call(http, "DELETE", f"{WIDGETS}/w1", current))[0] == 200
    assert (await call(http, "GET", f"{WIDGETS}/w1"))[0] == 404


# schema: defaults, validation, status isolation

async def test_custom_resources_get_the_schema_defaults_and_lose_unknown_fields(api, http):
    body = widget("w1")
    body["spec"].update(colour="red", steps=[{"weight": 5}, {"weight": 100, "pause": "10m"}])
    _, created = await call(http, "POST", WIDGETS, body)
    assert created["spec"] == {"size": 3, "mode": "safe", "limits": {"cpu": 0.9},
                               "steps": [{"weight": 5, "pause": "1m"}, {"weight": 100, "pause": "10m"}]}
    _, bare = await call(http, "POST", WIDGETS, widget("w2"))
    assert bare["spec"]["steps"] == [{"weight": 50, "pause": "1m"}, {"weight": 100, "pause": "1m"}]
    status, strict = await call(http, "POST", WIDGETS, {**body, "metadata": {"name": "w3"}},
                                params={"fieldValidation": "Strict"})
    assert status == 400 and 'unknown field "spec.colour"' in strict["message"]
    in_process = api.create({**widget("w4"), "metadata": {"name": "w4", "namespace": "default"}})
    assert in_process["spec"]["mode"] == "safe" and in_process["metadata"]["resourceVersion"]


async def test_invalid_custom_resources_are_refused_with_422_naming_the_field(http):
    body = widget("w1")
    body["spec"]["steps"] = [{"weight": 1}, {"weight": 5}, {"weight": 150}]
    status, refused = await call(http, "POST", WIDGETS, body)
    assert status == 422 and refused["reason"] == "Invalid"
    assert refused["message"] == ('Widget.devcluster.graft.dev "w1" is invalid: spec.steps[2].weight: Invalid value: '
                                  "150: spec.steps[2].weight in body should be less than or equal to 100")
    assert refused["details"]["causes"] == [{"reason": "FieldValueInvalid", "field": "spec.steps[2].weight",
        "message": "Invalid value: 150: spec.steps[2].weight in body should be less than or equal to 100"}]

    status, refused = await call(http, "POST", WIDGETS, {**widget("w1"), "spec": {"mode": "turbo"}})
    assert status == 422
    assert {c["field"] for c in refused["details"]["causes"]} == {"spec.size", "spec.mode"}
    assert 'spec.mode: Unsupported value: "turbo": supported values: "fast", "safe"' in refused["message"]

    await call(http, "POST", WIDGETS, widget("w1"))
    status, refused = await call(http, "PATCH", f"{WIDGETS}/w1", {"spec": {"size": "big"}})
    assert status == 422 and 'spec.size in body must be of type integer: "string"' in refused["message"]
    assert (await call(http, "PUT", f"{WIDGETS}/w1", widget("w1", size=0)))[0] == 422
    assert (await call(http, "GET", f"{WIDGETS}/w1"))[1]["spec"]["size"] == 3


async def test_status_subresource_is_isolated_from_the_main_resource(http):
    body = {**widget("w1"), "status": {"phase": "Forged"}}
    _, created = await call(http, "POST", WIDGETS, body)
    assert "status" not in created
    _, written = await call(http, "PATCH", f"{WIDGETS}/w1/status", {"status": {"phase": "Ready"}, "spec": {"size": 9}})
    assert written["status"] == {"phase": "Ready"} and written["spec"]["size"] == 3
    assert written["metadata"]["generation"] == 1
    _, main = await call(http, "PATCH", f"{WIDGETS}/w1", {"status": {"phase": "Forged"}, "spec": {"size": 5}})
    assert main["status"] == {"phase": "Ready"} and main["spec"]["size"] == 5
    _, replaced = await call(http, "PUT", f"{WIDGETS}/w1/status", {**main, "status": {"phase": "Done"}})
    assert replaced["status"] == {"phase": "Done"}
    assert (await call(http, "GET", f"{WIDGETS}/w1/status"))[1]["status"] == {"phase": "Done"}


async def test_a_long_running_server_keeps_bounded_histories(crd_file):
    async with ApiServer(crd_paths=[crd_file], history_limit=3) as api:
        async with aiohttp.ClientSession(api.url) as http:
            await call(http, "POST", WIDGETS, widget("w1"))
            for size in range(2, 10):
                await call(http, "PATCH", f"{WIDGETS}/w1", {"spec": {"size": size}})
        assert len(api.objects[f"{GROUP}/v1/widgets", "default", "w1"].history) == 3
        assert api.objects[f"{GROUP}/v1/widgets", "default", "w1"]["spec"]["size"] == 9
        assert len(api) <= 6  # the requests KMock keeps for assertions


# watch

async def watch(http, path: str, params: dict, count: int) -> tuple[str, list[dict]]:
    events = []
    async with http.get(path, params={"watch": "true", **params}) as reply:
        content_type = reply.headers["Content-Type"]
        async for line in reply.content:
            events.append(json.loads(line))
            if len(events) == count:
                break
    return content_type, events


async def test_watch_resumes_from_a_resource_version_and_follows_label_selectors(http):
    _, first = await call(http, "POST", WIDGETS, widget("w1", labels={"tier": "canary"}))
    await call(http, "POST", WIDGETS, widget("w2"))
    since = first["metadata"]["resourceVersion"]
    watcher = asyncio.create_task(watch(http, WIDGETS, {"resourceVersion": since, "labelSelector": "tier=canary"}, 3))
    await call(http, "PATCH", f"{WIDGETS}/w2", {"metadata": {"labels": {"tier": "canary"}}})
    await call(http, "PATCH", f"{WIDGETS}/w1", {"metadata": {"labels": {"tier": "stable"}}})
    await call(http, "PATCH", f"{WIDGETS}/w2", {"spec": {"size": 6}})
    content_type, events = await asyncio.wait_for(watcher, 10)
    assert content_type.startswith("application/json")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "w2"), ("DELETED", "w1"), ("MODIFIED", "w2")]
    assert events[2]["object"]["spec"]["size"] == 6

    _, initial = await watch(http, WIDGETS, {"fieldSelector": "metadata.name=w1"}, 1)
    assert initial == [{"type": "ADDED", "object": (await call(http, "GET", f"{WIDGETS}/w1"))[1]}]
    async with http.get(WIDGETS, params={"watch": "true", "resourceVersion": since, "timeoutSeconds": "1"}) as reply:
        assert len([line async for line in reply.content]) == 4  # all changes since, then the end


# other kinds and clients

@pytest.mark.parametrize("path, body", [
    ("/api/v1/namespaces/default/pods", {"metadata": {"name": "engine-0", "labels": {"app": "llm"}},
                                         "spec": {"containers": [{"name": "engine", "image": "graft"}]}}),
    ("/api/v1/namespaces/default/services", {"metadata": {"name": "llm"}, "spec": {"ports": [{"port": 80}]}}),
    ("/api/v1/namespaces/default/configmaps", {"metadata": {"name": "patch"}, "data": {"patch.py": "x = 1"}}),
    ("/api/v1/namespaces/default/secrets", {"metadata": {"name": "token"}, "stringData": {"token": "t"}}),
    ("/api/v1/namespaces/default/events", {"metadata": {"name": "e1"}, "reason": "StepStarted",
                                           "involvedObject": {"kind": "Widget", "name": "w1"}}),
    ("/apis/events.k8s.io/v1/namespaces/default/events", {"metadata": {"name": "e2"}, "reason": "Promoted"}),
    ("/apis/gateway.networking.k8s.io/v1/namespaces/default/httproutes",
     {"metadata": {"name": "llm"}, "spec": {"rules": [{"backendRefs": [{"name": "stable", "weight": 95}]}]}}),
    ("/apis/coordination.k8s.io/v1/namespaces/default/leases", {"metadata": {"name": "graft"}, "spec": {}}),
])
async def test_builtin_kinds_are_stored_and_served(http, path, body):
    status, created = await call(http, "POST", path, body)
    assert status == 201 and created["kind"] and created["metadata"]["uid"]
    name = body["metadata"]["name"]
    assert (await call(http, "GET", f"{path}/{name}"))[1] == created
    assert [i["metadata"]["name"] for i in (await call(http, "GET", path))[1]["items"]] == [name]


async def test_pod_status_is_written_through_its_subresource_as_a_kubelet_would(http):
    pods = "/api/v1/namespaces/default/pods"
    await call(http, "POST", pods, {"metadata": {"name": "p"}, "spec": {}, "status": {"podIP": "1.2.3.4"}})
    assert "status" not in (await call(http, "GET", f"{pods}/p"))[1]
    _, pod = await call(http, "PATCH", f"{pods}/p/status", {"status": {"podIP": "127.0.0.2", "phase": "Running"}})
    assert pod["status"] == {"podIP": "127.0.0.2", "phase": "Running"}
    configmaps = "/api/v1/namespaces/default/configmaps"
    await call(http, "POST", configmaps, {"metadata": {"name": "c"}})
    assert (await call(http, "PATCH", f"{configmaps}/c/status", {"status": {}}))[0] == 404  # it has none


async def test_a_crd_posted_at_runtime_is_served_and_its_removal_removes_its_objects(http):
    crd = json.loads(json.dumps(WIDGET_CRD).replace("widget", "gadget").replace("Widget", "Gadget"))
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    status, created = await call(http, "POST", crds, crd)
    assert status == 201
    assert {c["type"]: c["status"] for c in created["status"]["conditions"]}["Established"] == "True"
    gadgets = f"/apis/{GROUP}/v1/namespaces/default/gadgets"
    assert (await call(http, "POST", gadgets, {"metadata": {"name": "g"}, "spec": {"size": 2}}))[0] == 201
    assert (await call(http, "DELETE", f"{crds}/gadgets.{GROUP}"))[0] == 200
    assert (await call(http, "GET", gadgets))[0] == 404
    broken = {**crd, "metadata": {"name": "wrong"}}
    status, refused = await call(http, "POST", crds, broken)
    assert status == 422 and "metadata.name" in refused["message"]


async def test_the_kubernetes_client_reads_namespaces_and_custom_objects(api, http):
    import kubernetes

    await call(http, "POST", WIDGETS, widget("w1"))

    def read() -> tuple[list[str], dict]:
        config = kubernetes.client.Configuration()
        config.host = api.url
        with kubernetes.client.ApiClient(config) as client:
            names = [ns.metadata.name for ns in kubernetes.client.CoreV1Api(client).list_namespace().items]
            version = kubernetes.client.VersionApi(client).get_code().git_version
            obj = kubernetes.client.CustomObjectsApi(client).get_namespaced_custom_object(
                GROUP, "v1", "default", "widgets", "w1")
            return names + [version], obj

    names, obj = await asyncio.to_thread(read)
    assert "default" in names and "v1.32.0" in names
    assert obj["spec"]["mode"] == "safe"


# kopf against the emulator

async def test_kopf_operator_handles_create_field_change_and_delete_with_finalizers(api, http):
    registry = kopf.OperatorRegistry()
    resized: list[tuple[int, int]] = []
    deleted: list[str] = []

    @kopf.on.login(registry=registry)
    def login(**_):
        return kopf.ConnectionInfo(server=api.url, insecure=True, default_namespace="default")

    @kopf.on.create(GROUP, "v1", "widgets", id="create_widget", registry=registry)
    def create_widget(body, spec, patch, **_):
        kopf.info(body, reason="Provisioned", message=f"size {spec['size']}")
        patch.status["phase"] = "Ready"
        return {"size": spec["size"]}

    @kopf.on.field(GROUP, "v1", "widgets", field="spec.size", registry=registry)
    def resize_widget(old, new, patch, **_):
        if old is not None:
            resized.append((old, new))
            patch.status["size"] = new

    @kopf.on.delete(GROUP, "v1", "widgets", registry=registry)
    def delete_widget(name, **_):
        deleted.append(name)

    settings = kopf.OperatorSettings()
    stop, ready = asyncio.Event(), asyncio.Event()
    operator = asyncio.create_task(kopf.operator(registry=registry, settings=settings, standalone=True,
                                                 namespaces=["default"], stop_flag=stop, ready_flag=ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        await call(http, "POST", WIDGETS, widget("w1"))

        async def ready_widget():
            obj = (await call(http, "GET", f"{WIDGETS}/w1"))[1]
            return obj if obj.get("status", {}).get("phase") == "Ready" else None
        obj = await eventually(ready_widget)
        assert obj, "the create handler did not run"
        assert obj["status"]["create_widget"] == {"size": 3}
        assert obj["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]

        async def posted_event():
            items = (await call(http, "GET", "/api/v1/namespaces/default/events"))[1]["items"]
            return [e for e in items if e.get("reason") == "Provisioned"]
        events = await eventually(posted_event)
        assert events and events[0]["involvedObject"]["name"] == "w1" and events[0]["message"] == "size 3"

        await call(http, "PATCH", f"{WIDGETS}/w1", {"spec": {"size": 5}})

        async def resized_widget():
            return (await call(http, "GET", f"{WIDGETS}/w1"))[1].get("status", {}).get("size") == 5
        assert await eventually(resized_widget) and resized == [(3, 5)]

        status, deleting = await call(http, "DELETE", f"{WIDGETS}/w1")
        assert status == 200 and deleting["metadata"]["deletionTimestamp"]

        async def gone():
            return (await call(http, "GET", f"{WIDGETS}/w1"))[0] == 404
        assert await eventually(gone) and deleted == ["w1"]
    finally:
        stop.set()
        await asyncio.wait_for(operator, 20)


# the PatchRollout CRD of the project

async def test_the_patchrollout_crd_defaults_the_rollout_steps():
    crd_path = Path(__file__).parents[2] / "crds" / "patchrollout.yaml"
    async with ApiServer(crd_paths=[crd_path]) as api:
        rollout = {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout", "metadata": {"name": "kv-align"},
                   "spec": {"selector": {"matchLabels": {"app": "llm-engine"}},
                            "patch": {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}}}}
        rollouts = "/apis/graft.dev/v1alpha1/namespaces/default/patchrollouts"
        async with aiohttp.ClientSession(api.url) as session:
            status, created = await call(session, "POST", rollouts, rollout)
            assert status == 201, created
            assert [step.get("weight") for step in created["spec"]["steps"]] == [1, 5, 20, 50, 100]
            rollout["metadata"]["name"] = "two-sources"
            rollout["spec"]["patch"]["source"]["configMap"] = {"name": "bundle", "key": "patch.py"}
            status, refused = await call(session, "POST", rollouts, rollout)
        assert status == 422 and "spec.patch.source" in {c["field"] for c in refused["details"]["causes"]}


# kubectl against the emulator as a process

@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cluster")
    (folder / "crds").mkdir()
    (folder / "crds" / "widgets.yaml").write_text(yaml.safe_dump(WIDGET_CRD))
    kubeconfig, log = folder / "kubeconfig", folder / "apiserver.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "graft.devcluster.apiserver", "--crds", str(folder / "crds"),
                                    "--kubeconfig", str(kubeconfig)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not kubeconfig.exists():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the API server did not start"
            time.sleep(0.05)
        yield kubeconfig
    finally:
        process.terminate()
        process.wait(10)


kubectl = run_kubectl


def test_kubectl_applies_lists_labels_patches_and_deletes_custom_resources(cluster):
    manifest = yaml.safe_dump(widget("w1", labels={"team": "a"}))
    applied = kubectl(cluster, "apply", "--validate=false", "-f", "-", stdin=manifest)
    assert applied.returncode == 0, applied.stderr
    kubectl(cluster, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(widget("w2")))

    listed = kubectl(cluster, "get", "widgets", "-l", "team=a", "-o", "name")
    assert listed.stdout.split() == ["widget.devcluster.graft.dev/w1"]
    assert kubectl(cluster, "label", "widget", "w2", "team=a").returncode == 0
    assert kubectl(cluster, "get", "wg", "-l", "team=a", "-o", "name").stdout.split() == [
        "widget.devcluster.graft.dev/w1", "widget.devcluster.graft.dev/w2"]

    patched = kubectl(cluster, "patch", "widget", "w1", "--type", "merge", "-p", '{"spec": {"size": 4}}')
    assert patched.returncode == 0, patched.stderr
    spec = json.loads(kubectl(cluster, "get", "widget", "w1", "-o", "jsonpath={.spec}").stdout)
    assert spec == {"size": 4, "mode": "safe", "limits": {"cpu": 0.9},
                    "steps": [{"weight": 50, "pause": "1m"}, {"weight": 100, "pause": "1m"}]}

    assert kubectl(cluster, "delete", "widget", "w1", "w2").returncode == 0
    assert kubectl(cluster, "get", "widgets", "-o", "name").stdout == ""


def test_kubectl_shows_why_an_invalid_custom_resource_is_refused(cluster):
    bad = widget("bad", size=11)
    refused = kubectl(cluster, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(bad))
    assert refused.returncode != 0
    assert "spec.size: Invalid value: 11: spec.size in body should be less than or equal to 10" in refused.stderr


def test_kubectl_get_watch_sees_a_change(cluster):
    kubectl(cluster, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(widget("watched")))
    watcher = subprocess.Popen(["timeout", "-k", "5", "20", kubectl_binary(), f"--kubeconfig={cluster}", "get", "widget",
                                "watched", "-w", "-o", "jsonpath={.spec.size}{'\\n'}"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in watcher.stdout], daemon=True).start()
    try:
        assert lines.get(timeout=15) == "3"
        kubectl(cluster, "patch", "widget", "watched", "--type", "merge", "-p", '{"spec": {"size": 9}}')
        assert lines.get(timeout=15) == "9"
    finally:
        watcher.terminate()
        watcher.wait(10)


async def test_a_fault_injected_through_kmock_answers_instead_of_the_store(api, http):
    await call(http, "POST", WIDGETS, widget("w1"))
    api[kmock.method.PATCH, kmock.resource(GROUP, "v1", "widgets")][:2] << 503  # the next two patches fail
    for _ in range(2):
        assert (await call(http, "PATCH", f"{WIDGETS}/w1", {"spec": {"size": 5}}))[0] == 503
    assert (await call(http, "GET", f"{WIDGETS}/w1"))[1]["spec"]["size"] == 3
    assert (await call(http, "PATCH", f"{WIDGETS}/w1", {"spec": {"size": 5}}))[1]["spec"]["size"] == 5
