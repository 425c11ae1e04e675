"""What each engine runs, known without asking it every tick.

The fleet controller used to ask every running engine its revision (GET /admin/patches) on every
tick: a thousand pods, two hundred admin calls a second at rest. An engine's revision changes only
when someone applies or reverts a patch, or when its container is replaced. So the operator keeps a
`RevisionBook`, per admin address (pod IP, port):

- the answer of the last GET, with the container it came from: `Container`, the pod's uid and its
  engine container's `containerID` and `restartCount` (a restart or a new pod at a reused IP
  changes one of them, so the entry no longer holds and the engine is asked at once);
- what the operator itself did there since: a successful apply or revert (the rollout's canaries
  and the fleet's convergence alike, since both call through `RecordingAdmin`) sets the revision
  the engine answered, and the applied patch's config and code digests as the engine would report
  them. A call that failed may or may not have happened: the entry is dropped and the engine asked.

Knowledge also ages: each entry is asked again after `resync` seconds (the fleet's slow resync,
`GRAFT_FLEET_RESYNC_SECONDS`), which finds a revision changed behind the operator's back (a person
with the token, an engine that reverted a patch itself). The first resync of an entry falls anywhere
in that period, later ones within a tenth of it, so a fleet learnt in one tick is asked again a few
pods a tick, never all at once.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from graft.api import config_digest
from graft.adminapi import AdminClient, AdminError, EngineAnswer
from graft.rollout.observation import PodObservation

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Container:
    """Which engine process answers at an address: the pod and its engine container's run."""
    pod_uid: str
    container_id: str
    restart_count: int

    @classmethod
    def of(cls, pod: PodObservation) -> "Container":
        return cls(pod.uid, pod.container_id, pod.restart_count)


@dataclass(slots=True)
class _Entry:
    container: Container
    answer: EngineAnswer
    resync_at: float
    seen_at: float


class RevisionBook:
    """Engine answers by admin address, valid for one container and until their resync time."""

    def __init__(self, resync: float, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None):
        if resync <= 0:
            raise ValueError(f"resync must be positive, got {resync}")
        self.resync = resync
        self._clock = clock
        self._rng = rng or random.Random()
        self._entries: dict[Address, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def known(self, address: Address, container: Container) -> EngineAnswer | None:
        """What the engine at `address` runs, if known for this very container and not due for a
        resync; None: ask it."""
        entry = self._entries.get(address)
        if entry is None or entry.container != container:
            return None
        now = self._clock()
        if now >= entry.resync_at:
            return None
        entry.seen_at = now
        return entry.answer

    def learn(self, address: Address, container: Container, answer: EngineAnswer) -> None:
        """The engine's own answer (GET /admin/patches), from `container`."""
        now = self._clock()
        before = self._entries.get(address)
        # a first entry's resync falls anywhere in the period, so a fleet learnt at once is spread
        # over it; a renewed one keeps its place, give or take a tenth
        share = self._rng.uniform(0.9, 1.1) if before is not None and before.container == container \
            else self._rng.uniform(0.05, 1.0)
        self._entries[address] = _Entry(container, answer, now + self.resync * share, now)

    def applied(self, address: Address, revision: str, name: str, config: dict[str, Any] | None,
                digest: str | None) -> None:
        """The engine at `address` answered a successful apply of `name` with `revision`."""
        entry = self._entries.get(address)
        if entry is None:
            return
        if entry.answer.awaiting:      # how an apply settles start-up entries is the engine's to say
            self.forget(address)
            return
        configs = {**entry.answer.configs, name: config_digest(config)}
        digests = {**entry.answer.digests}
        if digest:
            digests[name] = digest
        else:
            digests.pop(name, None)    # a built-in's digest is the engine's: unknown until asked
        entry.answer = EngineAnswer(revision, (), configs, digests)

    def reverted(self, address: Address, revision: str, name: str) -> None:
        """The engine at `address` answered a successful revert of `name` with `revision`."""
        entry = self._entries.get(address)
        if entry is None:
            return
        if entry.answer.awaiting:
            self.forget(address)
            return
        entry.answer = EngineAnswer(revision, (), {k: v for k, v in entry.answer.configs.items() if k != name},
                                    {k: v for k, v in entry.answer.digests.items() if k != name})

    def forget(self, address: Address) -> None:
        self._entries.pop(address, None)

    def prune(self, live: Iterable[Address] | None = None) -> None:
        """Drop entries for addresses not in `live` (when given) and those no one looked up for two
        resync periods (pods long gone): the book stays the size of the fleets."""
        now = self._clock()
        keep = set(live) if live is not None else None
        for address in [a for a, e in self._entries.items()
                        if (keep is not None and a not in keep) or now - e.seen_at > 2 * self.resync]:
            del self._entries[address]


class RecordingAdmin:
    """The admin client, telling `book` what each successful apply and revert left on the engine.

    Everything else is the client's own (`token`, `state`, `revision`, ...)."""

    def __init__(self, client: AdminClient, book: RevisionBook):
        self._client, self.book = client, book

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_client", "book"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._client, name, value)

    async def apply(self, host: str, port: int, name: str, version: str, source: dict[str, Any],
                    config: dict[str, Any] | None = None, replace: bool = False) -> str:
        try:
            revision = await self._client.apply(host, port, name, version, source, config, replace=replace)
        except AdminError:
            self.book.forget((host, port))     # it may have been applied all the same
            raise
        digest = source.get("digest") if isinstance(source, dict) else None
        self.book.applied((host, port), revision, name, config, digest if isinstance(digest, str) else None)
        return revision

    async def revert(self, host: str, port: int, name: str) -> str:
        try:
            revision = await self._client.revert(host, port, name)
        except AdminError:
            self.book.forget((host, port))
            raise
        self.book.reverted((host, port), revision, name)
        return revision

    async def apply_patch(self, host: str, port: int, request):
        """The client's apply with the engine's whole answer (an ApplyRequest in, an ApplyAnswer out)."""
        try:
            answer = await self._client.apply_patch(host, port, request)
        except AdminError:
            self.book.forget((host, port))
            raise
        digest = request.source.get("digest") if isinstance(request.source, dict) else None
        self.book.applied((host, port), answer.revision, request.name, request.config,
                          digest if isinstance(digest, str) else None)
        return answer

    async def revert_patch(self, host: str, port: int, name: str):
        try:
            answer = await self._client.revert_patch(host, port, name)
        except AdminError:
            self.book.forget((host, port))
            raise
        self.book.reverted((host, port), answer.revision, name)
        return answer


async def engine_answer(book: RevisionBook, admin, address: Address, container: Container,
                        limit: asyncio.Semaphore, *, fresh: bool = False) -> EngineAnswer:
    """What the engine at `address` runs: from `book` while that knowledge holds (unless `fresh`),
    else asked (GET /admin/patches, at most `limit` of them in flight) and learnt. An AdminError
    leaves the book as it was: the engine is asked again next tick."""
    known = None if fresh else book.known(address, container)
    if known is not None:
        return known
    async with limit:
        answer = await admin.state(*address)
    book.learn(address, container, answer)
    return answer

