"""The engines' admin API client (docs/architecture.md, "Admin API"): one httpx client for every pod,
used by the operator, the benches and the demo.

Calls are bounded (at most `concurrency` in flight), timed out, and retried with exponential
backoff while they do not reach the engine (connection errors, timeouts, 5xx); the engine's own
refusals come back at once as `AdminError` with the kind the rollout acts on.

Given a CA bundle (`ca_file`) the client speaks https and verifies each engine's certificate
against it, for the name `tls_server_name` when given: the operator dials pod IPs, while a
certificate usually names the Service the pods sit behind.

`on_call`, when given, is called with an `AdminCall` after every call the engine answered (the
method, the path, the whole answer and the round trip): what a benchmark times, what a log shows.
"""
from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx

from graft.adminapi.models import ApplyAnswer, ApplyRequest, PatchesAnswer
from graft.api import parse_revision
from graft.rollout.observation import BAD_ANSWER, UNREACHABLE, VERIFY_FAILED

_KINDS = {400: "malformed", 401: "unauthorized", 403: "unauthorized", 404: "unknown-patch",
          409: "conflict", 422: VERIFY_FAILED}


class AdminError(Exception):
    """An admin API call that failed; `kind` is one of graft.rollout.observation's error kinds."""

    def __init__(self, kind: str, message: str, status: int | None = None):
        super().__init__(message)
        self.kind, self.message, self.status = kind, message, status


class EngineAnswer(NamedTuple):
    """What `GET /admin/patches` says that the operator acts on."""
    revision: str
    awaiting: tuple[str, ...] = ()
    configs: dict[str, str] = {}          # patch name -> config digest (an engine that says none: {})
    digests: dict[str, str] = {}          # patch name -> code digest ("builtin" for a built-in)


@dataclass(frozen=True, slots=True)
class AdminCall:
    """One call the engine answered: what `on_call` is given."""

    method: str
    path: str
    host: str
    port: int
    status: int
    answer: Any                 # the JSON the engine answered (None for a refusal that was not JSON)
    round_trip_ms: float        # from sending the request to having read the answer, retries excluded


