"""The pods of each namespace the operator acts in, kept by one list-then-watch per namespace.

The fleet controller and the rollout reconciliation read pods from here instead of listing them
every tick: what a tick costs then follows what changed, not how many pods there are. A namespace
is listed once, when it is first asked for, and then watched from that list's resourceVersion
(bookmarks keep the version current while nothing changes); every event (a pod added, deleted,
relabelled, restarted: a new containerID in its status) lands in the cache as it arrives. The
selector is applied here, as the API server applies `labelSelector`, so one watch serves every
fleet and rollout of the namespace.

A watch the API server ends (its timeout) is resumed from the last version seen; one refused as
too old (410 Gone) or broken off (a connection dropped, an error) is re-established with a fresh
list, after a pause that grows while it keeps failing. While it is down, readers get the pods as
last seen. The operator's own pod writes (labels, the readiness-gate condition) are noted from the
API server's replies (`saw`), so a reconciliation reads what it just wrote even before the watch
event arrives; the newer resourceVersion wins, whichever comes first.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from graft.operator.kube import Kube, KubeError, pods_path
from graft.operator.pods import list_pods
from graft.rollout.spec import LabelSelector

log = logging.getLogger(__name__)

Pod = dict[str, Any]
T = TypeVar("T")


def _version(obj: dict[str, Any]) -> int | None:
    """An object's resourceVersion as a number, when it is one (the API server's are, from etcd;
    they are opaque by contract, so one that is not a number is simply never compared)."""
    value = (obj.get("metadata") or {}).get("resourceVersion")
    return int(value) if isinstance(value, str) and value.isdigit() else None


class _Namespace:
    """One namespace's pods by name, and the watch that keeps them."""

    def __init__(self, name: str, items: list[Pod], version: str | None):
        self.name = name
        self.pods: dict[str, Pod] = {p["metadata"]["name"]: p for p in items}
        self.version = version
        self.task: asyncio.Task | None = None
        # name -> {function: (the pod version it was computed from, its value)}
        self.derived: dict[str, dict[Callable, tuple[Pod, Any]]] = {}

    def put(self, pod: Pod) -> None:
        """Keep `pod` unless the cache already holds a newer version of it."""
        name = pod["metadata"]["name"]
        held = self.pods.get(name)
        new, old = _version(pod), _version(held) if held is not None else None
        if held is not None and new is not None and old is not None and old > new:
            return
        self.pods[name] = pod
        self.derived.pop(name, None)

    def drop(self, pod: Pod) -> None:
        name = pod["metadata"]["name"]
        held = self.pods.get(name)
        if held is not None and (held["metadata"].get("uid") in (None, pod["metadata"].get("uid"))):
            del self.pods[name]
            self.derived.pop(name, None)


