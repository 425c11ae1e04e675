"""The engine as a user meets it: a real `graft serve` process with the real model over HTTP."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.support import bbh_prompt, metric_value, start_engine

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("engine"), "--max-num-batched-tokens", "256",
                       "--kv-cache-memory", "400M")
    yield eng
    eng.stop()


def chat(url: str, content: str, **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


async def test_concurrent_streaming_requests_through_the_openai_client(engine):
    client = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused")
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?",
                 "Say hello.", "Name a planet.", "What colour is the sky?"]

    async def ask(q: str) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                      max_tokens=24, temperature=0, stream=True)
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    results = await asyncio.gather(*(ask(q) for q in questions))
    assert all(text.strip() for text, _ in results)
    assert all(finish in ("stop", "length") for _, finish in results)
    assert "Paris" in results[0][0]
    # the same question without streaming gives the same greedy text
    whole = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": questions[0]}],
                                                 max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == results[0][0]
    assert whole.usage.completion_tokens > 0


def test_completions_honour_stop_strings_and_seeds(engine):
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 20, "temperature": 0, "stop": [" 7"]}
    r = httpx.post(engine.url + "/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"] == " 5, 6,"
    assert r["choices"][0]["finish_reason"] == "stop"
    sampled = {**body, "stop": None, "temperature": 1.0, "seed": 1234, "max_tokens": 12}
    a = httpx.post(engine.url + "/v1/completions", json=sampled, timeout=60).json()["choices"][0]["text"]
    b = httpx.post(engine.url + "/v1/completions", json=sampled, timeout=60).json()["choices"][0]["text"]
    assert a == b


def test_short_request_is_not_stalled_by_a_long_prefill(engine):
    long_prompt = "\n\n".join(bbh_prompt(t) for t in ("date_understanding", "logical_deduction_five_objects"))
    seen: dict[str, float] = {}

    def stream(name: str, prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    seen.setdefault(name + "_at", time.monotonic())
                if line.startswith("data: {") and json.loads(line[6:]).get("usage"):
                    seen[name + "_tokens"] = json.loads(line[6:])["usage"]["prompt_tokens"]

    long = threading.Thread(target=stream, args=("long", long_prompt))
    long.start()
    # the short request is sent only once the long prompt's prefill is under way (an observed state,
    # not a sleep that a busy machine could make too short)
    deadline = time.monotonic() + 60
    while metric_value(httpx.get(engine.metrics_url + "/metrics").text, "graft_num_requests_running") < 1:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.01)
    short = threading.Thread(target=stream, args=("short", "The capital of France is"))
    short.start()
    for t in (long, short):
        t.join()
    assert seen["long_tokens"] > 1400
    # the long prompt needs six steps or more of 256 tokens; the short one, sent while they run, is admitted
    # into the next step. Compared as an order of events, not as a ratio of durations: a loaded
    # machine stretches every step alike, but cannot reorder them
    assert seen["short_at"] < seen["long_at"], seen


@pytest.mark.parametrize("body, status, needle", [
    ("{not json", 400, "not valid JSON"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": ""}, 400, "empty"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "n": 3}, 400, "n"),
    ({"model": MODEL, "prompt": [1, 2, 99999999]}, 400, "token ids"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "word " * 9000}, 400, "context"),
])
def test_bad_input_gets_an_openai_style_error(engine, body, status, needle):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) \
        else {"json": body}
    r = httpx.post(engine.url + "/v1/completions", timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] or needle == err.get("param"), err
    assert err["type"]


def test_chat_rejects_bad_messages_and_keeps_serving(engine):
    r = httpx.post(engine.url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(engine.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, timeout=30)
    assert r.status_code == 400
    assert chat(engine.url, "Say yes.", max_tokens=4).status_code == 200


def test_a_client_that_hangs_up_frees_its_blocks_and_is_counted_abandoned(engine):
    """A hung-up request is neither `ok` nor `error`: `abandoned`, the client's doing, which canary
    analysis counts neither as a failure nor as an answer."""
    def outcomes() -> dict[str, float]:
        text = httpx.get(engine.metrics_url + "/metrics").text
        return {s: metric_value(text, "graft_requests_total", status=s) for s in ("ok", "error", "abandoned")}
    before = outcomes()
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        text = httpx.get(engine.metrics_url + "/metrics").text
        if metric_value(text, "graft_num_requests_running") == 0 and metric_value(text, "graft_kv_cache_usage_ratio") == 0:
            break
        time.sleep(0.2)
    assert metric_value(text, "graft_num_requests_running") == 0
    assert metric_value(text, "graft_kv_cache_usage_ratio") == 0
    after = outcomes()
    assert {s: after[s] - before[s] for s in after} == {"ok": 0, "error": 0, "abandoned": 1}


def test_health_ready_models_and_metrics(engine):
    assert httpx.get(engine.url + "/health").json()["status"] == "ok"
    assert httpx.get(engine.url + "/ready").status_code == 200
    assert httpx.get(engine.url + "/v1/models").json()["data"][0]["id"] == MODEL
    chat(engine.url, "Hi", max_tokens=2)
    text = httpx.get(engine.metrics_url + "/metrics").text
    assert metric_value(text, "graft_requests_total", revision="base", status="ok") >= 1
    for name in ("graft_request_duration_seconds_bucket", "graft_time_to_first_token_seconds_bucket",
                 "graft_prompt_tokens_total", "graft_generation_tokens_total", "graft_kv_cache_usage_ratio",
                 "graft_kv_cache_fragmentation_ratio", "graft_num_requests_waiting", "process_cpu_seconds_total"):
        assert name in text, name


def test_memory_stays_flat_across_five_hundred_requests(engine):
    proc = psutil.Process(engine.proc.pid)

    async def burst(n: int) -> int:
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=engine.url, timeout=120) as client:
            async def one(i: int) -> int:
                async with sem:
                    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": f"Number {i}:",
                                                                   "max_tokens": 2, "temperature": 0})
                    return r.status_code
            codes = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(c == 200 for c in codes)

    assert asyncio.run(burst(200)) == 200  # warm up allocator pools
    before = proc.memory_info().rss
    assert asyncio.run(burst(500)) == 500
    after = proc.memory_info().rss
    text = httpx.get(engine.metrics_url + "/metrics").text
    assert metric_value(text, "graft_kv_cache_usage_ratio") == 0
    assert metric_value(text, "graft_num_requests_running") == 0
    assert after - before < 48 << 20, f"RSS grew by {(after - before) >> 20} MiB"


def test_overload_answers_429_with_retry_after(tmp_path):
    eng = start_engine(tmp_path, "--max-waiting", "2", "--max-num-seqs", "1", "--max-num-batched-tokens", "64")
    try:
        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=eng.url, timeout=120) as client:
                body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 24, "ignore_eos": True}
                return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))
        responses = asyncio.run(flood())
        codes = [r.status_code for r in responses]
        assert 429 in codes and 200 in codes, codes
        assert set(codes) <= {200, 429}
        rejected = next(r for r in responses if r.status_code == 429)
        assert int(rejected.headers["retry-after"]) >= 1
        assert rejected.json()["error"]["type"] == "rate_limit_error"
        text = httpx.get(eng.metrics_url + "/metrics").text
        assert metric_value(text, "graft_requests_total", status="rejected") == codes.count(429)
    finally:
        eng.stop()


def test_sigterm_drains_in_flight_requests_then_exits(tmp_path):
    eng = start_engine(tmp_path, "--grace", "60")
    result: dict = {}

    def long_request() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True}
        result["r"] = httpx.post(eng.url + "/v1/completions", json=body, timeout=120)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)
    eng.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    ready = httpx.get(eng.url + "/ready", timeout=5)
    assert ready.status_code == 503
    late = httpx.post(eng.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=5)
    assert late.status_code == 503
    t.join(120)
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 48
    assert eng.proc.wait(60) == 0
