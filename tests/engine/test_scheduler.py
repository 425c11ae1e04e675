"""The continuous-batching scheduler: budgets, chunked prefill, priorities, fairness, preemption."""
from __future__ import annotations

import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graft.engine.block_manager import BlockManager
from graft.engine.config import EngineConfig
from graft.engine.scheduler import QueueFull, ScheduledBatch, Scheduler, default_policy
from graft.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

BS = 64
EOS = 0


def make(num_blocks: int = 64, **config) -> Scheduler:
    return Scheduler(EngineConfig(**config), BlockManager(num_blocks, BS))


def request(n: int, max_tokens: int = 4, *, priority: int = 0, tenant: str = "", arrival: float = 0.0,
            tokens: list[int] | None = None, **params) -> Sequence:
    prompt = tokens if tokens is not None else [random.Random(n).randint(1, 999) for _ in range(n)]
    return Sequence(prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens, **params),
                    priority=priority, tenant=tenant, arrival=arrival)


def step(sched: Scheduler, now: float = 0.0, token: int = 7, policy=default_policy) -> ScheduledBatch | None:
    """One engine step with a 'model' that always answers `token`."""
    batch = sched.schedule(policy, now)
    if batch is not None:
        sched.postprocess(batch, {s.seq_id: token for s in batch.sampling}, {EOS}, now=now)
    return batch


def steps_until(sched: Scheduler, done, token: int = 7, limit: int = 2000) -> int:
    """Step until `done()` holds; fails instead of spinning if it never does."""
    for n in range(limit):
        if done():
            return n
        step(sched, token=token)
        sched.block_manager.check_invariants()
    raise AssertionError(f"not done after {limit} steps")


def admitted(batch: ScheduledBatch) -> list[Sequence]:
    return [s for s, _ in batch.prefills]


# what a user relies on

def test_a_long_prompt_is_chunked_and_never_stalls_running_decodes():
    sched = make(max_num_batched_tokens=512)
    short = request(10, max_tokens=20)
    sched.add(short)
    step(sched)
    long = request(4000, max_tokens=2)
    sched.add(long)
    chunks = []
    for _ in range(20):
        if long.num_computed_tokens == 4000:
            break
        before = len(short.output_token_ids)
        batch = step(sched)
        assert batch.decodes == [short]
        assert len(short.output_token_ids) == before + 1
        assert batch.num_tokens <= 512
        chunks += [n for s, n in batch.prefills if s is long]
    assert chunks == [511] * 7 + [4000 - 7 * 511]
    assert len(long.output_token_ids) == 1  # only the last chunk samples


def test_a_partial_prefill_samples_no_token():
    sched = make(max_num_batched_tokens=100)
    seq = request(150)
    sched.add(seq)
    batch = sched.schedule(default_policy, 0.0)
    assert batch.prefills == [(seq, 100)] and batch.sampling == []
    with pytest.raises(ValueError, match="partial prefill"):
        sched.postprocess(batch, {seq.seq_id: 1}, {EOS})


def test_a_lower_priority_value_is_admitted_first():
    sched = make(max_num_seqs=1, max_num_batched_tokens=64)
    background = request(8, priority=5, arrival=0.0)
    urgent = request(8, priority=0, arrival=1.0)
    sched.add(background)
    sched.add(urgent)
    assert admitted(step(sched, now=1.0)) == [urgent]


def test_a_request_waiting_for_blocks_is_not_overtaken_by_a_lower_priority_one():
    sched = make(num_blocks=4, max_num_seqs=4, max_num_batched_tokens=512)
    hog = request(150, max_tokens=30, arrival=0.0)   # 3 of the 4 blocks
    sched.add(hog)
    step(sched)
    big = request(100, priority=0, arrival=1.0)      # needs 2 blocks, 1 is free
    small = request(10, priority=1, arrival=2.0)     # would fit in the free block
    sched.add(big)
    sched.add(small)
    order: list[Sequence] = []
    for _ in range(100):
        batch = step(sched, now=2.0)
        order += admitted(batch) if batch else []
    assert order == [big, small]


