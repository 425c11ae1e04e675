"""An engine refusing the admin token: retried for a few ticks (a rotation reaches the operator and the
engines at different moments), then final."""
from __future__ import annotations

from operator_cluster import TOKEN, create, events_with, get_rollout, manifest, phase_is, until


async def test_a_token_refused_for_good_fails_the_rollout_after_a_few_ticks(cluster, namespace, fleet, operator,
                                                                            prometheus):
    engines = await fleet(2)
    for e in engines:
        e.token = "another-token"
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    failed = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 30, what="Failed")
    assert failed["status"]["reason"] == "Unauthorized"
    assert await events_with(cluster, namespace, "Unauthorized")
    assert all(e.posts == 0 for e in engines)     # refused already when asked for their revision


async def test_a_token_refused_for_a_moment_does_not_fail_the_rollout(cluster, namespace, fleet, operator,
                                                                      prometheus):
    engines = await fleet(2)
    engines[0].token = "rotating"
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    held = await until(lambda: _message_has(cluster, namespace, "the admin token may be rotating"), 20,
                       what="a retried refusal")
    assert held["status"]["phase"] in ("Pending", "Progressing")
    engines[0].token = TOKEN                      # the engine has read its rotated token file
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), 60, what="Promoted")


async def _message_has(cluster, namespace, text):
    obj = await get_rollout(cluster.kube, namespace, "kv-align")
    return obj if text in (obj.get("status") or {}).get("message", "") else None
