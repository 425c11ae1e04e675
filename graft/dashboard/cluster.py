"""The dashboard's calls to Kubernetes, in one place: list and watch the namespace's PatchRollouts,
PatchFleets and Events with the user's own credentials (a kubeconfig's context, or a pod's service
account, as `graft rollout` logs in: graft.operator.kubeconfig), and run the rollout verbs
(graft.operator.verbs, the very code `graft rollout VERB` runs).

A list, then a watch from the list's resourceVersion (graft.operator.kube); a watch that falls too
far behind (410 Gone) ends, and the caller lists again.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from graft.api import FLEETS, ROLLOUTS
from graft.operator import verbs
from graft.operator.kube import Kube, KubeError, SyncKube, events_path, fleets_path, rollouts_path
from graft.operator.kubeconfig import Credentials, KubeconfigError, load_credentials

EVENTS = "events"
PATHS = {ROLLOUTS: rollouts_path, FLEETS: fleets_path, EVENTS: events_path}


class ClusterError(Exception):
    """The API server refused or could not be reached; `status` is its HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}" if status else message)
        self.status, self.message = status, message


class Gone(ClusterError):
    """A watch's resourceVersion is too old: list again."""


def credentials(kubeconfig: str | None, context: str | None) -> Credentials:
    """The user's credentials as `graft rollout` reads them: `kubeconfig` (default $KUBECONFIG or
    ~/.kube/config) and its `context`, or in a pod its service account."""
    try:
        return load_credentials(kubeconfig, context)
    except KubeconfigError as e:
        raise ClusterError(0, f"cannot load Kubernetes credentials: {e}") from None


class Cluster:
    """One namespace of one API server, as one user."""

    def __init__(self, creds: Credentials, namespace: str | None = None):
        self.creds, self.namespace = creds, namespace or creds.namespace
        self._kube = Kube.from_credentials(creds)

    async def aclose(self) -> None:
        await self._kube.aclose()

    async def list(self, plural: str) -> tuple[list[dict[str, Any]], str]:
        """The collection's items and its resourceVersion (where a watch starts)."""
        what = f"list {plural} in {self.namespace}"
        with _refusals(what):
            body = await self._kube.list_object(PATHS[plural](self.namespace))
        return body.get("items") or [], (body.get("metadata") or {}).get("resourceVersion") or ""

    async def watch(self, plural: str, resource_version: str, seconds: int = 300
                    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Changes after `resource_version`, in order, as (ADDED | MODIFIED | DELETED, object), for
        up to `seconds`; raises Gone when that version is too old."""
        events = self._kube.watch(PATHS[plural](self.namespace), resource_version=resource_version,
                                  timeout_seconds=seconds)
        with _refusals(f"watch {plural} in {self.namespace}"):
            async with contextlib.aclosing(events):
                async for event in events:
                    if event.type in ("ADDED", "MODIFIED", "DELETED"):
                        yield event.type, event.object

    async def act(self, verb: str, name: str, full: bool = False) -> tuple[bool, str]:
        """Run the rollout verb on `name` as this user: (done, what it said, as `graft rollout` says it)."""
        def run() -> verbs.Done:
            with SyncKube(lambda: Kube.from_credentials(self.creds)) as api:
                if verb == "promote":
                    return verbs.promote(api, self.namespace, name, full=full)
                return verbs.VERBS[verb](api, self.namespace, name)

        try:
            done = await asyncio.to_thread(run)
        except verbs.ActionError as e:
            return False, str(e)
        except httpx.TransportError as e:
            return False, f"cannot reach the API server: {type(e).__name__}: {e}"
        return True, " ".join([*(f"note: {n}." for n in done.notes), done.message])


@contextlib.contextmanager
def _refusals(what: str):
    try:
        yield
    except KubeError as e:
        if e.status == 410:
            raise Gone(410, e.message) from None
        raise ClusterError(e.status, f"cannot {what}: {verbs.refusal(e)}") from None
    except httpx.TransportError as e:
        raise ClusterError(0, f"cannot {what}: the API server did not answer ({type(e).__name__})") from None