def test_a_low_priority_request_is_not_starved_by_a_stream_of_urgent_ones():
    def admitted_at(policy) -> float | None:
        sched = make(max_num_seqs=1, max_num_batched_tokens=64)
        low = request(8, max_tokens=1, priority=3, arrival=0.0)
        sched.add(low)
        for t in range(100):
            sched.add(request(8, max_tokens=1, priority=0, arrival=float(t)))
            if low in admitted(step(sched, now=float(t), policy=policy)):
                return float(t)
        return None

    # three levels of ageing at 10 s each; then it ties with the newest and arrived first
    assert admitted_at(default_policy) == 30.0
    assert admitted_at(functools.partial(default_policy, ageing_seconds=float("inf"))) is None


def test_tenants_take_turns_within_a_priority():
    waiting = [request(4, tenant="a", arrival=t) for t in (0, 1, 2)]
    waiting += [request(4, tenant="b", arrival=t) for t in (3, 4)]
    waiting += [request(4, tenant="c", arrival=5)]
    order = default_policy(list(reversed(waiting)), now=6.0)
    assert [s.tenant for s in order] == ["a", "b", "c", "a", "b", "a"]
    assert [s.arrival for s in order if s.tenant == "a"] == [0, 1, 2]


def test_one_tenants_burst_does_not_hold_back_another_tenant():
    sched = make(max_num_seqs=2, max_num_batched_tokens=64)
    burst = [request(8, max_tokens=50, tenant="big", arrival=t / 10) for t in range(10)]
    other = request(8, max_tokens=50, tenant="small", arrival=5.0)
    for seq in [*burst, other]:
        sched.add(seq)
    assert admitted(step(sched, now=5.0)) == [burst[0], other]


def admission_order(sched: Scheduler, requests: list[tuple[str, str]], now: float = 5.0) -> list[str]:
    """Queue (name, tenant) requests in this order and step until they are done; the names in the
    order they were admitted."""
    names = {}
    for i, (name, tenant) in enumerate(requests):
        seq = request(4, max_tokens=1, tenant=tenant, arrival=float(i), tokens=[5 + i] * 4)
        names[seq.seq_id] = name
        sched.add(seq)
    order: list[str] = []
    while sched.has_work:
        order += [names[s.seq_id] for s in admitted(step(sched, now=now))]
    return order


