"""Finished rollouts go away through the real operator (kopf against the API server emulator): a
rollout's own ttlSecondsAfterFinished, and its fleet's revisionHistoryLimit.

The rollouts here are aborted before they start, so they finish (RolledBack) in their first
reconciliation, with no engine and no Prometheus; they still name their fleet as any finished one does.
"""
from __future__ import annotations

import asyncio
import re
import time

import pytest

from graft.operator.fleet import find_or_create_fleet
from graft.operator.history import delete
from graft.operator.kube import fleet_path, rollout_path, rollouts_path
from graft.operator.runtime import Runtime
from graft.operator.settings import OperatorSettings
from graft.rollout.history import plan, record
from graft.rollout.spec import parse_selector
from graft.rollout.status import from_time, to_time

from operator_cluster import TOKEN, create, events_of, get_rollout, phase_is, until

pytestmark = pytest.mark.timeout(60)
SELECTOR = {"matchLabels": {"app": "llm-engine"}}


def aborted(name, **spec):
    """A rollout that finishes RolledBack (reason Aborted) as soon as the operator sees it."""
    return {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout",
            "metadata": {"name": name, "annotations": {"graft.dev/abort": "true"}},
            "spec": {"selector": SELECTOR, "patch": {"name": "kv-align", "version": "3.2.1",
                                                     "source": {"builtin": {}}}, **spec}}


def completed_at(obj):
    (c,) = [c for c in obj["status"]["conditions"] if c["type"] == "Completed"]
    assert c["status"] == "True"
    return from_time(c["lastTransitionTime"])


async def names(cluster, namespace):
    return {r["metadata"]["name"] for r in await cluster.kube.list(rollouts_path(namespace))}


async def test_a_finished_rollout_is_deleted_its_ttl_after_it_finished(cluster, namespace, operator):
    await operator()
    await create(cluster, namespace, aborted("short-lived", ttlSecondsAfterFinished=1))
    await create(cluster, namespace, aborted("kept"))
    done = await until(lambda: phase_is(cluster, namespace, "short-lived", "RolledBack"), 15, what="RolledBack")
    finished = completed_at(done)
    await until(lambda: _gone(cluster, namespace, "short-lived"), 15, interval=0.05, what="deleted")
    assert time.time() - finished < 15
    (event,) = [e for e in await events_of(cluster.kube, namespace, "short-lived") if e["reason"] == "TTLExpired"]
    assert event["type"] == "Normal" and event["message"].endswith("after it finished RolledBack "
                                                                   "(ttlSecondsAfterFinished: 1)"), event
    # when the operator decided, measured from the finish time it read, not from this test's polling
    assert float(re.match(r"deleted ([0-9.]+)s after", event["message"]).group(1)) >= 1.0
    # without a TTL, and within its fleet's default history of ten, a finished rollout stays
    assert await phase_is(cluster, namespace, "kept", "RolledBack")
    assert (await cluster.kube.get(fleet_path(namespace, "llm-engine")))["spec"]["revisionHistoryLimit"] == 10


async def _gone(cluster, namespace, name):
    return await get_rollout(cluster.kube, namespace, name) is None


async def test_a_fleet_keeps_only_its_newest_finished_rollouts_and_says_which_it_deleted(cluster, namespace,
                                                                                          operator):
    await cluster.kube.create(fleet_path(namespace), {
        "apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet", "metadata": {"name": "llm-engine"},
        "spec": {"selector": SELECTOR, "revisionHistoryLimit": 1}})
    await operator()
    # an active rollout on the fleet (created paused, so it waits in Pending): never deleted
    waiting = aborted("waiting", paused=True)
    del waiting["metadata"]["annotations"]
    await create(cluster, namespace, waiting)
    for name in ("first", "second"):
        await finish(cluster, namespace, name)
    await until(lambda: _names_are(cluster, namespace, {"second", "waiting"}), 15, what="only the newest kept")
    # and a rollout finishing later takes the place of the one kept before
    await finish(cluster, namespace, "third")
    await until(lambda: _names_are(cluster, namespace, {"third", "waiting"}), 15, what="the second deleted")
    assert (await get_rollout(cluster.kube, namespace, "waiting"))["status"]["phase"] == "Pending"

    pruned = await until(lambda: _pruned(cluster, namespace, 2), 10, what="two HistoryPruned events")
    assert [e["type"] for e in pruned] == ["Normal", "Normal"]
    assert {e["involvedObject"]["kind"] for e in pruned} == {"PatchFleet"}
    assert sorted(e["message"] for e in pruned) == [
        f"deleted PatchRollout {name} (RolledBack): the fleet keeps 1 finished rollout (revisionHistoryLimit)"
        for name in ("first", "second")]


async def finish(cluster, namespace, name):
    await create(cluster, namespace, aborted(name))
    done = await until(lambda: phase_is(cluster, namespace, name, "RolledBack"), 15, what=f"{name} RolledBack")
    assert done["status"]["fleet"] == "llm-engine"


async def _names_are(cluster, namespace, expected):
    return await names(cluster, namespace) == expected


