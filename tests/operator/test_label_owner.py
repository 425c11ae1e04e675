"""One writer of a pod's labels at a time, through the real operator: kopf, the API server emulator,
fake engines.

While a PatchRollout runs over a PatchFleet's pods, both controllers tick over the same pods. The
rollout writes the label graft.dev/track and the annotation graft.dev/patches of every pod it
records, Ready or not; the fleet controller leaves those pods' labels alone. A canary that stops
being Ready (a failing probe, a restart under way) keeps its canary label: a canary Service that
selects on it sees it leave once, not flap every tick.
"""
from __future__ import annotations

import asyncio
import json

import httpx

from graft.operator.kube import fleet_path, pods_path

from operator_cluster import create, manifest, phase_is, set_pod_status, until

TRACK, PATCHES = "graft.dev/track", "graft.dev/patches"


class LabelHistory:
    """Every value the pods' track label and patches annotation took, as the API server's watch
    tells it: one entry per change, none for a write that changed nothing."""

    def __init__(self, url: str, namespace: str):
        self.url, self.namespace = url, namespace
        self.values: dict[str, list[tuple[str | None, str | None]]] = {}
        self.writes = 0            # pod updates seen (any field)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        async with httpx.AsyncClient(base_url=self.url) as client:
            listed = (await client.get(f"/api/v1/namespaces/{self.namespace}/pods")).json()
        for pod in listed["items"]:
            self._see(pod)
        self._task = asyncio.create_task(self._watch(listed["metadata"]["resourceVersion"]))

    async def _watch(self, since: str) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=None) as client:
            async with client.stream("GET", f"/api/v1/namespaces/{self.namespace}/pods",
                                     params={"watch": "true", "resourceVersion": since}) as reply:
                async for line in reply.aiter_lines():
                    if line.strip():
                        event = json.loads(line)
                        if event.get("type") == "MODIFIED":
                            self.writes += 1
                            self._see(event["object"])

    def _see(self, pod: dict) -> None:
        meta = pod["metadata"]
        value = ((meta.get("labels") or {}).get(TRACK), (meta.get("annotations") or {}).get(PATCHES))
        history = self.values.setdefault(meta["name"], [])
        if not history or history[-1] != value:
            history.append(value)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def _canary(cluster, namespace):
    pods = await cluster.kube.list(pods_path(namespace))
    canaries = [p["metadata"]["name"] for p in pods if (p["metadata"].get("labels") or {}).get(TRACK) == "canary"]
    return canaries[0] if len(canaries) == 1 else None


async def _fleet_names(cluster, namespace, rollout):
    fleet = await cluster.kube.get(fleet_path(namespace, "llm-engine"))
    return fleet if ((fleet or {}).get("status") or {}).get("activeRollout") == rollout else None


async def test_a_canary_that_is_not_ready_keeps_its_label_while_both_controllers_tick(cluster, namespace, fleet,
                                                                                       operator, prometheus):
    engines = await fleet(3)
    await operator()
    # one canary of three, held at its step well past this test
    await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 1, "pause": "10m"}, {"weight": 100}],
                                              progressDeadline="15m"))
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Progressing"), 60, what="Progressing")
    canary = await until(lambda: _canary(cluster, namespace), 60, what="one canary labelled")
    await until(lambda: _fleet_names(cluster, namespace, "kv-align"), 60, what="the fleet to see the rollout active")
    engine = engines[int(canary.rsplit("-", 1)[1])]
    assert engine.applied == {"kv-align": "3.2.1"}

    history = LabelHistory(cluster.url, namespace)
    await history.start()
    try:
        # its readiness probe fails: not Ready, its container still running (the fleet still asks it)
        await set_pod_status(cluster.kube, namespace, canary, engine, ready=False)
        # both controllers tick every 0.25 s, but under load a tick of each takes seconds: before, the
        # fleet relabelled it stable and the rollout canary again within ten
        await asyncio.sleep(10)
    finally:
        await history.stop()

    assert history.writes > 0, "the watch saw the operator at work"
    assert history.values[canary] == [("canary", "kv-align@3.2.1")], \
        f"the not-Ready canary was relabelled: {history.values[canary]}"
    for name, values in history.values.items():
        # a replacement canary among the Ready pods changes once, from stable to canary
        assert len(values) <= 2, f"pod {name} was labelled back and forth: {values}"
    pod = await cluster.kube.get(pods_path(namespace, canary))
    assert pod["metadata"]["labels"][TRACK] == "canary"
