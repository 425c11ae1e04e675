"""One request's failure is its own: poisoned requests under concurrent load fail alone.

The engine-level tests run a real engine (the real model) in this process with slots that fail
for chosen requests inside the step, the way a faulty patch or a sampler bug would: a sampler that
raises, one that returns no token id, a logprobs request the sampler cannot serve, a
`request.outcome` that raises. The HTTP test sends the original poison bodies to a real
`graft serve` beside ordinary traffic.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from graft.engine.config import EngineConfig
from graft.engine.engine import LLMEngine, no_outcome
from graft.engine.sampler import sample_batched, sample_per_row
from graft.engine.sequence import InvalidParam, SamplingParams
from tests.support import metric_value, start_engine

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"

RAISES, NO_TOKEN, OUTCOME = 9001, 9002, 9003   # seeds that mark a poisoned request


def poisoned(sampler):
    """A sampler that fails any batch holding a RAISES row and answers NO_TOKEN rows with garbage."""
    def sample(logits, params, generators):
        if any(p.seed == RAISES for p in params):
            raise RuntimeError("poisoned row")
        tokens = sampler(logits, params, generators)
        return [10**9 if p.seed == NO_TOKEN else t for p, t in zip(params, tokens)]
    return sample


def failing_outcome(seq):
    if seq.params.seed == OUTCOME:
        raise RuntimeError("poisoned outcome")
    return no_outcome(seq)


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=96 << 20, max_num_seqs=32,
                                 max_num_batched_tokens=256))
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture(params=[sample_per_row, sample_batched], ids=["per-row", "batched"])
def poisoned_engine(engine, request):
    plain = engine.slots
    engine.slots = plain.with_slots({"sampler": poisoned(request.param), "request.outcome": failing_outcome})
    yield engine
    engine.slots = plain


async def run(engine: LLMEngine, prompt_ids: list[int],
              params: SamplingParams) -> tuple[list[int], str | None, str | None]:
    """(tokens, finish reason, error) of one request submitted straight to the engine."""
    handle = engine.submit(prompt_ids, params)
    tokens, reason, error = [], None, None
    async for ev in handle.events():
        if ev.token_id is not None:
            tokens.append(ev.token_id)
        if ev.finished:
            reason, error = ev.finish_reason.value, ev.error
    return tokens, reason, error


def counts(engine: LLMEngine) -> dict[str, float]:
    text = engine.metrics.render().decode()
    return {s: metric_value(text, "graft_requests_total", status=s) for s in ("ok", "error")}


def test_a_poisoned_row_fails_alone_and_its_batch_mates_keep_their_tokens(poisoned_engine):
    """Seeded batch mates of a failing row get the very tokens they get without it (generators rewound)."""
    eng = poisoned_engine
    prompt = eng.tokenizer.encode("Once upon a time")

    async def batch(with_poison: bool):
        mates = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
        poison = [SamplingParams(max_tokens=3, temperature=1.0, seed=RAISES)] if with_poison else []
        return await asyncio.gather(*(run(eng, prompt, p) for p in [*poison, *mates]))

    alone = asyncio.run(batch(False))
    mixed = asyncio.run(batch(True))
    assert mixed[0][1:] == ("error", "internal error while sampling this request")
    assert [m[0] for m in mixed[1:]] == [a[0] for a in alone]
    assert all(m[1] == "length" and m[2] is None for m in mixed[1:])


def test_a_thousand_requests_with_a_poison_every_few_steps_have_no_collateral_errors(engine):
    """About 35 s on two cores: 1,000 requests of 1-4 tokens, one in nine poisoned, the plain sampler."""
    eng = engine
    plain = eng.slots
    eng.slots = plain.with_slots({"sampler": poisoned(sample_per_row), "request.outcome": failing_outcome})
    try:
        results, elapsed, n_poison, before, after = _thousand(eng)
    finally:
        eng.slots = plain
    collateral = [(p, r) for poison, p, r in results if not poison and r[2] is not None]
    assert not collateral, collateral[:5]
    for poison, params, (tokens, reason, error) in results:
        if poison:
            assert reason == "error" and error, (params, reason, error)
        else:
            assert reason == "length" and len(tokens) == params.max_tokens
    assert after["error"] - before["error"] == n_poison
    assert after["ok"] - before["ok"] == 1000 - n_poison
    assert eng.scheduler.num_running == 0 and eng.block_manager.usage == 0
    print(f"1000 requests, {n_poison} poisoned, in {elapsed:.1f}s")


def _thousand(eng: LLMEngine):
    rng = random.Random(7)
    poisons = (RAISES, NO_TOKEN, OUTCOME, "logprobs")
    before = counts(eng)

    def params_for(i: int) -> tuple[SamplingParams, bool]:
        n = rng.randint(1, 4)
        if i % 9 == 4:
            kind = poisons[(i // 9) % len(poisons)]
            if kind == "logprobs":  # asks for logprobs, and its sampler row raises
                return SamplingParams(max_tokens=n, temperature=0.8, seed=RAISES, logprobs=2), True
            return SamplingParams(max_tokens=n, temperature=0.8, seed=kind), True
        if i % 3:
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), False
        return SamplingParams(max_tokens=n, temperature=0.9, top_k=rng.choice([0, 5, 49152]), top_p=0.9,
                              seed=rng.randint(0, 2**63 - 1), ignore_eos=True, logprobs=rng.choice([None, 1])), False

    async def load(total: int, concurrency: int = 32):
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int):
            params, poison = params_for(i)
            async with sem:
                result = await run(eng, eng.tokenizer.encode(f"Item {i}:"), params)
            return poison, params, result
        return await asyncio.gather(*(one(i) for i in range(total)))

    t0 = time.monotonic()
    results = asyncio.run(load(1000))
    elapsed = time.monotonic() - t0
    n_poison = sum(poison for poison, _, _ in results)
    return results, elapsed, n_poison, before, counts(eng)


def test_a_request_whose_detokenisation_fails_fails_alone(engine, monkeypatch):
    """Text is made per request on the HTTP side: a detokeniser that breaks ends only its request."""
    from graft.engine import server
    made = iter(range(10**6))

    class Breaking(server.IncrementalDetokenizer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.broken = next(made) % 4 == 1

        def push(self, token_id: int) -> str:
            if self.broken:
                raise UnicodeError("poisoned detokeniser")
            return super().push(token_id)

    monkeypatch.setattr(server, "IncrementalDetokenizer", Breaking)
    app = server.build_app(engine, MODEL)
    before = counts(engine)

    async def load() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
            body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 16, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json={**body, "stream": i % 2 == 0})
                                          for i in range(16)))
    responses = asyncio.run(load())
    broken = [r for r in responses if "internal error while detokenizing" in r.text]
    assert len(broken) == 4
    assert all(r.status_code == 500 for r in broken if not r.text.startswith("data:"))
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in broken if r.text.startswith("data:"))
    ok = [r for r in responses if r not in broken]
    assert all(r.status_code == 200 and '"error"' not in r.text for r in ok)
    after = counts(engine)
    assert after["error"] - before["error"] == 4 and after["ok"] - before["ok"] == 12


def test_a_failed_forward_pass_still_fails_the_whole_batch(engine):
    """The one failure that is not any request's own: the model itself."""
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")
    plain = engine.slots
    engine.slots = plain.with_slots({"linear.qkv": broken})
    try:
        async def two():
            p = engine.tokenizer.encode("Hello")
            return await asyncio.gather(*(run(engine, p, SamplingParams(max_tokens=2)) for _ in range(2)))
        results = asyncio.run(two())
    finally:
        engine.slots = plain
    assert [r[2] for r in results] == ["internal error while running the model"] * 2


