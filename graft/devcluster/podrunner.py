"""A kubelet stand-in for the dev cluster: a real `graft serve` process per Pod object.

It plays two controllers for one namespace, through the Kubernetes API like any client:

- the Deployment controller: keeps `spec.replicas` Pods of each Deployment it manages (made from
  its pod template, named `<deployment>-<suffix>`), replacing deleted ones;
- the kubelet: gives each Pod its own loopback address (127.0.0.2, .3, ...), so every engine listens
  on the ports its container declares exactly as in a cluster; resolves the container's env
  (`value`, `secretKeyRef`, and the Downward API's `fieldRef` on `metadata.annotations[...]`, which
  is how `graft.dev/patches` becomes `GRAFT_PATCHES`) at every container start; keeps `status` true
  (phase, podIP, Ready from the readiness probe, containerID, restartCount); restarts a container
  that exits, with a new containerID and restartCount + 1; stops the process when the Pod goes.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)

MANAGED = "graft.dev/dev-cluster"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(slots=True)
class Container:
    pod: str
    ip: str
    process: subprocess.Popen | None = None
    restarts: int = 0
    container_id: str = ""
    started: float = 0.0
    ready: bool = False
    log_path: Path | None = None
    env_snapshot: dict[str, str] = field(default_factory=dict)


class PodRunner:
    """Run the pods of `namespace` as local processes. Use as `async with PodRunner(...)`."""

    def __init__(self, api_url: str, namespace: str, workdir: Path, *, engine_args: list[str] | None = None,
                 first_ip: int = 2, poll: float = 0.5, grace: float = 10.0):
        self.api = httpx.AsyncClient(base_url=api_url, timeout=10)
        self.namespace = namespace
        self.workdir = Path(workdir)
        self.engine_args = engine_args or []
        self.poll = poll
        self.grace = grace
        self.containers: dict[str, Container] = {}
        self._free_ips = [f"127.0.0.{i}" for i in range(first_ip, 250)]
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._counter = itertools.count(1)

    async def __aenter__(self) -> "PodRunner":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stopping = True
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(asyncio.to_thread(self._terminate, c) for c in self.containers.values()))
        await self.api.aclose()

    # paths
    def _ns(self, resource: str, name: str = "", group: str = "") -> str:
        base = f"/apis/{group}" if group else "/api/v1"
        return f"{base}/namespaces/{self.namespace}/{resource}" + (f"/{name}" if name else "")

    async def _list(self, resource: str, group: str = "") -> list[dict]:
        r = await self.api.get(self._ns(resource, group=group))
        r.raise_for_status()
        return r.json().get("items", [])

    # the loop
    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._reconcile_deployments()
                await self._reconcile_pods()
            except (httpx.HTTPError, OSError) as exc:
                log.warning("pod runner: API unreachable (%s); retrying", exc)
            except Exception:
                log.exception("pod runner: reconcile failed; retrying")
            await asyncio.sleep(self.poll)

    async def _reconcile_deployments(self) -> None:
        pods = await self._list("pods")
        for dep in await self._list("deployments", group="apps/v1"):
            if dep["metadata"].get("deletionTimestamp"):
                continue
            name = dep["metadata"]["name"]
            owned = [p for p in pods if p["metadata"].get("labels", {}).get(MANAGED) == name
                     and not p["metadata"].get("deletionTimestamp")]
            want = int(dep.get("spec", {}).get("replicas", 1))
            for _ in range(want - len(owned)):
                await self._create_pod(dep)
            for extra in owned[want:]:
                await self.api.delete(self._ns("pods", extra["metadata"]["name"]))
            await self.api.patch(self._ns("deployments", name, group="apps/v1") + "/status",
                                 json={"status": {"replicas": len(owned), "readyReplicas": sum(
                                     1 for p in owned if _is_ready(p)), "observedGeneration":
                                     dep["metadata"].get("generation", 1)}},
                                 headers={"content-type": "application/merge-patch+json"})

    async def _create_pod(self, dep: dict) -> None:
        template = dep["spec"]["template"]
        meta = template.get("metadata", {})
        name = f"{dep['metadata']['name']}-{secrets.token_hex(3)}"
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace,
                             "labels": {**meta.get("labels", {}), MANAGED: dep["metadata"]["name"]},
                             "annotations": dict(meta.get("annotations", {}))},
                "spec": template["spec"]}
        r = await self.api.post(self._ns("pods"), json=body)
        r.raise_for_status()
        log.info("created pod %s", name)

    async def _reconcile_pods(self) -> None:
        pods = {p["metadata"]["name"]: p for p in await self._list("pods")}
        for name in list(self.containers):
            pod = pods.get(name)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                c = self.containers.pop(name)
                await asyncio.to_thread(self._terminate, c)
                self._free_ips.insert(0, c.ip)
                if pod is not None:  # let the deletion finish: drop our finalizer-free pod for good
                    await self.api.delete(self._ns("pods", name), params={"gracePeriodSeconds": "0"})
        for name, pod in pods.items():
            if pod["metadata"].get("deletionTimestamp"):
                continue
            c = self.containers.get(name)
            if c is None:
                c = self.containers[name] = Container(name, self._free_ips.pop(0))
            if c.process is None or c.process.poll() is not None:
                if c.process is not None:
                    c.restarts += 1
                    log.warning("pod %s: container exited (%s); restarting", name, c.process.returncode)
                await self._start(c, pod)
            await self._sync_status(c, pod)

    # containers
    async def _resolve_env(self, pod: dict, container: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = str(item["value"])
                continue
            src = item.get("valueFrom", {})
            if "fieldRef" in src:
                env[item["name"]] = _field_ref(pod, src["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in src:
                ref = src["secretKeyRef"]
                r = await self.api.get(self._ns("secrets", ref["name"]))
                if r.status_code == 404 and ref.get("optional"):
                    continue
                r.raise_for_status()
                import base64
                env[item["name"]] = base64.b64decode(r.json().get("data", {})[ref["key"]]).decode()
        return env

    async def _start(self, c: Container, pod: dict) -> None:
        container = pod["spec"]["containers"][0]
        env = await self._resolve_env(pod, container)
        argv = [*container.get("command", []), *container.get("args", [])]
        if not argv or Path(argv[0]).name != "graft":
            raise ValueError(f"pod {c.pod}: the dev cluster runs `graft ...` containers only, got {argv[:1]}")
        cmd = [sys.executable, "-m", "graft.cli", *argv[1:], *_serve_flags(argv, c.ip), *self.engine_args]
        c.log_path = self.workdir / f"{c.pod}.log"
        c.env_snapshot = env
        out = open(c.log_path, "ab")
        out.write(f"--- start {_now()} restarts={c.restarts} env GRAFT_PATCHES={env.get('GRAFT_PATCHES', '')}\n".encode())
        out.flush()
        c.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True)
        out.close()
        c.container_id = f"graft://{c.pod}-{next(self._counter)}-{c.process.pid}"
        c.started = time.time()
        c.ready = False

    def _terminate(self, c: Container) -> None:
        if c.process is None or c.process.poll() is not None:
            return
        c.process.send_signal(signal.SIGTERM)
        try:
            c.process.wait(self.grace)
        except subprocess.TimeoutExpired:
            c.process.kill()
            c.process.wait()

    def kill(self, pod: str) -> int:
        """Kill a pod's engine process outright (the container crashes; the runner restarts it)."""
        c = self.containers[pod]
        assert c.process is not None
        c.process.kill()
        c.process.wait()
        return c.process.pid

    def ready_pods(self) -> list[Container]:
        return [c for c in self.containers.values() if c.ready]

    async def _probe(self, c: Container, pod: dict) -> bool:
        container = pod["spec"]["containers"][0]
        probe = (container.get("readinessProbe") or {}).get("httpGet") or {"path": "/ready", "port": 8000}
        port = _port(container, probe.get("port", 8000))
        try:
            r = await self.api.get(f"http://{c.ip}:{port}{probe.get('path', '/ready')}", timeout=1.0)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def _sync_status(self, c: Container, pod: dict) -> None:
        alive = c.process is not None and c.process.poll() is None
        c.ready = alive and await self._probe(c, pod)
        cname = pod["spec"]["containers"][0].get("name", "engine")
        started = datetime.fromtimestamp(c.started, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        status = {
            "phase": "Running" if alive else "Pending",
            "podIP": c.ip, "podIPs": [{"ip": c.ip}], "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if c.ready else "False"},
                           {"type": "ContainersReady", "status": "True" if c.ready else "False"}],
            "containerStatuses": [{"name": cname, "ready": c.ready, "restartCount": c.restarts,
                                   "containerID": c.container_id, "image": "graft-engine:dev",
                                   "started": alive,
                                   "state": {"running": {"startedAt": started}} if alive else
                                   {"waiting": {"reason": "ContainerCreating"}}}],
        }
        old = pod.get("status", {})
        if (old.get("podIP"), old.get("phase"), _is_ready(pod), _restarts(pod), _container_id(pod)) == \
                (c.ip, status["phase"], c.ready, c.restarts, c.container_id):
            return
        await self.api.patch(self._ns("pods", c.pod) + "/status", json={"status": status},
                             headers={"content-type": "application/merge-patch+json"})


