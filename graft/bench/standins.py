"""Light engine stand-ins for `graft bench operator`: the engine's admin API without a model.

Every stand-in is one pod: it listens on an address of its own (127.x.y.z, all on one port, as pods
of one workload share their admin port), so the operator dials it exactly as it dials a pod IP. All
of them share one event loop in a thread of their own (never the API server's loop, so an admin call
does not queue behind the API server's work). Each answers:

- `GET /admin/patches`: its revision and applied patches (name, version, digest, configDigest);
- `POST /admin/patches`: apply (a built-in patch of `available`; `replace` swaps a version);
- `DELETE /admin/patches/{name}`: revert;

after `latency` seconds, and with `failure_rate` of the calls answered 503 (the operator's client
retries those). Calls are counted by kind, and the moment of every successful apply is kept.

Per-revision request series go to Prometheus through one page per fleet (`/metrics/<fleet>` on a
port of its own): `graft_requests_total{revision,status}` summed over the fleet's stand-ins, each
serving `rps` requests a second, so an analysis of error-rate checks has real counts to judge
without a thousand scrape targets.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

from graft.api import config_digest


@dataclass(slots=True)
class StandIn:
    """One pod's engine: what it runs and what was asked of it."""
    fleet: str
    ip: str
    applied: dict[str, str] = field(default_factory=dict)        # name -> version
    digests: dict[str, str] = field(default_factory=dict)
    configs: dict[str, str] = field(default_factory=dict)
    applied_at: dict[str, float] = field(default_factory=dict)    # name@version -> time.monotonic() of its apply

    @property
    def revision(self) -> str:
        return ",".join(sorted(f"{n}@{v}" for n, v in self.applied.items())) or "base"


