"""Client traffic for the dev cluster: BBH prompts at a steady rate through a weighted router.

The router honours the rollout's routing the way the cluster's data plane would: with HTTPRoutes
in the namespace it splits by their backendRefs weights (each backend a Service, whose selector
picks the pods); without one, requests spread evenly over the ready pods, so the canary's share
is its share of pods (pod-ratio routing). As with kube-proxy, a pod takes traffic only while its
Ready condition is True (its containers ready and every readiness gate True) and it is not
terminating.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from dataclasses import dataclass, field

import httpx

from graft.devcluster.podrunner import pod_ready

# The BBH tasks of the dev cluster's client traffic (and the demo's): three few-shot prefixes stay
# in each pod's prefix cache, so a request costs its question and answer. The prefixes of all 27
# tasks do not fit in it: every request then prefills up to a thousand tokens, and three engines
# sharing two cores fall behind 2 requests a second until every request outlasts its timeout.
TRAFFIC_TASKS = ("date_understanding", "boolean_expressions", "sports_understanding")

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outcome:
    at: float            # wall-clock start
    pod: str
    status: int          # HTTP status; 0 when the connection failed
    latency: float
    error: str = ""


@dataclass
class TrafficStats:
    outcomes: list[Outcome] = field(default_factory=list)

    def since(self, t: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.at >= t]

    def failed(self, since: float = 0.0, allow: tuple[int, ...] = ()) -> list[Outcome]:
        return [o for o in self.since(since) if o.status != 200 and o.status not in allow]

    def by_pod(self, since: float = 0.0) -> dict[str, int]:
        counts: dict[str, int] = {}
        for o in self.since(since):
            counts[o.pod] = counts.get(o.pod, 0) + 1
        return counts


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


class Router:
    """Picks a pod for each request from the live cluster state (refreshed every `refresh` s)."""

    def __init__(self, api: httpx.AsyncClient, namespace: str, app_selector: dict[str, str], refresh: float = 0.5):
        self.api, self.namespace, self.selector, self.refresh = api, namespace, app_selector, refresh
        self._pods: list[dict] = []
        self._routes: list[dict] = []
        self._services: dict[str, dict] = {}
        self._at = 0.0
        self._rr = itertools.count()

    async def _load(self) -> None:
        if time.monotonic() - self._at < self.refresh:
            return
        ns = self.namespace
        pods = (await self.api.get(f"/api/v1/namespaces/{ns}/pods")).json().get("items", [])
        self._pods = [p for p in pods if _matches(self.selector, p["metadata"].get("labels", {})) and pod_ready(p)]
        r = await self.api.get(f"/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/httproutes")
        self._routes = r.json().get("items", []) if r.status_code == 200 else []
        if self._routes:
            svcs = (await self.api.get(f"/api/v1/namespaces/{ns}/services")).json().get("items", [])
            self._services = {s["metadata"]["name"]: s for s in svcs}
        self._at = time.monotonic()

    async def pick(self) -> dict | None:
        await self._load()
        candidates = self._pods
        for route in self._routes:
            refs = [b for rule in route.get("spec", {}).get("rules", []) for b in rule.get("backendRefs", [])]
            weighted = [(b, int(b.get("weight", 1))) for b in refs if int(b.get("weight", 1)) > 0]
            if not weighted:
                continue
            ref = random.choices([b for b, _ in weighted], weights=[w for _, w in weighted])[0]
            svc = self._services.get(ref["name"])
            if svc is None:
                return None
            sel = svc.get("spec", {}).get("selector", {})
            candidates = [p for p in self._pods if _matches(sel, p["metadata"].get("labels", {}))]
            break
        if not candidates:
            return None
        return candidates[next(self._rr) % len(candidates)]


class Traffic:
    """Send `rate` requests per second until stopped; every outcome is kept in `stats`."""

    def __init__(self, router: Router, prompts: list[str], *, rate: float = 3.0, max_tokens: int = 8,
                 model: str = "SmolLM2-135M-Instruct", port: int = 8000, timeout: float = 120.0):
        # 120 s: the dev cluster's float32 CPU engines, sharing two cores, queue a request for tens of
        # seconds while a busy machine slows them (an apply's self-check takes a canary 10-20 s
        # there); a client that hangs up sooner counts as `abandoned`, which no check counts as a
        # failure, so the gate would see fewer requests
        self.router, self.prompts, self.rate = router, prompts, rate
        self.max_tokens, self.model, self.port, self.timeout = max_tokens, model, port, timeout
        self.stats = TrafficStats()
        self._task: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()
        self._client = httpx.AsyncClient(timeout=timeout)

    async def __aenter__(self) -> "Traffic":
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task:
            self._task.cancel()
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=self.timeout)
        await self._client.aclose()

    async def _run(self) -> None:
        prompts = itertools.cycle(self.prompts)
        next_at = time.monotonic()
        while True:
            next_at += 1.0 / self.rate
            pod = await self.router.pick()
            if pod is not None:
                t = asyncio.create_task(self._one(pod, next(prompts)))
                self._inflight.add(t)
                t.add_done_callback(self._inflight.discard)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def _one(self, pod: dict, prompt: str) -> None:
        ip, name = pod["status"]["podIP"], pod["metadata"]["name"]
        at, t0 = time.time(), time.monotonic()
        try:
            r = await self._client.post(f"http://{ip}:{self.port}/v1/completions", json={
                "model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0})
            self.stats.outcomes.append(Outcome(at, name, r.status_code, time.monotonic() - t0,
                                               "" if r.status_code == 200 else r.text[:200]))
        except httpx.HTTPError as exc:
            self.stats.outcomes.append(Outcome(at, name, 0, time.monotonic() - t0, f"{type(exc).__name__}: {exc}"))