def _serve_flags(argv: list[str], ip: str) -> list[str]:
    """Where a pod's `graft serve` listens: its own IP for both ports, as in a cluster.

    The admin API binds 127.0.0.1 by default; the operator reaches it at the pod IP. The dev
    cluster's bundles are unsigned examples, so its engines run them on their digest alone unless
    the pod names a trusted key.
    """
    flags = ["--host", ip]
    if argv[1:2] == ["serve"]:
        flags += ["--admin-host", ip]
        if not any(a == "--trusted-key" or a.startswith("--trusted-key=") for a in argv):
            flags.append("--allow-unsigned-bundles")
    return flags


def _field_ref(pod: dict, path: str) -> str:
    meta = pod["metadata"]
    for prefix, key in (("metadata.annotations", "annotations"), ("metadata.labels", "labels")):
        if path.startswith(prefix + "["):
            name = path[len(prefix) + 1:-1].strip("'\"")
            return str(meta.get(key, {}).get(name, ""))
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "status.podIP": pod.get("status", {}).get("podIP")}
    if path not in simple:
        raise ValueError(f"unsupported fieldRef {path}")
    return str(simple[path] or "")


def _port(container: dict, port: Any) -> int:
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    return int(port)


def _is_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions", []))


def _restarts(pod: dict) -> int:
    cs = pod.get("status", {}).get("containerStatuses") or [{}]
    return int(cs[0].get("restartCount", 0))


def _container_id(pod: dict) -> str:
    cs = pod.get("status", {}).get("containerStatuses") or [{}]
    return cs[0].get("containerID", "")
