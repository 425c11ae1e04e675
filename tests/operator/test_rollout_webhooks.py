"""Webhooks and notifications end to end: the real operator calls a rollout's hooks on 127.0.0.1 in
order with their payloads, holds on a refusing confirm-promotion until it answers 2xx, ends a
rollout whose pre-rollout hook fails before touching any pod, rolls back on a failing rollout hook,
and tells each notification receiver once per moment it asked for."""
import json

import pytest

from operator_cluster import create, events_of, get_rollout, manifest, phase_is, until
from receivers import receivers  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(150)


def hooks(receivers, *kinds, **urls):
    return [{"name": k, "type": k, "url": urls.get(k.replace("-", "_"), receivers.url(k)), "timeout": "2s",
             "retries": 0, "metadata": {"team": "serving"}} for k in kinds]


def notifications(receivers) -> str:
    return json.dumps([{"name": "chat", "type": "slack", "url": receivers.url("chat")},
                       {"name": "audit", "type": "webhook", "url": receivers.url("audit"),
                        "moments": ["started", "step", "paused", "promoted", "rolledBack", "failed"]}])


async def test_hooks_are_called_in_order_and_confirm_promotion_holds_until_it_says_yes(
        cluster, namespace, fleet, operator, prometheus, receivers):
    engines = await fleet(3)
    await operator(notifications=notifications(receivers))
    receivers.script["confirm-promotion"] = [403]
    spec = hooks(receivers, "confirm-rollout", "pre-rollout", "rollout", "confirm-promotion", "post-rollout",
                 "rollback")
    await create(cluster, namespace, manifest(prometheus, webhooks=spec))

    async def waiting():
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        return obj if (obj.get("status") or {}).get("reason") == "AwaitingConfirmation" else None

    obj = await until(waiting, 60, what="the step before the last waiting for confirm-promotion")
    assert obj["status"]["stepIndex"] == 1
    assert "webhook confirm-promotion (HTTP 403: " in obj["status"]["message"]
    assert sum(e.revision != "base" for e in engines) < 3, "not promoted while the hook refuses"
    receivers.script["confirm-promotion"] = [200]
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), 60, what="Promoted")
    await until(lambda: receivers.got.get("post-rollout"), 10, what="the post-rollout hook")

    order = list(dict.fromkeys(receivers.order))      # each hook's first call, in order
    hooks_seen = [p for p in order if p not in ("chat", "audit")]
    assert hooks_seen == ["confirm-rollout", "pre-rollout", "rollout", "confirm-promotion", "post-rollout"], order
    assert "rollback" not in receivers.got
    pre = receivers.got["pre-rollout"][0]
    assert (pre["hook"], pre["rollout"], pre["namespace"], pre["metadata"]) == (
        "pre-rollout", "kv-align", namespace, {"team": "serving"})
    assert pre["patch"]["ref"] == "kv-align@3.2.1"
    assert receivers.got["post-rollout"][0]["phase"] == "Promoted"
    assert all(r["hook"] == "rollout" and "analysis" in r for r in receivers.got["rollout"])
    reasons = [e["reason"] for e in await events_of(cluster.kube, namespace, "kv-align")]
    assert reasons.count("AwaitingConfirmation") == 1 and "Confirmed" in reasons, reasons

    await until(lambda: len(receivers.got.get("chat", [])) >= 1 and receivers.got.get("audit"), 10,
                what="the notifications")
    moments = [b["moment"] for b in receivers.got["audit"]]
    assert moments[0] == "started" and moments[-1] == "promoted", moments
    assert moments.count("promoted") == 1 and moments.count("started") == 1, moments
    assert "paused" in moments, "the wait for confirmation is a pause a person hears of"
    chat = [b["text"] for b in receivers.got["chat"]]
    assert chat[-1].startswith("*kv-align@3.2.1 promoted in ") and len(chat) == 2, chat  # paused, promoted