class AdminClient:
    """Calls to engines' admin APIs, each engine named by host and port (see the module docstring)."""

    def __init__(self, token: str | None = None, *, scheme: str = "http", timeout: float = 60.0,
                 concurrency: int = 16, retries: int = 2, backoff: float = 0.2,
                 ca_file: str | None = None, tls_server_name: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 on_call: Callable[[AdminCall], None] | None = None):
        self.token = token
        self.on_call = on_call
        self.scheme = "https" if ca_file else scheme
        self.retries, self.backoff = retries, backoff
        self._limit = asyncio.Semaphore(concurrency)
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._extensions = {"sni_hostname": tls_server_name} if tls_server_name and self.scheme == "https" else {}
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport, verify=verify)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> "AdminClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def patches(self, host: str, port: int) -> PatchesAnswer:
        """The engine's whole `GET /admin/patches` answer (revision, applied, available, shadow, ...)."""
        answer = await self._call("GET", host, port, "/admin/patches")
        _revision(answer, "GET /admin/patches")
        return PatchesAnswer.model_validate(answer)

    async def apply_patch(self, host: str, port: int, request: ApplyRequest) -> ApplyAnswer:
        """Apply a patch (POST /admin/patches) and answer the engine's whole answer (timings included)."""
        answer = await self._call("POST", host, port, "/admin/patches", json=request.body())
        _revision(answer, "POST /admin/patches")
        return ApplyAnswer.model_validate(answer)

    async def revert_patch(self, host: str, port: int, name: str) -> ApplyAnswer:
        """Revert a patch (DELETE /admin/patches/{name}) and answer the engine's whole answer; a patch
        that is not applied is AdminError "unknown-patch" (404)."""
        answer = await self._call("DELETE", host, port, f"/admin/patches/{name}")
        _revision(answer, f"DELETE /admin/patches/{name}")
        return ApplyAnswer.model_validate(answer)

    async def revision(self, host: str, port: int) -> str:
        """The engine's current revision (GET /admin/patches)."""
        return _revision(await self._call("GET", host, port, "/admin/patches"), "GET /admin/patches")

    async def state(self, host: str, port: int) -> EngineAnswer:
        """The engine's revision, its `awaiting` start-up entries (bundles named by GRAFT_PATCHES
        that only the operator can apply again; the engine is not ready until it has, or has
        reverted them) and each applied patch's config digest: GET /admin/patches, checked at the edge."""
        answer = await self._call("GET", host, port, "/admin/patches")
        revision = _revision(answer, "GET /admin/patches")
        configs, digests = {}, {}
        applied = answer.get("applied")
        for entry in applied if isinstance(applied, list) else []:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                continue
            if isinstance(entry.get("configDigest"), str):
                configs[entry["name"]] = entry["configDigest"]
            if isinstance(entry.get("digest"), str):
                digests[entry["name"]] = entry["digest"]
        awaiting = answer.get("awaiting") or []
        if not isinstance(awaiting, list) or not all(isinstance(r, str) for r in awaiting):
            raise AdminError(BAD_ANSWER, f"GET /admin/patches: the engine answered awaiting {awaiting!r:.120}, "
                                         "not a list of name@version")
        try:
            for ref in awaiting:
                parse_revision(ref)
        except ValueError as e:
            raise AdminError(BAD_ANSWER, f"GET /admin/patches: the engine answered awaiting {awaiting!r:.120}: {e}") \
                from None
        return EngineAnswer(revision, tuple(awaiting), configs, digests)

    async def apply(self, host: str, port: int, name: str, version: str, source: dict[str, Any],
                    config: dict[str, Any] | None = None, replace: bool = False) -> str:
        """Apply a patch (POST /admin/patches); returns the new revision.

        With `replace` the engine swaps out the applied version of `name` in the same step (no
        window without either); without it, another applied version is a "conflict".
        """
        body: dict[str, Any] = {"name": name, "version": version, "source": source}
        if config:
            body["config"] = config
        if replace:
            body["replace"] = True
        return _revision(await self._call("POST", host, port, "/admin/patches", json=body), "POST /admin/patches")

    async def revert(self, host: str, port: int, name: str) -> str:
        """Revert a patch (DELETE /admin/patches/{name}); one that is not applied counts as reverted."""
        try:
            return _revision(await self._call("DELETE", host, port, f"/admin/patches/{name}"),
                             f"DELETE /admin/patches/{name}")
        except AdminError as e:
            if e.status == 404:
                return await self.revision(host, port)
            raise

    async def _call(self, method: str, host: str, port: int, path: str, **kwargs: Any) -> dict[str, Any]:
        url = f"{self.scheme}://{_host(host)}:{port}{path}"
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                async with self._limit:
                    started = time.perf_counter()
                    reply = await self._client.request(method, url, headers=headers, extensions=self._extensions,
                                                       **kwargs)
                    took = (time.perf_counter() - started) * 1000
            except httpx.TransportError as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            if reply.status_code >= 500:
                why = f"{reply.status_code} {_message(reply)}"
                continue
            try:
                answer = reply.json()
            except ValueError:
                answer = None
            if self.on_call is not None:
                self.on_call(AdminCall(method, path, host, port, reply.status_code, answer, took))
            if reply.status_code >= 400:
                kind = _KINDS.get(reply.status_code, "malformed")
                raise AdminError(kind, f"{method} {path}: {reply.status_code} {_message(reply)}", reply.status_code)
            if answer is None and reply.content.strip() != b"null":
                raise AdminError("malformed", f"{method} {path}: the answer is not JSON")
            return answer
        raise AdminError(UNREACHABLE, f"admin API at {_host(host)}:{port} unreachable: {why}")


def _revision(answer: Any, call: str) -> str:
    """The `revision` of an engine's answer, checked at the edge: an answer of another shape (not an
    object, no revision, not a string, not a list of valid `name@version`) is an AdminError
    (BAD_ANSWER, tried again next tick) naming what came back, never a KeyError in a reconciliation."""
    revision = answer.get("revision") if isinstance(answer, dict) else None
    if not isinstance(revision, str):
        got = f"an object without a string revision ({revision!r:.80})" if isinstance(answer, dict) \
            else f"a JSON {type(answer).__name__}"
        raise AdminError(BAD_ANSWER, f"{call}: the engine answered {got}, not its revision")
    try:
        parse_revision(revision)
    except ValueError as e:
        raise AdminError(BAD_ANSWER, f"{call}: the engine answered the revision {revision!r:.120}: {e}") from None
    return revision


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _message(reply: httpx.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(body.get("detail") or body.get("message") or body)[:200] if isinstance(body, dict) else str(body)
