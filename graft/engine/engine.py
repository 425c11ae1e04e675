"""The engine: one step loop in its own thread, fed from the HTTP event loop through a queue.

The step loop owns the scheduler, the block manager and the runner; nothing else touches them. The
event loop talks to it only by messages (`AddRequest`, `AbortRequest`, `CutRequests`,
`BetweenSteps`), and gets tokens back through one asyncio queue per request. Tokenization and
detokenization stay on the event loop's side (worker threads), never in the step loop.

What the step loop runs on (slot table, revision, the patches behind it) is one immutable
`EngineState`, replaced whole by `swap()` between two steps: a reader on the event loop
(`engine.state`) always sees a table, its revision and its patches that belong together. The patch
manager changes it only through `swap()`, `probe()` and `preempt_running()`, run between steps.

One request's failure is its own: a request whose sampling, logprobs, token delivery or outcome
fails inside a step is finished with an error on its own and the rest of the batch carries on. Only
a failure of the step as a whole (the forward pass) fails every request in it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import operator
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch

from graft.api import has_patch
from graft.engine import openmp
from graft.engine.attention import default_slots
from graft.engine.block_manager import BlockManager
from graft.engine.config import EngineConfig
from graft.engine.loader import load_model
from graft.engine.metrics import EngineMetrics
from graft.engine.patches.slots import SlotTable
from graft.engine.runner import (DTYPES, ModelRunner, ProbePlan, ProbeRun, build_probe_plan, builtin_probe_blocks,
                                 resolve_device)
from graft.engine.sampler import sample_per_row
from graft.engine.scheduler import POLICIES, QueueFull, Scheduler
from graft.engine.sequence import FinishReason, InvalidParam, SamplingParams, Sequence, SequenceStatus, TokenLogprobs
from graft.engine.shadow import ShadowComparator, ShadowSettings

log = logging.getLogger(__name__)

PROBE_BLOCKS = builtin_probe_blocks(64)  # KV blocks kept aside for the self-check's built-in probe (64-token blocks)
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token the model all but rules out
SHUTDOWN = "server_shutting_down"   # the error code of a request cut at the end of the grace period
INTERNAL = "internal_error"
MAX_OUTCOME_DELAY = 60.0    # seconds: the longest hold a `request.outcome` may ask for


# graft_requests_total's status of a finished request: a hang-up (`abandoned`) is the client's doing,
# a `timeout` the engine's (a request past the server's limit), and the comparison of canary and
# stable counts the engine's alone
_STATUS_OF = {FinishReason.ERROR: "error", FinishReason.ABORT: "abandoned", FinishReason.TIMEOUT: "timeout"}


def no_outcome(seq: Sequence) -> tuple[float, bool]:
    """The plain `request.outcome`: deliver at once, never fail."""
    return 0.0, False


class EngineDraining(RuntimeError):
    """The engine is shutting down and admits nothing new."""


class InvalidPrompt(ValueError):
    """A prompt the engine cannot run (empty, or longer than the context or the KV cache holds)."""

    param = "prompt"


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the step loop runs on, replaced whole between two steps (`LLMEngine.swap`).

    `patches` is the patch manager's record of what made `slots` differ from the base table, by
    patch name; the engine only keeps it, so that a reader sees it with the revision it names.
    """

    slots: SlotTable
    revision: str = "base"
    patches: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


# The step loop's inbox: what the event loop may ask of it.
@dataclass(frozen=True, slots=True)
class AddRequest:
    seq: Sequence


@dataclass(frozen=True, slots=True)
class AbortRequest:
    seq_id: int
    reason: FinishReason


@dataclass(frozen=True, slots=True)
class CutRequests:
    """End every request in flight with a SHUTDOWN error (the grace period is over)."""

    error: str


