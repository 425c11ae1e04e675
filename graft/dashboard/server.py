"""`graft dashboard`: the rollouts and fleets of a namespace, live, in the browser.

A Starlette application served on 127.0.0.1 (by default) with the user's own credentials:

    GET  /                              the page (static/index.html)
    GET  /static/...                    its script, styles and the charting library (uPlot), all local
    GET  /api/state                     every rollout's and fleet's view (graft.dashboard.views), as JSON
    GET  /api/stream                    the same, then every change, as server-sent events (the bridge)
    POST /api/rollouts/NAME/VERB        VERB: promote (body {"full": true} for --full), pause, resume,
                                        abort, retry, undo: what `graft rollout VERB NAME` does

The actions act with the user's credentials, so anyone who can reach the port acts as the user:
the server listens on loopback unless told otherwise, answers only requests whose Host is its own
address (a page elsewhere cannot reach it through DNS rebinding), and takes an action only with the
token the page was served with (in a header, which another site's form cannot send).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from graft.dashboard.bridge import Bridge
from graft.dashboard.cluster import Cluster
from graft.dashboard.views import ACTIONS

STATIC = Path(__file__).parent / "static"
TOKEN_HEADER = "X-Graft-Token"
HEARTBEAT = 15.0            # seconds between SSE comments, so proxies and browsers keep the stream


def create_app(cluster: Cluster, *, hosts: Sequence[str] = ("127.0.0.1", "localhost", "[::1]", "::1"),
               token: str | None = None, watch_seconds: int = 300) -> Starlette:
    """The dashboard for `cluster`'s namespace; `hosts`: the Host names it answers to."""
    token = token or secrets.token_urlsafe(24)
    bridge = Bridge(cluster, watch_seconds)
    page = (STATIC / "index.html").read_text()

    async def index(request: Request) -> Response:
        html = page.replace("{{TOKEN}}", token).replace("{{NAMESPACE}}", _escape(cluster.namespace))
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    async def state(request: Request) -> Response:
        return JSONResponse(bridge.snapshot())

    async def stream(request: Request) -> Response:
        queue = bridge.subscribe()

        async def messages() -> AsyncIterator[str]:
            try:
                yield "retry: 1000\n\n"
                while True:
                    try:
                        kind, data = await asyncio.wait_for(queue.get(), HEARTBEAT)
                    except asyncio.TimeoutError:
                        yield ": still here\n\n"
                        continue
                    yield f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
                    if kind == "reset":           # dropped for lagging: the browser reconnects
                        return
            finally:
                bridge.unsubscribe(queue)

        return StreamingResponse(messages(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def act(request: Request) -> Response:
        if not secrets.compare_digest(request.headers.get(TOKEN_HEADER, ""), token):
            return JSONResponse({"ok": False, "message": f"missing or wrong {TOKEN_HEADER}"}, status_code=403)
        verb, name = request.path_params["verb"], request.path_params["name"]
        if verb not in ACTIONS:
            return JSONResponse({"ok": False, "message": f"unknown action {verb!r} (one of {', '.join(ACTIONS)})"},
                                status_code=404)
        try:
            body = await request.json() if await request.body() else {}
        except ValueError:
            return JSONResponse({"ok": False, "message": "the body is not JSON"}, status_code=400)
        full = bool(body.get("full")) if isinstance(body, dict) else False
        ok, message = await cluster.act(verb, name, full=full)
        return JSONResponse({"ok": ok, "message": message}, status_code=200 if ok else 409)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        bridge.start()
        try:
            yield
        finally:
            await bridge.stop()
            await cluster.aclose()

    app = Starlette(routes=[Route("/", index), Route("/api/state", state), Route("/api/stream", stream),
                            Route("/api/rollouts/{name}/{verb}", act, methods=["POST"]),
                            Mount("/static", StaticFiles(directory=STATIC), name="static")],
                    middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=list(hosts))], lifespan=lifespan)
    app.state.bridge = bridge
    return app


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
