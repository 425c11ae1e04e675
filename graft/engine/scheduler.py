"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step has a token budget (`max_num_batched_tokens`) and a cap on running sequences
(`max_num_seqs`). Decodes of running sequences come first, one token each, so a prompt never stalls
them. What is left of the budget, the prefill budget, goes to prefill work: the next chunks of
running sequences still in prefill, and waiting sequences, admitted in the order the admission
policy (the `scheduler.policy` slot) returns. How it is shared is `EngineConfig.scheduling`:

`fair` (the default) ranks all prefill work in one order and shares the budget among tenants:

1. Rank (`prefill_rank`): effective priority first (`seq.priority`, one level better per
   AGEING_SECONDS since arrival), then the earliest prefill deadline, `arrival + remaining prefill
   tokens x DEADLINE_PER_TOKEN` (`prefill_deadline`). That is shortest remaining prefill first,
   aged: a request is overtaken only by requests arriving less than its remaining tokens x
   DEADLINE_PER_TOKEN after it (10 ms a token: 5 s for a 500-token prompt), and by none that
   arrive a priority level's ageing after it, so a stream of short prompts cannot starve a long one. Running prefills and waiting requests compete in
   this one order: a short request is admitted in the step it arrives in, not after the chunks of
   a long prompt admitted before it. Waiting requests keep the policy's order among themselves; the
   base policy, `fair_policy`, is this rank with tenants taking turns as in `default_policy`.
2. Share (`Scheduler._share`): each tenant with prefill work is granted an equal share of the
   prefill budget, spent on its own work in rank order; what the tenants leave goes to all work in
   rank order (work-conserving: a lone tenant gets the whole budget).
3. Admission is strict: when the next waiting request's blocks are not free, nothing behind it is
   admitted in that step, so a large request is not overtaken for ever by smaller ones.

