"""The shadow comparison: a patched engine compares its answers with the table it ran before.

An in-process engine (float32, the real model) with the test patches: a numerically neutral patch
is compared and agrees, a patch wrong only past a context length (`drift@1`) is compared and is
divergent on long requests only, nothing is compared with nothing to compare against, and shadow
work that fails never fails a client's request. The statistics of `compare` are checked on their
own: identical distributions agree, the partition KL never exceeds the full KL.
"""
from __future__ import annotations

import asyncio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft.engine.config import EngineConfig
from graft.engine.patches.base import Patch
from graft.engine.sequence import SamplingParams
from graft.engine.shadow import LIMITS, Limits, ShadowComparator, ShadowSettings, compare
from tests.support import bbh_prompt

pytestmark = pytest.mark.slow


# ---- the statistics ----

def _record(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    lp = logits.log_softmax(-1)
    top_lp, top_ids = lp.topk(k, dim=-1)
    return top_ids, top_lp


def test_identical_distributions_agree():
    logits = torch.randn(12, 500) * 3
    ids, lp = _record(logits, 32)
    c = compare(ids, lp, logits.clone(), LIMITS[torch.float32])
    assert c.positions == 12 and c.agreement == 1.0 and c.mean_kl < 1e-6 and not c.divergent


def test_a_changed_distribution_is_divergent_in_every_dtype():
    torch.manual_seed(1)
    live = torch.randn(20, 500) * 3
    other = torch.randn(20, 500) * 3
    ids, lp = _record(live, 32)
    for limits in LIMITS.values():
        c = compare(ids, lp, other, limits)
        assert c.divergent and c.mean_kl > 1 and c.agreement < 0.5


def test_rounding_noise_is_within_the_16_bit_limits_but_not_the_float32_ones():
    torch.manual_seed(2)
    live = torch.randn(64, 2000) * 4
    noisy = live + torch.randn_like(live) * 0.1          # what a reordered bf16 sum does to logits
    ids, lp = _record(live, 32)
    assert not compare(ids, lp, noisy, LIMITS[torch.bfloat16]).divergent
    assert compare(ids, lp, live + torch.randn_like(live) * 0.5, LIMITS[torch.float32]).divergent


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 40), scale=st.floats(0.1, 8.0))
def test_partition_kl_is_a_lower_bound_of_the_full_kl(seed, k, scale):
    g = torch.Generator().manual_seed(seed)
    live = torch.randn(4, 60, generator=g) * scale
    prev = torch.randn(4, 60, generator=g) * scale
    ids, lp = _record(live, k)
    c = compare(ids, lp, prev, Limits(kl=1.0, agreement=0.5))
    p, q = live.log_softmax(-1), prev.log_softmax(-1)
    full = (p.exp() * (p - q)).sum(-1)
    assert c.max_kl <= float(full.max()) + 1e-4
    assert 0 <= c.mean_kl <= float(full.mean()) + 1e-4


def test_non_finite_previous_logits_are_divergent():
    logits = torch.randn(3, 100)
    ids, lp = _record(logits, 8)
    bad = logits.clone()
    bad[1] = float("nan")
    assert compare(ids, lp, bad, LIMITS[torch.float32]).divergent


# ---- the budget ----

class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Runner:
    class config:
        block_size = 64


class _Metrics:
    pass


def test_the_budget_and_the_floor_pace_the_work():
    clock = _Clock()
    shadow = ShadowComparator(ShadowSettings(budget=0.05, floor=2, busy_gap=1.0), _Runner(), list(range(8)),
                              torch.float32, _Metrics(), clock=clock)
    assert shadow._due(clock(), busy=False)          # the floor: no comparison in the last minute
    shadow._recent.extend([clock.now, clock.now])    # two in the last minute: the floor is met
    shadow._credit = -1.0                            # and a slice just overspent the budget
    assert not shadow._due(clock(), busy=False)
    clock.now += 10                                  # 10 s at 5% pays back 0.5 s: still in debt
    assert not shadow._due(clock(), busy=False)
    clock.now += 15                                  # 1.25 s earned in all: credit again
    assert shadow._due(clock(), busy=False)
    shadow._last_slice = clock.now - 0.5             # while busy, one slice a second at most
    assert not shadow._due(clock(), busy=True)
    clock.now += 1
    assert shadow._due(clock(), busy=True)
    clock.now += 61                                  # the comparisons leave the minute: the floor again
    shadow._credit = -100.0
    assert shadow._due(clock(), busy=False)
    assert not shadow._due(clock(), busy=True)       # but only in idle time: busy, the budget alone


