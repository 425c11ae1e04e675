"""Short requests are not held back by long prefills (`--scheduling fair`), and nothing starves.

Every test drives the real Scheduler and BlockManager with a fake model that answers a fixed token;
time advances DT seconds a step. Each property is checked under `fair`, and where the old order
(`fcfs`) behaves differently, that is shown too.
"""
from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graft.engine.block_manager import BlockManager
from graft.engine.config import EngineConfig, SCHEDULING_CHOICES, add_engine_args, config_from_args, engine_argv
from graft.engine.scheduler import (AGEING_SECONDS, DEADLINE_PER_TOKEN, POLICIES, QueueFull, Scheduler,
                                    default_policy, fair_policy)
from graft.engine.sequence import SamplingParams, Sequence

BS = 64
TOKEN = 7
DT = 0.05   # seconds a step
_seeds = itertools.count()


def make(scheduling: str = "fair", num_blocks: int = 512, **config) -> Scheduler:
    return Scheduler(EngineConfig(scheduling=scheduling, **config), BlockManager(num_blocks, BS))


def request(n: int, max_tokens: int = 1, *, arrival: float = 0.0, priority: int = 0, tenant: str = "",
            rng: random.Random | None = None) -> Sequence:
    rng = rng or random.Random(next(_seeds))   # distinct prompts: nothing shared in the prefix cache
    return Sequence(prompt_token_ids=[rng.randint(1, 999) for _ in range(n)],
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    priority=priority, tenant=tenant, arrival=arrival)


@dataclass
class Run:
    """A scheduler stepped with checks: the step each request got its first token and finished."""

    sched: Scheduler
    dt: float = DT
    step_no: int = 0
    first_token: dict[int, int] = field(default_factory=dict)
    finished: dict[int, int] = field(default_factory=dict)
    prefilled: Counter = field(default_factory=Counter)   # tenant -> prefill tokens

    @property
    def now(self) -> float:
        return self.step_no * self.dt

    def add(self, seq: Sequence) -> Sequence:
        seq.arrival = self.now
        self.sched.add(seq)
        return seq

    def step(self) -> None:
        sched, cfg = self.sched, self.sched.config
        decoding = [s for s in sched.running if not s.in_prefill]
        batch = sched.schedule(sched.base_policy, self.now)
        self.step_no += 1
        if batch is None:
            assert not sched.has_work, "work left but nothing scheduled"
            return
        assert batch.num_tokens <= cfg.max_num_batched_tokens
        assert batch.num_seqs <= cfg.max_num_seqs and sched.num_running <= cfg.max_num_seqs
        for seq in decoding:   # every decode runs every step unless preempted
            assert seq in batch.decodes or seq in batch.preempted
        for seq, n in batch.prefills:
            assert n >= 1 and seq.num_computed_tokens + n <= len(seq)
            self.prefilled[seq.tenant] += n
        got, finished = sched.postprocess(batch, {s.seq_id: TOKEN for s in batch.sampling}, set(), now=self.now)
        for seq in got:
            self.first_token.setdefault(seq.seq_id, self.step_no)
        for seq in finished:
            self.finished[seq.seq_id] = self.step_no
        sched.block_manager.check_invariants()


# the short request behind long prompts

def short_behind_long(scheduling: str, longs: list[int], short: int, offset: int) -> int:
    """Steps from a short request's arrival to its first token, when `longs` arrived `offset` steps
    before it."""
    run = Run(make(scheduling))
    for n in longs:
        run.add(request(n, max_tokens=16))
    for _ in range(offset):
        run.step()
    seq = run.add(request(short, max_tokens=16))
    arrived = run.step_no
    while seq.seq_id not in run.first_token:
        run.step()
    return run.first_token[seq.seq_id] - arrived


@settings(max_examples=60, deadline=None)
@given(longs=st.lists(st.integers(500, 3000), min_size=1, max_size=4), short=st.integers(1, 128),
       offset=st.integers(0, 2))
def test_a_short_request_behind_long_prefills_gets_its_first_token_in_the_step_it_arrives(longs, short, offset):
    assert short_behind_long("fair", longs, short, offset) == 1


