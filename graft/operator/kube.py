"""Graft's one Kubernetes client: a small async REST client (httpx), JSON in and out.

The operator reads and writes pods, their labels, the workloads that own them, Secrets, ConfigMaps,
HTTPRoutes and the rollout's own annotations with it; `graft rollout` (through `SyncKube`) and the
demo read and steer PatchRollouts with it. kopf watches and patches PatchRollouts with its own
client, built from the very same credentials, so both act as one identity.

A client comes from `Credentials` (graft.operator.kubeconfig: a kubeconfig's context or a pod's
service account), from a `kopf.ConnectionInfo`, or from a plain URL. Typed views of the pod fields
Graft reads are in graft.operator.podview.
"""
from __future__ import annotations

import asyncio
import base64
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from graft.operator.kubeconfig import Credentials, RefreshingAuth

MERGE = "application/merge-patch+json"


class KubeError(Exception):
    """The API server's refusal: its HTTP status, its reason (`NotFound`, `Conflict`, `Expired`, ...)
    and its message."""

    def __init__(self, status: int, message: str, reason: str = ""):
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.reason = status, message, reason


class WatchEvent(tuple):
    """One event of a watch: `type` (ADDED, MODIFIED, DELETED, BOOKMARK) and the object."""

    __slots__ = ()

    def __new__(cls, type: str, object: dict[str, Any]):
        return super().__new__(cls, (type, object))

    @property
    def type(self) -> str:
        return self[0]

    @property
    def object(self) -> dict[str, Any]:
        return self[1]


