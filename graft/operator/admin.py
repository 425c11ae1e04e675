"""The engines' admin API client (docs/architecture.md, "Admin API"): one httpx client for every pod.

Calls are bounded (at most `concurrency` in flight), timed out, and retried with exponential
backoff while they do not reach the engine (connection errors, timeouts, 5xx); the engine's own
refusals come back at once as `AdminError` with the kind the rollout acts on.

Given a CA bundle (`ca_file`) the client speaks https and verifies each engine's certificate
against it, for the name `tls_server_name` when given: the operator dials pod IPs, while a
certificate usually names the Service the pods sit behind.
"""
from __future__ import annotations

import asyncio
import ssl
from typing import Any, NamedTuple

import httpx

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


class AdminClient:
    def __init__(self, token: str | None = None, *, scheme: str = "http", timeout: float = 60.0,
                 concurrency: int = 16, retries: int = 2, backoff: float = 0.2,
                 ca_file: str | None = None, tls_server_name: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.token = token
        self.scheme = "https" if ca_file else scheme
        self.retries, self.backoff = retries, backoff
        self._limit = asyncio.Semaphore(concurrency)
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._extensions = {"sni_hostname": tls_server_name} if tls_server_name and self.scheme == "https" else {}
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport, verify=verify)

    async def aclose(self) -> None:
        await self._client.aclose()

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
                    reply = await self._client.request(method, url, headers=headers, extensions=self._extensions,
                                                       **kwargs)
            except httpx.TransportError as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            if reply.status_code >= 500:
                why = f"{reply.status_code} {_message(reply)}"
                continue
            if reply.status_code >= 400:
                kind = _KINDS.get(reply.status_code, "malformed")
                raise AdminError(kind, f"{method} {path}: {reply.status_code} {_message(reply)}", reply.status_code)
            try:
                return reply.json()
            except ValueError:
                raise AdminError("malformed", f"{method} {path}: the answer is not JSON") from None
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
