"""Shadow comparison: a patched engine checks what it answered against the table it ran before.

Only an in-place patch makes this possible: right after a swap the engine still holds the state it
ran on a moment ago. For a share of the requests admitted after an apply or a replace, the step
loop records, at every generated position, the model's distribution (its top-k log-probabilities
and the mass left over) as the live table computed it. Once such a request has finished, its prompt
and generated tokens are run through the previous table, teacher-forced, on KV blocks kept aside
for it, and the two distributions are compared position by position: top-1 agreement and the KL
divergence KL(live || previous) over the recorded top-k and the rest lumped together (a lower bound
of the full KL, which the recorded tokens carry almost all of).

A request is *divergent* when its mean KL or its top-1 agreement is beyond the tolerance of the
engine's dtype (`LIMITS`): in float32 a good patch changes the distributions by rounding alone; in
16-bit floats a reordered sum moves logits by a tenth on average and flips the top token at near
ties, so the limits there are wider. A patch that changes the answers moves whole distributions,
far beyond either (docs/analysis.md, "Output divergence", has the measured figures).

The work is bounded so that client requests do not pay for it:

- it runs in the step loop between steps, in slices of at most `chunk` teacher-forced tokens;
- a token bucket holds its share of wall time to `budget`; while requests are running a slice
  runs at most every `busy_gap` seconds and takes about as long as the step before it at most
  (its size follows from the slices' measured speed), so a client's next token waits for one step's
  time more at most, and only `budget` of the time;
- nothing runs while requests wait for admission or were just preempted: the engine is behind its
  clients, and time taken from it then would grow the queue it is behind on;
- while the engine is idle, `floor` comparisons a minute run even beyond the budget, so a lightly
  loaded canary still produces evidence from time it would not use; a queue of `queue` finished
  requests waits for them, the oldest dropped first;
- the blocks kept aside work as a prefix cache of one sequence: a comparison whose input starts
  with the full blocks the last one left there (a shared system prompt or few-shot prefix, as
  computed by the same previous table) runs from the first block that differs, and the next job
  taken from the queue is the one sharing the most with them, so the comparisons of requests with
  a common prefix cost their own tokens, as the requests did.

Nothing is compared on an engine that has nothing to compare against: after a revert, or after
a start-up (the patches of `GRAFT_PATCHES` were never run the other way on this engine). A swap
starts a new epoch: records and jobs of the previous one are dropped. Every failure of shadow work
is counted (`result="error"`) and never reaches a client.
"""
from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graft.engine.scheduler import ScheduledBatch
from graft.engine.sequence import Sequence

log = logging.getLogger(__name__)

AGREE, DIVERGENT, ERROR = "agree", "divergent", "error"
MIN_SLICE = 32   # teacher-forced tokens a slice runs at least
RESULTS = (AGREE, DIVERGENT, ERROR)


@dataclass(frozen=True, slots=True)
class Limits:
    """When a compared request counts as divergent: mean KL (nats) above `kl`, or top-1 agreement below `agreement`."""

    kl: float
    agreement: float


LIMITS = {
    torch.float32: Limits(kl=0.01, agreement=0.9),
    torch.bfloat16: Limits(kl=0.1, agreement=0.8),
    torch.float16: Limits(kl=0.1, agreement=0.8),
}


@dataclass(slots=True)
class ShadowSettings:
    rate: float = 1.0           # share of requests recorded while there is something to compare against
    budget: float = 0.03        # share of wall time the step loop may spend on shadow work
    floor: float = 6.0          # comparisons a minute that run beyond the budget
    max_tokens: int = 2048      # longest request compared (prompt and output): sets the blocks kept aside
    chunk: int = 256            # teacher-forced tokens per slice: the longest pause it puts between two steps
    busy_gap: float = 1.0       # seconds between slices while requests are running
    top_k: int = 32             # alternatives recorded per generated position
    positions: int = 256        # generated positions compared per request (the last ones)
    queue: int = 8              # finished requests waiting for their comparison

    def __post_init__(self) -> None:
        if not 0 <= self.rate <= 1:
            raise ValueError(f"shadow rate must be within [0, 1], got {self.rate}")
        if not 0 <= self.budget <= 1:
            raise ValueError(f"shadow budget must be within [0, 1], got {self.budget}")
        if not 0 <= self.floor <= 600:
            raise ValueError(f"shadow floor must be within [0, 600] comparisons a minute, got {self.floor}")
        if self.max_tokens < 0 or self.chunk < 1 or self.top_k < 1 or self.positions < 1 or self.queue < 1:
            raise ValueError("shadow max_tokens, chunk, top_k, positions and queue must be positive")

    @property
    def enabled(self) -> bool:
        return self.rate > 0 and self.max_tokens > 0 and (self.budget > 0 or self.floor > 0)


