"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step has a token budget (`max_num_batched_tokens`) and a cap on running sequences
(`max_num_seqs`). Every step reads top to bottom:

1. decodes of running sequences, one token each, so a long prompt never stalls them;
2. the next chunks of running sequences still in prefill;
3. waiting sequences, in the order the admission policy (the `scheduler.policy` slot) returns,
   each prefilled in chunks of whatever budget is left.

When blocks run out, the lowest-priority, most recently arrived running sequence is preempted by
recompute: its blocks are freed and it goes back to the front of the queue, keeping its output;
when readmitted it prefills prompt and output again (mostly from the prefix cache).
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from graft.engine.block_manager import BlockManager
from graft.engine.config import EngineConfig
from graft.engine.sequence import FinishReason, Sequence, SequenceStatus

AGEING_SECONDS = 10.0  # a waiting request gains one priority level per this many seconds
TENANT_MEMORY = 4096   # tenants whose last admission the scheduler remembers

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


def default_policy(waiting: list[Sequence], now: float,
                   ageing_seconds: float = AGEING_SECONDS) -> list[Sequence]:
    """Admission order: effective priority, then tenants round-robin, then arrival.

    The effective priority is `seq.priority` minus one level per `ageing_seconds` waited (`now` on
    the clock of `seq.arrival`), so a low-priority request behind a stream of urgent ones is still
    admitted eventually. Among equal effective priorities each tenant's requests keep their arrival
    order and tenants take turns, so one tenant's burst cannot hold the others back. A turn goes
    first to the tenant admitted least recently (`seq.tenant_turn`, which the scheduler keeps), so
    the turns carry over from one call to the next: when requests are admitted one at a time (a
    full batch, a full cache), a burst still alternates with the other tenants instead of being
    served in arrival order.
    """
    def effective(seq: Sequence) -> int:
        return seq.priority - int(max(0.0, now - seq.arrival) // ageing_seconds)

    ordered = sorted(waiting, key=lambda s: (effective(s), s.arrival, s.seq_id))
    turn: dict[tuple[int, str], int] = {}
    keys: dict[int, tuple] = {}
    for seq in ordered:
        group = (effective(seq), seq.tenant)
        rank = turn.get(group, 0)
        turn[group] = rank + 1
        keys[seq.seq_id] = (group[0], rank, seq.tenant_turn, seq.arrival, seq.seq_id)
    return sorted(ordered, key=lambda s: keys[s.seq_id])


def _preemption_order(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrival, seq.seq_id)


class Scheduler:
    """Decides each step's batch and applies its results; owns the waiting and running queues."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
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
        # with requests waiting, a long prefill leaves part of the budget to them: a new short
        # request then gets its first token within a step or two instead of after the whole prompt
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
        room = (self.waiting and len(self.running) < self.config.max_num_seqs
                and batch.num_tokens < self.config.max_num_batched_tokens)
        # admitting right after a preemption would only thrash the cache
        if room and (not batch.preempted or not batch.num_seqs):
            waiting = list(self.waiting)
            for seq in waiting:
                seq.tenant_turn = self._tenant_turns.get(seq.tenant, 0)
            try:
                order = list(policy(waiting, now))
            except Exception as exc:   # a patched policy: the step goes on in arrival order
                self.policy_error = exc
                order = default_policy(waiting, now)
            self._admit(order, batch)
        return batch if batch.num_seqs else None

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

    def _admit(self, order: Iterable[Sequence], batch: ScheduledBatch) -> None:
        bm = self.block_manager
        seen: set[int] = set()
        for seq in order:
            # the policy is patchable: ignore anything it returns that is not waiting here
            if not isinstance(seq, Sequence) or seq.seq_id in seen or self._live.get(seq.seq_id) is not seq:
                continue
            if seq.status is not SequenceStatus.WAITING:
                continue
            seen.add(seq.seq_id)
            budget = self.config.max_num_batched_tokens - batch.num_tokens
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            chunk = min(len(seq) - bm.num_cached_prefix_tokens(seq), budget)
            if not bm.can_allocate(seq, chunk):
                return  # strict order: a smaller request behind it must not overtake it
            bm.allocate(seq, chunk)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.prefills.append((seq, chunk))
            self._remember_turn(seq.tenant)

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
