"""Pod readiness gates in the dev cluster, as kubelet, the EndpointSlice controller and kube-proxy
honour them: a gated pod whose containers are ready stays out of traffic until a client sets the
gate's condition True.

The pods here are small `python -m http.server` containers (ready in a fraction of a second), run
by the real pod runner against the real API server emulator; one test runs a real `graft serve`.
"""

import asyncio
import base64
import socket
import time
from pathlib import Path

import httpx
import pytest

from graft.devcluster.cluster import TOKEN_SECRET, ClusterOptions, engine_deployment
from graft.devcluster.podrunner import PodRunner, pod_conditions
from graft.devcluster.traffic import Router

from .kubectl_cli import run_kubectl

NS = "default"
PODS = f"/api/v1/namespaces/{NS}/pods"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
GATE = "graft.dev/patched"
APP = {"app": "web"}
SMP = {"content-type": "application/strategic-merge-patch+json"}
MERGE = {"content-type": "application/merge-patch+json"}


def web_spec(root: Path, gates: tuple[str, ...] = ()) -> dict:
    """A pod spec whose container is a static web server on the pod's IP, probed on `/`."""
    spec = {"containers": [{
        "name": "web", "workingDir": str(root),
        "command": ["python", "-m", "http.server", "--bind", "$(POD_IP)", "8000"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}}]}
    if gates:
        spec["readinessGates"] = [{"conditionType": g} for g in gates]
    return spec


def web_pod(name: str, root: Path, gates: tuple[str, ...] = ()) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": dict(APP)},
            "spec": web_spec(root, gates)}


@pytest.fixture
async def runner(api, tmp_path):
    async with PodRunner(api.url, NS, tmp_path / "pods") as pods:
        yield pods


def condition(pod: dict, kind: str) -> dict | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def ready(pod: dict) -> str | None:
    return (condition(pod, "Ready") or {}).get("status")


async def wait_for(probe, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        result = await probe()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout}s")
        await asyncio.sleep(0.05)


async def pod(client: httpx.AsyncClient, name: str) -> dict:
    return (await client.get(f"{PODS}/{name}")).json()


async def containers_ready(client: httpx.AsyncClient, name: str, timeout: float = 15) -> dict:
    async def check():
        p = await pod(client, name)
        return p if (condition(p, "ContainersReady") or {}).get("status") == "True" else None
    return await wait_for(check, timeout, f"{name}'s containers ready")


