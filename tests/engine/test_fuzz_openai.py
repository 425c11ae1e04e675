"""Fuzzing the OpenAI endpoints from the server's own OpenAPI schema.

Request bodies are drawn from the schema (valid ones) and then, often, broken: a field replaced by
any JSON value, an unknown field added, a string given a lone surrogate. Whatever arrives, the
server must never answer 500, and every 4xx it answers must be one the schema documents, with an
OpenAI-style error body naming what was wrong.
"""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import start_engine

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_NEW_TOKENS = 3   # valid token budgets are cut to this, so accepted requests stay cheap on a CPU

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
surrogates = st.sampled_from(["\ud800", "\udfff", "\ud83d", "a\udc00b"])


def often(usual: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """`usual` nine times in ten: valid-looking values reach the engine, odd ones still turn up."""
    return st.integers(0, 9).flatmap(lambda i: rare if i == 0 else usual)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("fuzz"), "--max-model-len", "512")
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def schema(engine) -> dict:
    return httpx.get(engine.url + "/openapi.json").json()


class SchemaStrategies:
    """Hypothesis strategies for the JSON Schema subset FastAPI emits for pydantic models."""

    def __init__(self, schema: dict):
        self.paths = schema["paths"]
        self.components = schema["components"]["schemas"]

    def for_schema(self, node: dict, name: str = "") -> st.SearchStrategy:
        if "$ref" in node:
            return self.for_schema(self.components[node["$ref"].rsplit("/", 1)[1]], name)
        if "anyOf" in node:
            return st.one_of([self.for_schema(n, name) for n in node["anyOf"]])
        if "enum" in node:
            return st.sampled_from(node["enum"])
        if "const" in node:
            return st.just(node["const"])
        if name == "model":  # mostly the served model, so that most bodies get past the model check
            return often(st.just(MODEL), st.text(max_size=12))
        kind = node.get("type")
        if kind == "object":
            return self._object(node)
        if kind == "array":
            items = self.for_schema(node.get("items", {}))
            return st.lists(items, min_size=node.get("minItems", 0), max_size=min(node.get("maxItems", 3), 3))
        if kind == "string":
            return often(st.text(min_size=node.get("minLength", 0), max_size=40), surrogates)
        if kind == "integer":
            lo, hi = node.get("minimum"), node.get("maximum")
            lo, hi = None if lo is None else int(lo), None if hi is None else int(hi)
            small = st.integers(lo if lo is not None else -100, (lo if lo is not None else 0) + 100)
            return often(small.filter(lambda v: hi is None or v <= hi), st.integers(lo, hi))
        if kind == "number":
            lo = node.get("minimum", node.get("exclusiveMinimum"))
            return st.floats(lo, node.get("maximum"), allow_nan=False, allow_infinity=False,
                             exclude_min="exclusiveMinimum" in node)
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        return json_values  # an unconstrained field (the unsupported OpenAI ones)

    def _object(self, node: dict) -> st.SearchStrategy:
        props = node.get("properties", {})
        required = set(node.get("required", ()))
        return st.fixed_dictionaries(
            {k: self.for_schema(v, k) for k, v in props.items() if k in required},
            optional={k: self.for_schema(v, k) for k, v in props.items() if k not in required})

    def request_body(self, path: str) -> st.SearchStrategy:
        """A body drawn from the schema, then half the time broken (see `mutations`)."""
        body = self.paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return self.for_schema(body).flatmap(lambda b: st.builds(mutate, st.just(b), mutations(b)))


def cheap(body: dict) -> dict:
    """Valid token budgets cut to MAX_NEW_TOKENS; out-of-range values are kept, they must be refused."""
    if body:
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if type(value) is int and MAX_NEW_TOKENS < value <= 512:
                body[key] = MAX_NEW_TOKENS
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_NEW_TOKENS
    return body


def mutations(body: dict) -> st.SearchStrategy:
    """None (keep the body), a field replaced by a hostile or arbitrary value, or unknown fields added."""
    hostile = st.sampled_from([None, True, -1, 2**64, 1e30, "x", "", [], {}, [True], "\ud800", 0.5])
    replace = st.tuples(st.sampled_from(sorted(body)), hostile | json_values).map(lambda kv: [kv])
    add = st.lists(st.tuples(st.text(min_size=1, max_size=16), json_values), min_size=1, max_size=2)
    return st.one_of(st.none(), st.none(), replace, add)


def mutate(body: dict, changes: list[tuple[str, Any]] | None) -> dict:
    return {**body, **dict(changes or [])}


def check(path: str, documented: set[str], body: Any, r: httpx.Response) -> None:
    assert r.status_code != 500 and r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert str(r.status_code) in documented, (body, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        return
    assert r.status_code == 200, (body, r.status_code)
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in r.text.split("\n") if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            assert "error" not in json.loads(line[6:]), (body, line)
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("path", PATHS)
def test_no_request_body_gets_a_500_or_an_undocumented_status(engine, schema, path):
    strategies = SchemaStrategies(schema)
    documented = set(schema["paths"][path]["post"]["responses"])
    client = httpx.Client(base_url=engine.url, timeout=60)

    @settings(max_examples=100, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(strategies.request_body(path))
    def fuzz(drawn: dict) -> None:
        body = cheap(drawn)
        content = json.dumps(body)
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        check(path, documented, body, r)

    try:
        fuzz()
    finally:
        client.close()


@pytest.mark.parametrize("raw", [
    b"", b"{", b"[]", b"null", b'"x"', b"{}", b"\xff\xfe", b'{"model": 1e999}',
    b'{"model": "\xed\xa0\x80"}',  # a surrogate written as (invalid) UTF-8 bytes
    b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800"}',  # and as a JSON escape
])
@pytest.mark.parametrize("path", PATHS)
def test_raw_bodies_that_are_not_requests_get_a_400(engine, path, raw):
    r = httpx.post(engine.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