def test_a_tenants_burst_does_not_hold_the_others_back_when_admissions_come_one_at_a_time():
    # one sequence at a time: each admission is a call of its own, so the turns must carry over
    sched = make(num_blocks=8, max_num_seqs=1)
    assert admission_order(sched, [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")]) == ["a1", "b1", "a2", "a3"]
    # and on the next burst the tenant admitted least recently (b) goes first
    assert admission_order(sched, [("a4", "a"), ("b2", "b"), ("b3", "b")]) == ["b2", "a4", "b3"]


def test_the_fairness_memory_is_bounded_and_forgets_the_least_recent_tenant(monkeypatch):
    monkeypatch.setattr("graft.engine.scheduler.TENANT_MEMORY", 2)
    sched = make(num_blocks=8, max_num_seqs=1)
    admission_order(sched, [("x", "x"), ("a", "a"), ("b", "b")])     # x is forgotten, a and b kept
    assert list(sched._tenant_turns) == ["a", "b"]
    # forgotten or never seen, x goes first either way: it was admitted least recently
    assert admission_order(sched, [("b1", "b"), ("a1", "a"), ("x1", "x")]) == ["x1", "a1", "b1"]
    assert len(sched._tenant_turns) == 2


def test_preemption_by_recompute_finishes_everything_with_the_asked_length():
    sched = make(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=256)
    seqs = [request(100 + i, max_tokens=150, ignore_eos=True, arrival=float(i)) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    steps_until(sched, lambda: not sched.has_work, token=EOS)  # EOS is ignored: all run to max_tokens
    assert sched.num_preemptions > 0
    assert all(len(s.output_token_ids) == 150 and s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert sched.block_manager.num_free_blocks == 6


def test_a_preempted_sequence_keeps_its_output_and_recomputes_it():
    sched = make(num_blocks=3, max_num_seqs=2, max_num_batched_tokens=256)
    first = request(60, max_tokens=100, arrival=0.0)
    second = request(60, max_tokens=100, arrival=1.0)
    sched.add(first)
    sched.add(second)
    steps_until(sched, lambda: second.num_preemptions > 0)
    out = list(second.output_token_ids)
    assert out and second.status is SequenceStatus.WAITING and second.num_computed_tokens == 0
    assert first.status is SequenceStatus.RUNNING  # the later arrival is the one preempted
    steps_until(sched, lambda: second.status is SequenceStatus.RUNNING)
    assert second.output_token_ids[:len(out)] == out


def test_a_shared_prefix_is_not_prefilled_twice():
    sched = make(max_num_batched_tokens=512)
    system = list(range(1, 193))
    first = request(0, tokens=system + [500, 501])
    sched.add(first)
    step(sched)
    second = request(0, tokens=system + [600])
    sched.add(second)
    batch = step(sched)
    assert (second, 1) in batch.prefills
    assert second.num_cached_tokens == 192


def test_queue_full_when_the_queue_is_full():
    sched = make(max_waiting=2)
    sched.add(request(4))
    sched.add(request(4))
    with pytest.raises(QueueFull) as err:
        sched.add(request(4))
    assert err.value.retry_after >= 1
    assert sched.num_waiting == 2


def test_an_impossible_prompt_is_rejected():
    sched = make(num_blocks=4, max_model_len=1024)
    with pytest.raises(ValueError, match="context"):
        sched.add(request(1024))
    with pytest.raises(ValueError, match="KV cache"):
        sched.add(request(4 * BS))
    with pytest.raises(ValueError, match="empty"):
        sched.add(request(0, tokens=[]))
    assert sched.num_waiting == 0
    sched.add(request(4 * BS - 1))  # fits, with room for one generated token


@pytest.mark.parametrize(("token", "params", "reason", "n_out"), [
    (EOS, {}, FinishReason.STOP, 1),
    (EOS, {"ignore_eos": True}, FinishReason.LENGTH, 3),
    (9, {"stop_token_ids": [9]}, FinishReason.STOP, 1),
    (7, {}, FinishReason.LENGTH, 3),
])
def test_finish_reasons(token, params, reason, n_out):
    sched = make()
    seq = request(5, max_tokens=3, **params)
    sched.add(seq)
    steps_until(sched, lambda: not sched.has_work, token=token)
    assert (seq.finish_reason, len(seq.output_token_ids)) == (reason, n_out)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_the_context_limit_ends_a_sequence():
    sched = make(max_model_len=100)
    seq = request(97, max_tokens=50)
    sched.add(seq)
    steps_until(sched, lambda: not sched.has_work)
    assert seq.finish_reason is FinishReason.LENGTH and len(seq) == 100


def test_abort_frees_blocks_and_is_safe_to_repeat():
    sched = make()
    running, queued = request(100), request(10)
    sched.add(running)
    step(sched)
    sched.add(queued)
    assert sched.abort(running.seq_id) is running
    assert sched.finish(queued.seq_id, FinishReason.STOP) is queued
    assert sched.abort(running.seq_id) is None and sched.abort(12345678) is None
    assert running.finish_reason is FinishReason.ABORT and queued.finish_reason is FinishReason.STOP
    assert not sched.has_work and sched.schedule(default_policy, 0.0) is None
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_an_abort_between_schedule_and_postprocess_is_skipped():
    sched = make()
    seq = request(10)
    sched.add(seq)
    batch = sched.schedule(default_policy, 0.0)
    sched.abort(seq.seq_id)
    got, finished = sched.postprocess(batch, {seq.seq_id: 3}, {EOS})
    assert got == [] and finished == [] and seq.output_token_ids == []


def test_a_patched_policy_cannot_admit_what_is_not_waiting():
    sched = make()
    seq = request(10)
    sched.add(seq)
    stranger = request(10)
    batch = sched.schedule(lambda waiting, now: [stranger, *waiting, *waiting], 0.0)
    assert admitted(batch) == [seq]


# simulation: random arrivals against a fake model

# arrival step, prompt length, max_tokens, priority, tenant, length of the shared system prompt
Request = tuple[int, int, int, int, str, int]


def simulate(reqs: list[Request], num_blocks: int, max_num_seqs: int, budget: int, max_waiting: int,
             seed: int) -> tuple[Scheduler, int]:
    """Run requests through a scheduler and a fake model answering random tokens, checking every
    step; returns the drained scheduler and the number of requests rejected with QueueFull."""
    sched = make(num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                 max_waiting=max_waiting, max_model_len=4096)
    bm = sched.block_manager
    rng = random.Random(seed)
    system = [rng.randint(1, 50) for _ in range(700)]
    arrivals: dict[int, list[Sequence]] = {}
    for at, n, max_tokens, priority, tenant, shared in reqs:
        tokens = system[:min(shared, n)] + [rng.randint(1, 50) for _ in range(n - min(shared, n))]
        seq = Sequence(prompt_token_ids=tokens, params=SamplingParams(max_tokens=max_tokens),
                       priority=priority, tenant=tenant, arrival=at * 0.5)
        arrivals.setdefault(at, []).append(seq)
    added: list[Sequence] = []
    rejected = 0
    for t in range(20_000):
        now = t * 0.5
        for seq in arrivals.pop(t, []):
            try:
                sched.add(seq)
                added.append(seq)
            except QueueFull:
                rejected += 1
        decoding = [s for s in sched.running if not s.in_prefill]
        batch = sched.schedule(default_policy, now)
        if batch is None:
            assert not sched.has_work, "work left but nothing scheduled"
            if not arrivals:
                break
            continue
        assert batch.num_tokens <= budget
        assert 1 <= batch.num_seqs <= max_num_seqs and sched.num_running <= max_num_seqs
        for seq in decoding:  # a decode is never starved by a prefill
            assert seq in batch.decodes or seq in batch.preempted
        for seq, n in batch.prefills:
            assert n >= 1 and seq.num_computed_tokens + n <= len(seq)
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + n
        for seq in batch.decodes:
            assert len(seq.block_table) * BS >= len(seq)
        sampled = {s.seq_id: (EOS if rng.random() < 0.02 else rng.randint(1, 50)) for s in batch.sampling}
        got, _ = sched.postprocess(batch, sampled, {EOS}, now=now)
        assert {s.seq_id for s in got} == set(sampled)
        bm.check_invariants()
    assert not sched.has_work and not arrivals, "the simulation did not drain"
    assert len(added) + rejected == len(reqs)
    for seq in added:
        assert seq.is_finished
        out = seq.output_token_ids
        if seq.finish_reason is FinishReason.STOP:
            assert out[-1] == EOS and EOS not in out[:-1]
        else:
            assert seq.finish_reason is FinishReason.LENGTH
            assert len(out) == seq.params.max_tokens or len(seq) == sched.max_seq_len
    assert bm.num_free_blocks == num_blocks, "blocks leaked"
    return sched, rejected


requests_st = st.lists(
    st.tuples(
        st.integers(0, 20),                     # arrival step
        st.integers(1, 2000),                   # prompt length
        st.integers(1, 40),                     # max_tokens
        st.integers(0, 3),                      # priority
        st.sampled_from(["", "a", "b"]),        # tenant
        st.sampled_from([0, 64, 200, 700]),     # length of a shared system prompt
    ),
    min_size=1, max_size=30)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests_st, num_blocks=st.integers(34, 160), max_num_seqs=st.integers(1, 12),
       extra_budget=st.integers(0, 700), max_waiting=st.integers(2, 40), seed=st.integers(0, 2**16))
def test_simulated_traffic_finishes_every_admitted_request(reqs, num_blocks, max_num_seqs, extra_budget,
                                                           max_waiting, seed):
    simulate(reqs, num_blocks, max_num_seqs, max_num_seqs + extra_budget, max_waiting, seed)


def test_simulated_overload_preempts_and_rejects_but_finishes_every_admitted_request():
    rng = random.Random(1)
    reqs = [(rng.randint(0, 250), rng.randint(1, 1500), rng.randint(20, 120), rng.randint(0, 3),
             rng.choice("abc"), rng.choice([0, 200, 700])) for _ in range(100)]
    sched, rejected = simulate(reqs, num_blocks=60, max_num_seqs=12, budget=384, max_waiting=16, seed=1)
    assert sched.num_preemptions > 0 and rejected > 0