def test_under_the_old_order_the_short_request_waits_for_the_long_prompts_ahead_of_it():
    longs = [1000, 1000, 1000, 1000]
    assert short_behind_long("fair", longs, 66, 0) == 1
    assert short_behind_long("fcfs", longs, 66, 0) >= 4


# tenants' shares

def test_backlogged_tenants_get_equal_shares_of_the_prefill_budget():
    """Tenant a sends 50-token prompts, b 2,000-token ones, c 300-token ones, each always with
    requests waiting: over a window each gets a third of the prefill tokens, where shortest-first
    alone would give everything to a."""
    lengths = {"a": 50, "b": 2000, "c": 300}
    rng = random.Random(0)
    run = Run(make(max_num_seqs=64, max_waiting=10_000))
    for _ in range(60):
        for tenant, n in lengths.items():
            while sum(s.tenant == tenant for s in run.sched.waiting) < 8:
                run.add(request(n, tenant=tenant, rng=rng))
        if run.step_no == 10:       # the window starts once all are in their stride
            run.prefilled.clear()
        run.step()
    total = sum(run.prefilled.values())
    assert total >= 50 * (1024 - 3)   # the whole budget (a prompt's last token alone runs as a decode)
    for tenant in lengths:
        assert run.prefilled[tenant] == pytest.approx(total / 3, rel=0.05), run.prefilled


def test_a_lone_tenant_gets_the_whole_budget_and_an_idle_share_goes_to_the_others():
    run = Run(make())
    run.add(request(5000, tenant="a"))
    run.add(request(10, tenant="b"))
    run.step()
    assert run.prefilled == {"a": 1024 - 10, "b": 10}
    run.step()
    assert run.prefilled["a"] == 2 * 1024 - 10


# ageing

def long_under_a_stream_of_short_ones(steps: int) -> int | None:
    """A 600-token prompt, then every step 52 prompts of 20 tokens (slightly more than a step's
    budget), a step every 0.1 s: the step the long prompt got its first token, None if not within
    `steps`."""
    run = Run(make(max_num_seqs=256, max_waiting=100_000), dt=0.1)
    long = run.add(request(600))
    rng = random.Random(1)
    for _ in range(steps):
        for _ in range(52):
            run.add(request(20, rng=rng))
        run.step()
        if long.seq_id in run.first_token:
            return run.first_token[long.seq_id]
    return None


def test_ageing_lets_a_long_prompt_through_a_stream_of_short_ones(monkeypatch):
    # its deadline is 600 x 10 ms after its arrival: the shorts that arrive later queue behind it
    horizon = math.ceil(600 * DEADLINE_PER_TOKEN / 0.1)
    assert horizon <= long_under_a_stream_of_short_ones(90) <= horizon + 5
    # shortest first without ageing starves it (until priority ageing, AGEING_SECONDS away)
    monkeypatch.setattr("graft.engine.scheduler.DEADLINE_PER_TOKEN", 1e6)
    assert 90 * 0.1 < AGEING_SECONDS
    assert long_under_a_stream_of_short_ones(90) is None


def test_priority_comes_before_the_deadline():
    run = Run(make(max_num_seqs=1))
    background = run.add(request(10, 4, priority=1))
    urgent = run.add(request(900, 4, priority=0))
    run.step()
    assert run.sched.running == [urgent] and background in run.sched.waiting


# random traffic: the limits hold, and no request starves

@dataclass(frozen=True)
class Arrival:
    step: int
    length: int
    max_tokens: int
    priority: int
    tenant: str


arrivals_st = st.lists(st.builds(Arrival, st.integers(0, 60), st.one_of(st.integers(1, 128), st.integers(500, 2500)),
                                 st.integers(1, 24), st.integers(0, 2), st.sampled_from("abc")),
                       min_size=1, max_size=40)


