"""A gated dev-cluster fleet for the PatchFleet scenarios (tests/e2e/test_fleet_scenarios.py).

The engine Deployment declares the readiness gate `graft.dev/patched`, as the chart does with
`engine.readinessGate`: a pod is Ready (in the Service's endpoints, picked by the router) only once
the operator's fleet controller has seen its engine run the fleet's revision. The helpers here talk
to the cluster the way a user does: the Kubernetes API, `kubectl` with the kubeconfig the dev
cluster writes, and each engine's admin API.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graft.api import BASE
from graft.devcluster.cluster import APP, ClusterOptions, DevCluster
from graft.operator.pods import PATCHES_ANNOTATION, TRACK_LABEL, is_ready
from graft.rollout.fleet import PATCHED_CONDITION
from tests.devcluster.kubectl_cli import kubectl_binary
from tests.e2e.fleet import GROUP_VERSION, LOCAL_TICK, SCRAPE_INTERVAL, Fleet

PODS = 2
FIRST_POD_IP = 120          # 127.0.0.120 up: clear of another dev cluster on this machine (they start at .2)
FLEET = "llm-engine"        # the name a rollout gives the fleet it creates for app=llm-engine


class GatedFleet(Fleet):
    """A fleet whose pods wait behind the readiness gate graft.dev/patched.

    At base it keeps its PatchFleet, with no patches: a pod added later is let in only by a fleet.
    `start_over` brings back the cluster as it started, before any fleet existed.
    """

    async def settle_fleets(self, timeout: float) -> None:
        """The fleet's PatchFleet with no patches (created if a scenario left none): its controller
        takes every patch out of the engines and keeps the gates open."""
        if await patch_fleet(self) is None:
            await create_patch_fleet(self)
        else:
            await set_fleet_patches(self, [])

    async def at_base(self) -> bool:
        return await converged(self, BASE, self.expected_pods)

    async def start_over(self, timeout: float = 240) -> None:
        """The cluster as it started: no rollout, no PatchFleet, and `expected_pods` engines at
        `base` whose pods passed their probes but were never let in (no gate condition at all).
        A pod a fleet has let in keeps its open gate, so it is replaced by a new one from the
        Deployment; when the scenario runs first, nothing needs replacing and this takes no time."""
        t0 = time.monotonic()
        await self.clear_rollouts()
        await self.scale_back()
        await self.delete_fleets(timeout)
        replaced = []
        for pod in await self.pods():
            if await self._touched(pod):
                name = pod["metadata"]["name"]
                reply = await self.api.delete(f"/api/v1/namespaces/{self.namespace}/pods/{name}")
                reply.raise_for_status()
                replaced.append(name)
        await self.wait_for(self._started, timeout, f"{self.expected_pods} pods as the cluster started them")
        print(f"[start over: {len(replaced)} pods replaced, cluster as it started {time.monotonic() - t0:.1f}s]")

    async def _started(self) -> bool:
        pods = await self.pods()
        return len(pods) == self.expected_pods and all([await self._as_started(p) for p in pods])

    async def _touched(self, pod: dict[str, Any]) -> bool:
        """Whether a fleet or a rollout has had this pod: its gate set, its marks, its engine patched."""
        revision = await self.engine_revision(pod)
        return (condition(pod, PATCHED_CONDITION) is not None or marks(pod) != (None, BASE)
                or revision not in (None, BASE))

    async def _as_started(self, pod: dict[str, Any]) -> bool:
        """Containers ready, held out by the gate alone (never set), unmarked, its engine at base."""
        ready = condition(pod, "Ready") or {}
        return ((condition(pod, "ContainersReady") or {}).get("status") == "True"
                and ready.get("status") == "False" and ready.get("reason") == "ReadinessGatesNotReady"
                and condition(pod, PATCHED_CONDITION) is None and marks(pod) == (None, BASE)
                and await self.engine_revision(pod) == BASE)


@contextlib.asynccontextmanager
async def open_gated_fleet(workdir: Path, pods: int = PODS) -> AsyncIterator[GatedFleet]:
    """A local dev cluster of `pods` engines behind the readiness gate graft.dev/patched.

    No PatchFleet exists yet: the engines start, pass their readiness probe, and stay not Ready.
    """
    opts = ClusterOptions(workdir=workdir, pods=pods, operator_tick=LOCAL_TICK,
                          scrape_interval=f"{SCRAPE_INTERVAL:g}s", readiness_gates=(PATCHED_CONDITION,),
                          first_pod_ip=FIRST_POD_IP)
    async with DevCluster(opts) as cluster:
        assert cluster.api is not None and cluster.prometheus is not None
        await cluster.wait_ready(timeout=300)          # the containers' probes, not the gate
        fleet = GatedFleet(cluster.api, cluster.namespace, cluster.token, cluster.prometheus.url, pods, cluster)
        try:
            yield fleet
        finally:
            await fleet.aclose()


# the PatchFleet
def fleet_path(fleet: Fleet, name: str = "") -> str:
    return f"/apis/{GROUP_VERSION}/namespaces/{fleet.namespace}/patchfleets" + (f"/{name}" if name else "")


def patch_fleet_manifest(name: str, patches: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"apiVersion": GROUP_VERSION, "kind": "PatchFleet", "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": dict(APP)}, "patches": patches or []}}


async def patch_fleet(fleet: Fleet, name: str = FLEET) -> dict[str, Any] | None:
    reply = await fleet.api.get(fleet_path(fleet, name))
    return reply.json() if reply.status_code == 200 else None


async def create_patch_fleet(fleet: Fleet, name: str = FLEET, patches: list[dict[str, Any]] | None = None) -> None:
    reply = await fleet.api.post(fleet_path(fleet), json=patch_fleet_manifest(name, patches))
    assert reply.status_code == 201, reply.text


async def set_fleet_patches(fleet: Fleet, patches: list[dict[str, Any]], name: str = FLEET) -> None:
    reply = await fleet.api.patch(fleet_path(fleet, name), json={"spec": {"patches": patches}},
                                  headers={"content-type": "application/merge-patch+json"})
    reply.raise_for_status()


def fleet_refs(pfl: dict[str, Any]) -> list[str]:
    return [f"{p['name']}@{p['version']}" for p in (pfl.get("spec") or {}).get("patches") or []]


# pods
def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def gate_open(pod: dict[str, Any]) -> bool:
    c = condition(pod, PATCHED_CONDITION)
    return bool(c) and c.get("status") == "True"


def marks(pod: dict[str, Any]) -> tuple[str | None, str | None]:
    """The pod's (track label, patches annotation)."""
    meta = pod["metadata"]
    return (meta.get("labels") or {}).get(TRACK_LABEL), (meta.get("annotations") or {}).get(PATCHES_ANNOTATION)


