"""Fire-and-forget HTTP deliveries (notifications, `event` webhooks): bounded in every direction.

A reconciliation hands a delivery over and goes on; workers post it in the background, each try
under a timeout, a few tries with backoff. Nothing here can hold a rollout: a receiver that hangs
costs its worker the timeout, a receiver that is down costs its retries, and when deliveries come
faster than they leave the oldest waiting one is dropped (and counted), never the caller blocked.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("graft.outbox")


@dataclass(frozen=True, slots=True)
class Delivery:
    """One POST of a JSON body; `what` names it in logs and counters (e.g. `slack/promoted`)."""

    url: str
    body: dict[str, Any]
    what: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float = 5.0
    retries: int = 2


class Outbox:
    def __init__(self, *, capacity: int = 1000, workers: int = 4, backoff: float = 0.5,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.capacity, self.backoff = capacity, backoff
        self._workers = workers
        self._queue: asyncio.Queue[Delivery] | None = None
        self._tasks: list[asyncio.Task] = []
        self._client = httpx.AsyncClient(transport=transport, follow_redirects=False)
        self.counts: Counter[str] = Counter()      # sent, failed, dropped
        self._busy = 0

    def send(self, delivery: Delivery) -> None:
        """Queue `delivery`; never waits and never raises. Starts the workers on first use (inside
        the operator's event loop)."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._tasks = [asyncio.get_running_loop().create_task(self._work(), name=f"outbox-{i}")
                           for i in range(self._workers)]
        while self._queue.qsize() >= self.capacity:
            dropped = self._queue.get_nowait()
            self._queue.task_done()
            self.counts["dropped"] += 1
            log.warning("outbox full: dropped %s to %s", dropped.what, _host(dropped.url))
        self._queue.put_nowait(delivery)

    async def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued delivery has been tried (True), or `timeout` passed (False)."""
        if self._queue is None:
            return True
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
            return True
        except TimeoutError:
            return False

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self._client.aclose()

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            delivery = await self._queue.get()
            try:
                ok = await self._deliver(delivery)
                self.counts["sent" if ok else "failed"] += 1
            except Exception:              # a worker must outlive anything one delivery does
                self.counts["failed"] += 1
                log.exception("delivering %s", delivery.what)
            finally:
                self._queue.task_done()

    async def _deliver(self, d: Delivery) -> bool:
        for attempt in range(d.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                r = await self._client.post(d.url, json=d.body, headers=d.headers, timeout=d.timeout)
            except httpx.HTTPError as e:
                log.info("%s to %s: %s (try %d)", d.what, _host(d.url), type(e).__name__, attempt + 1)
                continue
            if r.is_success:
                return True
            if r.status_code < 500 and r.status_code not in (408, 429):
                log.warning("%s to %s refused: HTTP %d", d.what, _host(d.url), r.status_code)
                return False      # a refusal will not change on a retry
            log.info("%s to %s: HTTP %d (try %d)", d.what, _host(d.url), r.status_code, attempt + 1)
        log.warning("%s to %s failed after %d tries", d.what, _host(d.url), d.retries + 1)
        return False


def _host(url: str) -> str:
    """The host of a URL for a log line: an incoming-webhook URL's path is its secret."""
    try:
        return httpx.URL(url).host or "?"
    except Exception:
        return "?"