def test_original_poison_bodies_beside_live_traffic_fail_nobody_else(tmp_path):
    """The bodies that once failed every request of their step, sent among ordinary requests."""
    eng = start_engine(tmp_path, "--max-num-batched-tokens", "256")
    poisons = [{"top_k": 1e20}, {"seed": 2**64}, {"seed": 1e30}, {"top_k": 2**63}, {"stream": "yes"},
               {"prompt": [True, False]}, {"prompt": "x\ud800"}, {"priority": 10**40}, {"n": 2}]
    try:
        async def load(total: int = 300):
            sem = asyncio.Semaphore(24)
            async with httpx.AsyncClient(base_url=eng.url, timeout=120) as client:
                async def one(i: int):
                    body = {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": 1 + i % 4, "temperature": 1.0,
                            "seed": i, "ignore_eos": True, "stream": i % 2 == 0}
                    poison = i % 5 == 2
                    if poison:
                        body.update(poisons[(i // 5) % len(poisons)])
                    async with sem:
                        r = await client.post("/v1/completions", content=json.dumps(body),
                                              headers={"content-type": "application/json"})
                    return poison, r.status_code, r.text
                return await asyncio.gather(*(one(i) for i in range(total)))
        results = asyncio.run(load())
        assert all(code == 400 for poison, code, _ in results if poison)
        ordinary = [(code, text) for poison, code, text in results if not poison]
        assert all(code == 200 and '"error"' not in text for code, text in ordinary), \
            [t for c, t in ordinary if c != 200 or '"error"' in t][:3]
        text = httpx.get(eng.metrics_url + "/metrics").text
        assert metric_value(text, "graft_requests_total", status="error") == 0
        assert metric_value(text, "graft_requests_total", status="ok") == len(ordinary)
    finally:
        eng.stop()


def test_the_engine_refuses_at_submit_what_its_step_could_not_run(engine):
    """Direct callers of the engine get the same bounds as HTTP clients: nothing bad enters a step."""
    async def submit(**settings):
        params = SamplingParams(max_tokens=2)
        for name, value in settings.items():
            setattr(params, name, value)  # as a caller that changed them after construction
        engine.submit([1, 2, 3], params)

    for settings, param in [({"top_k": 10**30}, "top_k"), ({"seed": 2**64}, "seed"),
                            ({"max_tokens": 10**9}, "max_tokens"), ({"temperature": float("nan")}, "temperature"),
                            ({"logprobs": 99}, "logprobs")]:
        with pytest.raises(InvalidParam) as err:
            asyncio.run(submit(**settings))
        assert err.value.param == param
