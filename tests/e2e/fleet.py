"""The fleet the end-to-end scenarios run against: the local dev cluster, or a real cluster.

`open_fleet(workdir)` gives a `Fleet` either way. Without `GRAFT_E2E_KUBECONFIG` it starts
`graft.devcluster.DevCluster` (API server emulator, three real engine pods, a real Prometheus, the
operator as its own process); with it, it talks to that cluster (see tests/e2e/test_scenarios.py
for the variables). The scenarios only use what both have: the Kubernetes API, the engines' admin
and HTTP ports, and Prometheus' query API. What only the local fleet can do (kill a process, stop
Prometheus) goes through `Fleet.require_local`, which skips the test on a real cluster.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from graft.devcluster.cluster import APP, TOKEN_SECRET, ClusterOptions, DevCluster, object_path
from graft.devcluster.traffic import Outcome, Router, Traffic, TrafficStats
from graft.operator.kube import fleet_path
from graft.operator.pods import PATCHES_ANNOTATION, TRACK_LABEL, admin_address, is_ready
from graft.rollout.queries import CANARY, Context, count_query
from graft.api import BASE, FINAL_PHASES, patches_of

T = TypeVar("T")
GROUP_VERSION = "graft.dev/v1alpha1"
DEPLOYMENT = "llm-engine"  # the engine Deployment of the local dev cluster (graft.devcluster.cluster)
SELECTOR = ",".join(f"{k}={v}" for k, v in APP.items())
LOCAL_PODS = 3
LOCAL_TICK = 1.0           # operator tick, seconds
SCRAPE_INTERVAL = 1.0      # Prometheus scrape interval of the local fleet, seconds


def canary_pods(pods: int, weight: int) -> int:
    """Pods a pod-ratio step of `weight` percent runs as canaries: ceil(N * w / 100), at least one."""
    return min(pods, max(1, math.ceil(pods * weight / 100)))


def metrics_port(pod: dict[str, Any]) -> int:
    """The engine's container port named `metrics`, where its /metrics is served (never the public port)."""
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            if port.get("name") == "metrics":
                return int(port["containerPort"])
    return 9400


