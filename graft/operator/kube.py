"""A small async Kubernetes REST client (httpx) for what the operator reads and writes itself:
pods, their labels, the workloads that own them, Secrets, ConfigMaps, HTTPRoutes and the rollout's
own annotations.

kopf watches and patches PatchRollouts with its own client; this one is built from the very
same credentials (`kopf.ConnectionInfo`), so both act as one identity.
"""
from __future__ import annotations

import base64
import ssl
from typing import Any
from urllib.parse import quote

import httpx

MERGE = "application/merge-patch+json"


class KubeError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


class Kube:
    """JSON over HTTP to one API server; `get` answers None for a 404."""

    def __init__(self, server: str, *, headers: dict[str, str] | None = None,
                 verify: bool | ssl.SSLContext = True, timeout: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self._client = httpx.AsyncClient(base_url=server.rstrip("/"), headers=headers or {}, verify=verify,
                                         timeout=timeout, transport=transport)

    @classmethod
    def from_connection(cls, info: Any) -> "Kube":
        """From a `kopf.ConnectionInfo` (what the login handler returned): same server, same identity."""
        verify = info.as_ssl_context() if info.server.startswith("https:") else False
        return cls(info.server, headers=info.as_http_headers(), verify=verify)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        reply = await self._client.request(method, path, **kwargs)
        if reply.status_code >= 400 and reply.status_code != 404:
            try:
                message = reply.json().get("message", reply.text)
            except ValueError:
                message = reply.text
            raise KubeError(reply.status_code, message)
        return reply

    async def get(self, path: str, **params: str) -> dict[str, Any] | None:
        reply = await self._call("GET", path, params=params or None)
        return None if reply.status_code == 404 else reply.json()

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        reply = await self._call("GET", path, params=params)
        if reply.status_code == 404:
            return []
        return reply.json().get("items") or []

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


def pods_path(namespace: str, name: str | None = None) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/pods" + (f"/{quote(name)}" if name else "")


def replicaset_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{quote(namespace)}/replicasets/{quote(name)}"


def statefulset_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{quote(namespace)}/statefulsets/{quote(name)}"


def deployment_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{quote(namespace)}/deployments/{quote(name)}"


def secret_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/secrets/{quote(name)}"


def configmap_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/configmaps/{quote(name)}"


def httproute_path(namespace: str, name: str) -> str:
    return f"/apis/gateway.networking.k8s.io/v1/namespaces/{quote(namespace)}/httproutes/{quote(name)}"


def rollout_path(namespace: str, name: str) -> str:
    return f"/apis/graft.dev/v1alpha1/namespaces/{quote(namespace)}/patchrollouts/{quote(name)}"


def rollouts_path(namespace: str) -> str:
    return f"/apis/graft.dev/v1alpha1/namespaces/{quote(namespace)}/patchrollouts"


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
