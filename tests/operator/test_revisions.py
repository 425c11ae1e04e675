"""The revision book: what each engine runs, known from what the operator did and from its
container's identity, asked again only when that knowledge is missing, stale or for another
container. The admin calls go to real HTTP fake engines through the real admin client."""
from __future__ import annotations

import asyncio
import random

import pytest

from graft.api import config_digest
from graft.adminapi import AdminClient, AdminError, EngineAnswer
from graft.operator.revisions import Container, RecordingAdmin, RevisionBook, engine_answer

from operator_cluster import TOKEN
from operator_fakes import FakeEngine

ADDRESS = ("10.0.0.1", 8081)
RUN = Container("uid-1", "containerd://a", 0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def book(resync: float = 300.0) -> tuple[RevisionBook, Clock]:
    clock = Clock()
    return RevisionBook(resync, clock=clock, rng=random.Random(7)), clock


def test_an_answer_holds_for_its_container_only():
    b, _ = book()
    assert b.known(ADDRESS, RUN) is None
    b.learn(ADDRESS, RUN, EngineAnswer("kv-align@3.2.1"))
    assert b.known(ADDRESS, RUN).revision == "kv-align@3.2.1"
    # a restart (count or container ID) or another pod at the same IP: the engine is asked
    assert b.known(ADDRESS, Container("uid-1", "containerd://a", 1)) is None
    assert b.known(ADDRESS, Container("uid-1", "containerd://b", 0)) is None
    assert b.known(ADDRESS, Container("uid-2", "containerd://a", 0)) is None
    assert b.known(("10.0.0.2", 8081), RUN) is None


def test_knowledge_goes_stale_after_the_resync_period():
    b, clock = book(resync=60.0)
    b.learn(ADDRESS, RUN, EngineAnswer("base"))
    clock.now += 60.0
    assert b.known(ADDRESS, RUN) is None
    b.learn(ADDRESS, RUN, EngineAnswer("base"))       # asked again: a renewal keeps its place, +-10%
    clock.now += 53.0
    assert b.known(ADDRESS, RUN) is not None
    clock.now += 14.0
    assert b.known(ADDRESS, RUN) is None


def test_a_fleet_learnt_at_once_comes_due_a_few_pods_a_tick():
    b, clock = book(resync=300.0)
    addresses = [(f"10.0.{i // 250}.{i % 250}", 8081) for i in range(1000)]
    for a in addresses:
        b.learn(a, RUN, EngineAnswer("base"))
    due = []
    for tick in range(1, 61):                 # five-second ticks over the whole period
        clock.now += 5.0
        stale = [a for a in addresses if b.known(a, RUN) is None]
        due.append(len(stale))
        for a in stale:
            b.learn(a, RUN, EngineAnswer("base"))
    # 1,000 pods over 300 s: about 17 a tick; never the fleet at once
    assert sum(due) >= 1000 and max(due) <= 40, due


def test_an_apply_or_revert_sets_what_the_engine_then_runs():
    b, _ = book()
    b.learn(ADDRESS, RUN, EngineAnswer("kv-align@3.2.1", configs={"kv-align": config_digest(None)},
                                       digests={"kv-align": "builtin"}))
    b.applied(ADDRESS, "kv-align@3.2.1,sync-free@1.0.0", "sync-free", {"block": 16}, "sha256:" + "a" * 64)
    answer = b.known(ADDRESS, RUN)
    assert answer.revision == "kv-align@3.2.1,sync-free@1.0.0"
    assert answer.configs == {"kv-align": config_digest(None), "sync-free": config_digest({"block": 16})}
    assert answer.digests == {"kv-align": "builtin", "sync-free": "sha256:" + "a" * 64}
    b.reverted(ADDRESS, "sync-free@1.0.0", "kv-align")
    answer = b.known(ADDRESS, RUN)
    assert answer.revision == "sync-free@1.0.0" and "kv-align" not in answer.configs | answer.digests
    # an engine never asked stays unknown: the apply says nothing about its other patches
    b.applied(("10.0.0.9", 8081), "kv-align@3.2.1", "kv-align", None, None)
    assert b.known(("10.0.0.9", 8081), RUN) is None


def test_an_engine_awaiting_start_up_bundles_is_asked_after_any_change():
    b, _ = book()
    b.learn(ADDRESS, RUN, EngineAnswer("base", awaiting=("kv-align@3.2.1",)))
    b.applied(ADDRESS, "kv-align@3.2.1", "kv-align", None, None)
    assert b.known(ADDRESS, RUN) is None


def test_entries_of_pods_gone_are_dropped():
    b, clock = book(resync=10.0)
    b.learn(ADDRESS, RUN, EngineAnswer("base"))
    b.learn(("10.0.0.2", 8081), RUN, EngineAnswer("base"))
    b.prune(live=[ADDRESS])
    assert len(b) == 1
    clock.now += 21.0
    b.prune()
    assert len(b) == 0


def test_a_resync_period_must_be_positive():
    with pytest.raises(ValueError, match="resync"):
        RevisionBook(0)


async def test_the_recording_client_writes_applies_and_forgets_failed_calls():
    engine = await FakeEngine("127.0.0.21", TOKEN, available=("kv-align@3.2.1",)).start()
    client = AdminClient(TOKEN, retries=0, timeout=5.0)
    b, _ = book()
    admin = RecordingAdmin(client, b)
    address = (engine.host, engine.port)
    try:
        limit = asyncio.Semaphore(4)
        assert (await engine_answer(b, admin, address, RUN, limit)).revision == "base"
        assert (await engine_answer(b, admin, address, RUN, limit)).revision == "base"
        assert len(engine.tokens) == 1                       # the second answer came from the book
        assert await admin.apply(*address, "kv-align", "3.2.1", {"builtin": {}}) == "kv-align@3.2.1"
        assert (await engine_answer(b, admin, address, RUN, limit)).revision == "kv-align@3.2.1"
        assert len(engine.tokens) == 2                       # the apply, and no question after it
        engine.refuse = 409
        with pytest.raises(AdminError):
            await admin.apply(*address, "kv-align", "3.2.1", {"builtin": {}}, {"x": 1})
        assert b.known(address, RUN) is None                 # a failed call may have changed anything
        admin.token = "rotated"                              # settings reach the client itself
        assert client.token == "rotated"
    finally:
        await client.aclose()
        await engine.stop()