async def converged(fleet: Fleet, revision: str, pods: int) -> bool:
    """`pods` pods, all Ready, each engine at `revision`, labelled stable and annotated so, its gate
    open; and the PatchFleet says the same."""
    current = await fleet.pods()
    if len(current) != pods or not all(is_ready(p) and gate_open(p) for p in current):
        return False
    for pod in current:
        if marks(pod) != ("stable", revision) or await fleet.engine_revision(pod) != revision:
            return False
    pfl = await patch_fleet(fleet)
    status = (pfl or {}).get("status") or {}
    return (status.get("revision"), status.get("pods"), status.get("converged")) == (revision, pods, pods)


# kubectl, as a user runs it
@dataclass(slots=True)
class Run:
    code: int
    out: str
    err: str


async def kubectl(fleet: Fleet, *args: str, timeout: float = 60) -> Run:
    local = fleet.require_local("kubectl against the dev cluster's kubeconfig")
    proc = await asyncio.create_subprocess_exec(
        kubectl_binary(), "--kubeconfig", str(local.kubeconfig), "-n", fleet.namespace, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        return Run(-1, out.decode(), err.decode() + f"\n(killed after {timeout:g}s)")
    return Run(proc.returncode or 0, out.decode(), err.decode())


# rollouts
def rollout_manifest(fleet: Fleet, name: str, patch: str, *, steps: list[dict[str, Any]] | None = None,
                     config: dict[str, Any] | None = None, action: str | None = None,
                     interval: str = "2s") -> dict[str, Any]:
    """A rollout of `patch` (name@version, built in) over the fleet, in short steps, judged by one
    permissive breaker: the scenarios are about where patches land, not about the analysis."""
    patch_name, _, version = patch.partition("@")
    spec: dict[str, Any] = {
        "selector": {"matchLabels": dict(APP)},
        "patch": {"name": patch_name, "version": version, "source": {"builtin": {}},
                  **({"config": config} if config is not None else {})},
        "steps": steps or [{"weight": 50, "pause": "2s"}, {"weight": 100, "pause": "2s"}],
        "analysis": {"interval": interval, "noData": "pass",
                     "breakers": [{"name": "error-rate", "max": 0.5, "window": "10s"}]},
        "progressDeadline": "5m",
    }
    if action:
        spec["action"] = action
    return {"apiVersion": GROUP_VERSION, "kind": "PatchRollout",
            "metadata": {"name": name, "namespace": fleet.namespace}, "spec": spec}


async def phase_of(fleet: Fleet, name: str) -> str | None:
    ro = await fleet.rollout(name)
    return ((ro or {}).get("status") or {}).get("phase")


async def until_phase(fleet: Fleet, name: str, phases: Collection[str], timeout: float) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        fleet.check_operator()
        ro = await fleet.rollout(name)
        return ro if ((ro or {}).get("status") or {}).get("phase") in phases else None
    return await fleet.wait_for(probe, timeout, f"{name} in {'/'.join(sorted(phases))}", interval=0.25)


def elapsed(since: float) -> str:
    return f"{time.monotonic() - since:.1f}s"


class GateWatch:
    """Samples every engine pod's readiness while a scenario runs: `async with GateWatch(fleet) as w`.

    A gate closed mid-rollout takes the pod out of service, and means the fleet controller and the
    rollout disagreed about what it should run. (Ready alone may blink on a loaded machine: the
    readiness probe has a one-second timeout.)"""

    def __init__(self, fleet: Fleet, every: float = 0.2):
        self.fleet, self.every = fleet, every
        self.samples: list[tuple[float, str, bool, bool, str | None]] = []   # (t, pod, Ready, gate, annotation)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "GateWatch":
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                now = time.time()
                for pod in await self.fleet.pods():
                    self.samples.append((now, pod["metadata"]["name"], is_ready(pod), gate_open(pod), marks(pod)[1]))
            await asyncio.sleep(self.every)

    def closed(self, pods: set[str] | None = None) -> list[tuple[float, str, bool, bool, str | None]]:
        """Samples of a pod (of `pods`, default all) whose gate graft.dev/patched was not open."""
        return [s for s in self.samples if not s[3] and (pods is None or s[1] in pods)]
