"""`graft dev-cluster`: a local stand-in for a Kubernetes cluster running an engine fleet.

One process holds it all together: the API server emulator (kubectl and the operator talk to it
through the kubeconfig it writes), the pod runner playing kubelet for the engine Deployment (a
real `graft serve` process per Pod), a real Prometheus scraping every engine, the operator as its
own process (`graft operator`, as in a cluster), and, when asked, client traffic of BBH prompts.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from graft.devcluster.apiserver import ApiServer
from graft.devcluster.podrunner import Container, PodRunner
from graft.devcluster.prometheus import PrometheusServer
from graft.devcluster.traffic import Router, Traffic

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
APP = {"app": "llm-engine"}
TOKEN_SECRET = "graft-admin-token"
METRICS_PORT = 9400     # the engines' /metrics: a port of its own, never the public 8000


@dataclass(slots=True)
class ClusterOptions:
    workdir: Path
    namespace: str = "llm"
    pods: int = 3
    kv_cache_memory: str = "256M"   # fp32: room for 1,280 tokens of shadow comparison (a BBH prompt and its answer)
    max_num_batched_tokens: int = 256
    scrape_interval: str = "1s"
    operator: bool = True
    operator_tick: float = 1.0
    engine_threads: int = 1
    api_port: int = 0
    api_history: int = 20   # requests KMock keeps for assertions; each request scans them all
    readiness_gates: tuple[str, ...] = ()   # condition types the engine pods wait for (e.g. graft.dev/patched)
    first_pod_ip: int = 2   # pods get 127.0.0.N from here up: another range keeps clear of a second dev cluster


def engine_deployment(opts: ClusterOptions) -> dict[str, Any]:
    """The engine Deployment of the dev cluster: the chart's engine pod, sized for a CPU."""
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "llm-engine", "namespace": opts.namespace, "labels": dict(APP)},
        "spec": {
            "replicas": opts.pods,
            "selector": {"matchLabels": dict(APP)},
            "template": {
                "metadata": {"labels": dict(APP), "annotations": {"graft.dev/patches": "base"}},
                "spec": {"containers": [{
                    "name": "engine",
                    "command": ["graft"],
                    "args": ["serve", "--port", "8000", "--metrics-port", str(METRICS_PORT), "--admin-port", "8081",
                             "--enable-test-patches",
                             "--paths", "plain", "--dtype", "float32",
                             "--kv-cache-memory", opts.kv_cache_memory,
                             "--max-num-batched-tokens", str(opts.max_num_batched_tokens), "--grace", "5",
                             # a comparison of a BBH request costs a float32 engine on a shared core
                             # a second or two once its few-shot prefix is in the shadow blocks: a
                             # tenth of its time lets a busy canary compare a few requests a minute
                             "--shadow-budget", "0.1"],
                    # Prometheus scrapes the port named `metrics`, as the chart's PodMonitor does
                    "ports": [{"name": "http", "containerPort": 8000}, {"name": "metrics", "containerPort": METRICS_PORT},
                              {"name": "admin", "containerPort": 8081}],
                    "env": [
                        {"name": "GRAFT_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": TOKEN_SECRET, "key": "token"}}},
                        {"name": "GRAFT_PATCHES", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['graft.dev/patches']"}}},
                        {"name": "OMP_NUM_THREADS", "value": str(opts.engine_threads)},
                    ],
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}},
                    "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}},
                }]},
            },
        },
    }
    if opts.readiness_gates:
        deployment["spec"]["template"]["spec"]["readinessGates"] = [{"conditionType": t} for t in opts.readiness_gates]
    return deployment