class StandIns:
    """`count` stand-ins per fleet on distinct loopback addresses, one shared admin port."""

    def __init__(self, fleets: dict[str, int], *, latency: float = 0.0, failure_rate: float = 0.0,
                 available: tuple[str, ...] = ("kv-align@3.2.1",), rps: float = 50.0, seed: int = 0):
        if not 0.0 <= failure_rate < 1.0:
            raise ValueError(f"failure_rate must be in [0, 1), got {failure_rate}")
        if latency < 0:
            raise ValueError(f"latency must not be negative, got {latency}")
        self.latency, self.failure_rate, self.available, self.rps = latency, failure_rate, available, rps
        self.calls: Counter[str] = Counter()         # get, apply, revert, failed
        self._random = random.Random(seed)
        self.pods: dict[str, StandIn] = {}            # ip -> stand-in
        self.by_fleet: dict[str, list[StandIn]] = {}
        addresses = _addresses()
        for fleet, count in fleets.items():
            group = [StandIn(fleet, next(addresses)) for _ in range(count)]
            self.pods.update((p.ip, p) for p in group)
            self.by_fleet[fleet] = group
        # per fleet: requests served so far by revision, and when they were last brought up to date
        self._served: dict[str, Counter[str]] = {f: Counter() for f in fleets}
        self._since: dict[str, float] = {}
        self.port = 0
        self.metrics_port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None

    # lifecycle
    def start(self) -> "StandIns":
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="engine-stand-ins", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(120)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop = None

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/admin/patches", self._list)
        app.router.add_post("/admin/patches", self._apply)
        app.router.add_delete("/admin/patches/{name}", self._revert)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # the first site takes a free port; every other address binds that same port
        for ip in self.pods:
            site = web.TCPSite(self._runner, ip, self.port, backlog=64)
            await site.start()
            if not self.port:
                self.port = site._server.sockets[0].getsockname()[1]   # noqa: SLF001 (aiohttp keeps it private)
        metrics = web.Application()
        metrics.router.add_get("/metrics/{fleet}", self._metrics)
        self._metrics_runner = web.AppRunner(metrics, access_log=None)
        await self._metrics_runner.setup()
        site = web.TCPSite(self._metrics_runner, "127.0.0.1", 0)
        await site.start()
        self.metrics_port = site._server.sockets[0].getsockname()[1]   # noqa: SLF001
        now = time.monotonic()
        self._since = {f: now for f in self.by_fleet}

    async def _stop(self) -> None:
        for runner in (self._runner, self._metrics_runner):
            if runner is not None:
                await runner.cleanup()

    # what the bench reads
    def snapshot(self) -> Counter[str]:
        return Counter(self.calls)

    def patched(self, fleet: str, ref: str) -> list[float]:
        """When each of the fleet's stand-ins that runs `ref` (name@version) had it applied."""
        return sorted(p.applied_at[ref] for p in self.by_fleet[fleet] if ref in p.applied_at
                      and p.applied.get(ref.partition("@")[0]) == ref.partition("@")[2])

    def apply_behind_the_back(self, ip: str, name: str, version: str) -> None:
        """Change a stand-in's revision without the operator (as a person with the token would)."""
        self._loop.call_soon_threadsafe(self._set, self.pods[ip], name, version, {})

    # admin API
    async def _answer(self, request: web.Request) -> StandIn | web.Response:
        if self.latency:
            await asyncio.sleep(self.latency)
        if self.failure_rate and self._random.random() < self.failure_rate:
            self.calls["failed"] += 1
            return web.json_response({"error": {"code": 503, "message": "stand-in failure"}}, status=503)
        ip = request.transport.get_extra_info("sockname")[0] if request.transport else None
        pod = self.pods.get(ip)
        if pod is None:
            return web.json_response({"error": {"code": 404, "message": f"no stand-in at {ip}"}}, status=404)
        return pod

    @staticmethod
    def _state(pod: StandIn) -> dict:
        return {"revision": pod.revision, "applied": [
            {"name": n, "version": v, "digest": pod.digests.get(n, "builtin"),
             "configDigest": pod.configs.get(n, config_digest(None))} for n, v in sorted(pod.applied.items())]}

    async def _list(self, request: web.Request) -> web.Response:
        pod = await self._answer(request)
        if isinstance(pod, web.Response):
            return pod
        self.calls["get"] += 1
        return web.json_response(self._state(pod))

    async def _apply(self, request: web.Request) -> web.Response:
        body = await request.json()
        pod = await self._answer(request)
        if isinstance(pod, web.Response):
            return pod
        self.calls["apply"] += 1
        name, version = body.get("name"), body.get("version")
        if f"{name}@{version}" not in self.available and "module" not in (body.get("source") or {}):
            return web.json_response({"error": {"code": 404, "message": f"no patch {name}@{version}"}}, status=404)
        if name in pod.applied and pod.applied[name] != version and not body.get("replace"):
            return web.json_response({"error": {"code": 409, "message": f"{name} applied"}}, status=409)
        self._set(pod, name, version, body.get("config"), (body.get("source") or {}).get("digest"))
        return web.json_response({"revision": pod.revision, "applyMs": 0.1, "changed": True})

    async def _revert(self, request: web.Request) -> web.Response:
        pod = await self._answer(request)
        if isinstance(pod, web.Response):
            return pod
        self.calls["revert"] += 1
        name = request.match_info["name"]
        if name not in pod.applied:
            return web.json_response({"error": {"code": 404, "message": f"{name} is not applied"}}, status=404)
        self._advance(pod.fleet)
        del pod.applied[name]
        pod.digests.pop(name, None)
        pod.configs.pop(name, None)
        return web.json_response({"revision": pod.revision, "applyMs": 0.1, "changed": True})

    def _set(self, pod: StandIn, name: str, version: str, config, digest: str | None = None) -> None:
        self._advance(pod.fleet)
        pod.applied[name] = version
        pod.configs[name] = config_digest(config)
        pod.digests[name] = digest or "builtin"
        pod.applied_at[f"{name}@{version}"] = time.monotonic()

    # per-revision series
    def _advance(self, fleet: str) -> None:
        now = time.monotonic()
        dt, self._since[fleet] = now - self._since[fleet], now
        served = self._served[fleet]
        for pod in self.by_fleet[fleet]:
            served[pod.revision] += self.rps * dt

    async def _metrics(self, request: web.Request) -> web.Response:
        fleet = request.match_info["fleet"]
        if fleet not in self._served:
            return web.Response(status=404, text=f"no fleet {fleet}\n")
        self._advance(fleet)
        lines = ["# TYPE graft_requests_total counter"]
        for revision, n in sorted(self._served[fleet].items()):
            lines.append(f'graft_requests_total{{revision="{revision}",status="ok"}} {n}')
            lines.append(f'graft_requests_total{{revision="{revision}",status="error"}} 0')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _addresses():
    """127.100.0.1, 127.100.0.2, ...: loopback addresses, each a pod IP (x.y.z.0 and .255 skipped)."""
    n = 0
    while True:
        n += 1
        if 0 < n % 256 < 255:
            yield f"127.{100 + n // 65536}.{(n // 256) % 256}.{n % 256}"