async def set_gate(client: httpx.AsyncClient, name: str, value: str, *, strategic: bool) -> float:
    """Set the gate's condition as the operator does (merge patch of the whole list, after reading
    the pod) or as kubectl does (strategic merge of that one condition); return when it was sent."""
    gate = {"type": GATE, "status": value, "reason": "Test", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    if strategic:
        body = {"status": {"conditions": [gate]}}
    else:
        current = (await pod(client, name))["status"]["conditions"]
        body = {"status": {"conditions": [c for c in current if c["type"] != GATE] + [gate]}}
    r = await client.patch(f"{PODS}/{name}/status", json=body, headers=SMP if strategic else MERGE)
    assert r.status_code == 200, r.text
    return time.monotonic()


async def becomes(client: httpx.AsyncClient, name: str, status: str, since: float, within: float = 2.0) -> float:
    async def check():
        return ready(await pod(client, name)) == status
    await wait_for(check, within + 5, f"{name} Ready={status}")
    took = time.monotonic() - since
    assert took <= within, f"{name} took {took:.2f}s to turn Ready={status}"
    return took


async def routed(client: httpx.AsyncClient) -> set[str]:
    """The pods the router sends requests to (pod-ratio routing over the app's pods)."""
    router = Router(client, NS, dict(APP), refresh=0)
    return {p["metadata"]["name"] for p in [await router.pick() for _ in range(8)] if p is not None}


async def slice_readiness(client: httpx.AsyncClient, want: dict[str, bool]) -> None:
    """Wait (a pass of the runner at most) until the Service's EndpointSlice says `want`."""
    async def check():
        items = (await client.get(SLICES, params={"labelSelector": "kubernetes.io/service-name=web"})).json()["items"]
        assert len(items) <= 1
        return items and {e["targetRef"]["name"]: e["conditions"]["ready"] for e in items[0]["endpoints"]} == want
    await wait_for(check, 1.0, f"the EndpointSlice to say {want}")


async def test_a_gated_pod_takes_traffic_only_while_its_gate_is_true(client, runner, tmp_path):
    await client.post(f"/api/v1/namespaces/{NS}/services", json={"metadata": {"name": "web"}, "spec": {
        "selector": dict(APP), "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}})
    await client.post(PODS, json=web_pod("gated", tmp_path, (GATE,)))
    await client.post(PODS, json=web_pod("plain", tmp_path))

    gated = await containers_ready(client, "gated")
    plain = await containers_ready(client, "plain")
    await asyncio.sleep(2 * runner.poll)  # more passes of the runner change nothing
    gated = await pod(client, "gated")
    assert condition(gated, "Ready") | {"lastTransitionTime": None} == {
        "type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady", "lastTransitionTime": None,
        "message": f'corresponding condition of pod readiness gate "{GATE}" does not exist.'}
    assert gated["status"]["containerStatuses"][0]["ready"] is True
    assert ready(plain) == "True"  # no gates: Ready with its containers, as before
    assert await routed(client) == {"plain"}
    await slice_readiness(client, {"gated": False, "plain": True})
    endpoints = (await client.get(f"/api/v1/namespaces/{NS}/endpoints/web")).json()["subsets"][0]
    assert [a["targetRef"]["name"] for a in endpoints["addresses"]] == ["plain"]
    assert [a["targetRef"]["name"] for a in endpoints["notReadyAddresses"]] == ["gated"]
    assert endpoints["ports"] == [{"name": "http", "port": 8000, "protocol": "TCP"}]

    took_true = await becomes(client, "gated", "True", await set_gate(client, "gated", "True", strategic=False))
    assert await routed(client) == {"gated", "plain"}
    await slice_readiness(client, {"gated": True, "plain": True})

    took_false = await becomes(client, "gated", "False", await set_gate(client, "gated", "False", strategic=True))
    gated = await pod(client, "gated")
    assert condition(gated, "Ready")["message"] == f'the status of pod readiness gate "{GATE}" is not "True", but False'
    assert await routed(client) == {"plain"}
    assert ready(await pod(client, "plain")) == "True"
    print(f"gate True -> Ready in {took_true:.2f}s, gate False -> not Ready in {took_false:.2f}s")


async def test_a_strategic_merge_patch_of_the_gate_alone_makes_the_pod_ready(client, runner, tmp_path):
    await client.post(PODS, json=web_pod("gated", tmp_path, (GATE, "example.com/second")))
    await containers_ready(client, "gated")
    await becomes(client, "gated", "False", time.monotonic(), within=5)
    await set_gate(client, "gated", "True", strategic=True)
    await asyncio.sleep(2 * runner.poll)
    gated = await pod(client, "gated")
    assert ready(gated) == "False", "one gate of two is not enough"
    assert condition(gated, "Ready")["message"] == \
        'corresponding condition of pod readiness gate "example.com/second" does not exist.'
    r = await client.patch(f"{PODS}/gated/status", headers=SMP, json={"status": {"conditions": [
        {"type": "example.com/second", "status": "True"}]}})
    assert r.status_code == 200
    await becomes(client, "gated", "True", time.monotonic())
    kinds = [c["type"] for c in (await pod(client, "gated"))["status"]["conditions"]]
    assert sorted(kinds) == sorted(["Initialized", "Ready", "ContainersReady", "PodScheduled", GATE,
                                    "example.com/second"])


async def test_the_runner_keeps_the_gate_condition_through_its_own_status_writes(client, runner, tmp_path):
    await client.post(PODS, json=web_pod("gated", tmp_path, (GATE,)))
    await containers_ready(client, "gated")
    await becomes(client, "gated", "True", await set_gate(client, "gated", "True", strategic=False))
    gate = condition(await pod(client, "gated"), GATE)
    old = (await pod(client, "gated"))["status"]["containerStatuses"][0]

    restarted = await runner.restart("gated")  # the runner writes the new container's status
    cs = restarted["status"]["containerStatuses"][0]
    assert cs["restartCount"] == old["restartCount"] + 1 and cs["containerID"] != old["containerID"]
    assert condition(restarted, GATE) == gate
    back = await containers_ready(client, "gated")
    assert condition(back, GATE) == gate and ready(back) == "True"
    assert back["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 137  # SIGKILL


async def test_deployment_scaling_creates_pods_from_the_template_with_its_gates(api, client, runner, tmp_path):
    await client.post(DEPLOYMENTS, json={
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 1, "selector": {"matchLabels": dict(APP)},
                 "template": {"metadata": {"labels": dict(APP)}, "spec": web_spec(tmp_path, (GATE,))}}})

    async def pods(count: int):
        async def check():
            items = (await client.get(PODS, params={"labelSelector": "app=web"})).json()["items"]
            return items if len(items) == count else None
        return await wait_for(check, 10, f"{count} pods")

    first = (await pods(1))[0]["metadata"]["name"]
    await containers_ready(client, first)
    await set_gate(client, first, "True", strategic=True)
    await becomes(client, first, "True", time.monotonic())

    r = await client.patch(f"{DEPLOYMENTS}/web", headers=MERGE, json={"spec": {"replicas": 3}})
    assert r.status_code == 200
    grown = await pods(3)
    assert all(p["spec"]["readinessGates"] == [{"conditionType": GATE}] for p in grown)
    for p in grown:
        await containers_ready(client, p["metadata"]["name"])
    assert {p["metadata"]["name"]: ready(await pod(client, p["metadata"]["name"])) for p in grown} == {
        p["metadata"]["name"]: "True" if p["metadata"]["name"] == first else "False" for p in grown}
    assert await routed(client) == {first}

    config = api.write_kubeconfig(tmp_path / "kubeconfig")
    done = await asyncio.to_thread(run_kubectl, config, "scale", "deployment", "web", "--replicas", "1")
    assert done.returncode == 0, done.stderr
    left = await pods(1)
    assert left[0]["metadata"]["name"] == first, "a scale-down deletes the pods that are not Ready first"
    done = await asyncio.to_thread(run_kubectl, config, "scale", "deployment", "web", "--replicas", "2")
    assert done.returncode == 0, done.stderr
    grown = await pods(2)
    assert all(p["spec"]["readinessGates"] == [{"conditionType": GATE}] for p in grown)

    async def counted():
        status = (await client.get(f"{DEPLOYMENTS}/web")).json().get("status") or {}
        return status if status.get("replicas") == 2 and status.get("readyReplicas") == 1 else None
    await wait_for(counted, 10, "the Deployment's status to count 2 pods, 1 Ready")


async def test_a_pod_that_cannot_start_does_not_hold_up_the_others(client, runner, tmp_path):
    broken = web_pod("broken", tmp_path)
    broken["spec"]["containers"][0]["command"] = ["nginx"]
    await client.post(PODS, json=broken)
    await client.post(PODS, json=web_pod("fine", tmp_path))
    fine = await containers_ready(client, "fine")
    assert ready(fine) == "True"
    state = (await pod(client, "broken"))["status"]["containerStatuses"][0]["state"]
    assert state["waiting"]["reason"] == "RunContainerError" and "nginx" in state["waiting"]["message"]


async def test_a_pod_gets_an_address_where_its_ports_are_free(api, client, tmp_path):
    """Another dev cluster on this machine holds 127.0.0.200:8000: the pod goes to the next address."""
    with socket.socket() as other:
        other.bind(("127.0.0.200", 8000))
        other.listen()
        async with PodRunner(api.url, NS, tmp_path / "pods", first_ip=200):
            await client.post(PODS, json=web_pod("web", tmp_path))
            placed = await containers_ready(client, "web")
    assert placed["status"]["podIP"] == "127.0.0.201"


def test_ready_follows_kubelets_rules():
    gated = {"spec": {"readinessGates": [{"conditionType": GATE}]},
             "status": {"conditions": [{"type": GATE, "status": "True"},
                                       {"type": "Ready", "status": "False", "lastTransitionTime": "T0"}]}}
    by_type = {c["type"]: c for c in pod_conditions(gated, False, "engine")}
    assert by_type["Ready"]["reason"] == by_type["ContainersReady"]["reason"] == "ContainersNotReady"
    assert by_type["Ready"]["message"] == "containers with unready status: [engine]"
    assert by_type["Ready"]["lastTransitionTime"] == "T0"  # unchanged status, unchanged time
    assert GATE not in by_type  # not the runner's to write
    by_type = {c["type"]: c for c in pod_conditions(gated, True, "engine")}
    assert by_type["Ready"]["status"] == "True" and "reason" not in by_type["Ready"]
    assert by_type["Ready"]["lastTransitionTime"] != "T0"
    assert {c["status"] for c in pod_conditions({"spec": {}}, True, "engine")} == {"True"}


async def test_a_real_engine_is_held_out_of_traffic_by_its_gate(api, client, runner, tmp_path):
    """The dev cluster's engine Deployment with the gate the fleet controller sets: ContainersReady
    once `graft serve` answers /ready, Ready (and routed to) only once the gate is True."""
    await client.post(f"/api/v1/namespaces/{NS}/secrets", json={
        "metadata": {"name": TOKEN_SECRET}, "data": {"token": base64.b64encode(b"t0ken").decode()}})
    dep = engine_deployment(ClusterOptions(workdir=tmp_path, namespace=NS, pods=1, readiness_gates=(GATE,)))
    assert "readinessGates" not in engine_deployment(ClusterOptions(workdir=tmp_path))["spec"]["template"]["spec"]
    assert (await client.post(DEPLOYMENTS, json=dep)).status_code == 201

    async def one_pod():
        items = (await client.get(PODS)).json()["items"]
        return items[0]["metadata"]["name"] if items else None
    name = await wait_for(one_pod, 10, "the engine pod")
    started = time.monotonic()
    engine = await containers_ready(client, name, timeout=120)
    print(f"engine answered /ready after {time.monotonic() - started:.1f}s")
    await asyncio.sleep(2 * runner.poll)
    assert ready(await pod(client, name)) == "False"
    assert condition(await pod(client, name), "Ready")["reason"] == "ReadinessGatesNotReady"
    router = Router(client, NS, {"app": "llm-engine"}, refresh=0)
    assert await router.pick() is None

    await becomes(client, name, "True", await set_gate(client, name, "True", strategic=False))
    picked = await router.pick()
    assert picked is not None and picked["metadata"]["name"] == name
    async with httpx.AsyncClient(timeout=30) as http:
        reply = await http.get(f"http://{picked['status']['podIP']}:8000/ready")
    assert reply.status_code == 200
    assert engine["status"]["containerStatuses"][0]["ready"] is True
