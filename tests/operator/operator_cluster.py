"""Helpers for the operator tests: the cluster handle, the operator in its own thread, pods played
by fake engines, PatchRollout manifests, and waiting for what the operator does."""
import asyncio
import inspect
import threading

from graft.operator.kube import Kube, pods_path, rollout_path
from graft.operator.podview import make_condition
from graft.operator.main import run
from graft.operator.settings import OperatorSettings

from operator_fakes import FakeEngine

TOKEN = "test-admin-token"


class Cluster:
    def __init__(self, kube: Kube, url: str | None, kubeconfig: str | None):
        self.kube, self.url, self.kubeconfig = kube, url, kubeconfig

    @property
    def real(self) -> bool:
        return self.kubeconfig is not None


class OperatorHandle:
    """The operator in a thread with its own event loop, as it would run in its own process.

    (kopf cancels every task of its loop that appeared after it started, so the test's own tasks
    must not share that loop.)
    """

    def __init__(self, settings: OperatorSettings):
        self.settings = settings
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="graft-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(run(self.settings, stop_flag=self.stop_flag, ready_flag=self.ready_flag))
        except BaseException as e:   # reported by start() / stop()
            self.error = e

    async def start(self) -> None:
        self.thread.start()
        ready = await asyncio.to_thread(self.ready_flag.wait, 20)
        if self.error is not None:
            raise self.error
        assert ready, "the operator did not get ready within 20 s"

    async def stop(self) -> None:
        self.stop_flag.set()
        await asyncio.to_thread(self.thread.join, 20)
        assert not self.thread.is_alive(), "the operator did not stop within 20 s"
        if self.error is not None:
            raise self.error


async def create_pod(kube: Kube, namespace: str, name: str, engine: FakeEngine, gated: bool = False) -> None:
    """A pod for `engine`, as a workload's controller makes it: owned (controller ownerReference) by a
    Deployment of its own name whose pod template is the pod's (every fake engine has its own admin
    port, which the operator reads from the owner's template). `gated`: it declares the readiness
    gate graft.dev/patched and, as kubelet would have it with the gate's condition not set, runs with
    its containers ready but is not Ready."""
    labels = {"app": "llm-engine"}
    spec = {"containers": [{"name": "engine", "image": "graft:dev",
                            "ports": [{"name": "http", "containerPort": 8000},
                                      {"name": "admin", "containerPort": engine.port}]}],
            **({"readinessGates": [{"conditionType": "graft.dev/patched"}]} if gated else {})}
    owner = await kube.create(f"/apis/apps/v1/namespaces/{namespace}/deployments", {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": spec}}})
    await kube.create(pods_path(namespace), {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": dict(labels), "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": name, "uid": owner["metadata"]["uid"],
             "controller": True, "blockOwnerDeletion": True}]},
        "spec": spec,
    })
    await set_pod_status(kube, namespace, name, engine, ready=not gated)


async def set_pod_status(kube: Kube, namespace: str, name: str, engine: FakeEngine, ready: bool = True) -> None:
    """Play the kubelet: the pod runs, is ready (unless held by its gate), and its container is the
    engine's current process."""
    await kube.merge_patch(pods_path(namespace, name) + "/status", {"status": {
        "phase": "Running", "podIP": engine.host,
        "conditions": [make_condition("Ready", ready), make_condition("ContainersReady", True)],
        "containerStatuses": [{"name": "engine", "ready": True, "restartCount": engine.generation,
                               "containerID": f"containerd://{name}-{engine.generation}",
                               "image": "graft:dev", "imageID": "graft@sha256:0"}]}})


async def until(probe, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """Wait until `probe()` (a value or an awaitable) is truthy; return it."""
    deadline = asyncio.get_running_loop().time() + timeout
    last = None
    while asyncio.get_running_loop().time() < deadline:
        last = probe()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


async def get_rollout(kube: Kube, namespace: str, name: str) -> dict:
    return await kube.get(rollout_path(namespace, name))


async def events_of(kube: Kube, namespace: str, name: str) -> list[dict]:
    items = await kube.list(f"/api/v1/namespaces/{namespace}/events")
    return [e for e in items if (e.get("involvedObject") or {}).get("name") == name]


CHECKS = {
    "breakers": [{"name": "error-rate", "max": 0.05, "window": "4s", "consecutive": 2},
                 {"name": "latency-p99", "max": 0.5, "window": "4s"}],
    "gates": [{"name": "error-rate-delta", "max": 0.05, "window": "4s"}],
}


def manifest(prometheus, name="kv-align", analysis=None, **spec):
    """A PatchRollout judged every second over 4 s windows (the fake engines serve 200 requests a
    second each, so every check has its evidence within a run); `analysis` replaces the checks.

    In `make test` the other worker runs real fleets beside this process, and Prometheus then
    scrapes late: a window over a new revision's series can hold fewer than the two samples
    increase() needs for many runs. So these rollouts never pause for an inconclusive analysis
    (`inconclusiveLimit: 0`) unless a test asks for it; they wait for the evidence instead."""
    body = {
        "selector": {"matchLabels": {"app": "llm-engine"}},
        "patch": {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}},
        "steps": [{"weight": 1, "pause": "1s"}, {"weight": 50, "pause": "1s"}, {"weight": 100}],
        "analysis": {"prometheus": {"address": prometheus.url}, "interval": "1s", "inconclusiveLimit": 0,
                     **(CHECKS if analysis is None else analysis)},
        "progressDeadline": "1m",
    }
    body.update(spec)
    return {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout", "metadata": {"name": name}, "spec": body}


async def create(cluster, namespace, body):
    return await cluster.kube.create(rollout_path(namespace, "")[:-1], body)


class Elsewhere:
    """A falsy answer that says where the object is instead, so a timed-out wait names the state it
    was stuck in."""

    def __init__(self, status: dict):
        self.status = status

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        s = self.status
        checks = [c.get("message") for c in (s.get("analysis") or {}).get("results") or [] if c.get("message")]
        held = f"; checks: {checks!r}" if checks else ""
        return f"<phase {s.get('phase')!r}, reason {s.get('reason')!r}: {s.get('message')!r}{held}>"


async def phase_is(cluster, namespace, name, *phases):
    obj = await get_rollout(cluster.kube, namespace, name)
    status = obj.get("status") or {}
    return obj if status.get("phase") in phases else Elsewhere(status)


async def events_with(cluster, namespace, reason, name="kv-align"):
    items = await events_of(cluster.kube, namespace, name)
    return items if any(e["reason"] == reason for e in items) else None


async def rollout_cli(cluster, namespace, tmp_path, *argv):
    """`graft rollout ARGV -n NAMESPACE` against the test's API server, as a person types it."""
    from rich.console import Console

    from graft.devcluster.kubeconfig import write_kubeconfig
    from graft.operator.cli import main_rollout

    kubeconfig = cluster.kubeconfig or str(write_kubeconfig(tmp_path / "kubeconfig", cluster.url,
                                                            namespace=namespace))
    console = Console(record=True, width=220, force_terminal=False)
    code = await asyncio.to_thread(main_rollout, [*argv, "-n", namespace, "--kubeconfig", kubeconfig], console)
    return code, console.export_text()
