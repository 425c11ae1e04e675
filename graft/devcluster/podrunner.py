"""A kubelet stand-in for the dev cluster: a real local process per Pod object.

It plays three controllers for one namespace, through the Kubernetes API like any client:

- the Deployment controller: keeps `spec.replicas` Pods of each Deployment it manages (made from
  its pod template, readiness gates included, named `<deployment>-<suffix>`, with a controller
  ownerReference to the Deployment and its uid, which the operator requires of an engine),
  replacing deleted ones and, on a scale-down, deleting the not-Ready and newest first;
  `kubectl scale` works through the API server's scale subresource;
- the kubelet: gives each Pod its own loopback address (127.0.0.2, .3, ...), so every engine listens
  on the ports its container declares exactly as in a cluster; resolves the container's env
  (`value` with `$(VAR)` references, `secretKeyRef`, and the Downward API's `fieldRef`, which is how
  `graft.dev/patches` becomes `GRAFT_PATCHES`) at every container start; keeps `status` true
  (phase, podIP, containerID, restartCount, and the conditions it owns: PodScheduled, Initialized,
  ContainersReady from the readiness probe, and Ready, which also waits for every readiness gate's
  condition to be True); restarts a container that exits, with a new containerID and
  restartCount + 1; stops the process when the Pod goes. Conditions of other types belong to
  whoever sets them (an operator's readiness gate): its status writes merge by condition type and
  never drop them;
- the EndpointSlice and Endpoints controllers: every Service with a selector gets an EndpointSlice
  and an Endpoints object listing its pods, an endpoint `ready` only when its pod is Ready;
- kube-proxy: each Service's clusterIP:port forwards to its Ready pods, and every container starts
  with the Services' `{NAME}_SERVICE_HOST/PORT` variables (graft.devcluster.services).

A container's command is run with this machine's Python environment standing in for the image:
`graft ...` runs `python -m graft.cli ...` (a `graft serve` is told to listen on the pod's IP, with the
runner's engine flags; any other command runs as written);
`python ...` runs this interpreter, which makes small engine-less pods possible in tests.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from graft.devcluster.jobs import reconcile_jobs
from graft.devcluster.services import ServiceProxy, service_env

log = logging.getLogger(__name__)

MANAGED = "graft.dev/dev-cluster"
KUBELET_CONDITIONS = ("Initialized", "Ready", "ContainersReady", "PodScheduled")  # the types it owns
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SLICE_MANAGER = {"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
ENDPOINTS_MANAGER = {MANAGED: "endpoints-controller"}  # marks the Endpoints objects this runner keeps
_SMP = {"content-type": "application/strategic-merge-patch+json"}
_MERGE = {"content-type": "application/merge-patch+json"}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ContainerError(Exception):
    """Why a container cannot start, as kubelet reports it in the container's waiting state."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


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
    waiting: ContainerError | None = None   # the last start failed: why
    last_exit: int | None = None            # exit code of the previous run
    ports: dict[str, int] = field(default_factory=dict)   # the container's named ports, as its pod declares them
    finished: float | None = None           # the container ran to its end and is not restarted (restartPolicy)


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
        self._leases: dict[str, IpLease] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._wake = asyncio.Event()
        self._counter = itertools.count(1)
        self.proxy = ServiceProxy()

    async def __aenter__(self) -> "PodRunner":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._tasks = [asyncio.create_task(self._run()), asyncio.create_task(self._watch_pods())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(asyncio.to_thread(self._terminate, c) for c in self.containers.values()))
        for ip in list(self._leases):
            self._release_ip(ip)
        await self.proxy.aclose()
        await self.api.aclose()

    # paths
    def _ns(self, resource: str, name: str = "", group: str = "") -> str:
        base = f"/apis/{group}" if group else "/api/v1"
        return f"{base}/namespaces/{self.namespace}/{resource}" + (f"/{name}" if name else "")

    async def _list(self, resource: str, group: str = "", **params: str) -> list[dict]:
        r = await self.api.get(self._ns(resource, group=group), params=params)
        r.raise_for_status()
        return r.json().get("items", [])

    # the loop
    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._reconcile_deployments()
                pods = await self._reconcile_pods()
                await reconcile_jobs(self.api, self.namespace, pods)
                await self._reconcile_endpoints(pods)
            except (httpx.HTTPError, OSError) as exc:
                log.warning("pod runner: API unreachable (%s); retrying", exc)
            except Exception:
                log.exception("pod runner: reconcile failed; retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll)
            self._wake.clear()

    async def _watch_pods(self) -> None:
        """Cut the loop's wait short when a pod comes or a condition the runner does not own changes.

        A readiness gate set True then turns the pod Ready within one pass, not a poll later. The
        runner's own status writes do not wake it (they change only its own conditions).
        """
        seen: dict[str, list] = {}
        since = ""
        while not self._stopping:
            try:
                params = {"watch": "true", **({"resourceVersion": since} if since else {})}
                async with self.api.stream("GET", self._ns("pods"), params=params, timeout=None) as r:
                    if r.status_code != 200:
                        since = ""
                        r.raise_for_status()
                    async for line in r.aiter_lines():
                        event = json.loads(line) if line.strip() else {}
                        if event.get("type") == "ERROR":
                            since = ""  # too old: start over from now
                            break
                        obj = event.get("object") or {}
                        since = obj.get("metadata", {}).get("resourceVersion", since)
                        name, foreign = obj.get("metadata", {}).get("name"), _foreign_conditions(obj)
                        if event.get("type") == "DELETED":
                            seen.pop(name, None)
                        elif seen.get(name) != foreign:
                            seen[name] = foreign
                            self._wake.set()
            except (httpx.HTTPError, ValueError) as exc:
                log.debug("pod runner: pod watch ended (%s); watching again", exc)
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
            for extra in _deletion_order(owned)[:max(0, len(owned) - want)]:
                await self.api.delete(self._ns("pods", extra["metadata"]["name"]))
            ready = sum(1 for p in owned if pod_ready(p))
            await self.api.patch(self._ns("deployments", name, group="apps/v1") + "/status", headers=_MERGE,
                                 json={"status": {"replicas": len(owned), "updatedReplicas": len(owned),
                                                  "readyReplicas": ready, "availableReplicas": ready,
                                                  "observedGeneration": dep["metadata"].get("generation", 1)}})

    async def _create_pod(self, dep: dict) -> None:
        template = dep["spec"]["template"]
        meta = template.get("metadata", {})
        name = f"{dep['metadata']['name']}-{secrets.token_hex(3)}"
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace,
                             "labels": {**meta.get("labels", {}), MANAGED: dep["metadata"]["name"]},
                             "annotations": dict(meta.get("annotations", {})),
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                                  "name": dep["metadata"]["name"], "uid": dep["metadata"]["uid"],
                                                  "controller": True, "blockOwnerDeletion": True}]},
                "spec": template["spec"]}
        r = await self.api.post(self._ns("pods"), json=body)
        r.raise_for_status()
        log.info("created pod %s", name)

    async def _reconcile_pods(self) -> list[dict]:
        """Start, restart and stop containers to match the pods; write their status. Returns the pods,
        with the status written, so the endpoints follow in the same pass."""
        pods = {p["metadata"]["name"]: p for p in await self._list("pods")}
        for name in list(self.containers):
            pod = pods.get(name)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                c = self.containers.pop(name)
                await asyncio.to_thread(self._terminate, c)
                self._release_ip(c.ip)
                if pod is not None:  # let the deletion finish: drop our finalizer-free pod for good
                    await self.api.delete(self._ns("pods", name), params={"gracePeriodSeconds": "0"})
        for name, pod in pods.items():
            if pod["metadata"].get("deletionTimestamp"):
                continue
            try:
                pods[name] = await self._sync_pod(pod)
            except httpx.HTTPError:
                raise
            except Exception:  # one broken pod must not stall the others
                log.exception("pod %s: sync failed", name)
        return list(pods.values())

    async def _sync_pod(self, pod: dict) -> dict:
        name = pod["metadata"]["name"]
        c = self.containers.get(name)
        if c is None:
            c = self.containers[name] = Container(name, self._take_ip(pod))
        if c.finished is None and (c.process is None or c.process.poll() is not None):
            if c.process is not None:
                code = c.process.returncode  # negative: killed by that signal; kubelet says 128 + signal
                c.last_exit = 128 - code if code < 0 else code
                c.process = None
                if not _restarts(pod, c.last_exit):
                    c.finished = time.time()
                    log.info("pod %s: container exited (%s); restartPolicy keeps it stopped", name, c.last_exit)
                    return await self._sync_status(c, pod)
                c.restarts += 1
                log.warning("pod %s: container exited (%s); restarting", name, c.last_exit)
            await self._start(c, pod)
        return await self._sync_status(c, pod)

    def _take_ip(self, pod: dict) -> str:
        """A free pod IP: the first one that no other dev cluster on this machine holds (a lease,
        see `IpLease`) and on which no other process already listens on a port the pod's
        containers declare. The lease closes the gap between this check and the engine's bind,
        seconds later, in which a second dev cluster starting at the same time would pick it too."""
        ports = [int(p["containerPort"]) for c in (pod.get("spec") or {}).get("containers") or []
                 for p in c.get("ports") or [] if str(p.get("containerPort", "")).isdigit()]
        for i, ip in enumerate(self._free_ips):
            lease = IpLease.take(ip)
            if lease is None:
                continue
            if all(_port_free(ip, port) for port in ports):
                self._leases[ip] = lease
                return self._free_ips.pop(i)
            lease.release()
        return self._free_ips.pop(0)  # all taken: the container will say so in its log

    def _release_ip(self, ip: str) -> None:
        lease = self._leases.pop(ip, None)
        if lease is not None:
            lease.release()
        self._free_ips.insert(0, ip)

    # containers
    async def _resolve_env(self, pod: dict, container: dict, ip: str) -> dict[str, str]:
        """The container's environment as kubelet makes it: the Services' variables, then its `env`."""
        env = service_env(await self._list("services"))
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(str(item["value"]), env)
                continue
            src = item.get("valueFrom", {})
            if "fieldRef" in src:
                env[item["name"]] = _field_ref(pod, src["fieldRef"]["fieldPath"], ip)
            elif "secretKeyRef" in src:
                value = await self._secret_key(src["secretKeyRef"])
                if value is not None:
                    env[item["name"]] = value
            else:
                raise ContainerError("CreateContainerConfigError",
                                     f"env {item['name']}: only value, fieldRef and secretKeyRef are supported")
        return env

    async def _secret_key(self, ref: dict) -> str | None:
        r = await self.api.get(self._ns("secrets", ref["name"]))
        data = (r.json().get("data") or {}) if r.status_code == 200 else {}
        if ref["key"] in data:
            return base64.b64decode(data[ref["key"]]).decode()
        if ref.get("optional"):
            return None
        if r.status_code == 404:
            raise ContainerError("CreateContainerConfigError", f'secret "{ref["name"]}" not found')
        r.raise_for_status()
        raise ContainerError("CreateContainerConfigError",
                             f"couldn't find key {ref['key']} in Secret {self.namespace}/{ref['name']}")

    def _command(self, c: Container, container: dict, env: dict[str, str]) -> list[str]:
        """The local command line of a container (`$(VAR)` expanded, as kubelet does)."""
        argv = [expand(str(a), env) for a in [*container.get("command", []), *container.get("args", [])]]
        program = Path(argv[0]).name if argv else ""
        if program == "graft" and argv[1:2] == ["serve"]:
            return [sys.executable, "-m", "graft.cli", *argv[1:], *_serve_flags(argv, c.ip), *self.engine_args]
        if program == "graft":      # any other command (graft eval, ...) as written
            return [sys.executable, "-m", "graft.cli", *argv[1:]]
        if program in ("python", "python3"):
            return [sys.executable, *argv[1:]]
        raise ContainerError("RunContainerError", f"the dev cluster runs `graft ...` and `python ...` containers "
                                                  f"only, got {argv[:1]}")

    async def _start(self, c: Container, pod: dict) -> None:
        container = pod["spec"]["containers"][0]
        try:
            env = await self._resolve_env(pod, container, c.ip)
            cmd = self._command(c, container, env)
        except ContainerError as e:
            if c.waiting is None or str(c.waiting) != str(e):
                log.warning("pod %s: %s: %s", c.pod, e.reason, e)
            c.waiting = e
            return
        c.waiting = None
        c.ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports") or []
                   if p.get("name") and str(p.get("containerPort", "")).isdigit()}
        c.log_path = self.workdir / f"{c.pod}.log"
        c.env_snapshot = env
        out = open(c.log_path, "ab")
        out.write(f"--- start {_now()} restarts={c.restarts} env GRAFT_PATCHES={env.get('GRAFT_PATCHES', '')}\n".encode())
        out.flush()
        c.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     cwd=container.get("workingDir") or None, start_new_session=True)
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

    async def restart(self, pod: str, timeout: float = 30.0) -> dict:
        """Kill a pod's container and wait until its status shows the new one; return the pod.

        The new container has a new containerID and restartCount + 1, as after a crash in a
        cluster; it need not be ready yet.
        """
        before = self.containers[pod]
        old_id, old_restarts = before.container_id, before.restarts
        self.kill(pod)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = await self.api.get(self._ns("pods", pod))
            if r.status_code == 200:
                cs = (r.json().get("status") or {}).get("containerStatuses") or [{}]
                if cs[0].get("containerID") not in ("", old_id) and cs[0].get("restartCount") == old_restarts + 1:
                    return r.json()
            await asyncio.sleep(0.1)
        raise TimeoutError(f"pod {pod}: no new container after {timeout}s")

    def ready_pods(self) -> list[Container]:
        """The containers that pass their readiness probe (whether their pod's gates are True or not)."""
        return [c for c in self.containers.values() if c.ready]

    async def _probe(self, c: Container, container: dict) -> bool:
        """The readiness probe (httpGet or tcpSocket); without one a running container is ready."""
        probe = container.get("readinessProbe")
        if not probe:
            return True
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = f"http://{get.get('host') or c.ip}:{_port(container, get.get('port', 80))}{get.get('path', '/')}"
            try:
                r = await self.api.get(url, timeout=timeout,
                                       headers={h["name"]: h["value"] for h in get.get("httpHeaders") or []})
                return 200 <= r.status_code < 400
            except httpx.HTTPError:
                return False
        if "tcpSocket" in probe:
            port = _port(container, probe["tcpSocket"].get("port"))
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(c.ip, port), timeout)
            except (OSError, TimeoutError):
                return False
            writer.close()
            return True
        log.warning("pod %s: readiness probe %s is not emulated; the container stays not ready", c.pod, sorted(probe))
        return False

    async def _sync_status(self, c: Container, pod: dict) -> dict:
        """Probe the container and write what changed in the pod's status; return the pod as stored."""
        container = pod["spec"]["containers"][0]
        alive = c.process is not None and c.process.poll() is None
        c.ready = alive and await self._probe(c, container)
        status = self._status(c, pod, alive)
        if _unchanged(pod.get("status") or {}, status):
            return pod
        # A strategic merge patch merges conditions by type: the ones other writers own stay as they are.
        r = await self.api.patch(self._ns("pods", c.pod) + "/status", json={"status": status}, headers=_SMP)
        return r.json() if r.status_code == 200 else pod

    def _status(self, c: Container, pod: dict, alive: bool) -> dict[str, Any]:
        """The status fields kubelet writes for the pod, as they are now."""
        cname = pod["spec"]["containers"][0].get("name", "engine")
        started = datetime.fromtimestamp(c.started, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        if c.finished is not None:
            finished = datetime.fromtimestamp(c.finished, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            state = {"terminated": {"exitCode": c.last_exit, "reason": "Completed" if c.last_exit == 0 else "Error",
                                    "startedAt": started, "finishedAt": finished, "containerID": c.container_id}}
        elif alive:
            state = {"running": {"startedAt": started}}
        elif c.waiting is not None:
            state = {"waiting": {"reason": c.waiting.reason, "message": str(c.waiting)}}
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        cs = {"name": cname, "ready": c.ready, "restartCount": c.restarts, "containerID": c.container_id,
              "image": "graft-engine:dev", "started": alive, "state": state}
        if c.last_exit is not None and c.finished is None:
            cs["lastState"] = {"terminated": {"exitCode": c.last_exit,
                                              "reason": "Completed" if c.last_exit == 0 else "Error"}}
        phase = "Running" if alive else "Pending"
        if c.finished is not None:
            phase = "Succeeded" if c.last_exit == 0 else "Failed"
        return {"phase": phase,
                "podIP": c.ip, "podIPs": [{"ip": c.ip}], "hostIP": "127.0.0.1",
                "conditions": pod_conditions(pod, c.ready, cname),
                "containerStatuses": [cs]}

    # endpoints
    async def _reconcile_endpoints(self, pods: list[dict]) -> None:
        """Keep an EndpointSlice and an Endpoints object per Service with a selector, as their
        controllers do, and each Service's address forwarding to its Ready pods (kube-proxy)."""
        every = await self._list("services")
        await self.proxy.sync(every, pods)
        services = [s for s in every if (s.get("spec") or {}).get("selector")]
        slices = {s["metadata"]["name"]: s for s in await self._list(
            "endpointslices", group="discovery.k8s.io/v1", labelSelector=_selector(SLICE_MANAGER))}
        endpoints = {e["metadata"]["name"]: e for e in await self._list("endpoints")}
        wanted_slices: set[str] = set()
        for svc in services:
            members = [p for p in pods if _matches(svc["spec"]["selector"], p["metadata"].get("labels") or {})
                       and (p.get("status") or {}).get("podIP")]
            want = endpoint_slice(svc, members)
            wanted_slices.add(want["metadata"]["name"])
            await self._put(want, slices.get(want["metadata"]["name"]), "endpointslices", "discovery.k8s.io/v1")
            await self._put(endpoints_object(svc, members), endpoints.get(svc["metadata"]["name"]), "endpoints")
        for name in set(slices) - wanted_slices:
            await self.api.delete(self._ns("endpointslices", name, group="discovery.k8s.io/v1"))
        names = {s["metadata"]["name"] for s in services}
        for name, ep in endpoints.items():
            if name not in names and _labels_match(ep, ENDPOINTS_MANAGER):  # ours, and its Service is gone
                await self.api.delete(self._ns("endpoints", name))

    async def _put(self, want: dict, have: dict | None, resource: str, group: str = "") -> None:
        """Create `want`, or replace `have` with it when they differ."""
        if have is None:
            r = await self.api.post(self._ns(resource, group=group), json=want)
        elif any(have.get(k) != v for k, v in want.items() if k != "metadata") or \
                (have["metadata"].get("labels") or {}) != want["metadata"].get("labels"):
            body = {**want, "metadata": {**want["metadata"], "resourceVersion": have["metadata"]["resourceVersion"]}}
            r = await self.api.put(self._ns(resource, want["metadata"]["name"], group=group), json=body)
        else:
            return
        if r.status_code not in (200, 201, 409):  # 409: written meanwhile; the next pass looks again
            r.raise_for_status()


def _restarts(pod: dict, exit_code: int) -> bool:
    """Whether kubelet starts a pod's exited container again: restartPolicy Always, or OnFailure after a failure."""
    policy = (pod.get("spec") or {}).get("restartPolicy") or "Always"
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def pod_ready(pod: dict) -> bool:
    """Whether a pod takes traffic: its Ready condition is True and it is not terminating."""
    return not pod["metadata"].get("deletionTimestamp") and _is_ready(pod)


def pod_conditions(pod: dict, containers_ready: bool, container: str) -> list[dict[str, Any]]:
    """The conditions kubelet owns, computed as kubelet does (`pkg/kubelet/status/generate.go`).

    Ready is ContainersReady, and then every readiness gate: a gate whose condition is missing
    or not True keeps the pod not Ready, with reason ReadinessGatesNotReady. A condition keeps its
    lastTransitionTime while its status stays the same.
    """
    status = pod.get("status") or {}
    have = {c.get("type"): c for c in status.get("conditions") or []}
    if containers_ready:
        containers = {"status": "True"}
    else:
        containers = {"status": "False", "reason": "ContainersNotReady",
                      "message": f"containers with unready status: [{container}]"}
    ready = dict(containers)
    if containers_ready:
        unready = []
        for gate in (pod.get("spec") or {}).get("readinessGates") or []:
            kind = gate.get("conditionType")
            found = have.get(kind)
            if found is None:
                unready.append(f'corresponding condition of pod readiness gate "{kind}" does not exist.')
            elif found.get("status") != "True":
                unready.append(f'the status of pod readiness gate "{kind}" is not "True", but {found.get("status")}')
        if unready:
            ready = {"status": "False", "reason": "ReadinessGatesNotReady", "message": ", ".join(unready)}
    wanted = {"Initialized": {"status": "True"}, "Ready": ready, "ContainersReady": containers,
              "PodScheduled": {"status": "True"}}
    out = []
    for kind in KUBELET_CONDITIONS:
        old = have.get(kind) or {}
        since = old.get("lastTransitionTime") if old.get("status") == wanted[kind]["status"] else None
        out.append({"type": kind, **wanted[kind], "lastTransitionTime": since or _now()})
    return out


def _foreign_conditions(pod: dict) -> list[tuple[str, str]]:
    """The (type, status) of the conditions other writers own, such as readiness gates."""
    return sorted((c.get("type"), c.get("status")) for c in (pod.get("status") or {}).get("conditions") or []
                  if c.get("type") not in KUBELET_CONDITIONS)


def _unchanged(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether the stored status already says what kubelet would write (its own conditions only)."""
    for key, value in new.items():
        if key == "conditions":
            mine = [c for c in old.get("conditions") or [] if c.get("type") in KUBELET_CONDITIONS]
            if sorted(mine, key=lambda c: c["type"]) != sorted(value, key=lambda c: c["type"]):
                return False
        elif old.get(key) != value:
            return False
    return True


def _deletion_order(pods: list[dict]) -> list[dict]:
    """Which pods a scale-down deletes first: not Ready before Ready, pending before running, newest first."""
    newest_first = sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp", ""), reverse=True)
    return sorted(newest_first, key=lambda p: (pod_ready(p), (p.get("status") or {}).get("phase") == "Running"))


def endpoint_slice(svc: dict, pods: list[dict]) -> dict[str, Any]:
    """The EndpointSlice of a Service: one endpoint per pod, `ready` as kube-proxy reads it."""
    meta = svc["metadata"]
    publish = bool((svc.get("spec") or {}).get("publishNotReadyAddresses"))
    suffix = hashlib.sha1(meta.get("uid", meta["name"]).encode()).hexdigest()[:5]
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{meta['name']}-{suffix}", "namespace": meta.get("namespace"),
                         "labels": {SERVICE_NAME_LABEL: meta["name"], **SLICE_MANAGER},
                         "ownerReferences": [_owner(svc)]},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [p["status"]["podIP"]],
                           "conditions": {"ready": publish or pod_ready(p), "serving": publish or _is_ready(p),
                                          "terminating": bool(p["metadata"].get("deletionTimestamp"))},
                           "targetRef": _pod_ref(p)} for p in pods],
            "ports": _endpoint_ports(svc, pods)}


def endpoints_object(svc: dict, pods: list[dict]) -> dict[str, Any]:
    """The (legacy) Endpoints of a Service: Ready pods in `addresses`, the others in `notReadyAddresses`."""
    meta = svc["metadata"]
    publish = bool((svc.get("spec") or {}).get("publishNotReadyAddresses"))
    ready = [{"ip": p["status"]["podIP"], "targetRef": _pod_ref(p)} for p in pods if publish or pod_ready(p)]
    not_ready = [{"ip": p["status"]["podIP"], "targetRef": _pod_ref(p)} for p in pods
                 if not (publish or pod_ready(p))]
    subset = {k: v for k, v in (("addresses", ready), ("notReadyAddresses", not_ready)) if v}
    return {"apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace"),
                         "labels": {**(meta.get("labels") or {}), **ENDPOINTS_MANAGER}},
            "subsets": [{**subset, "ports": _endpoint_ports(svc, pods)}] if subset else []}


def _endpoint_ports(svc: dict, pods: list[dict]) -> list[dict[str, Any]]:
    container = ((pods[0].get("spec") or {}).get("containers") or [{}])[0] if pods else {}
    ports = []
    for p in (svc.get("spec") or {}).get("ports") or []:
        target = p.get("targetPort", p.get("port"))
        try:
            number = _port(container, target)
        except ValueError:
            continue  # a named port the pods do not declare: no endpoint port
        ports.append({k: v for k, v in (("name", p.get("name")), ("port", number),
                                        ("protocol", p.get("protocol", "TCP"))) if v is not None})
    return ports


def _pod_ref(pod: dict) -> dict[str, str]:
    meta = pod["metadata"]
    return {"kind": "Pod", "name": meta["name"], "namespace": meta.get("namespace", ""), "uid": meta.get("uid", "")}


def _owner(svc: dict) -> dict[str, Any]:
    meta = svc["metadata"]
    return {"apiVersion": "v1", "kind": "Service", "name": meta["name"], "uid": meta.get("uid", ""),
            "controller": True, "blockOwnerDeletion": True}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _labels_match(obj: dict, labels: dict[str, str]) -> bool:
    return _matches(labels, obj["metadata"].get("labels") or {})


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined VAR is replaced, `$$` is a literal `$`, the rest is kept."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(one, text)


def _serve_flags(argv: list[str], ip: str) -> list[str]:
    """Where a pod's `graft serve` listens: its own IP for both ports, as in a cluster.

    The admin API binds 127.0.0.1 by default; the operator reaches it at the pod IP. The dev
    cluster's bundles are unsigned examples, so its engines run them on their digest alone unless
    the pod names a trusted key.
    """
    flags = ["--host", ip, "--admin-host", ip]
    if not any(a == "--trusted-key" or a.startswith("--trusted-key=") for a in argv):
        flags.append("--allow-unsigned-bundles")
    return flags


def _field_ref(pod: dict, path: str, ip: str) -> str:
    """A Downward API field; the pod's IP is known to kubelet before its status says so."""
    meta = pod["metadata"]
    for prefix, key in (("metadata.annotations", "annotations"), ("metadata.labels", "labels")):
        if path.startswith(prefix + "["):
            name = path[len(prefix) + 1:-1].strip("'\"")
            return str(meta.get(key, {}).get(name, ""))
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "status.podIP": ip, "status.hostIP": "127.0.0.1",
              "spec.nodeName": (pod.get("spec") or {}).get("nodeName") or "dev-cluster",
              "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName") or "default"}
    if path not in simple:
        raise ContainerError("CreateContainerConfigError", f"unsupported fieldRef {path}")
    return str(simple[path] or "")


class IpLease:
    """An exclusive claim on one loopback address among the dev clusters of this machine: an
    advisory lock on a file named after it, which the kernel drops when the process ends, so a
    crashed dev cluster leaves nothing to clean up."""

    DIR = Path(tempfile.gettempdir()) / "graft-devcluster-ips"

    def __init__(self, fd: int):
        self._fd = fd

    @classmethod
    def take(cls, ip: str) -> "IpLease | None":
        cls.DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(cls.DIR / ip, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(fd)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)   # closing the descriptor drops the lock
            self._fd = -1


def _port_free(ip: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket's TIME_WAIT is no owner
        try:
            probe.bind((ip, port))
        except OSError:
            return False
    return True


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
