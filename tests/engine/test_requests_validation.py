"""Requests at the edge: exact bounds, strict types, OpenAI fields honoured or refused by name.

Each case here is a request that once failed (a 500, or a 200 that ignored what was asked); they
run against a real `graft serve` process with the real model.
"""
from __future__ import annotations

import json
import math
import socket
import threading

import httpx
import openai
import pytest

from tests.support import metric_value, sse_events, start_engine

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("engine"))
    yield eng
    eng.stop()


def post(eng, body, path: str = "/v1/completions", **kw) -> httpx.Response:
    """POST `body` as JSON written by the standard library (which escapes lone surrogates)."""
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(eng.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=60, **kw)


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, **kw}


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, **kw}


def assert_refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(param) and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("body, param", [
    (completion(top_k=1e20, temperature=1.0), "top_k"),
    (completion(top_k=2**63, temperature=1.0), "top_k"),
    (completion(top_k=VOCAB + 1, temperature=1.0), "top_k"),
    (completion(seed=2**64, temperature=1.0), "seed"),
    (completion(seed=2**63, temperature=1.0), "seed"),
    (completion(seed=-(2**63) - 1, temperature=1.0), "seed"),
    (completion(seed=1e30, temperature=1.0), "seed"),
    (completion(seed=1.5), "seed"),
    (completion(stream="yes"), "stream"),
    (completion(stream=1), "stream"),
    (completion(prompt=[True, False]), "prompt"),
    (completion(prompt=[1.0, 2.0]), "prompt"),
    (completion(prompt=[-1, 2]), "prompt"),
    (completion(max_tokens=2.5), "max_tokens"),
    (completion(max_tokens=10**7), "max_tokens"),
    (completion(max_tokens=True), "max_tokens"),
    (completion(n=2), "n"),
    (completion(priority=2**40), "priority"),
    (completion(temperature="1"), "temperature"),
    (completion(temperature=True), "temperature"),
    (completion(ignore_eos="no"), "ignore_eos"),
    (completion(stop=["a", "b", "c", "d", "e"]), "stop"),
    (completion(stop=[""]), "stop"),
    (completion(logprobs=21), "logprobs"),
    (completion(logprobs=True), "logprobs"),
    (completion(stream_options={"include_usage": True}), "stream_options"),
    (completion(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (completion(user=12), "user"),
    (chat_body(top_logprobs=21, logprobs=True), "top_logprobs"),
    (chat_body(top_logprobs=2), "top_logprobs"),
    (chat_body(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content"),
])
def test_out_of_range_or_mistyped_fields_are_refused_by_name(engine, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    assert_refused(post(engine, body, path), param)


@pytest.mark.parametrize("literal, param", [("NaN", "temperature"), ("Infinity", "top_p"),
                                            ("-Infinity", "temperature")])
def test_non_finite_numbers_are_refused(engine, literal, param):
    body = json.dumps(completion()).replace('"max_tokens"', f'"{param}": {literal}, "max_tokens"')
    assert_refused(post(engine, body), param)


def test_a_poisoned_request_does_not_fail_a_stream_in_the_same_batch(engine):
    """seed 2**64 once reached the step loop and failed every request of its step with a 500."""
    before = metric_value(httpx.get(engine.metrics_url + "/metrics").text, "graft_requests_total", status="error")
    body = completion(prompt="Count: 1, 2, 3,", max_tokens=40, ignore_eos=True, stream=True, temperature=0)
    started, lines = threading.Event(), []

    def stream() -> None:
        with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=120) as r:
            for line in filter(None, r.iter_lines()):
                lines.append(line)
                if '"text"' in line:
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    poisons = [post(engine, completion(seed=2**64, temperature=1.0)),
               post(engine, completion(top_k=2**63, temperature=1.0)),
               post(engine, completion(seed=1e30, temperature=1.0))]
    t.join(120)
    assert [p.status_code for p in poisons] == [400, 400, 400]
    events = sse_events(lines)
    assert lines[-1] == "data: [DONE]" and not any("error" in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    after = metric_value(httpx.get(engine.metrics_url + "/metrics").text, "graft_requests_total", status="error")
    assert after == before


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", completion(prompt="hi \ud800 there"), "prompt"),
    ("/v1/completions", completion(prompt=["\udfff"]), "prompt"),
    ("/v1/completions", completion(stop=["\ud800"]), "stop"),
    ("/v1/completions", completion(user="\ud800"), "user"),
    ("/v1/completions", completion(model="\ud800"), "model"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "\ud83d"}]), "messages[0].content"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
     "messages[0].content"),
])
def test_a_lone_surrogate_is_a_json_400_naming_the_field(engine, path, body, param):
    r = post(engine, body, path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_lone_surrogate_keeps_the_connection_alive(engine):
    """Two requests on one socket: the refused one must not close the keep-alive connection."""
    bad = json.dumps(completion(prompt="\ud800")).encode()
    good = json.dumps(completion(temperature=0)).encode()

    def request(body: bytes) -> bytes:
        return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    with socket.create_connection((engine.host, engine.port), timeout=30) as sock:
        sock.sendall(request(bad))
        first = _read_response(sock)
        sock.sendall(request(good))
        second = _read_response(sock)
    assert first.startswith(b"HTTP/1.1 400") and b'"param":"prompt"' in first
    assert second.startswith(b"HTTP/1.1 200"), second


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("settings", [{"temperature": 1e-40}, {"top_p": 1e-40}, {"temperature": 1e-40, "top_p": 1e-40},
                                      {"temperature": 1e-30, "top_k": 5}])
def test_tiny_temperature_or_top_p_answer_the_greedy_text(engine, settings):
    """Once logits / 1e-40 overflowed float32 to NaN: an empty completion with finish_reason stop."""
    greedy = post(engine, completion(max_tokens=4, temperature=0)).json()["choices"][0]
    r = post(engine, completion(max_tokens=4, seed=3, **settings))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == greedy["text"] and choice["text"].strip()
    assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "echo", True), ("/v1/completions", "suffix", " the end"), ("/v1/completions", "best_of", 3),
    ("/v1/completions", "logit_bias", {"50256": -100}), ("/v1/chat/completions", "logit_bias", {"1": 5}),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "auto"), ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"), ("/v1/completions", "presence_penalty", 0.5),
    ("/v1/chat/completions", "frequency_penalty", 1),
])
def test_unsupported_openai_fields_are_refused_by_name(engine, path, field, value):
    body = (chat_body if "chat" in path else completion)(**{field: value})
    r = post(engine, body, path)
    assert_refused(r, field)
    assert "not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, neutral", [
    ("/v1/completions", {"echo": False, "suffix": None, "best_of": 1, "logit_bias": {}, "presence_penalty": 0,
                         "frequency_penalty": 0.0, "logprobs": None}),
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                              "logit_bias": None, "logprobs": False, "top_logprobs": None}),
])
def test_neutral_values_of_unsupported_fields_are_accepted(engine, path, neutral):
    body = (chat_body if "chat" in path else completion)(**neutral)
    assert post(engine, body, path).status_code == 200


