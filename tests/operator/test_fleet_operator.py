"""The fleet's durable state through the real operator: kopf, the API server emulator, fake engines.

A promotion records the patch in the fleet's PatchFleet; from then on every pod the fleet's selector
picks is converged to it, however it arrives.
"""
from __future__ import annotations

import asyncio

from graft.operator.kube import fleet_path, pods_path, rollout_path

from operator_cluster import (CHECKS, create, create_pod, events_of, get_rollout, manifest as _manifest, phase_is,
                              set_pod_status, until)
from operator_fakes import FakeEngine, Health

PATCHED = "graft.dev/patched"


# A rollout of these fake engines promotes in under 10 s alone; in `make test` the other worker runs
# real fleets beside this operator thread, which then gets a fraction of a core.
PROMOTED_WITHIN = 150
# and its Prometheus then scrapes late: a 2 s window over a revision's new series can hold fewer than
# the two samples increase() needs for as long as that lasts, so these rollouts judge 8 s windows
# and may hold a step well past its pause: these tests are about what the fleet records, so a slow
# judgement neither pauses them (no inconclusive limit) nor rolls them back (a 3 minute deadline)
WIDE = {**{role: [{**check, "window": "8s"} for check in checks] for role, checks in CHECKS.items()},
        "inconclusiveLimit": 0}


def manifest(prometheus, **spec):
    return _manifest(prometheus, analysis=WIDE, **{"progressDeadline": "3m", **spec})


async def fleets(cluster, namespace):
    return await cluster.kube.list(fleet_path(namespace))


def condition(obj, kind):
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


async def test_a_pod_added_after_promotion_is_patched_labelled_and_let_in(cluster, namespace, fleet, operator,
                                                                           prometheus):
    engines = await fleet(2)
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), PROMOTED_WITHIN, what="Promoted")
    rollout = await get_rollout(cluster.kube, namespace, "kv-align")
    assert rollout["status"]["fleet"] == "llm-engine"
    promoted = condition(rollout, "Promoted")
    assert promoted["status"] == "True" and promoted["lastTransitionTime"]
    (pfl,) = await fleets(cluster, namespace)
    assert [p["name"] + "@" + p["version"] for p in pfl["spec"]["patches"]] == ["kv-align@3.2.1"]

    # scale up: a third pod arrives on base, after every rollout has ended
    newcomer = await FakeEngine("127.0.0.9", engines[0].token).start()
    try:
        await create_pod(cluster.kube, namespace, "engine-new", newcomer)
        await until(lambda: newcomer.applied == {"kv-align": "3.2.1"}, 60, what="the new pod patched")
        pod = await until(lambda: _pod_with_condition(cluster, namespace, "engine-new"), 60,
                          what="graft.dev/patched on the new pod")
        assert pod["metadata"]["labels"]["graft.dev/track"] == "stable"
        assert pod["metadata"]["annotations"]["graft.dev/patches"] == "kv-align@3.2.1"
        status = await until(lambda: _fleet_converged(cluster, namespace, 3), 60, what="fleet converged")
        assert status["revision"] == "kv-align@3.2.1" and status["pending"] == []
        # a restart without the patch (as if its annotation had been lost) is converged again
        newcomer.restart()
        await set_pod_status(cluster.kube, namespace, "engine-new", newcomer)   # the kubelet: a new container
        await until(lambda: newcomer.applied == {"kv-align": "3.2.1"}, 60, what="re-patched after a restart")
    finally:
        await newcomer.stop()


async def _pod_with_condition(cluster, namespace, name):
    pod = await cluster.kube.get(pods_path(namespace, name))
    c = condition(pod, PATCHED)
    return pod if c and c["status"] == "True" else None


async def _fleet_converged(cluster, namespace, pods):
    items = await fleets(cluster, namespace)
    status = (items[0].get("status") or {}) if items else {}
    return status if status.get("pods") == pods and status.get("converged") == pods else None


async def test_a_second_rollout_on_the_same_fleet_queues_then_runs(cluster, namespace, fleet, operator, prometheus):
    await fleet(2, available=("kv-align@3.2.1", "sync-free@3.2.1"))
    await operator()
    first = manifest(prometheus, steps=[{"weight": 50, "pause": "4s"}, {"weight": 100}])
    await create(cluster, namespace, first)
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Progressing"), 30, what="first running")
    second = manifest(prometheus, name="sync-free", patch={"name": "sync-free", "version": "3.2.1",
                                                           "source": {"builtin": {}}})
    await create(cluster, namespace, second)
    queued = await until(lambda: _reason_is(cluster, namespace, "sync-free", "Queued"), 20, what="second queued")
    assert queued["status"]["phase"] == "Pending" and "kv-align" in queued["status"]["message"]
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), PROMOTED_WITHIN, what="first promoted")
    await until(lambda: phase_is(cluster, namespace, "sync-free", "Promoted"), PROMOTED_WITHIN, what="second promoted")
    (pfl,) = await fleets(cluster, namespace)
    assert sorted(p["name"] for p in pfl["spec"]["patches"]) == ["kv-align", "sync-free"]