@dataclass(frozen=True, slots=True)
class BetweenSteps:
    """Run `fn` between two steps; its result or exception goes to `future`."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future


Message = AddRequest | AbortRequest | CutRequests | BetweenSteps


def _floor(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN and -inf too


class GuardedSampler:
    """The `sampler` slot wrapped so that a row that cannot be sampled fails alone.

    The batch is sampled in one call as usual. If that call raises, the generators of seeded rows
    are rewound and each row is sampled on its own: the rows that fail are known, and the others
    get the very tokens they would have had. A returned value that is not a token id fails its row
    too. Rows that ask for logprobs get them from the model's distribution (before temperature and
    filtering, as OpenAI reports them). After a call, `failures` and `logprobs` are keyed by row.
    """

    def __init__(self, sampler: Callable[..., list[int]], vocab_size: int,
                 fallback: Callable[..., list[int]] | None = None):
        self.sampler = sampler
        self.vocab_size = vocab_size
        # a patched sampler's stand-in (the base table's): what a batch it fails is sampled with
        self.fallback = fallback
        self.failures: dict[int, str] = {}
        self.logprobs: dict[int, TokenLogprobs] = {}
        self.logits: torch.Tensor | None = None   # the last call's, for the shadow comparison
        self.raised: BaseException | None = None  # how a patched sampler misbehaved in the last call

    def reset(self) -> None:
        self.failures, self.logprobs, self.logits, self.raised = {}, {}, None, None

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        self.reset()
        self.logits = logits
        states = [gen.get_state() if gen is not None else None for gen in generators]
        try:
            tokens = list(self.sampler(logits, params, generators))
            if len(tokens) != len(params):
                raise RuntimeError(f"the sampler returned {len(tokens)} tokens for {len(params)} rows")
            if self.fallback is not None and not all(self._valid(t) for t in tokens):
                raise RuntimeError(f"the sampler returned {next(t for t in tokens if not self._valid(t))!r}, "
                                   "not a token id")
        except Exception as exc:
            for gen, state in zip(generators, states):
                if gen is not None:
                    gen.set_state(state)
            if self.fallback is not None:   # a patch's sampler: the base one samples the batch instead
                log.error("the patched sampler failed a batch of %d rows (%s); sampling it with the "
                          "base sampler", len(params), exc)
                sampler, fallback = self.sampler, self.fallback
                self.sampler, self.fallback = fallback, None
                try:
                    tokens = self(logits, params, generators)
                finally:
                    self.sampler, self.fallback = sampler, fallback
                self.raised = exc
                return tokens
            log.exception("sampling a batch of %d rows failed; sampling each row on its own", len(params))
            tokens = [self._one(logits, i, params[i], generators[i]) for i in range(len(params))]
        for i, token in enumerate(tokens):
            tokens[i] = self._token_id(i, token)
        self._add_logprobs(logits, tokens, params)
        return tokens

    def _valid(self, token: object) -> bool:
        try:
            return 0 <= operator.index(token) < self.vocab_size
        except TypeError:
            return False

    def _one(self, logits: torch.Tensor, row: int, params: SamplingParams,
             generator: torch.Generator | None) -> int:
        try:
            (token,) = self.sampler(logits[row:row + 1], [params], [generator])
            return token
        except Exception:
            log.exception("sampling row %d failed", row)
            self.failures[row] = "internal error while sampling this request"
            return 0

    def _token_id(self, row: int, token: object) -> int:
        if row in self.failures:
            return 0
        try:
            token = operator.index(token)
        except TypeError:
            token = -1
        if not 0 <= token < self.vocab_size:
            log.error("the sampler returned %r for row %d, not a token id", token, row)
            self.failures[row] = "internal error while sampling this request"
            return 0
        return token

    def _add_logprobs(self, logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> None:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None and i not in self.failures]
        if not rows:
            return
        try:
            dev = logits.device
            logprobs = logits[torch.tensor(rows, device=dev)].float().log_softmax(dim=-1)
            chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in rows], device=dev))[:, 0].tolist()
            k = max(params[i].logprobs for i in rows)
            top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
            top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
            for j, i in enumerate(rows):
                n = params[i].logprobs
                top = [(t, _floor(lp)) for t, lp in zip(top_ids[j][:n], top_lp[j][:n])]
                self.logprobs[i] = TokenLogprobs(tokens[i], _floor(chosen[j]), top)
        except Exception:
            log.exception("computing logprobs failed for %d rows", len(rows))
            for i in rows:
                self.failures[i] = "internal error while computing logprobs"


@dataclass(slots=True)
class TokenEvent:
    token_id: int | None
    finish_reason: FinishReason | None = None
    error: str | None = None
    code: str | None = None             # with `error`: SHUTDOWN or INTERNAL
    logprobs: TokenLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Stream:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def put(self, event: TokenEvent, delay: float = 0.0) -> None:
        try:
            if delay > 0:
                self.loop.call_soon_threadsafe(self.loop.call_later, delay, self.queue.put_nowait, event)
            else:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is gone: the client with it
            pass


class RequestHandle:
    """One admitted request: iterate `events()`; `close()` aborts it unless it already finished."""

    __slots__ = ("engine", "seq_id", "_stream", "finished")

    def __init__(self, engine: "LLMEngine", seq_id: int, stream: _Stream):
        self.engine = engine
        self.seq_id = seq_id
        self._stream = stream
        self.finished = False

    async def events(self) -> AsyncIterator[TokenEvent]:
        while not self.finished:
            event = await self._stream.queue.get()
            self.finished = event.finished
            yield event

    def close(self, reason: FinishReason = FinishReason.ABORT) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.seq_id, reason)


class LLMEngine:
    """A continuous-batching engine over one model. `start()` runs the step loop thread."""

    def __init__(self, config: EngineConfig, *, probe_prompts: list[str] | tuple[str, ...] = ()):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = DTYPES[config.dtype]
        torch.manual_seed(config.seed)
        self.model, self.tokenizer, self.model_config = load_model(config.model, self.dtype, self.device)
        self.config.max_model_len = min(config.max_model_len, self.model_config.max_position)
        self.runner = ModelRunner(config, self.model, self.model_config, self.device, self.dtype)
        total = self.runner.num_blocks
        # the patch self-check's probe (its built-in plan, then `probe_prompts`) runs on blocks of its own
        self.probe_plan: ProbePlan = build_probe_plan(self.tokenizer.encode, probe_prompts, config.block_size,
                                                      self.config.max_model_len)
        need = self.probe_plan.num_blocks
        if total <= need:
            raise ValueError(f"kv_cache_memory holds {total} KV blocks and the patch self-check keeps {need} aside "
                             f"for its probe ({self.probe_plan.longest} tokens at most), leaving none for requests: "
                             "raise --kv-cache-memory")
        self.probe_blocks = list(range(total - need, total))
        # below the probe's, the blocks the shadow comparison runs on (at most a quarter of the cache)
        total -= need
        shadow_n = min(-(-config.shadow_max_tokens // config.block_size), total // 4)
        shadow_blocks = list(range(total - shadow_n, total))
        self.block_manager = BlockManager(total - shadow_n, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        # which implementation serves each slot on this device and paths: graft.kernels.dispatch decides
        self.base_slots: SlotTable = default_slots(POLICIES[config.scheduling], sample_per_row, config.paths,
                                                   self.device).with_slots({"request.outcome": no_outcome})
        self._state = EngineState(self.base_slots)
        self.metrics = EngineMetrics()
        self.metrics.set_revision(None, self.revision)
        self.shadow = ShadowComparator(
            ShadowSettings(rate=config.shadow_rate, budget=config.shadow_budget, floor=config.shadow_floor,
                           max_tokens=config.shadow_max_tokens),
            self.runner, shadow_blocks, self.dtype, self.metrics, seed=config.seed)
        self.eos_ids = set(self.tokenizer.stop_token_ids)
        self._guard: tuple[SlotTable, SlotTable, GuardedSampler] | None = None
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[int, _Stream] = {}
        self._pending_adds = 0
        self._count_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running = False
        self.draining = False
        self.steps = 0
        self.heartbeat = time.monotonic()   # when the step loop last came round
        # start-up patches (GRAFT_PATCHES) from bundles, which only the operator can apply again:
        # the engine is not ready until every one of them is applied
        self.awaiting: tuple[str, ...] = ()
        # set by the patch manager: called in the step loop when a patch's slot misbehaves on live
        # traffic (the slot's name, what it did); True when it took the patch out
        self.on_slot_fault: Callable[[str, BaseException], bool] | None = None
        # the model runs on the step loop's OpenMP team: end the one that loading it started on
        # this thread (graft.engine.openmp says why)
        openmp.release_threads()

    # lifecycle
    def start(self) -> None:
        openmp.release_threads()     # and any this thread has started since
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="graft-step-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def is_running(self) -> bool:
        """Whether the step loop thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def stalled_for(self) -> float:
        """Seconds since the step loop last came round, when more than `stall_timeout`; else 0."""
        idle = time.monotonic() - self.heartbeat
        return idle if self._running and idle > self.config.stall_timeout else 0.0

    def not_ready(self) -> str | None:
        """Why the engine should get no traffic (what /ready answers 503 with), or None: draining,
        unhealthy, or start-up patches from a bundle not applied again yet."""
        if self.draining:
            return "draining"
        why = self.health()
        if why is not None:
            return why
        missing = [ref for ref in self.awaiting if not has_patch(self.revision, ref)]
        if missing:
            return (f"waiting for {', '.join(missing)} (in GRAFT_PATCHES, from a bundle) to be applied again "
                    "through the admin API")
        return None

    def health(self) -> str | None:
        """Why the engine cannot serve (what /health and /ready answer 503 with), or None."""
        if not self.is_running:
            return "the step loop is not running"
        stalled = self.stalled_for
        if stalled:
            return (f"the step loop has not come round for {stalled:.0f}s (more than {self.config.stall_timeout:g}s): "
                    "a step or a patch slot is stuck")
        return None

    @property
    def num_active(self) -> int:
        return len(self._streams) + self._pending_adds

    # what the step loop runs on
    @property
    def state(self) -> EngineState:
        """The current table, revision and patches, as one snapshot (safe to read from any thread)."""
        return self._state

    @property
    def slots(self) -> SlotTable:
        return self._state.slots

    @slots.setter
    def slots(self, table: SlotTable) -> None:
        """Replace the table alone, revision kept (tests poison a slot this way)."""
        self._state = replace(self._state, slots=table)

    @property
    def revision(self) -> str:
        return self._state.revision

    def swap(self, state: EngineState) -> EngineState:
        """Install `state` and return the one it replaces. Step loop only, between two steps."""
        old, self._state = self._state, state
        self.metrics.set_revision(old.revision, state.revision)
        self.shadow.on_swap(old, state)
        return old

    def probe(self, slots: SlotTable) -> ProbeRun:
        """The probe plan (`probe_plan`) under `slots`, on the blocks kept aside for it: each `step()` of
        the run is one forward pass. Steps run in the step loop only, between two steps."""
        return ProbeRun(self.runner, self.probe_plan, slots, self.probe_blocks)

    def preempt_running(self) -> None:
        """Send every running request back to wait (recomputed later). Step loop only."""
        self.scheduler.preempt_all()

    async def drain(self, grace: float, cut_wait: float = 5.0) -> bool:
        """Stop admitting and wait up to `grace` seconds for in-flight requests; True if all finished.

        Requests still running at the deadline are ended there with a SHUTDOWN error, so each
        client gets a proper answer (an SSE error event, or a 503) before the server closes.
        """
        self.draining = True
        deadline = time.monotonic() + grace
        while self.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.num_active:
            return True
        log.warning("grace period over with %d requests in flight: ending them", self.num_active)
        self._send(CutRequests("the server shut down before the request finished"))
        deadline = time.monotonic() + cut_wait
        while self.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return False

    # requests (called from the event loop)
    def validate(self, prompt_len: int, params: SamplingParams) -> None:
        """Refuse (InvalidPrompt, InvalidParam) what the step loop could not run; nothing else gets in."""
        if prompt_len == 0:
            raise InvalidPrompt("the prompt is empty")
        if prompt_len >= self.config.max_model_len:
            raise InvalidPrompt(f"the prompt has {prompt_len} tokens; this model's context is "
                             f"{self.config.max_model_len} tokens including the completion")
        if prompt_len >= self.scheduler.max_seq_len:   # refused here, a 400, not in the step loop
            raise InvalidPrompt(f"the prompt has {prompt_len} tokens; the KV cache holds "
                             f"{self.scheduler.max_seq_len} tokens including at least one generated token")
        params.validate()
        vocab = self.model_config.vocab_size
        if params.top_k > vocab:
            raise InvalidParam("top_k", f"must be at most the vocabulary size ({vocab}); 0 turns it off")
        if params.max_tokens > self.config.max_model_len:
            raise InvalidParam("max_tokens", f"must be at most the context length ({self.config.max_model_len})")

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, *,
               priority: int = 0, tenant: str = "") -> "RequestHandle":
        """Admit a request; its tokens arrive through the returned handle.

        Raises QueueFull (429), EngineDraining (503), InvalidPrompt or InvalidParam (400; both name
        the field in `param`) and admits nothing then.
        Must be called from the event loop that will read the handle.
        """
        if self.draining:
            raise EngineDraining("the engine is shutting down")
        self.validate(len(prompt_token_ids), params)
        room = self.config.max_model_len - len(prompt_token_ids)
        if params.max_tokens > room:
            params.max_tokens = room
        with self._count_lock:
            if self.scheduler.num_waiting + self._pending_adds >= self.config.max_waiting:
                raise QueueFull(retry_after=self._retry_after())
            self._pending_adds += 1
        seq = Sequence(prompt_token_ids=list(prompt_token_ids), params=params,
                       priority=priority, tenant=tenant)
        stream = _Stream(asyncio.get_running_loop())
        self._streams[seq.seq_id] = stream
        self._send(AddRequest(seq))
        return RequestHandle(self, seq.seq_id, stream)

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.ABORT) -> None:
        self._send(AbortRequest(seq_id, reason))

    def call_between_steps(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` in the step loop between two steps (how patch swaps stay atomic)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(BetweenSteps(fn, future))
        return future

    async def between_steps(self, fn: Callable[[], Any]) -> Any:
        """`call_between_steps`, awaited from the event loop: `fn`'s result, or what it raised."""
        return await asyncio.wrap_future(self.call_between_steps(fn))

    def _send(self, message: Message) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    def _retry_after(self) -> int:
        return max(1, round(self.scheduler.retry_after()))

    # the step loop (its own thread)
    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            match message:
                case AddRequest(seq):
                    self._add(seq)
                case AbortRequest(seq_id, reason):
                    seq = self.scheduler.finish(seq_id, reason)
                    if seq is not None:
                        self._retire(seq)
                    elif seq_id in self._streams:
                        self._streams.pop(seq_id).put(TokenEvent(None, reason))
                case CutRequests(error):
                    for seq_id in list(self._streams):
                        self._fail(seq_id, error, SHUTDOWN)
                case BetweenSteps(fn, future):
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn())
                        except BaseException as exc:  # handed back to the caller
                            future.set_exception(exc)

    def _add(self, seq: Sequence) -> None:
        with self._count_lock:
            self._pending_adds -= 1
            try:
                self.scheduler.add(seq)
            except Exception as exc:  # QueueFull, ValueError: that request alone fails
                self._finish_stream(seq, FinishReason.ERROR, error=str(exc))
                return
        seq.revision = self.revision
        self.metrics.request_started(seq.revision)
        self.shadow.admit(seq)

    def _loop(self) -> None:
        while self._running:
            self.heartbeat = time.monotonic()
            self._drain_inbox()
            batch = self.scheduler.schedule(self.slots["scheduler.policy"], time.monotonic())
            if self.scheduler.policy_error is not None:   # this step was admitted in arrival order
                error, self.scheduler.policy_error = self.scheduler.policy_error, None
                self._slot_fault("scheduler.policy", error)
            if batch is None:
                self._update_gauges()
                if not self.shadow.work(busy=False):   # idle time goes to shadow work first
                    self._wakeup.wait(0.05)
                    self._wakeup.clear()
                continue
            t0 = time.perf_counter()
            try:
                self._step(batch)
            except Exception as exc:  # a failed step must not kill the loop
                self._step_failed(batch, exc)
            self.shadow.work(busy=True, step_seconds=time.perf_counter() - t0,
                             backlog=self.scheduler.num_waiting > 0 or bool(batch.preempted))
        self._drain_inbox()
        for seq_id in list(self._streams):
            seq = self.scheduler.finish(seq_id, FinishReason.ABORT)
            if seq is not None:
                self._retire(seq)

    def _step_failed(self, batch, exc: Exception) -> None:
        """A step raised. When a patch's slot raised it, the patch is taken out and the step run
        again on the table before it (requests a revert preempted wait to be recomputed instead);
        otherwise, or if it fails again, its requests fail."""
        seqs = [*(s for s, _ in batch.prefills), *batch.decodes]
        slot = self._raising_slot(exc)
        if slot is not None and self._slot_fault(slot, exc):
            again = [s for s in seqs if s.status is SequenceStatus.RUNNING]
            if len(again) < len(seqs):
                return           # the revert preempted them: recomputed under the new table
            try:
                self._step(batch)
                return
            except Exception as again_exc:
                exc = again_exc
        log.error("engine step failed; failing the requests of this step", exc_info=exc)
        for seq in seqs:
            self._fail(seq.seq_id, "internal error while running the model")

    def _patched_slots(self) -> dict[str, Any]:
        """The slots of the current table that a patch provides (not the base table's)."""
        table, base = self.slots, self.base_slots
        return {name: table[name] for name in table if table[name] is not base[name]}

    def _raising_slot(self, exc: BaseException) -> str | None:
        """The patch slot in whose code `exc` was raised (innermost first), if one was."""
        codes: dict[Any, str] = {}
        for name, fn in self._patched_slots().items():
            code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
            if code is not None:
                codes[code] = name
        found, tb = None, exc.__traceback__
        while tb is not None:
            found = codes.get(tb.tb_frame.f_code, found)
            tb = tb.tb_next
        return found

    def _slot_fault(self, slot: str, error: BaseException) -> bool:
        """A slot misbehaved on live traffic: counted, logged, and handed to `on_slot_fault` (which
        takes the patch that provides it out) when a patch provides it. True when it was taken out."""
        if slot not in self._patched_slots():
            log.error("the base table's %s failed: %s", slot, error)
            return False
        self.metrics.slot_faults.labels(slot).inc()
        log.error("patch slot %s failed on live traffic under %s: %s", slot, self.revision, error)
        if self.on_slot_fault is None:
            return False
        try:
            return bool(self.on_slot_fault(slot, error))
        except Exception:
            log.exception("taking out the patch behind the failing slot %s failed", slot)
            return False

    def _step(self, batch) -> None:
        now = time.monotonic()
        for seq, _ in batch.prefills:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
                self.metrics.queue.labels(self.revision).observe(now - seq.arrival)
        if batch.preempted:
            self.metrics.preemptions.inc(len(batch.preempted))
        slots, guard = self._guarded_slots()
        guard.reset()
        tokens = self.runner.run(batch, slots)  # raises only when the step as a whole failed
        self.steps += 1
        if guard.raised is not None:   # the base sampler stood in for the patched one
            self._slot_fault("sampler", guard.raised)
        rows = list(tokens)  # seq ids in the order of the sampler's rows
        for row, message in guard.failures.items():
            self._fail(rows[row], message)
        if guard.logits is not None and self.shadow.active:
            self._record_shadow(batch, rows, guard)
        got, finished = self.scheduler.postprocess(batch, tokens, self.eos_ids)
        now = time.monotonic()
        logprobs = {rows[row]: lp for row, lp in guard.logprobs.items()}
        for seq in got:
            try:
                self._deliver(seq, logprobs.get(seq.seq_id), now)
            except Exception:
                log.exception("delivering a token of request %d failed", seq.seq_id)
                self._fail(seq.seq_id, "internal error while delivering a token")
        for seq in finished:
            self._retire(seq)
        self._update_gauges()

    def _record_shadow(self, batch, rows: list[int], guard: GuardedSampler) -> None:
        """Hand the shadow comparison the live distribution of each recorded row of this step."""
        recorded = {s.seq_id: s for s in batch.sampling if s.shadow is not None}
        if not recorded:
            return
        try:
            self.shadow.record([(i, recorded[sid]) for i, sid in enumerate(rows)
                                if sid in recorded and i not in guard.failures], guard.logits)
        except Exception:   # shadow work never fails a request: stop recording these instead
            log.exception("recording the shadow distributions of %d requests failed", len(recorded))
            for seq in recorded.values():
                self.shadow.finished(seq, ok=False)

    def _guarded_slots(self) -> tuple[SlotTable, GuardedSampler]:
        """The current slot table with its sampler guarded; rebuilt only when the table changes."""
        if self._guard is None or self._guard[0] is not self.slots:
            # a patch's sampler that fails a batch hands it to the base one, when there is a patch
            # manager to take that patch out (without one, the failing rows fail alone)
            sampler, base = self.slots["sampler"], self.base_slots["sampler"]
            fallback = base if sampler is not base and self.on_slot_fault is not None else None
            guard = GuardedSampler(sampler, self.model_config.vocab_size, fallback)
            self._guard = (self.slots, self.slots.with_slots({"sampler": guard}), guard)
        return self._guard[1], self._guard[2]

    def _deliver(self, seq: Sequence, logprobs: TokenLogprobs | None, now: float) -> None:
        if seq.params.logprobs is not None:
            if logprobs is None:
                raise RuntimeError("a token that asked for logprobs got none")
            seq.output_logprobs.append(logprobs)
        rev = self.revision
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.ttft.labels(rev).observe(now - seq.arrival)
        else:
            self.metrics.itl.labels(rev).observe(now - seq.last_token_at)
        seq.last_token_at = now
        stream = self._streams.get(seq.seq_id)
        if stream is not None and not seq.is_finished:
            stream.put(TokenEvent(seq.output_token_ids[-1], logprobs=logprobs))

    def _fail(self, seq_id: int, error: str, code: str = INTERNAL) -> None:
        """End one live request with an error; the rest of its batch is untouched."""
        seq = self.scheduler.finish(seq_id, FinishReason.ERROR)
        if seq is not None:
            self._retire(seq, error, code)

    def _finish_stream(self, seq: Sequence, reason: FinishReason, error: str | None = None,
                       code: str | None = None, delay: float = 0.0) -> None:
        stream = self._streams.pop(seq.seq_id, None)
        if stream is not None:
            last, logprobs = None, None
            if reason in (FinishReason.STOP, FinishReason.LENGTH) and seq.output_token_ids:
                last = seq.output_token_ids[-1]
                if seq.output_logprobs:
                    logprobs = seq.output_logprobs[-1]
            if error is not None and code is None:
                code = INTERNAL
            stream.put(TokenEvent(last, reason, error, code, logprobs), delay)

    def _outcome(self, seq: Sequence) -> tuple[float, str | None]:
        """The `request.outcome` slot's verdict: (delay, error or None). A patched slot that raises or
        answers anything but a delay within [0, MAX_OUTCOME_DELAY] seconds and a flag is a slot fault
        (its patch is taken out) and this request finishes as the base table would finish it."""
        try:
            delay, failed = self.slots["request.outcome"](seq)
            if isinstance(delay, bool) or not 0 <= float(delay) <= MAX_OUTCOME_DELAY \
                    or not isinstance(failed, (bool, int)):   # NaN fails the comparison too
                raise ValueError(f"request.outcome answered ({delay!r}, {failed!r}), not a delay within "
                                 f"[0, {MAX_OUTCOME_DELAY:g}] seconds and a flag")
        except Exception as exc:
            if self._slot_fault("request.outcome", exc):
                return 0.0, None          # as the base table's `no_outcome` finishes it
            log.error("request.outcome failed for request %d: %s", seq.seq_id, exc)
            return 0.0, "internal error while finishing the request"
        return float(delay), "injected fault" if failed else None

    def _retire(self, seq: Sequence, error: str | None = None, code: str | None = None) -> None:
        reason = seq.finish_reason or FinishReason.ABORT
        delay = 0.0
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            delay, error = self._outcome(seq)
            if error is not None:
                reason = FinishReason.ERROR
        self.runner.release(seq)
        if seq.shadow is not None:
            self.shadow.finished(seq, ok=reason in (FinishReason.STOP, FinishReason.LENGTH))
        # counted before the client hears of it, so a scrape after an answer always includes it
        rev = self.revision
        status = _STATUS_OF.get(reason, "ok")
        self.metrics.requests.labels(rev, status).inc()
        self.metrics.duration.labels(rev).observe(time.monotonic() - seq.arrival + delay)
        self.metrics.prompt_tokens.labels(rev).inc(seq.num_prompt_tokens)
        self.metrics.generation_tokens.labels(rev).inc(len(seq.output_token_ids))
        if seq.revision is not None:
            self.metrics.request_ended(seq.revision)
        self._finish_stream(seq, reason, error, code, delay)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(self.scheduler.num_running)
        m.waiting.set(self.scheduler.num_waiting)
        m.kv_usage.set(self.block_manager.usage)
        m.kv_fragmentation.set(self.block_manager.fragmentation)