@dataclass(slots=True)
class Record:
    """What a recorded request's live table said at each generated position (on the host)."""

    epoch: int
    ids: list[torch.Tensor] = field(default_factory=list)        # [k] int64 per position
    logprobs: list[torch.Tensor] = field(default_factory=list)   # [k] float32 per position


@dataclass(slots=True)
class Comparison:
    positions: int
    mean_kl: float
    max_kl: float
    agreement: float
    divergent: bool


def compare(live_ids: torch.Tensor, live_logprobs: torch.Tensor, previous_logits: torch.Tensor,
            limits: Limits) -> Comparison:
    """Compare the recorded live distributions ([m, k] ids and log-probs) with the previous table's logits [m, V].

    KL(live || previous) over the partition {the k recorded tokens, everything else}: by the
    data-processing inequality a lower bound of the full KL, and close to it when the k tokens
    carry nearly all of the live mass, as they do for a language model.
    """
    prev = previous_logits.float().log_softmax(dim=-1)
    q_top = prev.gather(1, live_ids)
    p_top = live_logprobs.exp()
    p_rest = (1 - p_top.sum(dim=1)).clamp_min(0)
    q_rest = (1 - q_top.exp().sum(dim=1)).clamp_min(1e-12)
    kl = (p_top * (live_logprobs - q_top)).sum(dim=1)
    kl = kl + torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-12).log() - q_rest.log()), torch.zeros_like(kl))
    kl = kl.clamp_min(0)
    agree = (prev.argmax(dim=-1) == live_ids[:, 0]).float()
    mean_kl, agreement = float(kl.mean()), float(agree.mean())
    if not math.isfinite(mean_kl):
        mean_kl = math.inf
    divergent = not (mean_kl <= limits.kl) or agreement < limits.agreement
    return Comparison(len(kl), mean_kl, float(kl.max()), agreement, divergent)


@dataclass(slots=True)
class _Job:
    revision: str
    epoch: int
    seq: Sequence              # the teacher-forced input as a scratch sequence on the shadow blocks
    first: int                 # index of the first compared position's logits in the input
    ids: torch.Tensor          # [m, k]
    logprobs: torch.Tensor     # [m, k]
    logits: list[torch.Tensor] = field(default_factory=list)