async def _reason_is(cluster, namespace, name, reason):
    obj = await get_rollout(cluster.kube, namespace, name)
    return obj if (obj.get("status") or {}).get("reason") == reason else None


async def test_an_upgrade_swaps_versions_in_one_call_and_the_fleet_records_the_new_one(cluster, namespace, fleet,
                                                                                        operator, prometheus):
    engines = await fleet(2, available=("kv-align@3.2.1", "kv-align@3.2.2"))
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), PROMOTED_WITHIN, what="3.2.1 promoted")
    upgrade = manifest(prometheus, name="kv-align-3-2-2",
                       patch={"name": "kv-align", "version": "3.2.2", "source": {"builtin": {}}})
    await create(cluster, namespace, upgrade)
    await until(lambda: phase_is(cluster, namespace, "kv-align-3-2-2", "Promoted"), PROMOTED_WITHIN, what="3.2.2 promoted")
    assert [e.applied for e in engines] == [{"kv-align": "3.2.2"}] * 2
    assert sum(e.replaced for e in engines) == 2 and sum(e.deletes for e in engines) == 0
    (pfl,) = await fleets(cluster, namespace)
    assert [p["version"] for p in pfl["spec"]["patches"]] == ["3.2.2"]
    rollout = await get_rollout(cluster.kube, namespace, "kv-align-3-2-2")
    assert rollout["status"]["stablePatch"] == "kv-align@3.2.1"


async def _upgrade_after_promotion(cluster, namespace, fleet, operator, prometheus, **engine_kwargs):
    engines = await fleet(2, available=("kv-align@3.2.1", "kv-align@3.2.2"), **engine_kwargs)
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), PROMOTED_WITHIN, what="3.2.1 promoted")
    return engines


async def _assert_all_back_on_3_2_1(cluster, namespace, engines):
    assert [e.applied for e in engines] == [{"kv-align": "3.2.1"}] * 2
    assert sum(e.deletes for e in engines) == 0, "never removed: no pod served base in between"
    for i in range(len(engines)):
        pod = await cluster.kube.get(pods_path(namespace, f"engine-{i}"))
        assert pod["metadata"]["annotations"]["graft.dev/patches"] == "kv-align@3.2.1"
    (pfl,) = await fleets(cluster, namespace)
    assert [p["name"] + "@" + p["version"] for p in pfl["spec"]["patches"]] == ["kv-align@3.2.1"]


async def test_a_failed_upgrade_swaps_its_canary_back_to_the_old_version(cluster, namespace, fleet, operator,
                                                                         prometheus):
    engines = await _upgrade_after_promotion(cluster, namespace, fleet, operator, prometheus,
                                             health={"kv-align@3.2.2": Health(error_ratio=0.5)})
    await create(cluster, namespace, manifest(prometheus, name="kv-align-3-2-2",
                                              patch={"name": "kv-align", "version": "3.2.2", "source": {"builtin": {}}}))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align-3-2-2", "RolledBack", "Promoted", "Failed"),
                      PROMOTED_WITHIN, what="the upgrade to end")
    assert (obj["status"]["phase"], obj["status"]["reason"]) == ("RolledBack", "AnalysisFailed"), obj["status"]
    await _assert_all_back_on_3_2_1(cluster, namespace, engines)
    assert sum(e.replaced for e in engines) == 2, "the canary swapped to 3.2.2 and back, each in one call"


async def test_an_upgrade_an_engine_refuses_leaves_every_pod_on_the_old_version(cluster, namespace, fleet, operator,
                                                                                prometheus):
    engines = await _upgrade_after_promotion(cluster, namespace, fleet, operator, prometheus)
    for e in engines:
        e.refuse = 422         # its self-check failed: the engine kept the table it had
    await create(cluster, namespace, manifest(prometheus, name="kv-align-3-2-2",
                                              patch={"name": "kv-align", "version": "3.2.2", "source": {"builtin": {}}}))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align-3-2-2", "RolledBack", "Promoted", "Failed"),
                      PROMOTED_WITHIN, what="the upgrade to end")
    assert (obj["status"]["phase"], obj["status"]["reason"]) == ("RolledBack", "PatchVerifyFailed"), obj["status"]
    await _assert_all_back_on_3_2_1(cluster, namespace, engines)
    assert sum(e.replaced for e in engines) == 0


async def test_a_revert_rollout_takes_the_patch_out_of_every_pod_and_the_fleet(cluster, namespace, fleet, operator,
                                                                               prometheus):
    engines = await fleet(2)
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), PROMOTED_WITHIN, what="promoted")
    await create(cluster, namespace, manifest(prometheus, name="undo-kv-align", action="revert"))
    await until(lambda: phase_is(cluster, namespace, "undo-kv-align", "Promoted"), PROMOTED_WITHIN, what="revert promoted")
    assert [e.applied for e in engines] == [{}, {}]
    (pfl,) = await fleets(cluster, namespace)
    assert pfl["spec"].get("patches") in ([], None)
    await asyncio.sleep(1.5)             # and the fleet controller leaves them so
    assert [e.applied for e in engines] == [{}, {}]


