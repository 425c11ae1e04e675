"""The operator reads pods from a watch, not a list per tick: through the real operator (kopf, the
API server emulator counting every request it gets, fake engines counting every admin call), a
fleet at rest makes no pod LIST however often it ticks, yet a pod added, deleted or relabelled is
seen at once; a watch the server ends is resumed, one refused as too old (410 Gone) or broken off
is listed anew; and a rollout asks each engine once as it starts (from what the engines say, not
from memory), then no engine whose container the operator knows, tick after tick."""
from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest

from graft.devcluster.apimachinery import parse_target, verb
from graft.devcluster.apiserver import ApiServer
from graft.operator.kube import Kube, fleet_path, pods_path
from graft.operator.podcache import PodCache
from graft.rollout.spec import LabelSelector

from operator_cluster import Cluster, create, create_pod, manifest, until
from operator_fakes import FakeEngine

ROOT = Path(__file__).resolve().parents[2]
TEST_AGENT = "graft-test-client"     # the test's own calls carry it and are not counted
KV_ALIGN = {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}}
TICKS = 2.0                          # eight ticks of 0.25 s


class CountingApiServer(ApiServer):
    """The emulator, counting every call but the test's by "verb resource"."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.calls: Counter[str] = Counter()

    async def __call__(self, raw_request):
        if raw_request.headers.get("User-Agent") != TEST_AGENT:
            target = parse_target(raw_request.url.path)
            if target is not None:
                kind = verb(raw_request.method, target, dict(raw_request.query))
                sub = f"/{target.subresource}" if target.subresource else ""
                self.calls[f"{kind} {target.resource.plural}{sub}"] += 1
        return await super().__call__(raw_request)

    def expire_watches(self) -> None:
        """Make every open watch too old to go on: each is ended with 410 Gone, as an API server
        does once the changes it would resume from are compacted away."""
        self._store.log_floor = self._store.rv + 1
        self._store.wake()


@pytest.fixture
async def cluster():
    # this module's own emulator (the shared fixture's does not count calls)
    async with CountingApiServer(crd_paths=[ROOT / "crds"]) as api:
        kube = Kube(api.url, headers={"User-Agent": TEST_AGENT})
        handle = Cluster(kube, api.url, None)
        handle.api = api
        yield handle
        await kube.aclose()


async def _fleet_of(cluster, namespace, patches) -> None:
    await cluster.kube.create(fleet_path(namespace), {
        "apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet", "metadata": {"name": "llm-engine"},
        "spec": {"selector": {"matchLabels": {"app": "llm-engine"}}, "patches": patches}})


async def _fleet_status(cluster, namespace, pods: int):
    status = ((await cluster.kube.get(fleet_path(namespace, "llm-engine"))) or {}).get("status") or {}
    return status if status.get("pods") == pods and status.get("converged") == pods else None


def _state_calls(engines) -> int:
    """GET /admin/patches answered: every admin call less the applies and reverts."""
    return sum(len(e.tokens) - e.posts - e.deletes for e in engines)


async def test_a_fleet_at_rest_lists_no_pod_however_often_it_ticks(cluster, namespace, fleet, operator):
    await fleet(3)
    await _fleet_of(cluster, namespace, [KV_ALIGN])
    await operator()
    await until(lambda: _fleet_status(cluster, namespace, 3), 60, what="the fleet converged")
    before = Counter(cluster.api.calls)
    await asyncio.sleep(TICKS)
    calls = cluster.api.calls - before
    assert calls["list pods"] == 0, f"a tick lists no pod: {dict(calls)}"
    assert calls["get patchfleets"] >= 4, "and the fleet did tick meanwhile"
    assert cluster.api.calls["watch pods"] >= 1, "its pods come from a watch"


async def test_a_pod_added_deleted_or_relabelled_is_seen_at_once_through_the_watch(cluster, namespace, fleet,
                                                                                   operator):
    engines = await fleet(3)
    await _fleet_of(cluster, namespace, [KV_ALIGN])
    await operator()
    await until(lambda: _fleet_status(cluster, namespace, 3), 60, what="the fleet converged")
    lists = cluster.api.calls["list pods"]

    newcomer = await FakeEngine("127.0.0.19", engines[0].token).start()
    try:
        await create_pod(cluster.kube, namespace, "engine-new", newcomer)
        await until(lambda: newcomer.applied == {"kv-align": "3.2.1"}, 15, what="the new pod's engine patched")
        await until(lambda: _fleet_status(cluster, namespace, 4), 15, what="the fleet counting the new pod")

        await cluster.kube.delete(pods_path(namespace, "engine-0"))
        await until(lambda: _fleet_status(cluster, namespace, 3), 15, what="the fleet dropping the deleted pod")

        # relabelled out of the selector: no longer a member, and no longer written to
        await cluster.kube.merge_patch(pods_path(namespace, "engine-1"), {"metadata": {"labels": {"app": "other"}}})
        await until(lambda: _fleet_status(cluster, namespace, 2), 15, what="the fleet dropping the relabelled pod")
        status = await _fleet_status(cluster, namespace, 2)
        assert "engine-1" not in str(status)
    finally:
        await newcomer.stop()
    assert cluster.api.calls["list pods"] == lists, "every change came through the watch, none from a list"


async def test_a_watch_the_server_ends_is_resumed_and_one_too_old_is_listed_anew(cluster, namespace, fleet,
                                                                               operator):
    engines = await fleet(2)
    await _fleet_of(cluster, namespace, [KV_ALIGN])
    await operator(pod_watch_seconds=1)       # the server ends each watch request after a second
    await until(lambda: _fleet_status(cluster, namespace, 2), 60, what="the fleet converged")
    lists, watches = cluster.api.calls["list pods"], cluster.api.calls["watch pods"]
    await until(lambda: cluster.api.calls["watch pods"] >= watches + 2, 10, what="the ended watch resumed")
    assert cluster.api.calls["list pods"] == lists, "a watch the server ended resumes where it was: no list"

    cluster.api.expire_watches()
    await until(lambda: cluster.api.calls["list pods"] > lists, 10, what="the expired watch listed anew")
    # what changes after the relist is seen: a new pod joins the fleet
    newcomer = await FakeEngine("127.0.0.19", engines[0].token).start()
    try:
        await create_pod(cluster.kube, namespace, "engine-new", newcomer)
        await until(lambda: _fleet_status(cluster, namespace, 3), 15, what="the fleet counting the new pod")
    finally:
        await newcomer.stop()


class BreakingKube(Kube):
    """A client whose next `breaks` watch requests break off, as a dropped connection does."""

    breaks = 0

    async def watch(self, path, **kwargs):
        if self.breaks:
            self.breaks -= 1
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
        async for event in super().watch(path, **kwargs):
            yield event


async def test_a_watch_broken_off_is_established_again_from_a_fresh_list(cluster, namespace):
    kube = BreakingKube(cluster.url)
    kube.breaks = 2
    cache = PodCache(lambda: kube, watch_seconds=30, retry=0.05)
    selector = LabelSelector({"app": "llm-engine"})
    try:
        assert await cache.pods(namespace, selector) == []
        await cluster.kube.create(pods_path(namespace), {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "engine-0", "labels": {"app": "llm-engine"}},
            "spec": {"containers": [{"name": "engine", "image": "graft:dev"}]}})

        async def seen():
            return [p["metadata"]["name"] for p in await cache.pods(namespace, selector)]
        assert await until(seen, 10, what="the pod seen after the watch broke off twice") == ["engine-0"]
        assert cache.lists >= 2, "each break is followed by a fresh list"

        await cluster.kube.merge_patch(pods_path(namespace, "engine-0"), {"metadata": {"labels": {"app": "x"}}})
        await until(lambda: _empty(cache.pods(namespace, selector)), 10, what="the relabelled pod leaving")
        assert [p["metadata"]["name"] for p in await cache.pods(namespace)] == ["engine-0"], \
            "still in the namespace, only no longer selected"
    finally:
        await cache.aclose()
        await kube.aclose()


async def _empty(pods) -> bool:
    return not await pods


async def test_a_rollout_asks_each_engine_once_as_it_starts_and_then_none_it_knows(cluster, namespace, fleet,
                                                                                    operator, prometheus):
    engines = await fleet(4)
    await _fleet_of(cluster, namespace, [])      # a fleet that runs nothing: every engine asked once
    await operator()
    await until(lambda: _fleet_status(cluster, namespace, 4), 60, what="the fleet converged")
    await asyncio.sleep(1.0)                     # some ticks at rest: every engine's revision is known
    asked = _state_calls(engines)
    await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 50, "pause": "1h"}, {"weight": 100}]))
    await until(lambda: sum(e.posts for e in engines) >= 2, 30, what="the 50% step's canaries patched")
    # the start: the book may be as old as the slow resync, so every engine is asked, once
    started = _state_calls(engines)
    assert len(engines) <= started - asked <= 2 * len(engines), \
        f"{started - asked} questions for {len(engines)} engines as the rollout started"
    await asyncio.sleep(2.0)                     # ticks of the step: the operator knows every container
    assert _state_calls(engines) == started, "no engine was asked what the operator knew it runs"
