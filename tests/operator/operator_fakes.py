"""Fake engines for the operator tests: the admin API of ARCHITECTURE.md and a /metrics page whose
numbers the test sets, on 127.0.0.x with a port the OS picks.

Traffic is simulated: every scrape adds `rps * elapsed` requests to the engine's current revision,
`error_ratio` of them errors, every one taking `latency` seconds (its first token too, and a tenth
of it per further token). The page has the series the built-in checks ask for (requests by status,
the request, TTFT and inter-token histograms, CPU seconds and quota, the revision info), each with
its `revision` label; Prometheus adds `namespace` and `instance`. The operator's queries are real.

Every fake engine serves from one event loop in a thread of its own, never the test's loop: that
loop also runs the API server emulator, and while the operator keeps it busy (schema and CEL checks
of every write) a scrape queued behind its requests overran Prometheus' timeout, so a new
revision's series stayed empty and a rollout held for want of evidence.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0)


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _engine_loop() -> asyncio.AbstractEventLoop:
    """The fake engines' own event loop, started on first use and kept for the process."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="fake-engines", daemon=True).start()
        return _loop


async def _on_engine_loop(coro):
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, _engine_loop()))


@dataclass
class Health:
    error_ratio: float = 0.0
    latency: float = 0.05


@dataclass
class FakeEngine:
    host: str
    token: str
    available: tuple[str, ...] = ("kv-align@3.2.1",)
    rps: float = 200.0
    health: dict[str, Health] = field(default_factory=dict)    # by revision; default: healthy
    refuse: int | None = None          # answer POST /admin/patches with this status
    rotated_token: str | None = None   # a token rotation under way: `token` is refused ...
    refusals_left: int = 0             # ... this many more times, then `rotated_token` is the token
    refused: int = 0                   # admin calls refused for their token
    tokens: list[str] = field(default_factory=list)   # the bearer token of every admin call, in order
    applied: dict[str, str] = field(default_factory=dict)      # name -> version
    posts: int = 0
    deletes: int = 0
    replaced: int = 0                  # one version swapped for another in one call
    port: int = 0
    generation: int = 0                # bumped by a restart (the container ID follows it)

    def __post_init__(self) -> None:
        self.requests: dict[tuple[str, str], float] = {}
        self.buckets: dict[tuple[str, float], float] = {}   # (revision, le) -> requests at most le
        self.sums: dict[str, float] = {}
        self.cpu = 0.0
        self.bundles: list[dict] = []      # bundle sources received
        self.digests: dict[str, str] = {}  # name -> the digest of the code applied ("builtin" by default)
        self._last = time.monotonic()
        self._runner: web.AppRunner | None = None

    @property
    def revision(self) -> str:
        return ",".join(sorted(f"{n}@{v}" for n, v in self.applied.items())) or "base"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> "FakeEngine":
        return await _on_engine_loop(self._start())

    async def stop(self) -> None:
        await _on_engine_loop(self._stop())

    async def _start(self) -> "FakeEngine":
        app = web.Application()
        app.router.add_get("/admin/patches", self._list)
        app.router.add_post("/admin/patches", self._apply)
        app.router.add_delete("/admin/patches/{name}", self._revert)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def restart(self, keep_patches: bool = False) -> None:
        """A container restart: the process comes back, without its patches unless told otherwise."""
        self.generation += 1
        if not keep_patches:
            self.applied.clear()

    # admin API
    def _authorized(self, request: web.Request) -> web.Response | None:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        self.tokens.append(given)
        if scheme.lower() != "bearer" or not given:
            return _error(401, "missing bearer token")
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            self.refused += 1
            if self.rotated_token is not None:
                self.refusals_left -= 1
                if self.refusals_left <= 0:   # the engine has read its rotated token file
                    self.token, self.rotated_token = self.rotated_token, None
            return _error(403, "wrong token")
        return None

    async def _list(self, request: web.Request) -> web.Response:
        if (denied := self._authorized(request)) is not None:
            return denied
        return web.json_response({"revision": self.revision, "applied": [
            {"name": n, "version": v, "digest": self.digests.get(n, "builtin")} for n, v in sorted(self.applied.items())],
            "available": [{"name": a.split("@")[0], "version": a.split("@")[1]} for a in self.available]})

    async def _apply(self, request: web.Request) -> web.Response:
        if (denied := self._authorized(request)) is not None:
            return denied
        self.posts += 1
        body = await request.json()
        name, version = body.get("name"), body.get("version")
        if self.refuse is not None:
            return _error(self.refuse, f"refused {name}@{version}")
        source = body.get("source") or {}
        if "module" in source:
            self.bundles.append(source)
            digest = "sha256:" + hashlib.sha256(source["module"].encode()).hexdigest()
            if digest != source.get("digest"):
                return _error(403, "the bundle does not match its pinned digest")
        elif f"{name}@{version}" not in self.available:
            return _error(404, f"no built-in patch {name}@{version}")
        if name in self.applied and self.applied[name] != version and not body.get("replace"):
            return _error(409, f"{name}@{self.applied[name]} is applied; replace it with replace: true")
        digest = source.get("digest", "builtin") if "module" in source else "builtin"
        if name in self.applied and self.applied[name] == version and self.digests.get(name, "builtin") != digest \
                and not body.get("replace"):
            return _error(409, f"{name}@{version} is applied from other code; replace it with replace: true")
        self.replaced += name in self.applied and (self.applied[name] != version
                                                   or self.digests.get(name, "builtin") != digest)
        self._advance()
        self.applied[name] = version
        self.digests[name] = digest
        return web.json_response({"revision": self.revision, "applyMs": 0.4, "changed": True})

    async def _revert(self, request: web.Request) -> web.Response:
        if (denied := self._authorized(request)) is not None:
            return denied
        self.deletes += 1
        name = request.match_info["name"]
        if name not in self.applied:
            return _error(404, f"no patch named {name} is applied")
        self._advance()
        del self.applied[name]
        self.digests.pop(name, None)
        return web.json_response({"revision": self.revision, "applyMs": 0.3, "changed": True})

    # metrics
    def _advance(self) -> None:
        now = time.monotonic()
        dt, self._last = now - self._last, now
        n = self.rps * dt
        h = self.health.get(self.revision, Health())
        rev = self.revision
        for status, share in (("ok", 1 - h.error_ratio), ("error", h.error_ratio)):
            self.requests[(rev, status)] = self.requests.get((rev, status), 0.0) + n * share
        for le in BUCKETS:
            if h.latency <= le:
                self.buckets[(rev, le)] = self.buckets.get((rev, le), 0.0) + n
        self.buckets[(rev, float("inf"))] = self.buckets.get((rev, float("inf")), 0.0) + n
        self.sums[rev] = self.sums.get(rev, 0.0) + n * h.latency
        self.cpu += 0.1 * dt

    async def _metrics(self, request: web.Request) -> web.Response:
        self._advance()
        lines = ["# TYPE graft_requests_total counter"]
        lines += [f'graft_requests_total{{revision="{r}",status="{s}"}} {v}' for (r, s), v in self.requests.items()]
        # the request's latency is also its time to first token; a tenth of it between later tokens
        for metric, scale in (("graft_request_duration_seconds", 1.0), ("graft_time_to_first_token_seconds", 1.0),
                              ("graft_inter_token_latency_seconds", 0.1)):
            lines += self._histogram(metric, scale)
        lines += ["# TYPE process_cpu_seconds_total counter", f"process_cpu_seconds_total {self.cpu}",
                  "# TYPE graft_cpu_quota_cores gauge", "graft_cpu_quota_cores 1",
                  "# TYPE graft_engine_revision_info gauge",
                  f'graft_engine_revision_info{{revision="{self.revision}"}} 1']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def _histogram(self, metric: str, scale: float) -> list[str]:
        """`metric` with every observation `scale` times the request latency (its bucket bounds scaled alike)."""
        lines = [f"# TYPE {metric} histogram"]
        for rev in self.sums:
            for le in (*BUCKETS, float("inf")):
                edge = "+Inf" if le == float("inf") else repr(le * scale)
                lines.append(f'{metric}_bucket{{revision="{rev}",le="{edge}"}} {self.buckets.get((rev, le), 0.0)}')
            lines.append(f'{metric}_sum{{revision="{rev}"}} {self.sums[rev] * scale}')
            lines.append(f'{metric}_count{{revision="{rev}"}} {self.buckets.get((rev, float("inf")), 0.0)}')
        return lines


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"code": status, "message": message}}, status=status)
