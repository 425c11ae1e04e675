"""The admin API (its own port): list, apply and revert hot patches. Bearer token required.

`GET /admin/patches`, `POST /admin/patches`, `DELETE /admin/patches/{name}`; answers 400 for a
malformed body, 401 without a token, 403 for a wrong token or an untrusted bundle, 404 for an
unknown patch, 409 for a conflicting one, 422 when a patch fails its self-check (already reverted).
"""
from __future__ import annotations

import hmac
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from graft.engine.patches.base import NAME_RE, VERSION_RE, PatchError
from graft.engine.patches.manager import PatchManager


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": status, "message": message}}, status_code=status, headers=headers)


def build_admin_app(manager: PatchManager, token: str | None) -> FastAPI:
    """`token=None` only with --admin-insecure."""
    app = FastAPI(title="graft admin", docs_url=None, redoc_url=None, openapi_url=None)
    expected = token.encode() if token else None

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if expected is not None:
            header = request.headers.get("authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not given:
                return _error(401, "missing bearer token", {"WWW-Authenticate": "Bearer"})
            if not hmac.compare_digest(given.strip().encode(), expected):
                return _error(403, "wrong token")
        return await call_next(request)

    @app.exception_handler(PatchError)
    async def _patch_error(_: Request, exc: PatchError) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.get("/admin/patches")
    async def list_patches() -> dict:
        return manager.describe()

    @app.post("/admin/patches")
    async def apply(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PatchError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise PatchError(400, "the body must be a JSON object")
        name, version, source = body.get("name"), body.get("version"), body.get("source")
        config = body.get("config") or {}
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise PatchError(400, "name: required, a DNS label (a-z, 0-9, '-')")
        if not isinstance(version, str) or not VERSION_RE.match(version):
            raise PatchError(400, "version: required, a version string")
        if not isinstance(source, dict) or len(source.keys() & {"builtin", "module"}) != 1:
            raise PatchError(400, "source: exactly one of {\"builtin\": true} or "
                                  "{\"module\": ..., \"digest\": \"sha256:...\"}")
        if not isinstance(config, dict):
            raise PatchError(400, "config: must be an object")
        result = await manager.apply(name, version, source, config)
        return JSONResponse(result)

    @app.delete("/admin/patches/{name}")
    async def revert(name: str) -> JSONResponse:
        if not NAME_RE.match(name):
            raise PatchError(400, "name: a DNS label (a-z, 0-9, '-')")
        return JSONResponse(await manager.revert(name))

    @app.get("/admin/health")
    async def admin_health() -> dict:
        return {"status": "ok", "revision": manager.revision}

    return app