async def _pruned(cluster, namespace, n):
    items = [e for e in await events_of(cluster.kube, namespace, "llm-engine") if e["reason"] == "HistoryPruned"]
    return items if len(items) >= n else None


async def test_rollouts_finishing_together_on_a_new_selector_share_one_fleet(cluster, namespace):
    """Two rollouts on a selector with no fleet yet (both finished in the same tick, as above) each
    create it: the second creation loses the race, and names the fleet the first one created."""
    selector = parse_selector(SELECTOR)
    names = await asyncio.gather(*(find_or_create_fleet(cluster.kube, namespace, selector, "base") for _ in range(3)))
    assert names == ["llm-engine"] * 3
    assert [f["metadata"]["name"] for f in await cluster.kube.list(fleet_path(namespace))] == ["llm-engine"]


async def test_a_rollout_retried_after_the_decision_to_delete_it_is_left_alone(cluster, namespace):
    """The decision is made on a list; the deletion reads the rollout again first: one retried since
    (`graft rollout retry` clears its status) is no longer what was decided on."""
    body = aborted("retried")
    del body["metadata"]["annotations"]
    await create(cluster, namespace, body)
    status_path = rollout_path(namespace, "retried") + "/status"
    done = {"phase": "RolledBack", "reason": "Aborted", "conditions": [
        {"type": "Completed", "status": "True", "lastTransitionTime": to_time(time.time() - 10)}]}
    await cluster.kube.merge_patch(status_path, {"status": done})
    (decided,) = plan([record(await get_rollout(cluster.kube, namespace, "retried"))], limit=0, now=time.time())
    await cluster.kube.merge_patch(status_path, {"status": {"phase": "Pending", "reason": None, "conditions": None}})
    runtime = Runtime(OperatorSettings(admin_token=TOKEN))
    runtime.kube = cluster.kube
    try:
        assert await delete(runtime, namespace, decided) is None
        assert await get_rollout(cluster.kube, namespace, "retried") is not None
        await cluster.kube.merge_patch(status_path, {"status": done})    # finished again, as decided
        assert (await delete(runtime, namespace, decided))["metadata"]["name"] == "retried"
        assert await get_rollout(cluster.kube, namespace, "retried") is None
    finally:
        runtime.kube = None           # the fixture's client, closed by the fixture
        await runtime.close()


class RacingKube:
    """The cluster's client, with someone else's write landing right after the first read of `path`:
    between the deletion's last look at a rollout and its DELETE."""

    def __init__(self, kube, path, write):
        self._kube, self._path, self._write = kube, path, write

    def __getattr__(self, name):
        return getattr(self._kube, name)

    async def get(self, path, **params):
        obj = await self._kube.get(path, **params)
        if path == self._path and self._write is not None:
            write, self._write = self._write, None
            await write()
        return obj


async def finished_rollout(cluster, namespace, name):
    """A rollout RolledBack ten seconds ago (no operator runs here: its status is written directly)."""
    body = aborted(name)
    del body["metadata"]["annotations"]
    await create(cluster, namespace, body)
    done = {"phase": "RolledBack", "reason": "Aborted", "conditions": [
        {"type": "Completed", "status": "True", "lastTransitionTime": to_time(time.time() - 10)}]}
    await cluster.kube.merge_patch(rollout_path(namespace, name) + "/status", {"status": done})
    return await get_rollout(cluster.kube, namespace, name)


@pytest.mark.parametrize("meanwhile", ["changed", "recreated"])
async def test_a_rollout_written_between_the_last_look_and_the_delete_is_left_alone(cluster, namespace, meanwhile):
    """The DELETE carries the uid and resourceVersion the deletion last read as preconditions: a
    rollout changed, or deleted and created again under its name, after that read is refused by the
    API server (409 Conflict) and stays; the next tick decides on it afresh."""
    path = rollout_path(namespace, "raced")
    first = await finished_rollout(cluster, namespace, "raced")
    (decided,) = plan([record(first)], limit=0, now=time.time())

    async def change():
        await cluster.kube.merge_patch(path, {"metadata": {"annotations": {"team": "inference"}}})

    async def recreate():
        await cluster.kube.delete(path)
        await finished_rollout(cluster, namespace, "raced")

    runtime = Runtime(OperatorSettings(admin_token=TOKEN))
    runtime.kube = RacingKube(cluster.kube, path, change if meanwhile == "changed" else recreate)
    try:
        assert await delete(runtime, namespace, decided) is None
        kept = await get_rollout(cluster.kube, namespace, "raced")
        assert kept is not None
        if meanwhile == "changed":
            assert kept["metadata"]["annotations"] == {"team": "inference"}
        else:
            assert kept["metadata"]["uid"] != first["metadata"]["uid"]
        runtime.kube = cluster.kube
        (again,) = plan([record(kept)], limit=0, now=time.time())      # the next tick: still history, deleted
        assert (await delete(runtime, namespace, again))["metadata"]["uid"] == kept["metadata"]["uid"]
        assert await get_rollout(cluster.kube, namespace, "raced") is None
    finally:
        runtime.kube = None
        await runtime.close()
