"""Calling webhooks: a gate's answer comes back as data (ok, or why not) within its timeout and
retries, whatever the receiver does; a fired hook never waits. Real receivers on 127.0.0.1."""
from __future__ import annotations

import time

from graft.operator.hooks import HookCaller
from graft.operator.outbox import Outbox
from graft.rollout.hooks import Hook, HookType
from receivers import receivers  # noqa: F401 (a fixture)

PAYLOAD = {"rollout": "kv-align", "namespace": "serving", "moment": "step", "step": 2}


def hook(receivers, path: str, kind=HookType.CONFIRM_PROMOTION, **kw) -> Hook:
    return Hook(path, kind, receivers.url(path), **({"timeout": 1.0, "retries": 1} | kw))


async def test_a_gate_that_answers_2xx_lets_the_rollout_on_and_gets_the_payload_with_its_metadata(receivers):
    caller = HookCaller(Outbox())
    answer = await caller.ask(hook(receivers, "ok", metadata={"team": "serving"}), PAYLOAD)
    assert answer.ok and answer.status == 200
    (body,) = receivers.got["ok"]
    assert body == PAYLOAD | {"hook": "confirm-promotion", "name": "ok", "metadata": {"team": "serving"}}
    await caller.aclose()


async def test_a_refusal_is_not_retried_and_says_why(receivers):
    caller = HookCaller(Outbox())
    answer = await caller.ask(hook(receivers, "refuse", retries=3), PAYLOAD)
    assert not answer.ok and answer.status == 403
    assert answer.message == "HTTP 403: change freeze until Monday"
    assert receivers.tries["refuse"] == 1
    await caller.aclose()


async def test_a_gate_down_for_a_moment_is_retried(receivers):
    caller = HookCaller(Outbox())
    assert (await caller.ask(hook(receivers, "flaky", retries=2), PAYLOAD)).ok
    assert receivers.tries["flaky"] == 3
    await caller.aclose()


async def test_a_hanging_gate_costs_at_most_its_timeout_per_try(receivers):
    caller = HookCaller(Outbox())
    started = time.monotonic()
    answer = await caller.ask(hook(receivers, "hang", timeout=0.5, retries=1), PAYLOAD)
    elapsed = time.monotonic() - started
    assert not answer.ok and answer.message == "no answer within 0.5s"
    assert elapsed < 0.5 * 2 + 0.5 + 1.0, elapsed       # two tries, one backoff, some slack
    await caller.aclose()


async def test_a_gate_nobody_listens_on_is_a_failure_not_an_exception():
    caller = HookCaller(Outbox())
    answer = await caller.ask(Hook("gone", HookType.PRE_ROLLOUT, "http://127.0.0.1:9/", retries=0), PAYLOAD)
    assert not answer.ok and answer.status is None and "ConnectError" in answer.message
    await caller.aclose()


async def test_a_fired_hook_returns_at_once_and_arrives(receivers):
    outbox = Outbox()
    caller = HookCaller(outbox)
    started = time.monotonic()
    caller.fire(hook(receivers, "hang", HookType.EVENT, timeout=0.3, retries=0), PAYLOAD)
    caller.fire(hook(receivers, "post", HookType.POST_ROLLOUT), PAYLOAD)
    assert time.monotonic() - started < 0.1
    assert await outbox.drain(10)
    assert receivers.got["post"][0]["hook"] == "post-rollout"
    await outbox.aclose()
    await caller.aclose()