`fcfs` is the order before `fair`, kept for comparisons: running prefills in admission order,
capped at half the budget while requests wait, then waiting requests in the policy's order
(`default_policy`: priority, tenants' turns, arrival) with what is left.

When blocks run out, the lowest-priority, most recently arrived running sequence is preempted by
recompute: its blocks are freed and it goes back to the front of the queue, keeping its output;
when readmitted it prefills prompt and output again (mostly from the prefix cache). No sequence is
admitted in a step that preempted one, unless that step has nothing else to run.
"""
from __future__ import annotations

import functools
import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from graft.engine.block_manager import BlockManager
from graft.engine.config import EngineConfig
from graft.engine.sequence import FinishReason, Sequence, SequenceStatus

AGEING_SECONDS = 10.0       # a waiting request gains one priority level per this many seconds
# fair: seconds of prefill deadline per remaining prompt token. Ageing at 100 tokens a second is
# slower than any engine here prefills, so a prompt being prefilled does not fall overdue and
# outrank the short requests behind it; from 1,000 tokens up, priority ageing bounds the wait first
DEADLINE_PER_TOKEN = 0.01
TENANT_MEMORY = 4096        # tenants whose last admission the scheduler remembers

Policy = Callable[[list[Sequence], float], list[Sequence]]


class QueueFull(Exception):
    """The admission queue is full; the client should retry after `retry_after` seconds."""

    def __init__(self, retry_after: float = 1.0, message: str = "the request queue is full"):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: prefill chunks first, then decodes (one token each).

    Between `schedule` and `postprocess`, a prefill whose chunk reaches `len(seq)` samples a
    token; a shorter chunk is a partial prefill and samples none.
    """

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    @property
    def num_seqs(self) -> int:
        return len(self.prefills) + len(self.decodes)

    @property
    def sampling(self) -> list[Sequence]:
        """Sequences that get a token from this step."""
        done = [s for s, n in self.prefills if s.num_computed_tokens + n == len(s)]
        return done + self.decodes

    def _drop(self, seq: Sequence) -> None:
        self.prefills = [(s, n) for s, n in self.prefills if s is not seq]
        self.decodes = [s for s in self.decodes if s is not seq]


def effective_priority(seq: Sequence, now: float, ageing_seconds: float = AGEING_SECONDS) -> int:
    """`seq.priority` less one level per `ageing_seconds` waited since its arrival (lower runs first)."""
    return seq.priority - int(max(0.0, now - seq.arrival) // ageing_seconds)


def prefill_deadline(seq: Sequence) -> float:
    """`arrival + remaining prefill tokens x DEADLINE_PER_TOKEN`; a waiting request's remaining
    tokens are all of them, whatever the prefix cache holds."""
    return seq.arrival + seq.num_uncomputed * DEADLINE_PER_TOKEN


def prefill_rank(seq: Sequence, now: float) -> tuple[int, float, int]:
    """The fair order of prefill work, smallest first: effective priority, then prefill deadline."""
    return effective_priority(seq, now), prefill_deadline(seq), seq.seq_id


def default_policy(waiting: list[Sequence], now: float,
                   ageing_seconds: float = AGEING_SECONDS) -> list[Sequence]:
    """Admission order of `--scheduling fcfs`: effective priority, then tenants round-robin, then arrival.

    The effective priority is `seq.priority` minus one level per `ageing_seconds` waited (`now` on
    the clock of `seq.arrival`), so a low-priority request behind a stream of urgent ones is still
    admitted eventually. Among equal effective priorities each tenant's requests keep their arrival
    order and tenants take turns, so one tenant's burst cannot hold the others back. A turn goes
    first to the tenant admitted least recently (`seq.tenant_turn`, which the scheduler keeps), so
    the turns carry over from one call to the next: when requests are admitted one at a time (a
    full batch, a full cache), a burst still alternates with the other tenants instead of being
    served in arrival order.
    """
    return _tenant_turns(waiting, now, ageing_seconds, lambda s: (s.arrival, s.seq_id))


def fair_policy(waiting: list[Sequence], now: float,
                ageing_seconds: float = AGEING_SECONDS) -> list[Sequence]:
    """Admission order of `--scheduling fair`: as `default_policy`, but each tenant's requests in
    prefill-deadline order (shortest aged prompt first) instead of arrival order."""
    return _tenant_turns(waiting, now, ageing_seconds, lambda s: (prefill_deadline(s), s.arrival, s.seq_id))


def _tenant_turns(waiting: list[Sequence], now: float, ageing_seconds: float,
                  within: Callable[[Sequence], tuple]) -> list[Sequence]:
    """Effective priority, then tenants taking turns (least recently admitted first), each
    tenant's requests in `within` order."""
    level = {s.seq_id: effective_priority(s, now, ageing_seconds) for s in waiting}
    ordered = sorted(waiting, key=lambda s: (level[s.seq_id], within(s)))
    turn: dict[tuple[int, str], int] = {}
    keys: dict[int, tuple] = {}
    for seq in ordered:
        group = (level[seq.seq_id], seq.tenant)
        rank = turn.get(group, 0)
        turn[group] = rank + 1
        keys[seq.seq_id] = (group[0], rank, seq.tenant_turn, within(seq))
    return sorted(ordered, key=lambda s: keys[s.seq_id])


POLICIES: dict[str, Policy] = {"fair": fair_policy, "fcfs": default_policy}
"""The base `scheduler.policy` of each `EngineConfig.scheduling`."""


def _preemption_order(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrival, seq.seq_id)


class Scheduler:
    """Decides each step's batch and applies its results; owns the waiting and running queues."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.base_policy = POLICIES[config.scheduling]   # stands in for a `scheduler.policy` that raises
        # the KV cache caps a lone sequence: beyond it nothing could be preempted to make room
        self.max_seq_len = min(config.max_model_len, block_manager.num_blocks * block_manager.block_size)
        self.waiting: deque[Sequence] = deque()
        self.policy_error: BaseException | None = None   # what the last failing `scheduler.policy` raised
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._live: dict[int, Sequence] = {}
        self._finish_times: deque[float] = deque(maxlen=32)
        # the fairness memory: tenant -> admission count at its last admission, least recent
        # first; forgetting the least recent one changes no order (0 sorts first as well)
        self._admissions = 0
        self._tenant_turns: OrderedDict[str, int] = OrderedDict()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # admission
    def add(self, seq: Sequence) -> None:
        """Queue a new request; raises QueueFull when the queue is full, ValueError if it can never run."""
        n = seq.num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.config.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; the context is {self.config.max_model_len} "
                             "tokens including at least one generated token")
        if n >= self.max_seq_len:
            raise ValueError(f"the prompt has {n} tokens; the KV cache holds {self.max_seq_len} "
                             "tokens including at least one generated token")
        if seq.seq_id in self._live or seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"sequence {seq.seq_id} was already added")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(retry_after=self.retry_after())
        self.waiting.append(seq)
        self._live[seq.seq_id] = seq

    def retry_after(self) -> float:
        """Seconds until the queue has likely drained, from the recent rate of finished requests."""
        times = self._finish_times
        if len(times) < 2 or times[-1] <= times[0]:
            return 1.0
        rate = (len(times) - 1) / (times[-1] - times[0])
        return min(60.0, max(1.0, len(self.waiting) / rate))

    # the step
    def schedule(self, policy: Policy, now: float) -> ScheduledBatch | None:
        """The next step's batch, or None when there is nothing to run."""
        batch = ScheduledBatch()
        for seq in [s for s in self.running if not s.in_prefill]:
            if seq.status is SequenceStatus.RUNNING and self._reserve(seq, 1, batch):
                batch.decodes.append(seq)
        if self.config.scheduling == "fcfs":
            self._prefill_fcfs(policy, now, batch)
        else:
            self._prefill_fair(policy, now, batch)
        return batch if batch.num_seqs else None

    def _prefill_fcfs(self, policy: Policy, now: float, batch: ScheduledBatch) -> None:
        """Running prefills in admission order, at most half the budget while requests wait; then
        waiting requests in the policy's order with whatever budget is left."""
        total = self.config.max_num_batched_tokens
        limit = total - total // 2 if self.waiting else total
        for seq in [s for s in self.running if s.in_prefill]:
            budget = limit - batch.num_tokens
            if budget <= 0:
                break
            if seq.status is SequenceStatus.RUNNING:
                chunk = self._reserve(seq, min(seq.num_uncomputed, budget), batch)
                if chunk:
                    batch.prefills.append((seq, chunk))
        if not self._may_admit(batch):
            return
        for seq in self._admission_order(policy, now):
            budget = total - batch.num_tokens
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            chunk = min(len(seq) - self.block_manager.num_cached_prefix_tokens(seq), budget)
            if not self._admit(seq, chunk, batch):
                return

    def _prefill_fair(self, policy: Policy, now: float, batch: ScheduledBatch) -> None:
        """Running prefills and waiting requests in one rank (`prefill_rank`; waiting requests in
        the policy's order), the prefill budget shared equally among the tenants with such work."""
        budget = self.config.max_num_batched_tokens - batch.num_tokens
        if budget <= 0:
            return
        rank = functools.partial(prefill_rank, now=now)
        running = sorted((s for s in self.running if s.in_prefill), key=rank)
        waiting = self._admission_order(policy, now) if self._may_admit(batch) else []
        work = list(heapq.merge(running, waiting, key=rank))
        if not work:
            return
        grants = self._share(work, budget, seats=self.config.max_num_seqs - len(self.running))
        for seq in running:
            want = grants.get(seq.seq_id)
            if want and seq.status is SequenceStatus.RUNNING:
                chunk = self._reserve(seq, want, batch)
                if chunk:
                    batch.prefills.append((seq, chunk))
        if batch.preempted and batch.num_seqs:
            return
        for seq in waiting:
            want = grants.get(seq.seq_id)
            if want and not self._admit(seq, want, batch):
                return

    def _share(self, work: list[Sequence], budget: int, seats: int) -> dict[int, int]:
        """Prefill tokens for each sequence of `work` (in rank order), seq_id -> tokens.

        First each tenant with work gets `budget // tenants`, spent on its own sequences in rank
        order; then what is left goes to all of them in rank order. A waiting sequence needs one of
        the `seats` (free places among the running) to get anything.
        """
        bm = self.block_manager
        grants: dict[int, int] = {}
        need: dict[int, int] = {}
        tenants = {seq.tenant for seq in work}
        shares = dict.fromkeys(tenants, budget // len(tenants))
        for fair in (True, False):
            for seq in work:
                if budget <= 0:
                    return grants
                cap = shares[seq.tenant] if fair else budget
                given = grants.get(seq.seq_id, 0)
                new = not given and seq.status is SequenceStatus.WAITING
                if cap <= 0 or (new and seats <= 0):
                    continue
                if seq.seq_id not in need:   # a waiting sequence's cached prefix is not computed again
                    need[seq.seq_id] = (seq.num_uncomputed if seq.status is SequenceStatus.RUNNING
                                        else len(seq) - bm.num_cached_prefix_tokens(seq))
                n = min(need[seq.seq_id] - given, cap, budget)
                if n <= 0:
                    continue
                seats -= new
                grants[seq.seq_id] = given + n
                budget -= n
                if fair:
                    shares[seq.tenant] -= n
        return grants

    def _may_admit(self, batch: ScheduledBatch) -> bool:
        """Whether this step can admit anyone; admitting right after a preemption would only
        thrash the cache."""
        return bool(self.waiting and len(self.running) < self.config.max_num_seqs
                    and batch.num_tokens < self.config.max_num_batched_tokens
                    and (not batch.preempted or not batch.num_seqs))

    def _admission_order(self, policy: Policy, now: float) -> list[Sequence]:
        """The waiting sequences in the policy's order; a policy that raises is recorded in
        `policy_error` and the base policy orders this step instead."""
        waiting = list(self.waiting)
        for seq in waiting:
            seq.tenant_turn = self._tenant_turns.get(seq.tenant, 0)
        try:
            order = list(policy(waiting, now))
        except Exception as exc:   # a patched policy
            self.policy_error = exc
            order = self.base_policy(waiting, now)
        # the policy is patchable: ignore anything it returns that is not waiting here, or again
        seen: set[int] = set()
        out: list[Sequence] = []
        for seq in order:
            if (isinstance(seq, Sequence) and seq.seq_id not in seen and self._live.get(seq.seq_id) is seq
                    and seq.status is SequenceStatus.WAITING):
                seen.add(seq.seq_id)
                out.append(seq)
        return out

    def _reserve(self, seq: Sequence, want: int, batch: ScheduledBatch) -> int:
        """Blocks for up to `want` new tokens of a running sequence, preempting others if none are
        left; returns the tokens granted, 0 when `seq` itself had to be preempted."""
        bm = self.block_manager
        while bm.num_allocatable_tokens(seq) < 1:
            victim = max(self.running, key=_preemption_order)
            self._preempt(victim, batch)
            if victim is seq:
                return 0
        chunk = min(want, bm.num_allocatable_tokens(seq))
        bm.allocate(seq, chunk)
        return chunk

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        batch._drop(seq)
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _admit(self, seq: Sequence, chunk: int, batch: ScheduledBatch) -> bool:
        """Start `seq` with a first chunk of `chunk` tokens; False when its blocks are not free
        (then nothing behind it is admitted in this step: a smaller request must not overtake it)."""
        bm = self.block_manager
        if not bm.can_allocate(seq, chunk):
            return False
        bm.allocate(seq, chunk)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.prefills.append((seq, chunk))
        self._remember_turn(seq.tenant)
        return True

    def _remember_turn(self, tenant: str) -> None:
        """Record an admission of `tenant`, keeping at most TENANT_MEMORY tenants."""
        self._admissions += 1
        self._tenant_turns[tenant] = self._admissions
        self._tenant_turns.move_to_end(tenant)
        if len(self._tenant_turns) > TENANT_MEMORY:
            self._tenant_turns.popitem(last=False)

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, int], eos_ids: set[int],
                    now: float | None = None) -> tuple[list[Sequence], list[Sequence]]:
        """Apply a step's results: advance progress, append sampled tokens, finish sequences.

        `sampled` maps seq_id to the token sampled for every sequence whose chunk reached the end
        of its known tokens and every decode. Returns (sequences that got a token, sequences that
        finished). A sequence finished or aborted since `schedule` is skipped.
        """
        got: list[Sequence] = []
        finished: list[Sequence] = []
        for seq, n in [*batch.prefills, *((s, 1) for s in batch.decodes)]:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
            if seq.num_uncomputed:
                if seq.seq_id in sampled:
                    raise ValueError(f"sequence {seq.seq_id} got a token from a partial prefill")
                continue
            if seq.seq_id not in sampled:
                raise ValueError(f"sequence {seq.seq_id} finished its chunk but got no sampled token")
            token = sampled[seq.seq_id]
            seq.output_token_ids.append(token)
            got.append(seq)
            reason = self._stop_reason(seq, token, eos_ids)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        if finished:
            stamp = time.monotonic() if now is None else now
            self._finish_times.extend([stamp] * len(finished))
        return got, finished

    def _stop_reason(self, seq: Sequence, token: int, eos_ids: set[int]) -> FinishReason | None:
        params = seq.params
        if token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos):
            return FinishReason.STOP
        if len(seq.output_token_ids) >= params.max_tokens or len(seq) >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def preempt_all(self) -> int:
        """Send every running sequence back to waiting (recompute): a swap that cannot take over
        live state happens with nothing running. Returns how many were preempted."""
        scratch = ScheduledBatch()
        for seq in sorted(self.running, key=_preemption_order, reverse=True):
            self._preempt(seq, scratch)
        return len(scratch.preempted)

    # ending early
    def finish(self, seq_id: int, reason: FinishReason) -> Sequence | None:
        """End a waiting or running sequence (stop string, client gone); None if it is not live."""
        seq = self._live.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, reason)
        return seq

    def abort(self, seq_id: int) -> Sequence | None:
        return self.finish(seq_id, FinishReason.ABORT)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._live[seq.seq_id]