class Fleet:
    """An engine fleet behind a Kubernetes API, with its Prometheus and (locally) its processes."""

    def __init__(self, api: httpx.AsyncClient, namespace: str, token: str, prometheus_url: str,
                 pods: int, local: DevCluster | None = None):
        self.api, self.namespace, self.token = api, namespace, token
        self.prometheus_url, self.expected_pods, self.local = prometheus_url, pods, local
        # no keep-alive: an engine closing an idle connection as a request goes out is not news
        self.http = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))
        self.rollouts: list[str] = []      # PatchRollouts created through `apply`, deleted by `reset`
        self.loop = asyncio.get_running_loop()

    async def aclose(self) -> None:
        await self.http.aclose()

    @property
    def workdir(self) -> Path | None:
        return self.local.workdir if self.local else None

    def require_local(self, what: str) -> DevCluster:
        """The local dev cluster; skips the test on a real cluster, where this is not ours to do."""
        if self.local is None:
            pytest.skip(f"GRAFT_E2E_KUBECONFIG: {what} needs local control of the process; "
                        "on a real cluster this scenario does not run")
        return self.local

    # the Kubernetes API
    def rollout_path(self, name: str = "") -> str:
        return f"/apis/{GROUP_VERSION}/namespaces/{self.namespace}/patchrollouts" + (f"/{name}" if name else "")

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create `obj`, or replace it when it exists (like `kubectl apply` for whole objects)."""
        path = object_path(obj)
        reply = await self.api.post(path.rsplit("/", 1)[0], json=obj)
        if reply.status_code == 409:
            current = (await self.api.get(path)).json()
            obj = {**obj, "metadata": {**obj["metadata"],
                                       "resourceVersion": current["metadata"]["resourceVersion"]}}
            reply = await self.api.put(path, json=obj)
        if reply.status_code >= 400:
            raise AssertionError(f"{obj['kind']} {obj['metadata'].get('name')}: {reply.status_code} {reply.text}")
        if obj["kind"] == "PatchRollout" and obj["metadata"]["name"] not in self.rollouts:
            self.rollouts.append(obj["metadata"]["name"])
        return reply.json()

    async def rollout(self, name: str) -> dict[str, Any] | None:
        reply = await self.api.get(self.rollout_path(name))
        return reply.json() if reply.status_code == 200 else None

    async def delete_rollout(self, name: str, timeout: float = 90) -> None:
        """Delete a PatchRollout and wait until its finalizer let it go."""
        await self.api.delete(self.rollout_path(name))
        await self.wait_for(lambda: self._gone(name), timeout, f"PatchRollout {name} to be deleted")

    async def _gone(self, name: str) -> bool:
        return await self.rollout(name) is None

    async def events(self, name: str) -> list[dict[str, Any]]:
        """The Events of one object, oldest first (by eventTime, which keeps microseconds)."""
        reply = await self.api.get(f"/api/v1/namespaces/{self.namespace}/events")
        items = [e for e in reply.json().get("items", []) if (e.get("involvedObject") or {}).get("name") == name]

        def key(e: dict[str, Any]) -> tuple:
            rv = e["metadata"].get("resourceVersion", "0")
            return (e.get("eventTime") or e.get("lastTimestamp") or "", int(rv) if rv.isdigit() else 0)
        return sorted(items, key=key)

    async def pods(self) -> list[dict[str, Any]]:
        """The engine pods (app=llm-engine), without the ones being deleted, by name."""
        reply = await self.api.get(f"/api/v1/namespaces/{self.namespace}/pods", params={"labelSelector": SELECTOR})
        reply.raise_for_status()
        return sorted((p for p in reply.json().get("items", []) if not p["metadata"].get("deletionTimestamp")),
                      key=lambda p: p["metadata"]["name"])

    async def ready_pods(self) -> list[dict[str, Any]]:
        return [p for p in await self.pods() if is_ready(p)]

    async def pod(self, name: str) -> dict[str, Any] | None:
        reply = await self.api.get(f"/api/v1/namespaces/{self.namespace}/pods/{name}")
        return reply.json() if reply.status_code == 200 else None

    async def label_pod(self, name: str, revision: str) -> None:
        """Put a pod back to the state no rollout touched: no track, the given revision annotated."""
        reply = await self.api.patch(f"/api/v1/namespaces/{self.namespace}/pods/{name}",
                                     json={"metadata": {"labels": {TRACK_LABEL: None},
                                                        "annotations": {PATCHES_ANNOTATION: revision}}},
                                     headers={"content-type": "application/merge-patch+json"})
        reply.raise_for_status()

    # the engines
    def _admin(self, pod: dict[str, Any]) -> str:
        address = admin_address(pod, 8081)
        assert address is not None, f"pod {pod['metadata']['name']} has no IP"
        return f"http://{address[0]}:{address[1]}/admin/patches"

    async def engine_patches(self, pod: dict[str, Any]) -> dict[str, Any]:
        """The engine's own answer to `GET /admin/patches` (revision, applied, available)."""
        reply = await self.http.get(self._admin(pod), headers={"Authorization": f"Bearer {self.token}"})
        reply.raise_for_status()
        return reply.json()

    async def engine_revision(self, pod: dict[str, Any]) -> str | None:
        """The engine's revision, or None when it does not answer (restarting)."""
        try:
            return (await self.engine_patches(pod))["revision"]
        except httpx.HTTPError:
            return None

    async def revert_engine(self, pod: dict[str, Any], name: str) -> None:
        reply = await self.http.delete(f"{self._admin(pod)}/{name}", headers={"Authorization": f"Bearer {self.token}"})
        if reply.status_code not in (200, 404):
            reply.raise_for_status()

    async def engine_metric(self, pod: dict[str, Any], metric: str, **labels: str) -> float:
        """The sum of an engine's own samples of `metric` matching `labels` (from its /metrics)."""
        reply = await self.http.get(f"http://{pod['status']['podIP']}:{metrics_port(pod)}/metrics")
        reply.raise_for_status()
        total = 0.0
        for line in reply.text.splitlines():
            head, _, value = line.rpartition(" ")
            if (head == metric or head.startswith(metric + "{")) and all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    # Prometheus
    async def query(self, promql: str) -> float | None:
        """One number from Prometheus (None: no data); raises when Prometheus cannot answer."""
        reply = await self.http.get(f"{self.prometheus_url}/api/v1/query", params={"query": promql})
        reply.raise_for_status()
        result = reply.json()["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) else value

    async def counts(self, revision: str, window: float) -> tuple[float, float]:
        """Requests and errors of `revision` over the last `window` seconds, asked the way the
        analysis asks (graft.rollout.queries); (0, 0) before the revision has any series."""
        ctx = Context(self.namespace, revision, BASE)
        requests = await self.query(count_query(ctx, CANARY, window))
        errors = await self.query(count_query(ctx, CANARY, window, "error"))
        return requests or 0.0, errors or 0.0

    # traffic
    def traffic(self, prompts: list[str], rate: float, max_tokens: int) -> Traffic:
        return Traffic(Router(self.api, self.namespace, dict(APP)), prompts, rate=rate, max_tokens=max_tokens)

    # waiting and cleaning up
    @staticmethod
    async def wait_for(probe: Callable[[], Awaitable[T]], timeout: float, what: str, interval: float = 0.5) -> T:
        """Wait until `await probe()` is truthy and return it."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = await probe()
            if last:
                return last
            await asyncio.sleep(interval)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")

    def check_operator(self) -> None:
        """Locally: fail at once, with its log, when the operator process has died."""
        proc = self.local.operator_proc if self.local else None
        if proc is not None and proc.poll() is not None:
            assert self.workdir is not None
            raise AssertionError(f"the operator exited with code {proc.returncode}\n"
                                 + _tail(self.workdir / "operator.log", 40))

    async def restore_processes(self) -> None:
        """Locally: a Prometheus or operator that a scenario stopped runs again."""
        if self.local is None:
            return
        assert self.local.prometheus is not None
        if not self.local.prometheus.running:
            await asyncio.to_thread(self.local.prometheus.start)
        proc = self.local.operator_proc
        if proc is None or proc.poll() is not None:
            self.local.start_operator()

    async def reset(self, timeout: float = 180) -> None:
        """The fleet at `base`, as the next scenario expects it: stopped processes running again,
        the scenario's rollouts deleted, the engine Deployment back at its replicas, and every pod
        Ready with its engine at `base`. What a fleet's PatchFleet and pods look like at base is
        the fleet's own (`settle_fleets`, `at_base`): here, no PatchFleet, as the cluster started."""
        t0 = time.monotonic()
        await self.clear_rollouts()
        deleted = time.monotonic() - t0
        await self.scale_back()
        await self.settle_fleets(timeout)
        await self.wait_for(self.at_base, timeout, f"{self.expected_pods} ready pods, all at {BASE}")
        print(f"[reset: rollouts deleted in {deleted:.1f}s, fleet at base {time.monotonic() - t0:.1f}s]")

    async def clear_rollouts(self) -> None:
        """Stopped processes running again, and the rollouts the scenario applied deleted."""
        await self.restore_processes()
        for name in list(self.rollouts):
            await self.delete_rollout(name)
            self.rollouts.remove(name)

    async def scale_back(self) -> None:
        """Locally: the engine Deployment back at the replicas the fleet started with (a scenario
        may have scaled it); on a real cluster the scenarios never scale it."""
        if self.local is None:
            return
        reply = await self.api.patch(f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{DEPLOYMENT}",
                                     json={"spec": {"replicas": self.expected_pods}},
                                     headers={"content-type": "application/merge-patch+json"})
        reply.raise_for_status()

    async def settle_fleets(self, timeout: float) -> None:
        """No PatchFleet: the one a promotion wrote would have its controller patch the engines again."""
        await self.delete_fleets(timeout)

    async def delete_fleets(self, timeout: float) -> None:
        path = fleet_path(self.namespace)
        reply = await self.api.get(path)
        for obj in reply.json().get("items", []) if reply.status_code == 200 else []:
            await self.api.delete(f"{path}/{obj['metadata']['name']}")

        async def none_left() -> bool:
            r = await self.api.get(path)
            return r.status_code != 200 or not r.json().get("items")
        await self.wait_for(none_left, timeout, "every PatchFleet to be deleted")

    async def at_base(self) -> bool:
        """Every pod Ready, its engine at `base`, no track label, annotated `base`; reverts the
        engines and relabels the pods that are not (no controller does it without a PatchFleet)."""
        pods = await self.ready_pods()
        done = len(pods) >= self.expected_pods
        for pod in pods:
            meta = pod["metadata"]
            revision = await self.engine_revision(pod)
            if revision is None:
                done = False
                continue
            for ref in patches_of(revision):
                await self.revert_engine(pod, ref.partition("@")[0])
            if revision != BASE or (meta.get("labels") or {}).get(TRACK_LABEL) is not None \
                    or (meta.get("annotations") or {}).get(PATCHES_ANNOTATION) != BASE:
                await self.label_pod(meta["name"], BASE)
                done = False
        return done

    # what a failed scenario leaves to read
    async def diagnostics(self, names: list[str]) -> str:
        out: list[str] = []
        for name in names:
            ro = await self.rollout(name)
            status = (ro or {}).get("status") or {}
            out.append(f"== PatchRollout {name}: {status.get('phase')} step {status.get('stepIndex')} "
                       f"weight {status.get('weight')}: {status.get('message')}")
            for r in (status.get("analysis") or {}).get("results", []):
                out.append(f"   {r.get('name')}: {r.get('verdict')} {r.get('value')} ({r.get('message')})")
            for e in await self.events(name):
                out.append(f"   {e.get('eventTime') or e.get('lastTimestamp')} {e.get('reason')}: {e.get('message')}")
        for pod in await self.pods():
            meta, cs = pod["metadata"], ((pod.get("status") or {}).get("containerStatuses") or [{}])[0]
            out.append(f"== pod {meta['name']} ready={is_ready(pod)} restarts={cs.get('restartCount')} "
                       f"track={(meta.get('labels') or {}).get(TRACK_LABEL)} "
                       f"patches={(meta.get('annotations') or {}).get(PATCHES_ANNOTATION)} "
                       f"engine={await self.engine_revision(pod) if is_ready(pod) else '-'}")
        if self.workdir is not None:
            out.append(_tail(self.workdir / "operator.log", 80))
            for log in sorted((self.workdir / "pods").glob("*.log")):
                out.append(_tail(log, 15))
        return "\n".join(out)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        return f"== {path}: {e}"
    return "\n".join([f"== {path} (last {lines} lines)", *text])


@dataclass(slots=True)
class ClientLoad:
    """The client traffic running over the fleet for the whole module."""

    traffic: Traffic
    warm_at: float = 0.0   # wall-clock time the fleet last kept up with it (`keeps_up`)

    @property
    def stats(self) -> TrafficStats:
        return self.traffic.stats

    def finished(self, since: float) -> list[Outcome]:
        """Requests answered (or failed) at or after `since`, whenever they were sent."""
        return [o for o in self.stats.outcomes if o.at + o.latency >= since]

    def failed(self, since: float) -> list[Outcome]:
        return [o for o in self.finished(since) if o.status != 200]

    def answered(self, since: float) -> int:
        return sum(1 for o in self.finished(since) if o.status == 200)

    def keeps_up(self, pods: list[str], answers: int = 2) -> bool:
        """Every pod's last `answers` requests were answered, each faster than requests reach it
        (N pods / rate seconds apart): no backlog left from cold prefills or a patch."""
        gap = len(pods) / self.traffic.rate
        for pod in pods:
            last = [o for o in self.stats.outcomes if o.pod == pod][-answers:]
            if len(last) < answers or any(o.status != 200 or o.latency >= gap for o in last):
                return False
        return True


@dataclass(slots=True)
class Sample:
    """One look at a rollout: its status, its pods, and (when asked) each engine's own revision."""

    t: float
    status: dict[str, Any]
    pods: list[dict[str, Any]]
    engines: dict[str, str | None] = field(default_factory=dict)

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")

    @property
    def step(self) -> int:
        return int(self.status.get("stepIndex") or 0)

    @property
    def weight(self) -> int:
        return int(self.status.get("weight") or 0)

    def labelled(self, track: str) -> list[str]:
        return [p["metadata"]["name"] for p in self.pods
                if (p["metadata"].get("labels") or {}).get(TRACK_LABEL) == track]

    def recorded(self, track: str) -> list[str]:
        """The pods the rollout's own status puts on `track`."""
        return [p["name"] for p in self.status.get("pods") or [] if p.get("track") == track]


class Recorder:
    """Samples a rollout every `every` seconds while it runs: `async with Recorder(...) as rec`."""

    def __init__(self, fleet: Fleet, name: str, *, engines: bool = False, every: float = 0.5):
        self.fleet, self.name, self.engines, self.every = fleet, name, engines, every
        self.samples: list[Sample] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Recorder":
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                await self.sample()
            await asyncio.sleep(self.every)

    async def sample(self) -> Sample | None:
        ro = await self.fleet.rollout(self.name)
        if ro is None or not ro.get("status"):
            return None
        pods = await self.fleet.pods()
        engines = {}
        if self.engines:
            ready = [p for p in pods if is_ready(p)]
            revisions = await asyncio.gather(*(self.fleet.engine_revision(p) for p in ready))
            engines = {p["metadata"]["name"]: r for p, r in zip(ready, revisions)}
        s = Sample(time.time(), ro["status"], pods, engines)
        self.samples.append(s)
        return s

    @property
    def last(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    async def until(self, done: Callable[[Sample], bool], timeout: float, what: str) -> Sample:
        """Wait until a sample satisfies `done`; returns that sample."""
        async def probe() -> Sample | None:
            self.fleet.check_operator()
            s = self.last
            return s if s is not None and done(s) else None
        return await Fleet.wait_for(probe, timeout, f"{self.name}: {what}", interval=0.1)

    async def final(self, timeout: float) -> Sample:
        return await self.until(lambda s: s.phase in FINAL_PHASES, timeout, "a final phase")

    def between(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.t <= end]


# opening a fleet
@contextlib.asynccontextmanager
async def open_fleet(workdir: Path) -> AsyncIterator[Fleet]:
    """The real cluster named by GRAFT_E2E_KUBECONFIG, else a local dev cluster in `workdir`."""
    kubeconfig = os.environ.get("GRAFT_E2E_KUBECONFIG")
    opener = _real_fleet(kubeconfig) if kubeconfig else _local_fleet(workdir)
    async with opener as fleet:
        try:
            yield fleet
        finally:
            await fleet.aclose()


@contextlib.asynccontextmanager
async def _local_fleet(workdir: Path) -> AsyncIterator[Fleet]:
    opts = ClusterOptions(workdir=workdir, pods=LOCAL_PODS, operator_tick=LOCAL_TICK,
                          scrape_interval=f"{SCRAPE_INTERVAL:g}s")
    cluster = DevCluster(opts)
    async with cluster:
        assert cluster.api is not None and cluster.prometheus is not None
        await cluster.wait_ready(timeout=300)
        await asyncio.to_thread(cluster.prometheus.wait_for_targets, LOCAL_PODS, 60)
        yield Fleet(cluster.api, cluster.namespace, cluster.token, cluster.prometheus.url, LOCAL_PODS, cluster)


@contextlib.asynccontextmanager
async def _real_fleet(kubeconfig: str) -> AsyncIterator[Fleet]:
    from graft.operator.runtime import _from_kubeconfig

    namespace = os.environ.get("GRAFT_E2E_NAMESPACE", "llm")
    prometheus = os.environ.get("GRAFT_E2E_PROMETHEUS")
    if not prometheus:
        raise pytest.UsageError("GRAFT_E2E_KUBECONFIG is set: GRAFT_E2E_PROMETHEUS must name the "
                                "Prometheus the operator queries (http://host:port, reachable from here)")
    info = await asyncio.to_thread(_from_kubeconfig, kubeconfig, os.environ.get("GRAFT_E2E_CONTEXT"))
    verify = info.as_ssl_context() if info.server.startswith("https:") else False
    async with httpx.AsyncClient(base_url=info.server.rstrip("/"), headers=info.as_http_headers(),
                                 verify=verify, timeout=30) as api:
        token = os.environ.get("GRAFT_E2E_ADMIN_TOKEN") or await _secret_token(api, namespace)
        fleet = Fleet(api, namespace, token, prometheus.rstrip("/"), 0)
        pods = await fleet.ready_pods()
        if not pods:
            raise pytest.UsageError(f"no ready pods labelled {SELECTOR} in namespace {namespace}")
        fleet.expected_pods = len(pods)
        yield fleet


async def _secret_token(api: httpx.AsyncClient, namespace: str) -> str:
    name = os.environ.get("GRAFT_E2E_TOKEN_SECRET", TOKEN_SECRET)
    reply = await api.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
    if reply.status_code != 200:
        raise pytest.UsageError(f"cannot read Secret {namespace}/{name} (the engines' admin token): "
                                f"{reply.status_code}; set GRAFT_E2E_ADMIN_TOKEN or GRAFT_E2E_TOKEN_SECRET")
    return base64.b64decode(reply.json()["data"]["token"]).decode().strip()
