"""Notifications: one message per moment a receiver asked for, with the decision in numbers; a
receiver that is down, slow or hanging never holds the operator.

Deliveries go to real HTTP receivers on 127.0.0.1 (aiohttp), through the same Outbox the operator
uses.
"""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from hypothesis import given, settings, strategies as st

from graft.api import Reason
from graft.operator.notify import (NotifyConfigError, Notifier, Receiver, receivers_from_env,
                                   slack_message)
from graft.operator.outbox import Delivery, Outbox
from graft.rollout.decision import Event
from graft.rollout.notifications import DEFAULT_MOMENTS, Moment, moments, payload
from receivers import receivers  # noqa: F401 (a fixture)

ROLLOUT = {"metadata": {"name": "kv-align", "namespace": "serving", "uid": "u-1"},
           "spec": {"patch": {"name": "kv-align", "version": "3.2.1"},
                    "steps": [{"weight": 1}, {"weight": 5}, {"weight": 100}]}}
ANALYSIS = {"lastRun": "2026-12-04T10:00:00.000Z", "verdict": "Failed",
            "results": [{"name": "error-rate", "role": "breaker", "verdict": "Failed", "value": 0.0123,
                         "threshold": "<= 0.005", "window": "60s",
                         "numbers": {"errors": 12, "requests": 975, "lower": 0.0071, "upper": 0.0211}},
                        {"name": "ttft-p99", "role": "breaker", "verdict": "Successful", "value": 1.04,
                         "threshold": "<= 1.5 x stable", "window": "30s",
                         "numbers": {"canary_samples": 420, "stable_samples": 9100}}]}


def status(phase: str, step: int = 0, **extra) -> dict:
    base = {"phase": phase, "stepIndex": step, "weight": [1, 5, 100][min(step, 2)],
            "patch": "kv-align@3.2.1", "startedAt": "2026-12-04T09:58:00.000Z" if phase != "Pending" else None}
    return base | extra


# -- moments: transitions, never states ---------------------------------------------------------

def test_a_whole_promoted_rollout_makes_each_moment_once():
    path = [None, status("Pending"), status("Progressing", 0), status("Progressing", 0), status("Progressing", 1),
            status("Progressing", 1), status("Progressing", 2), status("Promoted", 2), status("Promoted", 2)]
    seen = [m for before, after in zip(path, path[1:]) for m in moments(before, after)]
    assert seen == [Moment.STARTED, Moment.STEP, Moment.STEP, Moment.PROMOTED]


def test_a_rolled_back_and_a_failed_rollout_say_which():
    assert moments(status("RollingBack", 1), status("RolledBack", 1)) == [Moment.ROLLED_BACK]
    assert moments(status("RollingBack", 1), status("Failed", 1)) == [Moment.FAILED]
    assert moments(None, status("Failed", 0, startedAt=None)) == [Moment.FAILED]


def test_waiting_for_approval_is_a_pause_once():
    waiting = status("Progressing", 1, awaitingApprovalSince="2026-12-04T10:00:00.000Z")
    assert moments(status("Progressing", 1), waiting) == [Moment.PAUSED]
    assert moments(waiting, waiting) == []


PHASES = st.sampled_from(["Pending", "Progressing", "Paused", "Promoted", "RollingBack", "RolledBack", "Failed"])
STATUSES = st.builds(lambda p, s, w: status(p, s, **({"awaitingApprovalSince": "t"} if w else {})),
                     PHASES, st.integers(0, 4), st.booleans())


@settings(max_examples=300, deadline=None)
@given(STATUSES)
def test_a_status_reconciled_again_notifies_nothing(s):
    assert moments(s, dict(s)) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(STATUSES, min_size=2, max_size=12))
def test_every_ending_is_told_once_per_arrival(path):
    """However a rollout wanders, each arrival in a final phase is one moment, never more."""
    told = [m for before, after in zip(path, path[1:]) for m in moments(before, after)
            if m in (Moment.PROMOTED, Moment.ROLLED_BACK, Moment.FAILED)]
    arrivals = sum(1 for before, after in zip(path, path[1:])
                   if after["phase"] != before["phase"] and after["phase"] in ("Promoted", "RolledBack", "Failed"))
    assert len(told) == arrivals


