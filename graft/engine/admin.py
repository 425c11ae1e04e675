"""The admin API (its own port): list, apply and revert hot patches. Bearer token required.

`GET /admin/patches`, `POST /admin/patches`, `DELETE /admin/patches/{name}`; answers 400 for a
malformed body (not strict JSON, nested deeper than 64 levels, a number beyond Python's integer
limit, a string holding a lone surrogate, `builtin` other than `true`), 413 for a body over 4 MiB,
401 without a token, 403 for a wrong token or a bundle the engine may not run (wrong digest,
missing, untrusted or expired signature, one made for another config, a revoked version or
digest, or no trusted key configured), 404 for an unknown
patch, 409 for a conflicting one, 422 when a patch fails its self-check (already reverted) or a
bundle fails to load: it raises, exits, or overruns `--bundle-timeout`. Every error is JSON:
`{"error": {"code", "message"}}`. The bodies are graft.adminapi.models' (shared with the client):
a body breaking a field's rule is refused naming the field and the rule.

`"replace": true` in a POST body swaps the applied version of that patch for the requested one in
a single step-loop swap (one self-check; on failure the applied version stays). Without it another
applied version answers 409, so a client that did not ask for a swap never gets one.

It binds 127.0.0.1 unless `--admin-host` says otherwise, and speaks TLS when given a certificate.
A token read from a file (a mounted Secret) is read again whenever the file changes, so a rotated
Secret takes effect without a restart; the previous token stays accepted for
`--admin-token-overlap` seconds (default 300) after the change, while the new Secret reaches the
other pods and the operator.
"""
from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from graft.adminapi.models import (ApplyAnswer, ApplyRequest, PatchesAnswer, RevertAnswer, error_body,
                                   request_error)
from graft.api import NAME_RE
from graft.engine.patches.base import PatchError
from graft.engine.patches.manager import PatchManager

log = logging.getLogger(__name__)


class AdminToken:
    """The bearer token the admin API expects: fixed, or read from a file and re-read on change.

    A file is stat'ed on each call (microseconds): its mtime, inode and size tell when a Secret
    volume swapped in a new version. A file that is briefly missing or empty, as during that swap,
    leaves the previous token in force. After a change the previous token is still accepted for
    `overlap` seconds (`--admin-token-overlap`, default 300): the kubelet brings a rotated Secret
    to each pod within a minute or two, and the operator may hold either token meanwhile.
    """

    def __init__(self, value: str | None = None, path: str | None = None, *, overlap: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.path = path
        self.overlap = overlap
        self._clock = clock
        self._token = value.encode() if value else None
        self._previous: bytes | None = None
        self._previous_until = 0.0
        self._stamp: tuple[int, int, int] | None = None
        if path is not None:
            self.current()
            if self._token is None:
                raise ValueError(f"admin token file {path} is missing or empty")

    @classmethod
    def from_env(cls, path: str | None = None, *, overlap: float = 300.0) -> "AdminToken | None":
        """From `path` (or GRAFT_ADMIN_TOKEN_FILE), else GRAFT_ADMIN_TOKEN; None when neither is set."""
        path = path or os.environ.get("GRAFT_ADMIN_TOKEN_FILE") or None
        if path:
            return cls(path=path, overlap=overlap)
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
                    if self._stamp is not None and token.encode() != self._token:
                        log.info("admin token file %s changed; using the new token (the previous one is "
                                 "accepted for %gs more)", self.path, self.overlap)
                        self._previous, self._previous_until = self._token, self._clock() + self.overlap
                    self._token, self._stamp = token.encode(), stamp
        except OSError as exc:
            log.warning("admin token file %s unreadable (%s); keeping the current token", self.path, exc)
        return self._token

    def accepts(self, given: bytes) -> bool:
        """Whether `given` is the current token, or the previous one within its overlap window."""
        expected = self.current()
        ok = expected is not None and hmac.compare_digest(given, expected)
        if self._previous is not None:
            if self._clock() < self._previous_until:
                ok = hmac.compare_digest(given, self._previous) or ok
            else:
                self._previous = None
        return ok


MAX_BODY_BYTES = 4 << 20   # a bundle's source (a ConfigMap holds at most 1 MiB) and its config, with room
MAX_DEPTH = 64             # levels of nested arrays and objects in a body


async def _read_body(request: Request) -> bytes:
    """The request body; PatchError(413) past MAX_BODY_BYTES, read no further than that."""
    too_big = PatchError(413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB")
    with contextlib.suppress(ValueError):
        if int(request.headers.get("content-length", "0")) > MAX_BODY_BYTES:
            raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_big
    return bytes(body)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is beyond the range of a number")
    return value


def parse_body(raw: bytes) -> object:
    """A JSON body, strictly: PatchError(400) for invalid JSON (NaN and Infinity included), numbers
    beyond Python's integer limit, nesting deeper than MAX_DEPTH, and strings that are not Unicode
    (a lone surrogate such as "\\ud800")."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except UnicodeDecodeError as exc:
        raise PatchError(400, f"the body is not valid JSON: not UTF-8 ({exc})") from None
    except RecursionError:
        raise PatchError(400, f"the body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except json.JSONDecodeError as exc:
        raise PatchError(400, f"the body is not valid JSON: {exc}") from None
    except ValueError as exc:   # an integer of too many digits, NaN, a float beyond its range
        if "integer string conversion" in str(exc):
            exc = f"a number has more than {sys.get_int_max_str_digits()} digits"
        raise PatchError(400, f"the body is not valid JSON: {exc}") from None
    stack: list[tuple[object, int, str]] = [(body, 1, "body")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise PatchError(400, f"the body is nested too deeply (at most {MAX_DEPTH} levels)")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, f"{where}: a key")
                stack.append((item, depth + 1, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"))
        elif isinstance(value, str):
            _check_text(value, where)
    return body


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PatchError(400, f"{where[:80]}: holds a lone surrogate ({text[exc.start]!r} at {exc.start}), "
                              "which is not Unicode text") from None


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def _answer(model: type[BaseModel], answer: dict) -> dict:
    """An answer as the shared model declares it (what clients parse), its fields as the manager
    set them: a manager answer that breaks the model is a 500 here, not a puzzle in a client."""
    return model.model_validate(answer).model_dump(by_alias=True, exclude_unset=True)


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
            if not token.accepts(given.strip().encode()):
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
        return _answer(PatchesAnswer, manager.describe())

    @app.post("/admin/patches")
    async def apply(request: Request) -> JSONResponse:
        body = parse_body(await _read_body(request))
        if not isinstance(body, dict):
            raise PatchError(400, "the body must be a JSON object")
        try:
            req = ApplyRequest.model_validate(body)
        except ValidationError as exc:
            raise PatchError(400, request_error(exc)) from None
        result = await manager.apply(req.name, req.version, req.source, req.settings, replace=req.replace)
        return JSONResponse(_answer(ApplyAnswer, result))

    @app.delete("/admin/patches/{name}")
    async def revert(name: str) -> JSONResponse:
        return JSONResponse(_answer(RevertAnswer, await manager.revert(_check_name(name))))

    @app.get("/admin/health")
    async def admin_health() -> dict:
        return {"status": "ok", "revision": manager.revision}

    return app
