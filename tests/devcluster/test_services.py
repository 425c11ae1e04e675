"""Services in the dev cluster: an address allocated and kept as kube-apiserver does, a proxy behind
it that reaches Ready pods in turn (real sockets, real `python -c` HTTP servers as pods), and the
variables a container finds a Service by, `$(VAR)` expansion included."""
from __future__ import annotations

import asyncio
import ipaddress
import time

import httpx

from graft.devcluster.podrunner import PodRunner
from graft.devcluster.services import CLUSTER_IP_RANGE, service_env

NS = "default"
SVCS = f"/api/v1/namespaces/{NS}/services"
PODS = f"/api/v1/namespaces/{NS}/pods"
# a pod that answers every GET with its own name, on its port named http
SERVER = ("import http.server, os\n"
          "class H(http.server.BaseHTTPRequestHandler):\n"
          "    def do_GET(self):\n"
          "        body = os.environ['POD'].encode()\n"
          "        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()\n"
          "        self.wfile.write(body)\n"
          "    def log_message(self, *a): pass\n"
          "http.server.ThreadingHTTPServer((os.environ['IP'], 8080), H).serve_forever()\n")


def service(name: str, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
                     **spec}}


def web_pod(name: str, ready: bool = True) -> dict:
    probe = {"readinessProbe": {"tcpSocket": {"port": "http" if ready else 9}}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "web"}},
            "spec": {"containers": [{"name": "web", "command": ["python", "-c", SERVER],
                                     "ports": [{"name": "http", "containerPort": 8080}], **probe,
                                     "env": [{"name": "POD", "value": name},
                                             {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}]}}


async def until(probe, timeout: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await probe()
        if got:
            return got
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_service_gets_an_address_that_stays_and_cannot_be_moved(client):
    made = (await client.post(SVCS, json=service("web"))).json()
    spec = made["spec"]
    assert ipaddress.ip_address(spec["clusterIP"]) in CLUSTER_IP_RANGE and spec["clusterIPs"] == [spec["clusterIP"]]
    assert (spec["type"], spec["ports"][0]["protocol"]) == ("ClusterIP", "TCP")
    other = (await client.post(SVCS, json=service("other", ports=[{"port": 81}]))).json()["spec"]
    assert other["clusterIP"] != spec["clusterIP"] and other["ports"][0]["targetPort"] == 81
    # a replace that leaves the address out keeps it, as kube-apiserver does
    replaced = await client.put(f"{SVCS}/web", json=service("web"))
    assert replaced.status_code == 200 and replaced.json()["spec"]["clusterIP"] == spec["clusterIP"]
    moved = await client.put(f"{SVCS}/web", json=service("web", clusterIP="127.96.0.9"))
    assert moved.status_code == 422, moved.text
    assert moved.json()["details"]["causes"][0]["field"] == "spec.clusterIP"
    assert "field is immutable" in moved.json()["message"]
    headless = (await client.post(SVCS, json=service("headless", clusterIP="None"))).json()
    assert headless["spec"]["clusterIP"] == "None" and service_env([headless]) == {}


async def test_a_pod_reaches_the_ready_pods_of_a_service_in_turn_and_not_after_it_is_gone(api, client, tmp_path):
    async with PodRunner(api.url, NS, tmp_path / "pods", poll=0.2) as runner:
        ip = (await client.post(SVCS, json=service("web"))).json()["spec"]["clusterIP"]
        for pod in (web_pod("web-a"), web_pod("web-b"), web_pod("web-unready", ready=False)):
            await client.post(PODS, json=pod)

        async def ready_two() -> bool:
            pods = (await client.get(PODS)).json()["items"]
            return sum(any(c["type"] == "Ready" and c["status"] == "True" for c in (p.get("status") or {}).get(
                "conditions") or []) for p in pods) == 2
        await until(ready_two, what="two Ready pods")
        async with httpx.AsyncClient(timeout=5) as http:
            async def answers() -> list[str]:
                try:
                    return [(await http.get(f"http://{ip}:80/")).text for _ in range(6)]
                except httpx.HTTPError:
                    return []
            seen = await until(answers, what="the service's address to answer")
        assert set(seen) == {"web-a", "web-b"} and seen.count("web-a") == 3, seen
        assert (ip, 80) in runner.proxy.addresses
        await client.delete(f"{SVCS}/web")
        await until(lambda: asyncio.sleep(0, (ip, 80) not in runner.proxy.addresses), what="the listener to close")
        async with httpx.AsyncClient(timeout=2) as http:
            try:
                await http.get(f"http://{ip}:80/")
                raise AssertionError("the deleted Service still answers")
            except httpx.HTTPError:
                pass


async def test_a_container_finds_services_by_their_variables_and_expands_them(api, client, tmp_path):
    api.pod_logs_dir = tmp_path / "pods"        # kubectl logs reads the pod runner's files
    async with PodRunner(api.url, NS, tmp_path / "pods", poll=0.2):
        web = (await client.post(SVCS, json=service("llm-engine", ports=[
            {"name": "http", "port": 8000, "targetPort": "http"}, {"name": "metrics", "port": 9090}]))).json()
        ip = web["spec"]["clusterIP"]
        code = "import os, sys; print(sys.argv[1]); print(os.environ['LLM_ENGINE_SERVICE_PORT_METRICS'])"
        await client.post(PODS, json={"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"}, "spec": {
            "restartPolicy": "Never", "containers": [{"name": "c", "command": [
                "python", "-c", code, "http://$(LLM_ENGINE_SERVICE_HOST):$(LLM_ENGINE_SERVICE_PORT)/v1"]}]}})

        async def finished() -> bool:
            pod = (await client.get(f"{PODS}/probe")).json()
            return (pod.get("status") or {}).get("phase") == "Succeeded"
        await until(finished, what="the pod to finish")
        log = (await client.get(f"{PODS}/probe/log")).text
    assert log.splitlines() == [f"http://{ip}:8000/v1", "9090"], log
    assert service_env([web]) == {"LLM_ENGINE_SERVICE_HOST": ip, "LLM_ENGINE_SERVICE_PORT": "8000",
                                  "LLM_ENGINE_SERVICE_PORT_HTTP": "8000", "LLM_ENGINE_SERVICE_PORT_METRICS": "9090"}
