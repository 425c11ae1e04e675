"""The patch self-check's probe: the engine's own paths (chunked prefill across KV blocks, a
prefix-cache hit, decodes of mixed context lengths, the operator's prompts) and every slot a patch
may replace, judged in fp32 and in bf16, with the figures it answers with.

Two engines in this process (fp32 on the fast paths, bf16 on the plain 3.2.0 paths, so that the
3.2.1 patches really change the numerics there), each with its patch manager and admin app, called
in-process (and a third for the operator's probe prompts).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys

import httpx
import pytest

from graft.engine.admin import build_admin_app
from graft.engine.config import EngineConfig
from graft.engine.engine import LLMEngine
from graft.engine.patches.base import Patch
from graft.engine.patches.manager import PatchManager
from graft.engine.runner import PROBE_USER_MAX_TOKENS, ProbeRow, build_probe_plan
from graft.engine.sampler import sample_batched
from graft.engine.scheduler import default_policy
from graft.engine.sequence import SamplingParams
from graft.engine.serve import MAX_PROBE_PROMPTS, load_probe_prompts
from tests.support import ROOT

pytestmark = pytest.mark.slow
BUILTIN = {"builtin": True}
SET_321 = ("kv-align", "prefill-fusion", "sync-free")
PROMPT = "The three primary colours are"


class Engine:
    """An engine, its patch manager and its admin app, driven from the test's own event loops."""

    def __init__(self, probe_prompts: list[str] | tuple[str, ...] = (), **config):
        self.engine = LLMEngine(EngineConfig(kv_cache_memory=96 << 20, **config), probe_prompts=probe_prompts)
        self.engine.start()
        self.manager = PatchManager(self.engine, enable_test_patches=True)
        self.app = build_admin_app(self.manager, None)
        self.prompt = self.engine.tokenizer.encode(PROMPT)

    def call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://admin",
                                         timeout=300) as client:
                return await client.request(method, path, json=body)
        return asyncio.run(go())

    def apply(self, name: str, version: str = "3.2.1", **extra) -> httpx.Response:
        return self.call("POST", "/admin/patches", {"name": name, "version": version, "source": BUILTIN, **extra})

    def revert(self, name: str) -> None:
        assert self.call("DELETE", f"/admin/patches/{name}").status_code == 200

    def listing(self) -> dict:
        return self.call("GET", "/admin/patches").json()

    def greedy(self, n: int = 4) -> list[int]:
        async def go() -> list[int]:
            handle = self.engine.submit(self.prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            tokens = []
            async for event in handle.events():
                assert event.error is None, event.error
                if event.token_id is not None:
                    tokens.append(event.token_id)
            return tokens
        return asyncio.run(go())


@pytest.fixture(scope="module")
def fp32():
    eng = Engine(dtype="float32")
    yield eng
    eng.engine.stop()


@pytest.fixture(scope="module")
def bf16():
    eng = Engine(dtype="bfloat16", paths="plain")
    yield eng
    eng.engine.stop()


@pytest.fixture(params=["fp32", "bf16"])
def eng(request, fp32, bf16):
    e = {"fp32": fp32, "bf16": bf16}[request.param]
    yield e
    for applied in e.listing()["applied"]:
        e.revert(applied["name"])


def refused(eng: Engine, r: httpx.Response, revision: str = "base") -> str:
    """The 422's message, once the engine is known to run `revision` still and to keep serving."""
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert "failed its self-check" in message
    assert eng.listing()["revision"] == revision
    assert eng.manager.revision == revision
    assert len(eng.greedy(2)) == 2
    return message


# the probe reaches past two KV blocks, in prefill and in decode

def test_a_decode_wrong_only_past_two_blocks_is_refused_with_its_figures(eng):
    before = eng.greedy()
    message = refused(eng, eng.apply("drift", "1", config={"fromTokens": 128}))
    assert "was reverted" in message
    assert "positions compared" in message and "decode" in message, message
    assert eng.greedy() == before


def test_a_decode_wrong_only_beyond_the_probe_passes_it(eng):
    """What the probe cannot see: contexts past its longest (196 tokens in the built-in plan)."""
    r = eng.apply("drift", "1", config={"fromTokens": 4096})
    assert r.status_code == 200, r.text
    assert r.json()["selfCheck"]["positions"] == len(eng.engine.probe_plan.rows)


def test_drift_config_is_checked(fp32):
    for bad in (0, -3, 1.5, "128", True):
        r = fp32.apply("drift", "1", config={"fromTokens": bad})
        assert r.status_code == 400, (bad, r.text)
        assert "fromTokens" in r.json()["error"]["message"]


# the good patches pass, and say how close they came

def test_the_321_set_passes_and_reports_its_figures(eng):
    plan = eng.engine.probe_plan
    answers = {}
    for name in SET_321:
        r = eng.apply(name)
        assert r.status_code == 200, r.text
        answers[name] = r.json()
    figures = answers["sync-free"]["selfCheck"]
    assert figures["positions"] == len(plan.rows) > 250
    assert set(figures) >= {"positions", "worst", "worstAt", "mean", "agreement", "verifyMs", "longestPauseMs",
                            "pieces", "parts"}
    assert 0 <= figures["mean"] <= figures["worst"] and 0.9 <= figures["agreement"] <= 1
    assert 0 < figures["longestPauseMs"] < figures["verifyMs"]
    assert figures["pieces"] >= len(plan.forwards) + 2   # the tentative forwards, the slot checks, the swap
    parts = {p["part"]: p for p in figures["parts"]}
    assert set(parts) == {"prefill A", "prefill B", "prefill C", "decode A", "decode B", "decode C"}
    assert parts["decode A"]["positions"] == 8 and parts["prefill B"]["positions"] == 24
    assert sum(p["positions"] for p in parts.values()) == figures["positions"]
    listed = {a["name"]: a for a in eng.listing()["applied"]}
    for name, answer in answers.items():
        assert listed[name]["selfCheck"] == answer["selfCheck"]
        assert listed[name]["verifyMs"] == answer["verifyMs"] == answer["selfCheck"]["verifyMs"]
    r = eng.apply("kv-align", "3.2.2-test", replace=True)
    assert r.status_code == 200, r.text
    assert eng.listing()["revision"] == "kv-align@3.2.2-test,prefill-fusion@3.2.1,sync-free@3.2.1"


def test_a_fault_patch_that_fails_requests_passes_its_self_check(fp32):
    r = fp32.apply("fault", "1", config={"errorRate": 1.0, "latencyMs": 5})
    try:
        assert r.status_code == 200, r.text
    finally:
        fp32.revert("fault")


def test_a_wrong_kv_gather_is_refused_where_the_cache_is_read_back(fp32):
    message = refused(fp32, fp32.apply("kv-align", "3.2.2-skew"))
    assert "kv-align@3.2.2-skew failed its self-check" in message, message


# the slots outside the forward pass

def _sampler_raises(logits, params, generators):
    raise RuntimeError("no sampling today")


def _sampler_out_of_vocabulary(logits, params, generators):
    return [logits.shape[-1] + 7 for _ in params]


def _sampler_short(logits, params, generators):
    return sample_batched(logits, params, generators)[:1]


def _sampler_not_greedy(logits, params, generators):
    return [int(logits[0].argmin()), *sample_batched(logits, params, generators)[1:]]


def _decode_raises(q, k_cache, v_cache, block_tables, context_lens, scale, gather):
    raise RuntimeError("no decoding today")


def _policy_raises(waiting, now):
    raise KeyError("tenant")


def _policy_drops(waiting, now):
    return default_policy(waiting, now)[1:]


def _policy_duplicates(waiting, now):
    ordered = default_policy(waiting, now)
    return [ordered[0], *ordered[:-1]]


def _policy_invents(waiting, now):
    import copy
    return [copy.copy(s) for s in waiting]


BAD_SLOTS = {
    "sampler-raises": ("sampler", _sampler_raises, "no sampling today"),
    "sampler-out-of-vocabulary": ("sampler", _sampler_out_of_vocabulary, "outside the vocabulary"),
    "sampler-short": ("sampler", _sampler_short, "1 token ids for 2 rows"),
    "sampler-not-greedy": ("sampler", _sampler_not_greedy, "greedy row"),
    "policy-raises": ("scheduler.policy", _policy_raises, "policy raised KeyError"),
    "policy-drops": ("scheduler.policy", _policy_drops, "returned 4 of 5"),
    "policy-duplicates": ("scheduler.policy", _policy_duplicates, "more than once"),
    "policy-invents": ("scheduler.policy", _policy_invents, "not among the waiting"),
    "outcome-nan": ("request.outcome", lambda seq: (math.nan, False), "delay of nan"),
    "outcome-inf": ("request.outcome", lambda seq: (math.inf, False), "delay of inf"),
    "outcome-negative": ("request.outcome", lambda seq: (-1.0, False), "delay of -1.0"),
    "outcome-too-long": ("request.outcome", lambda seq: (61, False), "delay of 61"),
    "outcome-not-a-pair": ("request.outcome", lambda seq: 0.0, "not (delay, failed)"),
    "outcome-failed-text": ("request.outcome", lambda seq: (0.0, "yes"), "not a bool"),
    "outcome-raises": ("request.outcome", lambda seq: 1 / 0, "ZeroDivisionError"),
    "decode-raises": ("attention.decode", _decode_raises, "the probe raised RuntimeError: no decoding today"),
}


@pytest.mark.parametrize("name", list(BAD_SLOTS))
def test_a_slot_that_raises_or_answers_nonsense_is_refused(fp32, name):
    slot, impl, reason = BAD_SLOTS[name]
    patch = Patch(name, "1", {slot: impl}, test_only=True)
    fp32.manager.available[patch.id] = patch
    failures = fp32.engine.metrics.patch_failures.labels(name, "verify")._value.get()
    message = refused(fp32, fp32.apply(name, "1"))
    assert reason in message, message
    assert fp32.engine.metrics.patch_failures.labels(name, "verify")._value.get() == failures + 1


def test_a_request_outcome_that_fails_requests_in_its_contract_passes(fp32):
    patch = Patch("always-fails", "1", {"request.outcome": lambda seq: (60, True)}, test_only=True)
    fp32.manager.available[patch.id] = patch
    assert fp32.apply("always-fails", "1").status_code == 200
    fp32.revert("always-fails")


# the transaction across pieces

def test_a_state_change_between_the_pieces_starts_the_self_check_again(bf16):
    """The slot checks run in one piece, the forward passes in others: a state installed in
    between (here by the sampler itself) must not be overwritten by a table built on the old one."""
    calls = []

    def meddling(times: int):
        def sampler(logits, params, generators):
            calls.append(1)
            if len(calls) <= times:
                bf16.engine.slots = bf16.engine.slots   # a new state, the same table
            return sample_batched(logits, params, generators)
        return sampler

    bf16.manager.available["meddles-once@1"] = Patch("meddles-once", "1", {"sampler": meddling(1)}, test_only=True)
    r = bf16.apply("meddles-once", "1")
    assert r.status_code == 200, r.text
    assert len(calls) == 2 and bf16.listing()["revision"] == "meddles-once@1"
    bf16.revert("meddles-once")
    calls.clear()
    bf16.manager.available["meddles@1"] = Patch("meddles", "1", {"sampler": meddling(99)}, test_only=True)
    r = bf16.apply("meddles", "1")
    assert r.status_code == 409 and "changed during each of 3 self-checks" in r.json()["error"]["message"], r.text
    assert bf16.listing()["revision"] == "base" and len(bf16.greedy(2)) == 2


# the operator's own probe prompts

LONG = " ".join(f"Step {i}: the pump moves {i * 3} litres of water from the lower tank to the upper one."
                for i in range(1, 22))


def test_a_probe_prompt_of_ones_own_makes_the_probe_compare_more_positions(tmp_path, fp32):
    prompts = tmp_path / "probe-prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": LONG, "source": "pump logs"}) + "\n\n")
    n = len(fp32.engine.tokenizer.encode(LONG))
    assert 300 < n < PROBE_USER_MAX_TOKENS
    builtin = len(fp32.engine.probe_plan.rows)
    eng = Engine(dtype="bfloat16", probe_prompts=load_probe_prompts(str(prompts)))
    try:
        assert eng.engine.probe_plan.longest == n
        assert len(eng.engine.probe_blocks) == -(-n // 64) > len(fp32.engine.probe_blocks)
        asyncio.run(eng.manager.warm_up())   # as graft serve does at start-up: the base revision's logits
        r = eng.apply("kv-align")
        assert r.status_code == 200, r.text
        figures = r.json()["selfCheck"]
        assert figures["positions"] == builtin + n
        assert figures["pieces"] == len(eng.engine.probe_plan.forwards) + 2   # no reference left to compute
        parts = {p["part"]: p["positions"] for p in figures["parts"]}
        assert parts["prefill prompt 1"] == n - 2 and parts["decode prompt 1"] == 2
        # the built-in plan reaches 196 tokens; this prompt, past 256
        message = refused(eng, eng.apply("drift", "1", config={"fromTokens": 256}), "kv-align@3.2.1")
        assert "decode prompt 1" in message, message
    finally:
        eng.engine.stop()


def test_a_prompt_longer_than_the_probe_takes_is_cut(fp32):
    words = "one two three four five six seven eight nine ten " * 600
    plan = build_probe_plan(fp32.engine.tokenizer.encode, [words, "hi"], 64, 8192)
    assert plan.longest == PROBE_USER_MAX_TOKENS and plan.num_blocks == PROBE_USER_MAX_TOKENS // 64
    assert "prompt 2" not in plan.seqs   # too short to probe with
    chunks = [n for f in plan.forwards for name, n in f.prefills if name == "prompt 1"]
    assert sum(chunks) == PROBE_USER_MAX_TOKENS - 2 and max(chunks) < 256


def test_a_kv_cache_too_small_for_the_probe_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="keeps 6 aside for its probe"):
        LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=6 * 2 * 30 * 64 * 3 * 64 * 4))


