"""Which pods the operator calls, and where: only engines of a workload (a controller that exists with
the ownerReference's uid and whose pod template runs the pod's containers), on the admin port of
that template. A pod that merely carries the selector's labels gets no label, no call, no token."""
import asyncio

import pytest

from graft.operator.kube import fleet_path, pods_path
from graft.api import Reason
from graft.operator.pods import NoPodIP
from graft.rollout.observation import PodError

from operator_cluster import TOKEN, create, events_of, events_with, manifest, phase_is, set_pod_status, until
from operator_fakes import FakeEngine

pytestmark = pytest.mark.timeout(120)


def test_a_pod_without_an_ip_is_asked_again():
    assert not PodError(NoPodIP("pod a has no IP yet").kind, "").permanent


async def trap(cluster, namespace, name, engine, owner=None, image="graft:dev", labels=None):
    """A pod with the rollout's labels (or `labels`), played by `engine`, with `owner` as its
    controller ownerReference."""
    await cluster.kube.create(pods_path(namespace), {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": "llm-engine"},
                     **({"ownerReferences": [owner]} if owner else {})},
        "spec": {"containers": [{"name": "engine", "image": image,
                                 "ports": [{"name": "admin", "containerPort": engine.port}]}]}})
    await set_pod_status(cluster.kube, namespace, name, engine)


def owned_by(deployment: dict, uid: str | None = None) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"],
            "uid": uid or deployment["metadata"]["uid"], "controller": True}


async def test_pods_that_are_no_engines_get_no_call_no_token_and_no_label(cluster, namespace, fleet, operator,
                                                                        prometheus):
    engines = await fleet(2)
    traps = [await FakeEngine(f"127.0.0.{10 + i}", TOKEN).start() for i in range(3)]
    try:
        owner = await cluster.kube.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/engine-0")
        await trap(cluster, namespace, "trap-orphan", traps[0])
        await trap(cluster, namespace, "trap-forged", traps[1], owned_by(owner, uid="forged-uid"))
        await trap(cluster, namespace, "trap-image", traps[2], owned_by(owner), image="attacker:latest")
        await operator()
        await create(cluster, namespace, manifest(prometheus))
        await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), 60)
        assert all(e.revision == "kv-align@3.2.1" for e in engines)
        for t in traps:
            assert (t.tokens, t.posts, t.deletes, t.applied) == ([], 0, 0, {}), "a trap pod was called"
        assert all(TOKEN in e.tokens for e in engines)
        for name in ("trap-orphan", "trap-forged", "trap-image"):
            pod = await cluster.kube.get(pods_path(namespace, name))
            assert "graft.dev/track" not in (pod["metadata"].get("labels") or {})
        events = await until(lambda: events_with(cluster, namespace, Reason.NOT_AN_ENGINE), 10)
        messages = sorted(e["message"] for e in events if e["reason"] == Reason.NOT_AN_ENGINE)
        assert len(messages) == 3, messages     # once per pod
        assert "pod trap-forged" in messages[0] and "has another uid" in messages[0]
        assert "pod trap-image" in messages[1] and "image 'attacker:latest', not 'graft:dev'" in messages[1]
        assert "pod trap-orphan" in messages[2] and "no controller ownerReference" in messages[2]
    finally:
        for t in traps:
            await t.stop()


async def test_a_rollout_over_no_engine_waits_and_says_why(cluster, namespace, needs_fake_pods, operator,
                                                          prometheus):
    engine = await FakeEngine("127.0.0.9", TOKEN).start()
    try:
        await trap(cluster, namespace, "trap-orphan", engine)
        await operator()
        await create(cluster, namespace, manifest(prometheus))
        obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Pending"), 20)
        obj = await until(lambda: _reason(cluster, namespace, Reason.NOT_AN_ENGINE), 20)
        assert "only pods left alone (pod trap-orphan: it has no controller ownerReference" in obj["status"]["message"]
        assert engine.tokens == [], "a pod left alone received an admin call"
    finally:
        await engine.stop()


async def _reason(cluster, namespace, reason):
    obj = await cluster.kube.get(f"/apis/graft.dev/v1alpha1/namespaces/{namespace}/patchrollouts/kv-align")
    return obj if (obj.get("status") or {}).get("reason") == reason else None


async def test_a_pod_labelled_into_two_fleets_makes_no_overlap(cluster, namespace, fleet, operator, prometheus):
    """Fleet overlap is judged on members: a trap pod carrying the labels of the fleet `batch` and of
    a rollout over other engines belongs to neither, so the rollout is not held for an overlap."""
    engines = await fleet(2)
    decoy = await FakeEngine("127.0.0.12", TOKEN).start()
    try:
        await cluster.kube.create(fleet_path(namespace), {
            "apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet", "metadata": {"name": "batch"},
            "spec": {"selector": {"matchLabels": {"tier": "batch"}}, "patches": []}})
        await trap(cluster, namespace, "trap-both", decoy, labels={"app": "llm-engine", "tier": "batch"})
        await operator()
        await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 100}]))   # one step will do
        obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted", "Failed"), 90,
                          what="the rollout to end")
        assert obj["status"]["phase"] == "Promoted", obj["status"]
        assert obj["status"]["fleet"] == "llm-engine"
        assert [e.applied for e in engines] == [{"kv-align": "3.2.1"}] * 2
        for name in ("kv-align", "batch"):
            assert not [e for e in await events_of(cluster.kube, namespace, name) if e["reason"] == "FleetOverlap"]
        batch = await cluster.kube.get(fleet_path(namespace, "batch"))
        assert (batch.get("status") or {}).get("pods", 0) == 0
        assert decoy.tokens == [], "the trap pod received an admin call"
    finally:
        await decoy.stop()
