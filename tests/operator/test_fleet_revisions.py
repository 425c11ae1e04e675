"""A fleet's work follows change, not its size: through the real operator (kopf, the API server
emulator, fake engines that count every admin call), an engine is asked its revision only when the
operator does not know it: a new or restarted container, or the slow resync."""
from __future__ import annotations

import asyncio

from graft.operator.kube import fleet_path

from operator_cluster import create_pod, set_pod_status, until
from operator_fakes import FakeEngine

KV_ALIGN = {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}}
TICKS = 2.0          # eight ticks of 0.25 s


async def _fleet_of(cluster, namespace, patches) -> None:
    await cluster.kube.create(fleet_path(namespace), {
        "apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet", "metadata": {"name": "llm-engine"},
        "spec": {"selector": {"matchLabels": {"app": "llm-engine"}}, "patches": patches}})


async def _converged(cluster, namespace, pods: int):
    status = ((await cluster.kube.get(fleet_path(namespace, "llm-engine"))) or {}).get("status") or {}
    return status if status.get("pods") == pods and status.get("converged") == pods else None


def calls(engines) -> list[int]:
    return [len(e.tokens) for e in engines]


async def test_a_fleet_at_rest_asks_no_engine_whose_container_is_unchanged(cluster, namespace, fleet, operator):
    engines = await fleet(3)
    await _fleet_of(cluster, namespace, [KV_ALIGN])
    await operator()
    await until(lambda: _converged(cluster, namespace, 3), 60, what="the fleet converged")
    assert [e.applied for e in engines] == [{"kv-align": "3.2.1"}] * 3
    before = calls(engines)
    await asyncio.sleep(TICKS)
    assert calls(engines) == before, "no admin call at rest: the operator knows what each engine runs"
    assert await _converged(cluster, namespace, 3), "and the fleet still says so"


async def test_a_restarted_or_new_container_is_asked_at_once(cluster, namespace, fleet, operator):
    engines = await fleet(2)
    await _fleet_of(cluster, namespace, [KV_ALIGN])
    await operator()          # the default resync: five minutes, far beyond this test
    await until(lambda: _converged(cluster, namespace, 2), 60, what="the fleet converged")
    before = calls(engines)

    # the container restarts without its patch: a new containerID and restartCount in the pod's status
    engines[0].restart()
    await set_pod_status(cluster.kube, namespace, "engine-0", engines[0])
    await until(lambda: engines[0].applied == {"kv-align": "3.2.1"}, 15, what="the restarted engine patched again")
    assert calls(engines)[1] == before[1], "the engine that did not restart was not asked"

    # a new pod at a new address
    newcomer = await FakeEngine("127.0.0.19", engines[0].token).start()
    try:
        await create_pod(cluster.kube, namespace, "engine-new", newcomer)
        await until(lambda: newcomer.applied == {"kv-align": "3.2.1"}, 15, what="the new engine patched")
        await until(lambda: _converged(cluster, namespace, 3), 30, what="the fleet converged again")
        settled = calls([*engines, newcomer])
        await asyncio.sleep(TICKS)
        assert calls([*engines, newcomer]) == settled, "once known, none of them is asked again"
    finally:
        await newcomer.stop()


async def test_the_slow_resync_finds_a_revision_changed_behind_the_operators_back(cluster, namespace, fleet,
                                                                                  operator):
    engines = await fleet(2, available=("kv-align@3.2.1", "sync-free@3.2.1"))
    await _fleet_of(cluster, namespace, [KV_ALIGN])
    await operator(fleet_resync=3.0)
    await until(lambda: _converged(cluster, namespace, 2), 60, what="the fleet converged")
    # someone with the token applies a patch the fleet does not hold, straight to the engine
    engines[1].applied["sync-free"] = "3.2.1"
    await until(lambda: engines[1].deletes >= 1, 20, what="the resync to find the drift")
    assert engines[1].applied == {"kv-align": "3.2.1"}, "the drift was reverted"
    assert engines[0].deletes == 0 and engines[0].applied == {"kv-align": "3.2.1"}