async def test_a_failing_pre_rollout_hook_ends_the_rollout_before_any_pod_is_touched(
        cluster, namespace, fleet, operator, prometheus, receivers):
    engines = await fleet(3)
    await operator(notifications=notifications(receivers))
    spec = hooks(receivers, "pre-rollout", "post-rollout", pre_rollout=receivers.url("refuse"))
    await create(cluster, namespace, manifest(prometheus, webhooks=spec))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 60, what="Failed")
    assert obj["status"]["reason"] == "PreRolloutFailed"
    assert obj["status"]["message"] == ("pre-rollout webhook pre-rollout failed: HTTP 403: change freeze until "
                                        "Monday; no pod was touched")
    assert all(e.revision == "base" for e in engines) and not any(e.posts for e in engines)
    await until(lambda: receivers.got.get("post-rollout"), 10, what="the post-rollout hook")
    assert receivers.got["post-rollout"][0]["phase"] == "Failed"
    await until(lambda: receivers.got.get("audit"), 10, what="the notification")
    assert [b["moment"] for b in receivers.got["audit"]] == ["failed"]


async def test_a_failing_rollout_hook_rolls_back_and_calls_the_rollback_hook(
        cluster, namespace, fleet, operator, prometheus, receivers):
    engines = await fleet(3)
    await operator(notifications=notifications(receivers))
    spec = hooks(receivers, "rollout", "rollback", "post-rollout", rollout=receivers.url("down"))
    await create(cluster, namespace, manifest(prometheus, webhooks=spec))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "RolledBack"), 60, what="RolledBack")
    failed = [e["message"] for e in await events_of(cluster.kube, namespace, "kv-align")
              if e["reason"] == "AnalysisFailed"]
    assert any("webhook/rollout: HTTP 500" in m for m in failed), failed
    assert all(e.revision == "base" for e in engines)
    await until(lambda: receivers.got.get("post-rollout") and receivers.got.get("rollback"), 10,
                what="the rollback and post-rollout hooks")
    assert len(receivers.got["rollback"]) == 1 and receivers.got["rollback"][0]["hook"] == "rollback"
    assert receivers.got["post-rollout"][0]["phase"] == "RolledBack"
    await until(lambda: "rolledBack" in [b["moment"] for b in receivers.got.get("audit", [])], 10,
                what="the rolledBack notification")
    chat = [b["text"] for b in receivers.got["chat"]]
    assert any(" rolled back in " in t and "webhook/rollout" in t for t in chat), chat


async def test_a_hanging_hook_holds_its_own_rollout_and_no_other(cluster, namespace, fleet, operator, prometheus,
                                                                receivers):
    """Two fleets (zone a, zone b): the rollout of zone a waits on a confirm-rollout hook that never
    answers; the rollout of zone b goes through all its steps meanwhile."""
    engines = await fleet(4)
    for i in range(4):
        await cluster.kube.merge_patch(f"/api/v1/namespaces/{namespace}/pods/engine-{i}",
                                       {"metadata": {"labels": {"zone": "a" if i < 2 else "b"}}})
    await operator()
    stuck = manifest(prometheus, name="zone-a", selector={"matchLabels": {"app": "llm-engine", "zone": "a"}},
                     webhooks=hooks(receivers, "confirm-rollout", confirm_rollout=receivers.url("hang")))
    await create(cluster, namespace, stuck)
    await create(cluster, namespace, manifest(prometheus, name="zone-b",
                                              selector={"matchLabels": {"app": "llm-engine", "zone": "b"}}))
    await until(lambda: phase_is(cluster, namespace, "zone-b", "Promoted"), 90, what="zone b promoted")
    held = (await get_rollout(cluster.kube, namespace, "zone-a"))["status"]
    assert (held["phase"], held["reason"]) == ("Pending", "AwaitingConfirmation"), held
    assert held["message"] == "waiting for confirmation to start: webhook confirm-rollout (no answer within 2s)"
    assert [e.revision for e in engines] == ["base", "base", "kv-align@3.2.1", "kv-align@3.2.1"]
    assert receivers.tries["hang"] >= 2, "asked again at later ticks, each bounded by its timeout"


async def test_a_rollout_refused_as_invalid_is_told_as_failed(cluster, namespace, fleet, operator, prometheus,
                                                            receivers):
    await fleet(2)
    await operator(notifications=notifications(receivers))
    # a pause of 60 (a number) is admitted by the API server (the field has no type) and refused by
    # the operator (InvalidSpec)
    await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 10, "pause": 60}, {"weight": 100}]))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 60, what="Failed")
    assert obj["status"]["reason"] == "InvalidSpec"
    await until(lambda: receivers.got.get("audit"), 10, what="the notification")
    (told,) = receivers.got["audit"]
    assert (told["moment"], told["reason"]) == ("failed", "InvalidSpec") and "spec.steps[0].pause" in told["message"]
