"""The extra request fields, honoured by a real engine over HTTP: `top_k`, `priority` and `user`.

The engine's KV cache holds two 64-token blocks for requests (and one for the patch self-check). While a long request holds both, every other request
waits in the queue; when it finishes, the scheduler admits the first two of the queue in its policy's
order, and those two finish before the next two start. What the tests compare is which requests
finished in each round, never a duration.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from graft.engine.engine import PROBE_BLOCKS
from tests.support import metric_value, start_engine

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colours are"
# 2 (K and V) x 30 layers x 64 tokens x 3 KV heads x 64 dims x 4 bytes (float32): one block
BLOCK_BYTES = 2 * 30 * 64 * 3 * 64 * 4
BLOCKER = "Count the numbers one by one, slowly, and say each of them in words: " + "one, two, three, " * 5


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("fields"), "--dtype", "float32", "--tenant-header", "x-tenant",
                       "--priority-header", "x-priority",
                       "--kv-cache-memory", str((2 + PROBE_BLOCKS) * BLOCK_BYTES))
    yield eng
    eng.stop()


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)


def text(url: str, **body) -> str:
    r = complete(url, **body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_top_k_one_samples_the_greedy_token_whatever_the_temperature(engine):
    greedy = text(engine.url, prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    for seed in (1, 2, 3):
        assert text(engine.url, prompt=PROMPT, max_tokens=8, temperature=1.5, top_k=1, seed=seed,
                    ignore_eos=True) == greedy, seed
    # the same temperature without top_k does sample: the equality above is top_k's doing
    sampled = {text(engine.url, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=seed, ignore_eos=True)
               for seed in (1, 2, 3)}
    assert sampled != {greedy}


def metric(engine, name: str) -> float:
    return metric_value(httpx.get(engine.metrics_url + "/metrics", timeout=10).text, name)


def test_a_prompt_the_kv_cache_cannot_hold_is_a_400_naming_the_prompt(engine):
    r = complete(engine.url, prompt=[1] * 128, max_tokens=1)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and "the KV cache holds 128 tokens" in error["message"]
    assert complete(engine.url, prompt=[1] * 127, max_tokens=1).status_code == 200


def admission_rounds(engine, requests: list[tuple[str, dict]]) -> list[set[str]]:
    """Hold both cache blocks with a long request, queue `requests` (name, extra body) in this order,
    and return which of them finished in each round of two once the long one is done."""
    done: list[str] = []
    lock = threading.Lock()

    def send(name: str, extra: dict) -> None:
        extra = dict(extra)
        headers = extra.pop("headers", {})
        body = {"prompt": f"Request {name}: say hi.", "max_tokens": 2, "temperature": 0, **extra}
        r = httpx.post(engine.url + "/v1/completions", json={"model": MODEL, **body}, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        with lock:
            done.append(name)

    blocker = threading.Thread(target=send, args=("blocker", {"prompt": BLOCKER, "max_tokens": 40,
                                                              "ignore_eos": True}))
    blocker.start()
    deadline = time.monotonic() + 60
    while metric(engine, "graft_kv_cache_usage_ratio") < 1:
        assert time.monotonic() < deadline, "the long request never filled the cache"
        time.sleep(0.02)
    threads = []
    for i, (name, extra) in enumerate(requests):
        t = threading.Thread(target=send, args=(name, extra))
        t.start()
        threads.append(t)
        # each one in the queue before the next is sent: arrival order is the list's order
        while metric(engine, "graft_num_requests_waiting") < i + 1:
            assert time.monotonic() < deadline, f"{name} never reached the queue"
            time.sleep(0.01)
    assert "blocker" not in done, "the long request ended before the queue was built: nothing was compared"
    for t in [blocker, *threads]:
        t.join(120)
    assert done[0] == "blocker"
    rest = done[1:]
    return [set(rest[i:i + 2]) for i in range(0, len(rest), 2)]


def test_a_lower_priority_value_is_admitted_first_whatever_its_arrival(engine):
    rounds = admission_rounds(engine, [("late-1", {"priority": 5}), ("late-2", {"priority": 5}),
                                       ("urgent", {"priority": -5}), ("normal", {})])
    assert rounds == [{"urgent", "normal"}, {"late-1", "late-2"}]


def tenant(name: str) -> dict:
    return {"headers": {"x-tenant": name}}


def test_the_gateway_header_is_the_tenant_and_tenants_take_turns_within_an_admission(engine):
    # a burst from tenant a, then one request each from b and c: each round admits one request per
    # tenant before a second from any; with the header ignored the rounds would follow arrival order
    rounds = admission_rounds(engine, [("a1", tenant("a")), ("a2", tenant("a")), ("a3", tenant("a")),
                                       ("b1", tenant("b")), ("c1", tenant("c"))])
    assert rounds == [{"a1", "b1"}, {"c1", "a2"}, {"a3"}]


def test_a_client_chosen_user_wins_no_turns(engine):
    # fresh `user` names per request from one connection: one tenant (the peer), arrival order
    rounds = admission_rounds(engine, [("a1", {"user": "a"}), ("a2", {"user": "b"}), ("a3", {"user": "c"}),
                                       ("b1", tenant("b"))])
    assert rounds == [{"a1", "b1"}, {"a2", "a3"}]


def test_a_client_priority_is_clamped_and_the_gateway_header_is_believed(engine):
    # clamped, the flood asks -1 at most; the gateway's -5 goes first, then arrival among equals
    rounds = admission_rounds(engine, [("flood-1", {"priority": -(2**31)}), ("flood-2", {"priority": -(2**31)}),
                                       ("gateway", {"headers": {"x-priority": "-5"}}), ("normal", {})])
    assert rounds == [{"gateway", "flood-1"}, {"flood-2", "normal"}]