class Kube:
    """JSON over HTTP to one API server; `get` answers None for a 404."""

    def __init__(self, server: str, *, headers: dict[str, str] | None = None,
                 verify: bool | ssl.SSLContext = True, timeout: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None, auth: httpx.Auth | None = None):
        self._client = httpx.AsyncClient(base_url=server.rstrip("/"), headers=headers or {}, verify=verify,
                                         timeout=timeout, transport=transport, auth=auth)
        self._extensions: dict[str, Any] = {}

    @classmethod
    def from_connection(cls, info: Any) -> "Kube":
        """From a `kopf.ConnectionInfo` (what the login handler returned): same server, same identity."""
        verify = info.as_ssl_context() if info.server.startswith("https:") else False
        return cls(info.server, headers=info.as_http_headers(), verify=verify)

    @classmethod
    def from_credentials(cls, creds: Credentials, *, timeout: float = 30.0) -> "Kube":
        """From a kubeconfig's context or a pod's service account (graft.operator.kubeconfig)."""
        # tokens that age (an exec plugin's, a token file's) are read again: RefreshingAuth
        kube = cls(creds.server, verify=creds.ssl_context(), timeout=timeout, auth=RefreshingAuth(creds))
        if creds.tls_server_name:
            kube._extensions = {"sni_hostname": creds.tls_server_name}
        return kube

    def use_headers(self, headers: dict[str, str]) -> None:
        """Send these headers (a fresh token) from now on; calls and watches in flight go on."""
        self._client.headers.pop("Authorization", None)
        self._client.headers.update(headers)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> "Kube":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        reply = await self._client.request(method, path, extensions=self._extensions, **kwargs)
        if reply.status_code >= 400 and reply.status_code != 404:
            raise _error(reply)
        return reply

    async def get(self, path: str, **params: str) -> dict[str, Any] | None:
        reply = await self._call("GET", path, params=params or None)
        return None if reply.status_code == 404 else reply.json()

    async def text(self, path: str, **params: str) -> str | None:
        """A plain-text answer (a pod's log); None for a 404."""
        reply = await self._call("GET", path, params=params or None)
        return None if reply.status_code == 404 else reply.text

    async def list(self, path: str, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        """The items of a collection ([] when the collection does not exist)."""
        params = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        reply = await self._call("GET", path, params=params or None)
        if reply.status_code == 404:
            return []
        return reply.json().get("items") or []

    async def watch(self, path: str, *, resource_version: str | None = None, field_selector: str | None = None,
                    label_selector: str | None = None, timeout_seconds: int | None = None,
                    bookmarks: bool = False) -> AsyncIterator[WatchEvent]:
        """The changes of a collection from `resource_version` on, in order, as `WatchEvent`s, until
        the API server ends the watch (after `timeout_seconds`). A version too old to watch from is
        KubeError 410 (Expired): read the collection anew. BOOKMARK events (only a newer
        resourceVersion to resume from) are asked for and passed on with `bookmarks`, else left out."""
        params: dict[str, Any] = {"watch": "true", "allowWatchBookmarks": "true" if bookmarks else "false"}
        for key, value in (("resourceVersion", resource_version), ("fieldSelector", field_selector),
                           ("labelSelector", label_selector), ("timeoutSeconds", timeout_seconds)):
            if value is not None:
                params[key] = str(value)
        read_timeout = None if timeout_seconds is None else timeout_seconds + 30.0
        async with self._client.stream("GET", path, params=params, extensions=self._extensions,
                                       timeout=httpx.Timeout(30.0, read=read_timeout)) as reply:
            if reply.status_code >= 400:
                await reply.aread()
                raise _error(reply)
            async for line in reply.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":         # the watch's own end: a Status (410 when the version expired)
                    raise KubeError(int(obj.get("code") or 500), obj.get("message") or "watch error",
                                    obj.get("reason") or "")
                if kind != "BOOKMARK" or bookmarks:
                    yield WatchEvent(kind, obj)

    async def list_object(self, path: str, **params: str) -> dict[str, Any]:
        """A collection as the API server answers it (`items` and `metadata.resourceVersion`, the
        version to watch from); an empty one when the collection does not exist."""
        reply = await self._call("GET", path, params=params or None)
        return {"items": []} if reply.status_code == 404 else reply.json()

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return (await self._call("POST", path, json=body)).json()

    async def delete(self, path: str, preconditions: dict[str, str] | None = None) -> dict[str, Any] | None:
        """`preconditions` (`uid`, `resourceVersion`): delete only that very object, as it was read;
        one recreated or changed since is refused (KubeError 409) and stays."""
        options = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": preconditions}
        reply = await self._call("DELETE", path, json=options if preconditions else None)
        return None if reply.status_code == 404 else reply.json()

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        reply = await self._call("PATCH", path, json=body, headers={"Content-Type": MERGE})
        return None if reply.status_code == 404 else reply.json()


def _error(reply: httpx.Response) -> KubeError:
    """The API server's Status body as a KubeError (its text when it sent none)."""
    try:
        body = reply.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return KubeError(reply.status_code, str(body.get("message") or reply.reason_phrase), body.get("reason") or "")
    return KubeError(reply.status_code, reply.text or reply.reason_phrase)


T = TypeVar("T")


class SyncKube:
    """`Kube` for synchronous code (`graft rollout`): each call runs on an event loop of its own,
    kept for the client's life. `run` takes any coroutine made with `kube` (a watch, say)."""

    def __init__(self, kube: Callable[[], Kube]):
        self._runner = asyncio.Runner()
        self.kube: Kube = self._runner.run(_made(kube))

    def run(self, call: Awaitable[T]) -> T:
        return self._runner.run(call)

    def get(self, path: str, **params: str) -> dict[str, Any] | None:
        return self.run(self.kube.get(path, **params))

    def list(self, path: str, label_selector: str | None = None,
             field_selector: str | None = None) -> list[dict[str, Any]]:
        return self.run(self.kube.list(path, label_selector, field_selector))

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.run(self.kube.create(path, body))

    def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        return self.run(self.kube.merge_patch(path, body))

    def close(self) -> None:
        try:
            self.run(self.kube.aclose())
        finally:
            self._runner.close()

    def __enter__(self) -> "SyncKube":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _made(factory: Callable[[], Kube]) -> Kube:
    return factory()        # httpx binds its pool to the loop that first uses it: make it on that loop


def pods_path(namespace: str, name: str | None = None) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/pods" + (f"/{quote(name)}" if name else "")


def replicaset_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{quote(namespace)}/replicasets/{quote(name)}"


def statefulset_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{quote(namespace)}/statefulsets/{quote(name)}"


def deployment_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{quote(namespace)}/deployments/{quote(name)}"


def job_path(namespace: str, name: str | None = None) -> str:
    return f"/apis/batch/v1/namespaces/{namespace}/jobs" + (f"/{name}" if name else "")


def secret_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/secrets/{quote(name)}"


def configmap_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/configmaps/{quote(name)}"


def httproute_path(namespace: str, name: str) -> str:
    return f"/apis/gateway.networking.k8s.io/v1/namespaces/{quote(namespace)}/httproutes/{quote(name)}"


def rollout_path(namespace: str, name: str) -> str:
    return f"/apis/graft.dev/v1alpha1/namespaces/{quote(namespace)}/patchrollouts/{quote(name)}"


def rollouts_path(namespace: str | None) -> str:
    """The PatchRollouts of a namespace (None: of every namespace)."""
    if namespace is None:
        return "/apis/graft.dev/v1alpha1/patchrollouts"
    return f"/apis/graft.dev/v1alpha1/namespaces/{quote(namespace)}/patchrollouts"


def fleets_path(namespace: str | None) -> str:
    """The PatchFleets of a namespace (None: of every namespace)."""
    if namespace is None:
        return "/apis/graft.dev/v1alpha1/patchfleets"
    return fleet_path(namespace)


def events_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/events"


def scale_path(namespace: str, deployment: str) -> str:
    return deployment_path(namespace, deployment) + "/scale"


def fleet_path(namespace: str, name: str | None = None) -> str:
    return f"/apis/graft.dev/v1alpha1/namespaces/{quote(namespace)}/patchfleets" + (f"/{quote(name)}" if name else "")


def template_path(namespace: str, name: str) -> str:
    return f"/apis/graft.dev/v1alpha1/namespaces/{quote(namespace)}/patchanalysistemplates/{quote(name)}"


def cluster_template_path(name: str) -> str:
    return f"/apis/graft.dev/v1alpha1/clusterpatchanalysistemplates/{quote(name)}"


def secret_value(secret: dict[str, Any], key: str) -> str | None:
    """A Secret's value under `key` (data is base64, stringData plain), or None."""
    if key in (secret.get("stringData") or {}):
        return secret["stringData"][key]
    raw = (secret.get("data") or {}).get(key)
    return base64.b64decode(raw).decode("utf-8") if raw is not None else None
