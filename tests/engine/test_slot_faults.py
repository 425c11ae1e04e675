"""A patch slot that passes the self-check and misbehaves later, on live traffic.

An in-process engine (float32, the real model) and its patch manager, with patches whose slots
are right on everything the self-check feeds them and wrong on one kind of live request (a tenant,
a length, a `max_tokens`): a scheduler policy or a sampler that raises, a model slot that raises
past a context length, a `request.outcome` that asks for an infinite delay, and a policy that
hangs. For each, the engine takes the patch out by itself, the request that met it gets its answer
(the base table's), `GET /admin/patches` names the fault and `graft_slot_faults_total` counts it;
a hang turns /health and /ready to 503 and a revert answers within the stall timeout.
"""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from graft.engine.config import EngineConfig
from graft.engine.patches.base import Patch
from graft.engine.scheduler import default_policy
from graft.engine.sequence import SamplingParams

pytestmark = pytest.mark.slow

STALL = 3.0   # the engine's stall timeout here, seconds


@pytest.fixture(scope="module")
def served():
    from graft.engine.engine import LLMEngine
    from graft.engine.patches.manager import PatchManager
    loop = asyncio.new_event_loop()
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=256 << 20, stall_timeout=STALL, shadow_rate=0))
    engine.start()
    manager = PatchManager(engine, enable_test_patches=True)
    yield engine, manager, loop
    engine.stop()
    loop.close()


def _generate(engine, loop, ids, *, n: int = 6, tenant: str = "", max_tokens: int | None = None,
              timeout: float = 60) -> list[int]:
    async def one():
        handle = engine.submit(list(ids), SamplingParams(max_tokens=max_tokens or n, temperature=0, ignore_eos=True),
                               tenant=tenant)
        out = []
        async for ev in handle.events():
            assert ev.error is None, ev.error
            if ev.token_id is not None:
                out.append(ev.token_id)
        return out
    return loop.run_until_complete(asyncio.wait_for(one(), timeout))


def _apply(manager, loop, patch: Patch) -> dict:
    manager.available[patch.id] = patch
    return loop.run_until_complete(manager.apply(patch.name, patch.version, {"builtin": True}))


def _faults(engine, slot: str) -> float:
    return engine.metrics.slot_faults.labels(slot)._value.get()


@pytest.fixture
def prompt(served):
    engine, _, _ = served
    return engine.tokenizer.encode("The three primary colours are red, yellow and")


def _poisoned_policy(waiting, now):
    if any(s.tenant == "poison" for s in waiting):
        raise RuntimeError("this policy cannot order the poison tenant")
    return default_policy(waiting, now)


def test_a_policy_raising_on_live_traffic_is_taken_out_and_the_request_is_served(served, prompt):
    engine, manager, loop = served
    expected = _generate(engine, loop, prompt)
    before = _faults(engine, "scheduler.policy")
    _apply(manager, loop, Patch("poison-policy", "1", {"scheduler.policy": _poisoned_policy}, test_only=True))
    assert engine.revision == "poison-policy@1"            # the self-check saw nothing wrong
    assert _generate(engine, loop, prompt, tenant="poison") == expected
    assert engine.revision == "base" and engine.health() is None
    assert _faults(engine, "scheduler.policy") == before + 1
    fault = manager.describe()["faults"][-1]
    assert (fault["patch"], fault["slot"], fault["revision"]) == ("poison-policy@1", "scheduler.policy", "base")
    assert "poison tenant" in fault["error"]


def test_a_sampler_raising_on_live_traffic_is_replaced_by_the_base_one_at_once(served, prompt):
    engine, manager, loop = served
    expected = _generate(engine, loop, prompt, max_tokens=7)
    base = engine.base_slots["sampler"]

    def sampler(logits, params, generators):
        if any(p.max_tokens == 7 for p in params):
            raise ValueError("no seven")
        return base(logits, params, generators)
    _apply(manager, loop, Patch("seven", "1", {"sampler": sampler}, test_only=True))
    assert engine.revision == "seven@1"
    # the batch the patched sampler failed was sampled by the base sampler: the same greedy tokens
    assert _generate(engine, loop, prompt, max_tokens=7) == expected
    assert engine.revision == "base"
    assert manager.describe()["faults"][-1]["slot"] == "sampler"