def test_no_more_requests_are_recorded_than_the_queue_could_compare():
    from graft.engine.sequence import Sequence
    shadow = ShadowComparator(ShadowSettings(queue=2), _Runner(), list(range(8)), torch.float32, _Metrics())
    shadow.previous, shadow.revision = object(), "p@1"
    seqs = [Sequence(prompt_token_ids=[1, 2, 3]) for _ in range(4)]
    for seq in seqs:
        seq.revision = "p@1"
        shadow.admit(seq)
    assert [s.shadow is not None for s in seqs] == [True, True, False, False]
    shadow.finished(seqs[0], ok=False)        # an error or a hang-up frees its place
    shadow.admit(seqs[2])
    assert seqs[2].shadow is not None and seqs[0].shadow is None


def test_the_next_comparison_is_the_one_sharing_the_most_whole_blocks_with_the_shadow_blocks():
    """The shadow blocks as a prefix cache of one sequence: the queued job sharing the most whole
    blocks goes first (the oldest on ties), it starts after them, and never past its first compared
    position."""
    from graft.engine.sequence import Sequence
    from graft.engine.shadow import _Job
    shadow = ShadowComparator(ShadowSettings(), _Runner(), list(range(8)), torch.float32, _Metrics())
    system = list(range(1000, 1150))                   # a 150-token shared prefix: two whole blocks

    def job(tokens, compared=4):
        seq = Sequence(prompt_token_ids=tokens)
        return _Job("p@1", shadow.epoch, seq, len(tokens) - compared, torch.zeros(compared, 1), torch.zeros(compared, 1))
    other = job(list(range(5, 300)))
    same = job(system + [7] * 40)
    longer = job(system + [7] * 40 + [8] * 100)
    shadow._queue.extend([other, same, longer])
    shadow._cached = system[:128]
    assert shadow._shared(other) == 0 and shadow._shared(same) == shadow._shared(longer) == 128
    assert shadow._take() is same and same.seq.num_computed_tokens == 128 and shadow.reused == 128
    shadow._cached = system[:100] + [0] * 92           # differs inside the second block: one block shared
    assert shadow._shared(longer) == 64
    short = job(system[:70], compared=20)              # compared from position 50: nothing reused
    assert shadow._shared(short) == 0
    shadow._cached = []
    assert shadow._take() is other and other.seq.num_computed_tokens == 0   # the oldest on ties


def test_settings_out_of_range_are_refused():
    for bad in ({"rate": 1.5}, {"budget": -0.1}, {"floor": 1000}, {"chunk": 0}):
        with pytest.raises(ValueError):
            ShadowSettings(**bad)
    with pytest.raises(ValueError, match="shadow_rate"):
        EngineConfig(dtype="float32", shadow_rate=2.0)


# ---- a real engine ----

@pytest.fixture(scope="module")
def served():
    """A float32 engine in this process with its patch manager; shadow work runs as fast as it can."""
    from graft.engine.engine import LLMEngine
    from graft.engine.patches.manager import PatchManager
    loop = asyncio.new_event_loop()
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=512 << 20, shadow_budget=1.0,
                                    shadow_floor=600, shadow_max_tokens=1024))
    engine.start()
    manager = PatchManager(engine, enable_test_patches=True)
    yield engine, manager, loop
    engine.stop()
    loop.close()


