"""The watch-to-SSE bridge: one list-then-watch per collection (PatchRollouts, PatchFleets, their
Events) for the whole dashboard, however many pages are open, and every change pushed to each
page's queue as the view of the object it changed.

A page that connects gets the whole state first (`snapshot`), then a message per change
(`rollout`, `fleet`, `deleted`, `notes`). A page that falls too far behind (its queue full) is
dropped: its browser reconnects (EventSource does by itself) and gets a fresh snapshot. A
collection the user may not read (403) is left out and said so in `notes`, tried again later.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from graft.api import FLEETS, ROLLOUTS
from graft.dashboard.cluster import EVENTS, Cluster, ClusterError, Gone
from graft.dashboard.views import fleet_view, rollout_view

log = logging.getLogger(__name__)
KINDS = {ROLLOUTS: "PatchRollout", FLEETS: "PatchFleet"}
QUEUE = 256                 # messages a page may lag behind before it is dropped (it reconnects)
RETRY = 2.0                 # seconds before listing again after the API server failed
FORBIDDEN_RETRY = 30.0      # ... after it refused (the user's rights may change)


class Bridge:
    def __init__(self, cluster: Cluster, watch_seconds: int = 300):
        self.cluster, self.watch_seconds = cluster, watch_seconds
        self.objects: dict[str, dict[str, dict[str, Any]]] = {ROLLOUTS: {}, FLEETS: {}, EVENTS: {}}
        self.notes: dict[str, str] = {}
        self.synced: dict[str, bool] = {p: False for p in self.objects}
        self._pages: set[asyncio.Queue] = set()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(p), name=f"watch-{p}") for p in self.objects]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- what pages get ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        events = list(self.objects[EVENTS].values())
        return {"namespace": self.cluster.namespace,
                "rollouts": [rollout_view(o, events) for _, o in sorted(self.objects[ROLLOUTS].items())],
                "fleets": [fleet_view(o, events) for _, o in sorted(self.objects[FLEETS].items())],
                "notes": dict(self.notes), "synced": all(self.synced.values())}

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(QUEUE)
        queue.put_nowait(("snapshot", self.snapshot()))
        self._pages.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._pages.discard(queue)

    def _publish(self, kind: str, data: dict[str, Any]) -> None:
        for queue in list(self._pages):
            try:
                queue.put_nowait((kind, data))
            except asyncio.QueueFull:
                self._pages.discard(queue)
                while not queue.empty():        # make room for the last word: start over
                    queue.get_nowait()
                queue.put_nowait(("reset", {}))

    def _publish_object(self, plural: str, name: str) -> None:
        obj = self.objects[plural].get(name)
        if obj is None:
            self._publish("deleted", {"kind": KINDS[plural], "name": name})
            return
        events = list(self.objects[EVENTS].values())
        if plural == ROLLOUTS:
            self._publish("rollout", rollout_view(obj, events))
        else:
            self._publish("fleet", fleet_view(obj, events))

    # -- what the API server says -----------------------------------------------------------------

    async def _follow(self, plural: str) -> None:
        """List, then watch from the list's version; on any break list again (the list replaces what
        was kept, so a deletion missed meanwhile is seen too)."""
        while True:
            try:
                items, version = await self.cluster.list(plural)
                self._replace(plural, items)
                self._note(plural, None)
                self.synced[plural] = True
                async for kind, obj in self.cluster.watch(plural, version, self.watch_seconds):
                    self._apply(plural, kind, obj)
            except Gone:
                continue
            except ClusterError as e:
                self._note(plural, e.message)
                await asyncio.sleep(FORBIDDEN_RETRY if e.status in (401, 403) else RETRY)

    def _note(self, plural: str, text: str | None) -> None:
        if self.notes.get(plural) == text or (text is None and plural not in self.notes):
            return
        if text is None:
            self.notes.pop(plural, None)
        else:
            log.warning("dashboard: %s", text)      # once a change, not once a retry
            self.notes[plural] = text
        self._publish("notes", dict(self.notes))

    def _replace(self, plural: str, items: list[dict[str, Any]]) -> None:
        if plural == EVENTS:
            items = [e for e in items if _ours(e)]
        before = self.objects[plural]
        now = {_key(plural, o): o for o in items}
        self.objects[plural] = now
        if plural == EVENTS:
            for name in {_involved(e) for e in list(before.values()) + items}:
                self._publish_involved(name)
            return
        for name in set(before) | set(now):
            if before.get(name, {}).get("metadata", {}).get("resourceVersion") != \
                    now.get(name, {}).get("metadata", {}).get("resourceVersion") or name not in now:
                self._publish_object(plural, name)

    def _apply(self, plural: str, kind: str, obj: dict[str, Any]) -> None:
        if plural == EVENTS:
            if not _ours(obj):
                return
            if kind == "DELETED":
                self.objects[EVENTS].pop(_key(EVENTS, obj), None)
            else:
                self.objects[EVENTS][_key(EVENTS, obj)] = obj
            self._publish_involved(_involved(obj))
            return
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.objects[plural].pop(name, None)
        else:
            self.objects[plural][name] = obj
        self._publish_object(plural, name)

    def _publish_involved(self, involved: tuple[str, str]) -> None:
        kind, name = involved
        plural = ROLLOUTS if kind == "PatchRollout" else FLEETS
        if name in self.objects[plural]:
            self._publish_object(plural, name)


def _ours(event: dict[str, Any]) -> bool:
    return (event.get("involvedObject") or {}).get("kind") in KINDS.values()


def _involved(event: dict[str, Any]) -> tuple[str, str]:
    involved = event.get("involvedObject") or {}
    return involved.get("kind", ""), involved.get("name", "")


def _key(plural: str, obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    if plural == EVENTS:       # Events of one name may be recreated: their uid tells them apart
        return meta.get("uid") or meta.get("name", "")
    return meta.get("name", "")