MALFORMED = {
    "not-json": ('{"prompt": "fine"}\n{"prompt": \n', "line 2 is not JSON"),
    "not-an-object": ('["a list"]\n', "line 1 must be a JSON object"),
    "no-prompt": ('{"text": "no prompt key"}\n', 'line 1 needs "prompt"'),
    "blank-prompt": ('{"prompt": "   "}\n', 'line 1 needs "prompt"'),
    "not-text": ('{"prompt": 42}\n', 'line 1 needs "prompt"'),
    "empty": ("\n\n", "holds no prompts"),
    "too-many": ('{"prompt": "a"}\n' * (MAX_PROBE_PROMPTS + 1), f"at most {MAX_PROBE_PROMPTS}"),
    "not-utf8": (b"\xff\xfe{", "cannot read it"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_probe_prompts_file_is_refused_in_one_line(tmp_path, name):
    content, reason = MALFORMED[name]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SystemExit) as stopped:
        load_probe_prompts(str(path))
    message = str(stopped.value)
    assert reason in message and str(path) in message and "\n" not in message, message
    with pytest.raises(SystemExit, match="cannot read it"):
        load_probe_prompts(str(tmp_path / "missing.jsonl"))
    assert load_probe_prompts(None) == [] and load_probe_prompts("") == []


@pytest.mark.parametrize("how", ["flag", "env"])
def test_graft_serve_with_a_malformed_probe_prompts_file_stops_before_loading_the_model(tmp_path, how):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": \n')
    args, env = ["--probe-prompts", str(path)], {}
    if how == "env":
        args, env = [], {"GRAFT_PROBE_PROMPTS_FILE": str(path)}
    done = subprocess.run([sys.executable, "-m", "graft.cli", "serve", "--admin-insecure", *args], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "line 2 is not JSON" in lines[0] and str(path) in lines[0], done.stderr


def test_the_verdict_names_rows_in_plan_order(fp32):
    rows = fp32.engine.probe_plan.rows
    assert rows[0] == ProbeRow("prefill A", "prefill A at position 0")
    assert "decode A at context 196" in [r.where for r in rows]
    assert ProbeRow("prefill B", "prefill B at position 128") in rows