def _generate(engine, loop, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    async def one(ids):
        handle = engine.submit(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        out = []
        async for ev in handle.events():
            assert ev.error is None, ev.error
            if ev.token_id is not None:
                out.append(ev.token_id)
        return out

    async def all_():
        return await asyncio.gather(*[one(p) for p in prompts])
    return loop.run_until_complete(all_())


def _counts(engine, revision: str) -> dict[str, float]:
    return {r: engine.metrics.shadow_requests.labels(revision, r)._value.get() for r in ("agree", "divergent", "error")}


def _settle(engine, loop, revision: str, total: int, since: dict[str, float] | None = None,
            timeout: float = 90) -> dict[str, float]:
    """The comparisons of `revision` since `since` (a `_counts` snapshot), once `total` have been made."""
    since = since or {r: 0.0 for r in ("agree", "divergent", "error")}

    def delta():
        now = _counts(engine, revision)
        return {r: now[r] - since[r] for r in now}

    async def wait():
        deadline = loop.time() + timeout
        while sum(delta().values()) < total and loop.time() < deadline:
            await asyncio.sleep(0.1)
    loop.run_until_complete(wait())
    return delta()


def _apply(manager, loop, patch_id: str, config=None, replace=False):
    name, version = patch_id.split("@")
    return loop.run_until_complete(manager.apply(name, version, {"builtin": True}, config, replace=replace))


def _revert(manager, loop, name: str):
    return loop.run_until_complete(manager.revert(name))


@pytest.fixture(scope="module")
def prompts(served):
    engine, _, _ = served
    long = engine.tokenizer.encode(bbh_prompt("date_understanding"))[:700]
    short = engine.tokenizer.encode("The capital of France is")
    return long, short


def test_nothing_is_compared_without_a_previous_table(served, prompts):
    engine, manager, loop = served
    assert not engine.shadow.active
    _generate(engine, loop, list(prompts))
    assert _counts(engine, "base") == {"agree": 0, "divergent": 0, "error": 0}


def test_a_neutral_patch_agrees_with_the_table_before_it(served, prompts):
    engine, manager, loop = served
    _apply(manager, loop, "kv-align@3.2.2-test")
    try:
        assert engine.shadow.active and engine.shadow.previous.revision == "base"
        before = _counts(engine, engine.revision)
        _generate(engine, loop, list(prompts))
        counts = _settle(engine, loop, engine.revision, 2, before)
        assert counts == {"agree": 2, "divergent": 0, "error": 0}
        assert engine.shadow.last.mean_kl < 1e-4 and engine.shadow.last.agreement == 1.0
        positions = engine.metrics.shadow_positions.labels(engine.revision)._value.get()
        assert positions == 2 * 12        # every generated position of both requests
    finally:
        _revert(manager, loop, "kv-align")
    assert not engine.shadow.active       # a revert leaves nothing to compare against


def test_a_patch_wrong_past_a_context_length_is_divergent_on_long_requests_only(served, prompts):
    engine, manager, loop = served
    long, short = prompts
    _apply(manager, loop, "drift@1", {"fromTokens": 400})   # beyond the self-check's probe
    try:
        rev = engine.revision
        _generate(engine, loop, [long])
        assert _settle(engine, loop, rev, 1) == {"agree": 0, "divergent": 1, "error": 0}
        assert engine.shadow.last.mean_kl > LIMITS[torch.float32].kl * 10
        _generate(engine, loop, [short])
        assert _settle(engine, loop, rev, 2) == {"agree": 1, "divergent": 1, "error": 0}
    finally:
        _revert(manager, loop, "drift")


@pytest.mark.parametrize("patch, config, result", [("kv-align@3.2.2-test", None, "agree"),
                                                   ("drift@1", {"fromTokens": 400}, "divergent")])
def test_a_comparison_after_one_with_the_same_prefix_starts_after_it_and_judges_the_same(
        served, prompts, patch, config, result):
    """Two long requests with the same 3-shot prefix: the second's comparison reuses the prefix's
    blocks the first left in the shadow blocks (nine whole blocks) and comes to the same verdict as
    the first, for a neutral patch and for one wrong past 400 tokens."""
    engine, manager, loop = served
    long, _ = prompts
    other = long[:600] + engine.tokenizer.encode(" Q: Today is the last day of 1999. What is the date tomorrow?")
    _apply(manager, loop, patch, config)
    try:
        rev = engine.revision
        before = _counts(engine, rev)
        _generate(engine, loop, [long])
        assert _settle(engine, loop, rev, 1, before)[result] == 1
        reused = engine.shadow.reused
        _generate(engine, loop, [other])
        counts = _settle(engine, loop, rev, 2, before)
        assert counts[result] == 2, counts
        assert engine.shadow.reused - reused == 9 * 64
        if result == "agree":
            assert engine.shadow.last.mean_kl < 1e-4 and engine.shadow.last.agreement == 1.0
    finally:
        _revert(manager, loop, patch.split("@")[0])


def test_a_failing_comparison_is_counted_and_never_fails_a_request(served, prompts):
    engine, manager, loop = served
    _apply(manager, loop, "kv-align@3.2.2-test")
    try:
        rev = engine.revision
        before = _counts(engine, rev)
        previous = engine.shadow.previous

        def broken(*args, **kwargs):
            raise RuntimeError("the previous table's kernel is gone")
        engine.shadow.previous = type(previous)(previous.slots.with_slots({"attention.prefill": broken}),
                                                previous.revision, previous.patches)
        outs = _generate(engine, loop, list(prompts))
        assert all(len(o) == 12 for o in outs)
        assert _settle(engine, loop, rev, 2, before) == {"agree": 0, "divergent": 0, "error": 2}
    finally:
        _revert(manager, loop, "kv-align")


def test_requests_longer_than_the_shadow_blocks_are_skipped(served):
    engine, manager, loop = served
    _apply(manager, loop, "kv-align@3.2.2-test")
    try:
        text = engine.tokenizer.encode(bbh_prompt("date_understanding") * 2)
        cap = engine.shadow.capacity
        skipped = engine.metrics.shadow_skipped.labels("too-long")
        before = skipped._value.get()
        before_counts = _counts(engine, engine.revision)
        _generate(engine, loop, [text[:cap + 50]], n=2)    # not even recorded
        _generate(engine, loop, [text[:cap - 1]], n=4)     # recorded, longer than the blocks once answered
        loop.run_until_complete(asyncio.sleep(0.5))
        assert _counts(engine, engine.revision) == before_counts
        assert skipped._value.get() == before + 1
    finally:
        _revert(manager, loop, "kv-align")


def test_a_new_swap_drops_the_comparisons_of_the_old_one(served, prompts):
    engine, manager, loop = served
    _apply(manager, loop, "kv-align@3.2.2-test")
    first = engine.shadow.epoch
    _apply(manager, loop, "kv-align@3.2.1", replace=True)
    try:
        assert engine.shadow.epoch > first
        assert engine.shadow.previous.revision == "kv-align@3.2.2-test"   # the replaced version
        before = _counts(engine, engine.revision)
        _generate(engine, loop, [prompts[1]])
        assert _settle(engine, loop, engine.revision, 1, before)["agree"] == 1
    finally:
        _revert(manager, loop, "kv-align")


def test_a_shadow_rate_of_zero_turns_it_off():
    shadow = ShadowComparator(ShadowSettings(rate=0.0), _Runner(), list(range(8)), torch.float32, _Metrics())
    shadow.previous = object()
    assert not shadow.active


def test_a_registered_patch_that_only_reorders_the_schedule_agrees(served, prompts):
    """A patch outside the model (here the scheduler policy) changes no distribution at all."""
    engine, manager, loop = served
    from graft.engine.scheduler import default_policy
    manager.available["fifo@1"] = Patch("fifo", "1", {"scheduler.policy": lambda waiting, now: default_policy(waiting, now)},
                                        test_only=True)
    _apply(manager, loop, "fifo@1")
    try:
        _generate(engine, loop, list(prompts))
        counts = _settle(engine, loop, engine.revision, 2)
        assert counts["agree"] == 2 and engine.shadow.last.mean_kl == pytest.approx(0, abs=1e-6)
    finally:
        _revert(manager, loop, "fifo")


def test_graft_serve_compares_after_an_admin_apply_but_not_after_its_start_up_patches(tmp_path):
    """A restarted container comes back with GRAFT_PATCHES: it never ran them the other way, so it has
    nothing to compare against until the next apply; GET /admin/patches says which."""
    from tests.support import start_engine
    eng = start_engine(tmp_path, env={"GRAFT_PATCHES": "kv-align@3.2.1"})
    try:
        with eng.admin() as admin:
            shadow = admin.get("/admin/patches").json()["shadow"]
            assert shadow["active"] is False and shadow["against"] is None
            r = admin.post("/admin/patches", json={"name": "sync-free", "version": "3.2.1", "source": {"builtin": True}})
            assert r.status_code == 200, r.text
            shadow = admin.get("/admin/patches").json()["shadow"]
            assert shadow["active"] is True
            assert (shadow["revision"], shadow["against"]) == ("kv-align@3.2.1,sync-free@3.2.1", "kv-align@3.2.1")
            assert shadow["capacityTokens"] > 0 and shadow["limits"]["meanKl"] == LIMITS[torch.float32].kl
            assert admin.delete("/admin/patches/sync-free").status_code == 200
            assert admin.get("/admin/patches").json()["shadow"]["active"] is False
    finally:
        eng.stop()


def test_the_shadow_rate_comes_from_its_flag_or_the_pod_annotation_env(monkeypatch):
    import argparse
    from graft.engine.config import add_engine_args, config_from_args

    def parsed(*argv: str) -> EngineConfig:
        p = argparse.ArgumentParser()
        add_engine_args(p)
        return config_from_args(p.parse_args(["--dtype", "float32", *argv]))
    monkeypatch.delenv("GRAFT_SHADOW_RATE", raising=False)
    assert parsed().shadow_rate == 1.0
    monkeypatch.setenv("GRAFT_SHADOW_RATE", "")          # the Downward API's value of an absent annotation
    assert parsed().shadow_rate == 1.0
    monkeypatch.setenv("GRAFT_SHADOW_RATE", "0.25")
    assert parsed().shadow_rate == 0.25
    assert parsed("--shadow-rate", "0").shadow_rate == 0.0
    monkeypatch.setenv("GRAFT_SHADOW_RATE", "lots")
    with pytest.raises(SystemExit):
        parsed()