def test_completion_logprobs_as_openai_reports_them(engine):
    r = post(engine, completion(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)).json()
    choice, n = r["choices"][0], r["usage"]["completion_tokens"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 3 <= len(top) <= 4 and token in top
        assert logprob <= 0 and math.isclose(logprob, max(top.values()), abs_tol=1e-4)  # greedy: the argmax


def test_chat_logprobs_and_top_logprobs_as_openai_reports_them(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].token == t.token and bytes(t.bytes).decode() == t.token
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_cover_every_token(engine):
    body = chat_body(max_tokens=6, temperature=0, logprobs=True, top_logprobs=1, stream=True, ignore_eos=True,
                     stream_options={"include_usage": True})
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    chunks = [e for e in events if e["choices"]]
    tokens = [t for e in chunks for t in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(tokens) == events[-1]["usage"]["completion_tokens"] == 6
    assert "".join(t["token"] for t in tokens) == "".join(e["choices"][0]["delta"]["content"] for e in chunks)


def test_usage_chunk_only_when_asked(engine):
    def stream(**kw) -> list[dict]:
        with httpx.stream("POST", engine.url + "/v1/completions", json=completion(stream=True, **kw), timeout=60) as r:
            return sse_events(r.iter_lines())

    plain = stream()
    assert all(e["choices"] and "usage" not in e for e in plain)
    with_usage = stream(stream_options={"include_usage": True})
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] == 2
    assert all(e["usage"] is None for e in with_usage[:-1])


def test_openai_client_streams_with_include_usage(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_openapi_documents_400_not_422(engine):
    schema = httpx.get(engine.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert {"400", "404", "429", "500", "503"} <= set(responses)
        ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        error = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert error["required"] == ["error"]
    assert "422" not in json.dumps(schema)
    assert post(engine, {"model": MODEL}).status_code == 400