def test_a_model_slot_raising_past_a_context_length_is_taken_out_and_the_step_run_again(served):
    """Wrong only past 300 tokens of context, beyond the self-check's probe: the step it fails is
    run again on the base table, so the long request is answered as the base table answers it."""
    engine, manager, loop = served
    from tests.support import bbh_prompt
    long = engine.tokenizer.encode(bbh_prompt("date_understanding"))[:400]
    expected = _generate(engine, loop, long)
    base = engine.base_slots["attention.decode"]

    def decode(q, k_cache, v_cache, block_tables, context_lens, scale, gather):
        if int(max(context_lens)) > 300:
            raise RuntimeError("decode past 300 tokens is not implemented")
        return base(q, k_cache, v_cache, block_tables, context_lens, scale, gather)
    _apply(manager, loop, Patch("short-decode", "1", {"attention.decode": decode}, test_only=True))
    assert engine.revision == "short-decode@1"
    assert _generate(engine, loop, long) == expected
    assert engine.revision == "base"
    fault = manager.describe()["faults"][-1]
    assert fault["slot"] == "attention.decode" and "300 tokens" in fault["error"]


@pytest.mark.parametrize("delay", [float("inf"), float("nan"), -1.0, 3600.0])
def test_an_outcome_asking_for_a_delay_out_of_bounds_holds_no_request(served, prompt, delay):
    engine, manager, loop = served

    def outcome(seq):
        return (delay, False) if seq.tenant == "poison" else (0.0, False)
    _apply(manager, loop, Patch("hold", "1", {"request.outcome": outcome}, test_only=True))
    assert engine.revision == "hold@1"
    assert len(_generate(engine, loop, prompt, tenant="poison", timeout=20)) == 6
    assert engine.revision == "base"
    assert manager.describe()["faults"][-1]["slot"] == "request.outcome"


def test_a_hanging_policy_turns_health_and_ready_to_503_and_a_revert_answers(served, prompt):
    """The step loop cannot be taken back from a slot that never returns: /health says so (the
    kubelet's liveness probe restarts the pod) and a revert answers 503 within the stall timeout
    instead of hanging; once the slot returns, the revert it asked for runs."""
    from graft.engine.server import build_app
    engine, manager, loop = served
    release = threading.Event()

    def hanging(waiting, now):
        if any(s.tenant == "poison" for s in waiting):
            release.wait(60)
        return default_policy(waiting, now)
    _apply(manager, loop, Patch("hang", "1", {"scheduler.policy": hanging}, test_only=True))
    app = build_app(engine, "SmolLM2-135M-Instruct")

    async def scenario():
        handle = engine.submit(list(prompt), SamplingParams(max_tokens=2, temperature=0), tenant="poison")
        await asyncio.sleep(STALL + 1)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            health, ready = await client.get("/health"), await client.get("/ready")
        t0 = loop.time()
        with pytest.raises(Exception) as refused:
            await manager.revert("hang")
        answered = loop.time() - t0
        release.set()
        tokens = [ev.token_id async for ev in handle.events() if ev.token_id is not None]
        return health, ready, refused.value, answered, tokens
    health, ready, refused, answered, tokens = loop.run_until_complete(scenario())
    assert health.status_code == 503 and "has not come round" in health.json()["error"]["message"]
    assert ready.status_code == 503 and ready.json()["status"] == "unhealthy"
    assert getattr(refused, "status", None) == 503 and answered < STALL + 2
    assert len(tokens) == 2
    deadline = loop.time() + 10
    while engine.revision != "base" and loop.time() < deadline:
        loop.run_until_complete(asyncio.sleep(0.05))
    assert engine.revision == "base" and engine.health() is None


def test_the_stall_timeout_is_a_flag_and_checked():
    import argparse

    from graft.engine.config import add_engine_args, config_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert config_from_args(p.parse_args(["--stall-timeout", "5", "--dtype", "float32"])).stall_timeout == 5
    with pytest.raises(ValueError, match="stall_timeout"):
        EngineConfig(dtype="float32", stall_timeout=0)
    assert EngineConfig(dtype="float32").stall_timeout == 60.0
