"""HTTP receivers on 127.0.0.1 for notifications and webhooks: each path records what it got.

/ok (or any other name) records and answers 200; /flaky fails twice, then records; /down always
answers 500; /refuse answers 403 with a reason; /hang never answers. `script[name]` can hold a list
of statuses a path answers in turn (the last one repeats).
"""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web


class Receivers:
    def __init__(self):
        self.got: dict[str, list[dict]] = {}
        self.tries: dict[str, int] = {}
        self.script: dict[str, list[int]] = {}
        self.order: list[str] = []
        self.base = ""

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path.strip("/")
        self.tries[path] = self.tries.get(path, 0) + 1
        body = await request.json()
        if path == "hang":
            await asyncio.sleep(3600)
        if path == "down" or (path == "flaky" and self.tries[path] <= 2):
            return web.Response(status=500)
        if path == "refuse":
            return web.Response(status=403, text="change freeze until Monday")
        if path in self.script:
            statuses = self.script[path]
            status = statuses[min(self.tries[path], len(statuses)) - 1]
            self.got.setdefault(path, []).append(body)
            self.order.append(path)
            return web.json_response({"status": status}, status=status)
        self.got.setdefault(path, []).append(body)
        self.order.append(path)
        return web.json_response({"ok": True})


@pytest.fixture
async def receivers():
    r = Receivers()
    app = web.Application()
    app.router.add_post("/{name}", r.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, shutdown_timeout=0.2)   # /hang's handlers are cut, not awaited
    await site.start()
    r.base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    yield r
    await runner.cleanup()