class PodCache:
    """Pods by namespace, from one list-then-watch each. `kube` gives the current client (a new
    login replaces it); `watch_seconds` is how long one watch request runs before it is resumed."""

    def __init__(self, kube: Callable[[], Kube], *, watch_seconds: int = 300, retry: float = 1.0,
                 max_retry: float = 30.0):
        self._kube = kube
        self.watch_seconds, self.retry, self.max_retry = watch_seconds, retry, max_retry
        self._namespaces: dict[str, _Namespace] = {}
        self._listing: dict[str, asyncio.Lock] = {}
        self.lists = 0          # full lists made (the first of each namespace, then one per relist)
        self.watches = 0        # watch requests made
        self._closed = False

    async def pods(self, namespace: str, selector: LabelSelector | None = None) -> list[Pod]:
        """The pods of `namespace` that `selector` picks (all of them for None), without those being
        deleted, by name. The first call for a namespace lists it (a KubeError then comes through)."""
        ns = self._namespaces.get(namespace) or await self._start(namespace)
        return sorted((p for p in ns.pods.values()
                       if not p["metadata"].get("deletionTimestamp")
                       and (selector is None or selector.matches(p["metadata"].get("labels") or {}))),
                      key=lambda p: p["metadata"]["name"])

    def derived(self, pod: Pod, fn: Callable[[Pod], T]) -> T:
        """`fn(pod)`, computed once per version of a pod this cache gave out (a pod that does not
        change costs a tick nothing to read again); `fn` must read nothing but the pod."""
        meta = pod["metadata"]
        ns = self._namespaces.get(meta.get("namespace") or "")
        if ns is None or ns.pods.get(meta["name"]) is not pod:
            return fn(pod)
        memo = ns.derived.setdefault(meta["name"], {})
        held = memo.get(fn)
        if held is None or held[0] is not pod:
            held = memo[fn] = (pod, fn(pod))
        return held[1]

    def saw(self, pod: Pod | None) -> None:
        """A pod as the API server answered one of the operator's own writes to it."""
        if not pod or not isinstance(pod.get("metadata"), dict):
            return
        ns = self._namespaces.get(pod["metadata"].get("namespace") or "")
        if ns is not None and pod["metadata"].get("name") in ns.pods:
            ns.put(pod)

    async def _start(self, namespace: str) -> _Namespace:
        lock = self._listing.setdefault(namespace, asyncio.Lock())
        async with lock:        # many ticks of a namespace may ask at once: it is listed once
            if namespace in self._namespaces:
                return self._namespaces[namespace]
            items, version = await self._list(namespace)
            ns = self._namespaces[namespace] = _Namespace(namespace, items, version)
            ns.task = asyncio.create_task(self._keep(ns), name=f"graft-pod-watch-{namespace}")
            return ns

    async def _list(self, namespace: str) -> tuple[list[Pod], str | None]:
        self.lists += 1
        kube = self._kube()
        listing = await kube.list_object(pods_path(namespace))
        return listing.get("items") or [], (listing.get("metadata") or {}).get("resourceVersion")

    async def _keep(self, ns: _Namespace) -> None:
        """Watch `ns` for the operator's life: resume after a server's timeout, relist after anything else."""
        failures = 0
        while not self._closed:
            try:
                if ns.version is None:
                    items, ns.version = await self._list(ns.name)
                    ns.pods, ns.derived = {}, {}
                    for pod in items:
                        ns.put(pod)
                self.watches += 1
                kube = self._kube()
                async for event in kube.watch(pods_path(ns.name), resource_version=ns.version,
                                              timeout_seconds=self.watch_seconds, bookmarks=True):
                    version = (event.object.get("metadata") or {}).get("resourceVersion")
                    if event.type == "DELETED":
                        ns.drop(event.object)
                    elif event.type in ("ADDED", "MODIFIED"):
                        ns.put(event.object)
                    if version:
                        ns.version = version
                    failures = 0
                failures = 0        # the server ended the watch in time: resumed from ns.version
            except asyncio.CancelledError:
                raise
            except Exception as e:    # noqa: BLE001 - nothing may end the watch for good
                # 410 Gone: the version is older than the server keeps; anything else: the watch
                # broke off (a dropped connection, a client closed by a new login, a bug). Either
                # way the pods are read anew, so no change can be missed.
                ns.version = None
                gone = isinstance(e, KubeError) and e.status == 410
                # a first 410 is listed again at once; a server that keeps refusing is given time
                pause = 0.0 if gone and not failures else min(self.max_retry, self.retry * 2 ** failures)
                failures += 1
                if gone:
                    log.info("pod watch of namespace %s: %s; listing again", ns.name, e)
                else:
                    log.warning("pod watch of namespace %s broke off (%s: %s); listing again in %.0f s",
                                ns.name, type(e).__name__, e, pause,
                                exc_info=not isinstance(e, (KubeError, httpx.HTTPError, ValueError)))
                await asyncio.sleep(pause)

    async def aclose(self) -> None:
        self._closed = True
        tasks = [ns.task for ns in self._namespaces.values() if ns.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def read_pods(cache: PodCache | None, kube: Kube, namespace: str,
                    selector: LabelSelector | None) -> list[Pod]:
    """The pods `selector` picks: from `cache` when there is one, else listed (a caller without an
    operator's cache, such as a one-off command)."""
    if cache is not None:
        return await cache.pods(namespace, selector)
    return await list_pods(kube, namespace, selector.to_query() if selector is not None else "")