class DevCluster:
    """`async with DevCluster(opts) as cluster:`; everything stops when the block ends."""

    def __init__(self, opts: ClusterOptions):
        self.opts = opts
        self.workdir = Path(opts.workdir)
        self.kubeconfig = self.workdir / "kubeconfig"
        self.token = secrets.token_urlsafe(24)
        self.api_server = ApiServer(crd_paths=[CRDS], port=opts.api_port, history_limit=opts.api_history,
                                    pod_logs_dir=self.workdir / "pods")
        self.api: httpx.AsyncClient | None = None
        self.pods: PodRunner | None = None
        self.prometheus: PrometheusServer | None = None
        self.operator_proc: subprocess.Popen | None = None
        self._sync_task: asyncio.Task | None = None
        self._stack = contextlib.AsyncExitStack()

    @property
    def namespace(self) -> str:
        return self.opts.namespace

    async def __aenter__(self) -> "DevCluster":
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            await self._stack.enter_async_context(self.api_server)
            self.api_server.write_kubeconfig(self.kubeconfig, namespace=self.namespace)
            self.api = httpx.AsyncClient(base_url=self.api_server.url, timeout=10)
            self._stack.push_async_callback(self.api.aclose)
            await self._bootstrap()
            self.prometheus = PrometheusServer([], scrape_interval=self.opts.scrape_interval)
            self.prometheus.start()
            self._stack.callback(self.prometheus.close)
            self.pods = PodRunner(self.api_server.url, self.namespace, self.workdir / "pods",
                                  first_ip=self.opts.first_pod_ip)
            await self._stack.enter_async_context(self.pods)
            self._sync_task = asyncio.create_task(self._sync_targets())
            self._stack.push_async_callback(self._cancel_sync)
            if self.opts.operator:
                self.start_operator()
                self._stack.callback(self.stop_operator)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _cancel_sync(self) -> None:
        if self._sync_task:
            self._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sync_task

    async def _bootstrap(self) -> None:
        await self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}})
        import base64
        await self.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": TOKEN_SECRET, "namespace": self.namespace},
                          "type": "Opaque", "data": {"token": base64.b64encode(self.token.encode()).decode()}})
        await self.apply({"apiVersion": "v1", "kind": "Service",
                          "metadata": {"name": "llm-engine", "namespace": self.namespace},
                          "spec": {"selector": dict(APP), "ports": [{"name": "http", "port": 8000, "targetPort": "http"}]}})
        await self.apply(engine_deployment(self.opts))

    async def _sync_targets(self) -> None:
        seen: list = []
        while True:
            assert self.pods is not None and self.prometheus is not None
            targets = scrape_targets(self.pods.containers.values(), self.namespace)
            if targets != seen:
                self.prometheus.set_targets(targets)
                seen = targets
            await asyncio.sleep(0.5)

    # the operator, as its own process
    def start_operator(self) -> None:
        env = {**os.environ, "GRAFT_KUBE_SERVER": self.api_server.url,
               "GRAFT_ADMIN_TOKEN_SECRET": f"{self.namespace}/{TOKEN_SECRET}",
               "GRAFT_TICK_SECONDS": str(self.opts.operator_tick), "GRAFT_NAMESPACES": self.namespace,
               # every pod of the dev cluster listens on this machine's loopback: no network to cross
               "GRAFT_ADMIN_PLAIN_HTTP": "true",
               # job checks (an LLM quality gate) run as the namespace's default service account
               "GRAFT_JOB_CHECKS": "true"}
        if self.prometheus is not None:     # rollouts that name no Prometheus use the dev cluster's
            env["GRAFT_PROMETHEUS_ADDRESS"] = self.prometheus.url
        out = open(self.workdir / "operator.log", "ab")
        self.operator_proc = subprocess.Popen([sys.executable, "-m", "graft.cli", "operator"],
                                              stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()

    def stop_operator(self, sig: int = signal.SIGTERM) -> None:
        p = self.operator_proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(sig)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    # API helpers
    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create, or replace if it exists (like `kubectl apply` for whole objects)."""
        assert self.api is not None
        path = object_path(obj)
        r = await self.api.post(path.rsplit("/", 1)[0] if obj["metadata"].get("name") else path, json=obj)
        if r.status_code == 409:
            cur = (await self.api.get(path)).json()
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": cur["metadata"]["resourceVersion"]}}
            r = await self.api.put(path, json=obj)
        if r.status_code >= 400:
            raise ValueError(f"{obj['kind']} {obj['metadata'].get('name')}: {r.json().get('message', r.text)}")
        return r.json()

    async def get(self, path: str) -> dict[str, Any] | None:
        assert self.api is not None
        r = await self.api.get(path)
        return r.json() if r.status_code == 200 else None

    async def rollout(self, name: str) -> dict[str, Any] | None:
        return await self.get(f"/apis/graft.dev/v1alpha1/namespaces/{self.namespace}/patchrollouts/{name}")

    async def pod_objects(self) -> list[dict[str, Any]]:
        assert self.api is not None
        return (await self.api.get(f"/api/v1/namespaces/{self.namespace}/pods")).json()["items"]

    async def events(self, name: str | None = None) -> list[dict[str, Any]]:
        assert self.api is not None
        items = (await self.api.get(f"/api/v1/namespaces/{self.namespace}/events")).json()["items"]
        if name is not None:
            items = [e for e in items if e.get("involvedObject", {}).get("name") == name]
        return sorted(items, key=lambda e: (e.get("lastTimestamp") or e.get("eventTime") or "",
                                            int(e["metadata"].get("resourceVersion", 0))))

    async def wait_ready(self, count: int | None = None, timeout: float = 180) -> None:
        count = self.opts.pods if count is None else count
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pods and len(self.pods.ready_pods()) >= count:
                return
            await asyncio.sleep(0.5)
        logs = "\n".join(f"{c.pod}: {c.log_path.read_text()[-800:] if c.log_path else ''}"
                         for c in (self.pods.containers.values() if self.pods else []))
        raise TimeoutError(f"{count} engine pods not ready after {timeout}s\n{logs}")

    def router(self) -> Router:
        assert self.api is not None
        return Router(self.api, self.namespace, dict(APP))

    def traffic(self, prompts: list[str], rate: float = 3.0, max_tokens: int = 8) -> Traffic:
        return Traffic(self.router(), prompts, rate=rate, max_tokens=max_tokens)


def scrape_targets(containers: Iterable[Container], namespace: str) -> list[tuple[str, dict[str, str]]]:
    """What Prometheus scrapes: each pod's container port named `metrics` (a pod that names none,
    the public port being no place for the engine's metrics, is not scraped), labelled with its
    namespace and pod as the chart's scrape config labels them."""
    return sorted((f"{c.ip}:{c.ports['metrics']}", {"namespace": namespace, "pod": c.pod})
                  for c in containers if "metrics" in c.ports)


def object_path(obj: dict[str, Any]) -> str:
    api_version, kind = obj["apiVersion"], obj["kind"]
    plural = {"Namespace": "namespaces", "Secret": "secrets", "Service": "services", "Deployment": "deployments",
              "ConfigMap": "configmaps", "Pod": "pods", "PatchRollout": "patchrollouts",
              "HTTPRoute": "httproutes"}[kind]
    meta = obj["metadata"]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if kind == "Namespace":
        return f"{base}/namespaces/{meta['name']}"
    return f"{base}/namespaces/{meta.get('namespace', 'default')}/{plural}/{meta.get('name', '')}"


def route_logs(workdir: Path) -> None:
    """Send the dev cluster's logs to files in its folder, so the terminal keeps only warnings.

    The API server's access log (a line per API call: the operator and the pod runner make
    several a second) goes to ``apiserver.log``, everything else logged in this process to
    ``devcluster.log``; pods and the operator already write their own logs there.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    access = logging.getLogger("aiohttp.access")
    access.handlers[:] = [logging.FileHandler(workdir / "apiserver.log")]
    access.propagate = False
    root = logging.getLogger()
    for handler in root.handlers:
        if type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.stdout):
            handler.setLevel(max(handler.level, logging.WARNING))
    everything = logging.FileHandler(workdir / "devcluster.log")
    everything.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(everything)
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)


def traffic_prompts(per_task: int = 2) -> list[str]:
    """BBH chain-of-thought prompts of `TRAFFIC_TASKS` for client traffic (data from GRAFT_DATA_DIR
    or ../shared/data)."""
    from graft.bench.data import bbh_prompts
    from graft.devcluster.traffic import TRAFFIC_TASKS
    return [prompt.text for prompt in bbh_prompts(tasks=list(TRAFFIC_TASKS), per_task=per_task)]


def main(args: argparse.Namespace) -> int:
    """Run the dev cluster in the foreground until Ctrl-C; ``--traffic RPS`` adds steady client traffic."""
    opts = ClusterOptions(workdir=Path(args.dir), pods=args.pods)
    rate = float(getattr(args, "traffic", 0) or 0)
    prompts = traffic_prompts() if rate > 0 else []  # missing data fails here, before anything starts
    route_logs(opts.workdir)

    async def run() -> None:
        async with DevCluster(opts) as cluster, contextlib.AsyncExitStack() as stack:
            await cluster.wait_ready()
            traffic = await stack.enter_async_context(cluster.traffic(prompts, rate=rate)) \
                if rate > 0 else None
            kc = cluster.kubeconfig.resolve()
            print(f"dev cluster up: {opts.pods} engine pods in namespace {opts.namespace}\n"
                  f"  kubectl --kubeconfig {kc} get pods,patchrollouts -n {opts.namespace}\n"
                  f"  kubectl --kubeconfig {kc} apply -f examples/rollout-dev-cluster.yaml\n"
                  f"  Prometheus: {cluster.prometheus.url if cluster.prometheus else '-'}\n"
                  f"  client traffic: {f'{rate:g} BBH prompts per second' if traffic else 'none (--traffic RPS)'}\n"
                  f"  logs: {opts.workdir.resolve()}/ (apiserver.log, devcluster.log, operator.log, pods/)\n"
                  f"Ctrl-C stops everything.", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            if traffic is not None:
                sent, failed = len(traffic.stats.outcomes), len(traffic.stats.failed())
                print(f"client traffic: {sent} requests, {failed} failed", flush=True)

    asyncio.run(run())
    return 0