# -- messages: the decision in numbers ----------------------------------------------------------

def test_the_payload_carries_the_rollout_the_step_and_the_last_analysis():
    p = payload(ROLLOUT, status("RolledBack", 1, analysis=ANALYSIS), Moment.ROLLED_BACK,
                reason="RolledBack", message="analysis failed at step 2/3", event_type="Warning", now="t")
    assert (p["rollout"], p["namespace"], p["patch"]["ref"]) == ("kv-align", "serving", "kv-align@3.2.1")
    assert (p["moment"], p["phase"], p["step"], p["steps"], p["weight"]) == ("rolledBack", "RolledBack", 2, 3, 5)
    assert p["analysis"]["results"][0] == {"name": "error-rate", "role": "breaker", "verdict": "Failed",
                                           "value": 0.0123, "threshold": "<= 0.005", "window": "60s",
                                           "numbers": ANALYSIS["results"][0]["numbers"]}
    json.dumps(p)     # a body any receiver can read


def test_the_slack_message_shows_each_check_against_its_threshold_with_counts_and_bounds():
    text = slack_message(payload(ROLLOUT, status("RolledBack", 1, analysis=ANALYSIS), Moment.ROLLED_BACK,
                                 reason="RolledBack", message="analysis failed"))["text"]
    assert "kv-align@3.2.1 rolled back in serving/kv-align" in text
    assert "error-rate 0.0123 vs <= 0.005: Failed (12/975 bad; [0.0071, 0.0211])" in text
    assert "ttft-p99 1.04 vs <= 1.5 x stable: Successful (420 canary, 9100 stable samples)" in text


# -- configuration: URLs from the environment, clear refusals -------------------------------------

def test_receivers_read_their_urls_from_the_variables_the_chart_fills_from_secrets():
    env = {"GRAFT_NOTIFICATIONS": json.dumps([
        {"name": "deploys", "type": "slack", "urlEnv": "URL_A"},
        {"name": "audit", "type": "webhook", "urlEnv": "URL_B", "moments": ["started", "promoted"]}]),
        "URL_A": "https://hooks.example/T0/B0/secret", "URL_B": "http://audit.local/graft"}
    a, b = receivers_from_env(env)
    assert (a.name, a.kind, a.url, a.moments) == ("deploys", "slack", "https://hooks.example/T0/B0/secret",
                                                  DEFAULT_MOMENTS)
    assert b.moments == (Moment.STARTED, Moment.PROMOTED)


@pytest.mark.parametrize("config, env, words", [
    ("[{", {}, "not JSON"),
    ('{"name": "x"}', {}, "a list of receivers"),
    ('[{"name": "x", "type": "teams", "urlEnv": "U"}]', {"U": "http://h"}, "'teams' is not one of slack, webhook"),
    ('[{"name": "x", "type": "slack", "urlEnv": "U"}]', {}, "urlEnv 'U' is unset"),
    ('[{"name": "x", "type": "slack", "urlEnv": "U"}, {"name": "x", "type": "slack", "urlEnv": "U"}]',
     {"U": "http://h"}, "'x' given twice"),
    ('[{"name": "x", "type": "slack", "urlEnv": "U", "moments": ["done"]}]', {"U": "http://h"},
     "not among started, step, paused, promoted, rolledBack, failed"),
])
def test_a_bad_receiver_configuration_is_refused_naming_what_is_wrong(config, env, words):
    with pytest.raises(NotifyConfigError, match=r".*") as e:
        receivers_from_env({"GRAFT_NOTIFICATIONS": config} | env)
    assert words in str(e.value)


# -- delivery: real receivers, bounded --------------------------------------------------------------

async def test_a_receiver_down_for_a_moment_still_gets_its_message(receivers):
    outbox = Outbox(backoff=0.01)
    outbox.send(Delivery(f"{receivers.base}/flaky", {"n": 1}, retries=2))
    assert await outbox.drain(10)
    assert receivers.got["flaky"] == [{"n": 1}] and receivers.tries["flaky"] == 3
    await outbox.aclose()