async def _zone_a(cluster, namespace, pod="engine-0"):
    await cluster.kube.merge_patch(pods_path(namespace, pod), {"metadata": {"labels": {"zone": "a"}}})


async def test_a_rollout_over_part_of_a_fleet_holds_and_one_over_the_same_pods_uses_that_fleet(
        cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2)
    await _zone_a(cluster, namespace)
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), PROMOTED_WITHIN, what="promoted")

    # app=llm-engine,zone=a picks one pod of fleet llm-engine: two fleets over it would fight
    part = manifest(prometheus, name="zone-a-undo", action="revert",
                    selector={"matchLabels": {"app": "llm-engine", "zone": "a"}})
    await create(cluster, namespace, part)
    held = await until(lambda: _reason_is(cluster, namespace, "zone-a-undo", "FleetOverlap"), 30, what="an overlap hold")
    assert held["status"]["phase"] == "Pending"
    assert "PatchFleet llm-engine" in held["status"]["message"] and "engine-0" in held["status"]["message"]
    await asyncio.sleep(2)
    assert [e.applied for e in engines] == [{"kv-align": "3.2.1"}] * 2, "nothing touched"
    assert [f["metadata"]["name"] for f in await fleets(cluster, namespace)] == ["llm-engine"], "no second fleet"
    await cluster.kube.delete(rollout_path(namespace, "zone-a-undo"))

    # the same pods under another spelling (an expression, in another order) are the same fleet
    same = manifest(prometheus, name="undo", action="revert", selector={"matchExpressions": [
        {"key": "app", "operator": "In", "values": ["other", "llm-engine"]}, {"key": "app", "operator": "Exists"}]})
    await create(cluster, namespace, same)
    obj = await until(lambda: phase_is(cluster, namespace, "undo", "Promoted"), PROMOTED_WITHIN, what="revert promoted")
    assert obj["status"]["fleet"] == "llm-engine"
    assert [e.applied for e in engines] == [{}, {}]
    (pfl,) = await fleets(cluster, namespace)
    assert pfl["spec"].get("patches") in ([], None)


async def test_a_younger_fleet_over_pods_of_another_acts_on_none_of_them(cluster, namespace, fleet, operator,
                                                                          prometheus):
    engines = await fleet(2)
    await _zone_a(cluster, namespace)
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), PROMOTED_WITHIN, what="promoted")
    # someone applies a fleet for zone a that holds no patch: it would revert engine-0 as drift
    await cluster.kube.create(fleet_path(namespace), {
        "apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet", "metadata": {"name": "zone-a"},
        "spec": {"selector": {"matchLabels": {"app": "llm-engine", "zone": "a"}}, "patches": []}})

    async def stood_down():
        obj = await cluster.kube.get(fleet_path(namespace, "zone-a"))
        c = condition(obj, "Converged")
        return obj if c and c["reason"] == "FleetOverlap" else None

    obj = await until(stood_down, 30, what="the younger fleet to stand down")
    c = condition(obj, "Converged")
    assert c["status"] == "False" and "older PatchFleet llm-engine" in c["message"] and "engine-0" in c["message"]
    await asyncio.sleep(3)
    assert [e.applied for e in engines] == [{"kv-align": "3.2.1"}] * 2, "the younger fleet reverted nothing"
    assert sum(e.deletes for e in engines) == 0
    older = await cluster.kube.get(fleet_path(namespace, "llm-engine"))
    assert condition(older, "Converged")["status"] == "True", "the older fleet goes on as before"
    events = [e for e in await events_of(cluster.kube, namespace, "zone-a") if e["reason"] == "FleetOverlap"]
    assert len(events) == 1 and events[0]["type"] == "Warning"


async def test_gated_pods_whose_engines_disagree_get_no_fleet_until_they_agree(cluster, namespace, fleet, operator,
                                                                               prometheus):
    """Pods behind the readiness gate with no PatchFleet yet: a rollout creates the fleet, adopting
    what the engines run, only when they all run the same; adopting one of two revisions would
    revert the other pod's patch as drift."""
    engines = await fleet(2, gated=True)
    engines[1].applied = {"sync-free": "3.2.1"}          # set by hand, say, before any fleet existed
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    held = await until(lambda: _reason_is(cluster, namespace, "kv-align", "NoPods"), 30, what="the rollout to wait")
    assert held["status"]["phase"] == "Pending"
    await asyncio.sleep(3)
    assert await fleets(cluster, namespace) == [], "no fleet adopted one of two revisions"
    assert [e.applied for e in engines] == [{}, {"sync-free": "3.2.1"}] and sum(e.deletes for e in engines) == 0

    engines[1].applied = {}                               # now both run base
    (pfl,) = await until(lambda: fleets(cluster, namespace), 30, what="the fleet, once the engines agree")
    assert pfl["spec"].get("patches") in ([], None), "it adopted base, what both run"
    for i in range(2):
        await until(lambda: _pod_with_condition(cluster, namespace, f"engine-{i}"), 30,
                    what=f"the gate of engine-{i} opened")
