"""An engine refusing the admin token: retried for a grace in seconds and at least a few ticks (a
rotation reaches the operator and the engines at different moments), then final."""
from __future__ import annotations

import time

from operator_cluster import TOKEN, create, events_with, manifest, phase_is, until


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
    """The engine takes the rotated token after two refused calls: fewer than the ticks the operator
    asks again for, whatever the grace, so a slow machine cannot stretch the rotation past them."""
    engines = await fleet(2)
    engines[0].token, engines[0].rotated_token, engines[0].refusals_left = "rotating", TOKEN, 2
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), 60, what="Promoted")
    assert engines[0].refused == 2 and engines[1].refused == 0
    assert not await events_with(cluster, namespace, "Unauthorized")


async def test_a_refused_token_is_final_only_after_the_grace_in_seconds(cluster, namespace, fleet, operator,
                                                                        prometheus):
    """kubelet refreshes a mounted Secret within a minute or two: the operator keeps asking for
    GRAFT_ADMIN_TOKEN_GRACE seconds, many ticks, before a refusal fails the rollout."""
    engines = await fleet(2)
    for e in engines:
        e.token = "another-token"
    await operator(admin_token_grace=3.0)
    started = time.monotonic()
    await create(cluster, namespace, manifest(prometheus))
    failed = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 30, what="Failed")
    assert time.monotonic() - started >= 3.0
    assert failed["status"]["reason"] == "Unauthorized" and "refused for" in failed["status"]["message"]
    assert max(e.refused for e in engines) > 3, "asked again on every tick of the grace"
