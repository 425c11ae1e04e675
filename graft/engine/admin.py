"""The admin API (its own port): list, apply and revert hot patches. Bearer token required.

`GET /admin/patches`, `POST /admin/patches`, `DELETE /admin/patches/{name}`; answers 400 for a
malformed body, 401 without a token, 403 for a wrong token or a bundle the engine may not run
(wrong digest, missing or untrusted signature, or no trusted key configured), 404 for an unknown
patch, 409 for a conflicting one, 422 when a patch fails its self-check (already reverted) or a
bundle fails to load: it raises, exits, or overruns `--bundle-timeout`. Every error is JSON:
`{"error": {"code", "message"}}`.

`"replace": true` in a POST body swaps the applied version of that patch for the requested one in
a single step-loop swap (one self-check; on failure the applied version stays). Without it another
applied version answers 409, so a client that did not ask for a swap never gets one.

It binds 127.0.0.1 unless `--admin-host` says otherwise, and speaks TLS when given a certificate.
A token read from a file (a mounted Secret) is read again whenever the file changes, so a rotated
Secret takes effect without a restart.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from graft.api import NAME_RE, VERSION_RE
from graft.engine.patches.base import PatchError
from graft.engine.patches.manager import PatchManager

log = logging.getLogger(__name__)


class AdminToken:
    """The bearer token the admin API expects: fixed, or read from a file and re-read on change.

    A file is stat'ed on each call (microseconds): its mtime, inode and size tell when a Secret
    volume swapped in a new version. A file that is briefly missing or empty, as during that swap,
    leaves the previous token in force.
    """

    def __init__(self, value: str | None = None, path: str | None = None):
        self.path = path
        self._token = value.encode() if value else None
        self._stamp: tuple[int, int, int] | None = None
        if path is not None:
            self.current()
            if self._token is None:
                raise ValueError(f"admin token file {path} is missing or empty")

    @classmethod
    def from_env(cls, path: str | None = None) -> "AdminToken | None":
        """From `path` (or GRAFT_ADMIN_TOKEN_FILE), else GRAFT_ADMIN_TOKEN; None when neither is set."""
        path = path or os.environ.get("GRAFT_ADMIN_TOKEN_FILE") or None
        if path:
            return cls(path=path)
        value = os.environ.get("GRAFT_ADMIN_TOKEN") or None
        return cls(value) if value else None

    def current(self) -> bytes | None:
        if self.path is None:
            return self._token
        try:
            st = os.stat(self.path)   # follows the ..data symlink of a Secret volume
            stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
            if stamp != self._stamp:
                token = Path(self.path).read_text(encoding="utf-8").strip()
                if token:
                    if self._stamp is not None:
                        log.info("admin token file %s changed; using the new token", self.path)
                    self._token, self._stamp = token.encode(), stamp
        except OSError as exc:
            log.warning("admin token file %s unreadable (%s); keeping the current token", self.path, exc)
        return self._token


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": status, "message": message}}, status_code=status, headers=headers)


def _check_name(name: object, field: str = "name") -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise PatchError(400, f"{field}: required, a DNS label (a-z, 0-9, '-')")
    return name


def build_admin_app(manager: PatchManager, token: AdminToken | None) -> FastAPI:
    """`token=None` only with --admin-insecure."""
    app = FastAPI(title="graft admin", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if token is not None:
            header = request.headers.get("authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not given:
                return _error(401, "missing bearer token", {"WWW-Authenticate": "Bearer"})
            expected = token.current()
            if expected is None or not hmac.compare_digest(given.strip().encode(), expected):
                return _error(403, "wrong token")
        return await call_next(request)

    @app.exception_handler(PatchError)
    async def _patch_error(_: Request, exc: PatchError) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:  # uvicorn logs the traceback
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

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
        replace = body.get("replace", False)
        _check_name(name)
        if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
            raise PatchError(400, "version: required, a version string")
        if not isinstance(source, dict) or len(source.keys() & {"builtin", "module"}) != 1:
            raise PatchError(400, "source: exactly one of {\"builtin\": true} or "
                                  "{\"module\": ..., \"digest\": \"sha256:...\", \"signature\": ...}")
        if not isinstance(config, dict):
            raise PatchError(400, "config: must be an object")
        if not isinstance(replace, bool):
            raise PatchError(400, "replace: must be true or false")
        result = await manager.apply(name, version, source, config, replace=replace)
        return JSONResponse(result)

    @app.delete("/admin/patches/{name}")
    async def revert(name: str) -> JSONResponse:
        return JSONResponse(await manager.revert(_check_name(name)))

    @app.get("/admin/health")
    async def admin_health() -> dict:
        return {"status": "ok", "revision": manager.revision}

    return app
