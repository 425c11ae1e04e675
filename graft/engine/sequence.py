"""A request as the scheduler sees it: token ids, sampling settings, block table, progress."""
from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1    # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20                           # alternatives reported per token, as OpenAI allows
GREEDY_TEMPERATURE = 1e-5                   # below it logits / temperature overflows float32: greedy


class InvalidParam(ValueError):
    """A request setting out of range; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param} {message}")
        self.param = param


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS or a stop string
    LENGTH = "length"      # max_tokens or the context limit
    ABORT = "abort"        # client went away or the engine shut down
    ERROR = "error"
    TIMEOUT = "timeout"    # ran past the server's request timeout: ended by the engine, not the client


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0            # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0 means off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None         # None: none; k: the sampled token's and the k most likely

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidParam for any setting the sampler could not honour (NaN, overflow, a bad seed)."""
        if self.max_tokens < 1:
            raise InvalidParam("max_tokens", "must be at least 1")
        if not 0 <= self.temperature < math.inf:
            raise InvalidParam("temperature", "must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidParam("top_k", "must be >= 0")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidParam("seed", f"must be in [{SEED_MIN}, {SEED_MAX}]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidParam("logprobs", f"must be in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


@dataclass(slots=True)
class TokenLogprobs:
    """The log-probability of one sampled token under the model, and the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """One request. `num_computed_tokens` counts tokens whose K/V are in the cache."""

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0                   # lower runs first (as in vLLM)
    tenant: str = ""                    # the OpenAI `user` field; fairness is per tenant
    tenant_turn: int = 0                # when its tenant was last admitted (scheduler-kept; 0: not remembered)
    seq_id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # only when params.logprobs is set
    revision: str | None = None         # the engine revision it was admitted under
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens found in the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    first_scheduled: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    shadow: Any = None                  # graft.engine.shadow.Record while its answer is recorded for comparison

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while the prompt (or, after preemption, the prompt and prior output) is not all cached."""
        return self.num_uncomputed > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