def drive(sched: Scheduler, arrivals: list[Arrival], seed: int) -> tuple[Run, dict[int, tuple[Arrival, int]]]:
    """Run `arrivals` to the end; returns the run and seq_id -> (arrival, the step it was added)."""
    run = Run(sched)
    rng = random.Random(seed)
    pending = sorted(arrivals, key=lambda a: a.step)
    added: dict[int, tuple[Arrival, int]] = {}
    while pending or sched.has_work:
        while pending and pending[0].step <= run.step_no:
            a = pending.pop(0)
            try:
                seq = run.add(request(a.length, a.max_tokens, priority=a.priority, tenant=a.tenant, rng=rng))
                added[seq.seq_id] = (a, run.step_no)
            except QueueFull:
                pass
        run.step()
        assert run.step_no < 20_000, "the run did not drain"
    assert set(run.finished) == set(added)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return run, added


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=arrivals_st, scheduling=st.sampled_from(SCHEDULING_CHOICES), num_blocks=st.integers(41, 120),
       max_num_seqs=st.integers(1, 12), budget=st.integers(12, 1200), max_waiting=st.integers(2, 40),
       seed=st.integers(0, 2**16))
def test_under_pressure_every_step_keeps_the_limits_and_every_admitted_request_finishes(
        arrivals, scheduling, num_blocks, max_num_seqs, budget, max_waiting, seed):
    sched = make(scheduling, num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max(budget, max_num_seqs),
                 max_waiting=max_waiting, max_model_len=4096)
    drive(sched, arrivals, seed)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=arrivals_st, seed=st.integers(0, 2**16))
def test_every_request_finishes_within_its_bound(arrivals, seed):
    """With room for everyone, a request is overtaken only by its own tenant's requests that arrive
    before its horizon (when its aged priority beats any newcomer's, and its deadline passed), and
    its tenant gets at least a third of the prefill budget each step: it finishes within the
    horizon, its tenant's work up to then at that rate, and its decodes."""
    budget, seats = 1024, 64
    sched = make("fair", 4096, max_num_seqs=seats, max_num_batched_tokens=budget, max_waiting=1000)
    run, added = drive(sched, arrivals, seed)
    lowest = min(a.priority for a in arrivals)
    share = (budget - seats) // 3
    for seq_id, (a, at) in added.items():
        horizon = at + math.ceil(((a.priority - lowest + 1) * AGEING_SECONDS
                                  + a.length * DEADLINE_PER_TOKEN) / DT)
        ahead = sum(b.length for b, t in added.values() if b.tenant == a.tenant and t <= horizon)
        bound = horizon - at + math.ceil(ahead / share) + a.max_tokens + 1
        assert run.finished[seq_id] - at <= bound, (a, run.finished[seq_id] - at, bound)
    assert sched.num_preemptions == 0


# the flag, and the policy slot

def test_fair_is_the_default_and_fcfs_is_selectable():
    import argparse
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert config_from_args(p.parse_args([])).scheduling == "fair" == EngineConfig().scheduling
    args = p.parse_args(["--scheduling", "fcfs"])
    assert config_from_args(args).scheduling == "fcfs" and engine_argv(args) == ["--scheduling", "fcfs"]
    with pytest.raises(ValueError, match="scheduling"):
        EngineConfig(scheduling="sjf")
    assert POLICIES == {"fair": fair_policy, "fcfs": default_policy}
    assert make("fcfs").base_policy is default_policy and make().base_policy is fair_policy


def test_fair_admits_waiting_requests_in_the_patched_policys_order():
    run = Run(make(max_num_seqs=2))
    small, big, other = (run.add(request(n)) for n in (10, 500, 20))
    batch = run.sched.schedule(lambda waiting, now: sorted(waiting, key=len, reverse=True), run.now)
    assert [s for s, _ in batch.prefills] == [big, other]
    assert small in run.sched.waiting


def test_a_raising_policy_falls_back_to_the_base_policy_of_the_mode():
    sched = make()
    long, short = request(900), request(20, arrival=0.5)   # deadlines 0.9 and 0.52
    sched.add(long)
    sched.add(short)

    def broken(waiting, now):
        raise RuntimeError("no order")
    batch = sched.schedule(broken, 1.0)
    assert isinstance(sched.policy_error, RuntimeError)
    assert batch.prefills[0] == (short, 20)     # fair_policy's order: the shorter deadline first