async def test_a_hanging_or_failing_receiver_never_holds_the_caller_or_the_others(receivers):
    outbox = Outbox(backoff=0.01, workers=3)
    started = time.monotonic()
    for _ in range(3):
        outbox.send(Delivery(f"{receivers.base}/hang", {"n": 0}, timeout=0.5, retries=1))
        outbox.send(Delivery(f"{receivers.base}/down", {"n": 0}, retries=1))
    outbox.send(Delivery(f"{receivers.base}/ok", {"n": 1}))
    assert time.monotonic() - started < 0.1            # sending never waits on a receiver
    assert await outbox.drain(15)
    assert receivers.got["ok"] == [{"n": 1}]
    assert outbox.counts["failed"] == 6 and outbox.counts["sent"] == 1
    await outbox.aclose()


async def test_a_full_outbox_drops_the_oldest_and_counts_it(receivers):
    outbox = Outbox(capacity=2, workers=1)
    outbox.send(Delivery(f"{receivers.base}/hang", {"n": 0}, timeout=0.3, retries=0))
    await asyncio.sleep(0.1)                          # the worker is stuck on the first
    for n in range(1, 6):
        outbox.send(Delivery(f"{receivers.base}/ok", {"n": n}))
    assert await outbox.drain(10)
    assert [b["n"] for b in receivers.got["ok"]] == [4, 5]
    assert outbox.counts["dropped"] == 3
    await outbox.aclose()


async def test_each_receiver_gets_the_moments_it_asked_for_in_its_own_format(receivers):
    outbox = Outbox()
    notifier = Notifier([Receiver("chat", "slack", f"{receivers.base}/chat"),
                         Receiver("audit", "webhook", f"{receivers.base}/audit", tuple(Moment))], outbox)
    path = [None, status("Progressing", 0), status("Progressing", 1), status("Progressing", 2),
            status("Promoted", 2, analysis=ANALYSIS)]
    events = {4: [Event(Reason.PROMOTED, "every pod runs kv-align@3.2.1", "Normal")]}
    for i, (before, after) in enumerate(zip(path, path[1:]), start=1):
        notifier.publish(ROLLOUT, before, after, events.get(i, []), now=1_800_000_000)
    assert await outbox.drain(10)
    assert [b["moment"] for b in receivers.got["audit"]] == ["started", "step", "step", "promoted"]
    assert receivers.got["audit"][-1]["reason"] == "Promoted"
    (chat,) = receivers.got["chat"]                   # the default moments: no start, no steps
    assert chat["text"].startswith("*kv-align@3.2.1 promoted in serving/kv-align*")
    await outbox.aclose()


async def test_a_rollout_chooses_its_receivers_and_moments(receivers):
    outbox = Outbox()
    notifier = Notifier([Receiver("chat", "slack", f"{receivers.base}/chat"),
                         Receiver("audit", "webhook", f"{receivers.base}/audit")], outbox)
    quiet = ROLLOUT | {"spec": ROLLOUT["spec"] | {"notifications": [{"receiver": "audit", "moments": ["started"]},
                                                                   {"receiver": "nobody"}]}}
    notifier.publish(quiet, None, status("Progressing", 0), [], now=0)
    notifier.publish(quiet, status("Progressing", 2), status("Promoted", 2), [], now=0)
    assert await outbox.drain(10)
    assert [b["moment"] for b in receivers.got["audit"]] == ["started"]
    assert "chat" not in receivers.got
    await outbox.aclose()


def test_a_refused_spec_whose_notifications_are_malformed_is_still_told_to_every_receiver():
    notifier = Notifier([Receiver("chat", "slack", "http://127.0.0.1:9/chat")], Outbox())
    for bad in ("all", [{"receiver": "chat", "moments": ["finished"]}], [["chat"]]):
        rollout = ROLLOUT | {"spec": ROLLOUT["spec"] | {"notifications": bad}}
        assert [(r.name, m) for r, m in notifier.wanted(rollout)] == [("chat", DEFAULT_MOMENTS)]