class ShadowComparator:
    """The step loop's shadow work. Every method runs in the step loop thread."""

    def __init__(self, settings: ShadowSettings, runner, blocks: list[int], dtype: torch.dtype, metrics,
                 *, clock: Callable[[], float] = time.monotonic, seed: int = 0):
        self.settings = settings
        self.runner = runner
        self.blocks = list(blocks)
        self.capacity = min(settings.max_tokens, len(self.blocks) * runner.config.block_size)
        self.limits = LIMITS.get(dtype, LIMITS[torch.bfloat16])
        self.metrics = metrics
        self.clock = clock
        self.rng = random.Random(seed)
        self.epoch = 0
        self.previous = None               # the EngineState compared against, or None
        self.revision: str | None = None   # the revision whose requests are compared
        self._queue: deque[_Job] = deque()
        self._job: _Job | None = None
        self._credit = 0.0
        self._last = clock()
        self._last_slice = -math.inf
        self._recent: deque[float] = deque()   # when comparisons finished, for the floor
        self._speed: float | None = None       # teacher-forced tokens a second, as last measured
        self._recording = 0                    # requests of this epoch being recorded
        self._ran = 0
        self._cached: list[int] = []           # token ids whose KV the shadow blocks hold, full blocks only
        self.reused = 0                        # teacher-forced tokens the shadow prefix cache saved
        self.last: Comparison | None = None

    # what there is to compare
    @property
    def active(self) -> bool:
        return self.previous is not None and self.settings.enabled and self.capacity > 0

    def on_swap(self, old, new) -> None:
        """A new state is installed: compare against `old` if `new` adds or replaces a patch, else stop."""
        self.epoch += 1
        self._queue.clear()
        self._job = None
        self._recording = 0
        self._cached = []
        added = set(new.patches) - set(old.patches) or any(
            getattr(new.patches[n], "patch", None) is not getattr(old.patches[n], "patch", None)
            for n in set(new.patches) & set(old.patches))
        self.previous = old if added else None
        self.revision = new.revision if added else None
        if added and self.active:
            for result in RESULTS:
                self.metrics.shadow_requests.labels(new.revision, result)

    def forget(self) -> None:
        """Compare nothing until the next apply (a start-up's patches were never run the other way)."""
        self.epoch += 1
        self.previous = self.revision = None
        self._queue.clear()
        self._job = None
        self._recording = 0
        self._cached = []

    # the requests
    def admit(self, seq: Sequence) -> None:
        """Choose whether `seq` is recorded (at admission, under the current epoch).

        No more requests are recorded than the queue could take once they end: recording costs
        every step a little, and a request the comparisons cannot reach would pay it for nothing.
        """
        if self.active and seq.revision == self.revision and seq.num_prompt_tokens < self.capacity \
                and self._recording + len(self._queue) < self.settings.queue \
                and self.rng.random() < self.settings.rate:
            seq.shadow = Record(self.epoch)
            self._recording += 1

    def record(self, rows: list[tuple[int, Sequence]], logits: torch.Tensor) -> None:
        """The live distribution of this step's token for each recorded row (row index into `logits`)."""
        rows = [(i, s) for i, s in rows if s.shadow is not None and s.shadow.epoch == self.epoch]
        if not rows:
            return
        idx = torch.tensor([i for i, _ in rows], device=logits.device)
        lp = logits[idx].float().log_softmax(dim=-1)
        top_lp, top_ids = lp.topk(min(self.settings.top_k, lp.shape[-1]), dim=-1)
        top_lp, top_ids = top_lp.cpu(), top_ids.cpu()
        for j, (_, seq) in enumerate(rows):
            seq.shadow.ids.append(top_ids[j])
            seq.shadow.logprobs.append(top_lp[j])

    def finished(self, seq: Sequence, ok: bool = True) -> None:
        """A recorded request ended: queue its comparison if it ended well (the oldest waiting one
        gives way when the queue is full)."""
        rec, seq.shadow = seq.shadow, None
        if rec is None:
            return
        if rec.epoch == self.epoch:
            self._recording = max(0, self._recording - 1)
        if not ok or rec.epoch != self.epoch or not rec.ids:
            return
        out = seq.output_token_ids
        if len(rec.ids) != len(out):        # recomputed after a preemption: the positions doubled up
            rec.ids, rec.logprobs = rec.ids[-len(out):], rec.logprobs[-len(out):]
            if len(rec.ids) != len(out):
                return
        tokens = seq.prompt_token_ids + out[:-1]
        if len(tokens) > self.capacity:
            self.metrics.shadow_skipped.labels("too-long").inc()
            return
        m = min(self.settings.positions, len(out))
        scratch = Sequence(prompt_token_ids=tokens)
        scratch.block_table = self.blocks
        job = _Job(self.revision, self.epoch, scratch, len(tokens) - m,
                   torch.stack(rec.ids[-m:]), torch.stack(rec.logprobs[-m:]))
        if len(self._queue) >= self.settings.queue:
            self._queue.popleft()
            self.metrics.shadow_skipped.labels("queue-full").inc()
        self._queue.append(job)

    # the work
    def _due(self, now: float, busy: bool) -> bool:
        s = self.settings
        self._credit = min(self._credit + (now - self._last) * s.budget, max(s.budget * 60.0, 0.0))
        self._last = now
        while self._recent and self._recent[0] < now - 60:
            self._recent.popleft()
        if busy:   # the budget alone: clients are waiting
            return now - self._last_slice >= s.busy_gap and self._credit > 0
        return self._credit > 0 or len(self._recent) < s.floor

    def work(self, busy: bool, step_seconds: float | None = None, backlog: bool = False) -> bool:
        """Run one slice of shadow work if there is some and it is due; True when a slice ran.

        `step_seconds`, while busy: how long the step just run took, which a slice stays within.
        `backlog`: requests wait for admission or were preempted, so the engine is not keeping up
        with its clients; nothing runs then (shadow work taking a saturated engine's time would
        lengthen the queue it is behind on, which the comparisons would then wait on too).
        """
        if self._job is None and not self._queue or busy and backlog:
            return False
        now = self.clock()
        if not self._due(now, busy):
            return False
        if self._job is None:
            self._job = self._take()
        job = self._job
        limit = self.settings.chunk
        if busy and step_seconds is not None and self._speed is not None:
            limit = max(MIN_SLICE, min(limit, int(self._speed * step_seconds)))
        t0 = time.perf_counter()
        try:
            done = self._slice(job, limit)
        except Exception:
            log.exception("shadow comparison of a %s request against %s failed", job.revision,
                          getattr(self.previous, "revision", None))
            self.metrics.shadow_requests.labels(job.revision, ERROR).inc()
            self._job, done = None, False
        spent = time.perf_counter() - t0
        if self._ran and spent > 0:
            self._speed = self._ran / spent
        self._credit -= spent
        self.metrics.shadow_seconds.inc(spent)
        self._last_slice = self.clock()
        if done:
            self._job = None
            self._recent.append(self._last_slice)
        return True

    def _shared(self, job: _Job) -> int:
        """Tokens at the start of `job`'s input whose KV the shadow blocks already hold: whole
        blocks, and never past the first compared position (its logits must be computed)."""
        tokens, cached = job.seq.prompt_token_ids, self._cached
        n = 0
        limit = min(len(cached), job.first)
        while n < limit and tokens[n] == cached[n]:
            n += 1
        bs = self.runner.config.block_size
        return n // bs * bs

    def _take(self) -> _Job:
        """The next job: the queued one sharing the most with the shadow blocks, the oldest first on ties."""
        best = max(range(len(self._queue)), key=lambda i: (self._shared(self._queue[i]), -i))
        job = self._queue[best]
        del self._queue[best]
        shared = self._shared(job)
        job.seq.num_computed_tokens = shared
        self.reused += shared
        return job

    @torch.inference_mode()
    def _slice(self, job: _Job, limit: int) -> bool:
        """Teacher-force the next `limit` tokens of `job` through the previous table; compare when all are run."""
        self._ran = 0
        if job.epoch != self.epoch or self.previous is None:
            return False
        seq, runner = job.seq, self.runner
        start = seq.num_computed_tokens
        n = min(limit, len(seq) - start)
        self._ran = n
        bs = runner.config.block_size
        # what the blocks hold for certain while this slice writes from `start` on (and after it fails)
        self._cached = seq.prompt_token_ids[:start // bs * bs]
        step = runner.prepare(ScheduledBatch(prefills=[(seq, n)], decodes=[], preempted=[]))
        lo = min(max(job.first, start), start + n)   # the compared positions in this chunk: lo .. start + n
        step.ctx.logits_indices = torch.arange(lo - start, n, device=runner.device)
        logits = runner.forward(step, self.previous.slots)
        if lo < start + n:
            job.logits.append(logits)
        seq.num_computed_tokens += n
        self._cached = seq.prompt_token_ids[:seq.num_computed_tokens // bs * bs]
        if seq.num_computed_tokens < len(seq):
            return False
        logits = torch.cat(job.logits)
        result = compare(job.ids.to(logits.device), job.logprobs.to(logits.device), logits, self.limits)
        self.last = result
        m = self.metrics
        m.shadow_requests.labels(job.revision, DIVERGENT if result.divergent else AGREE).inc()
        m.shadow_divergence.labels(job.revision).observe(min(result.mean_kl, 1e9))
        m.shadow_positions.labels(job.revision).inc(result.positions)
        return True

    def describe(self) -> dict[str, Any]:
        """What `GET /admin/patches` says of it (read from the event loop: plain values only)."""
        previous, last = self.previous, self.last
        return {"active": self.active, "revision": self.revision,
                "against": previous.revision if previous is not None else None,
                "queued": len(self._queue) + (self._job is not None), "capacityTokens": self.capacity,
                "reusedTokens": self.reused,
                "limits": {"meanKl": self.limits.kl, "agreement": self.limits.agreement},
                "last": None if last is None else {"positions": last.positions, "meanKl": last.mean_kl,
                                                   "maxKl": last.max_kl, "agreement": last.agreement,
                                                   "divergent": last.divergent}}
