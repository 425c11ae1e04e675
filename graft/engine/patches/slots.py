"""Patch points: the slot table the model and scheduler read their implementations from.

Every step reads `slots[name]` afresh, so swapping the table between two steps switches the
engine's behaviour atomically. The table itself is immutable; a patch produces a new table.

Each slot's call signature is a Protocol below, and `SLOTS` maps the slot names to them: what a
patch's implementation must accept and return. Tensors are on the engine's device; a paged cache
is [num_blocks, block_size, n_kv, d]. The engine calls every slot with positional arguments, so
an implementation may name its parameters as it likes.

This module imports no torch at run time (tensor types are annotations only): the patch
definitions and the bundle tooling, which run without torch, import it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Generator, Tensor, nn

    from graft.engine.sequence import SamplingParams
    from graft.engine.sequence import Sequence as Request


class KVStore(Protocol):
    """``kv.store``: write the new tokens' keys and values k, v [T, n_kv, d] into their cache
    slots (block * block_size + offset, [T]); a negative slot is padding and is skipped."""

    def __call__(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, /) -> None: ...


class KVGather(Protocol):
    """``kv.gather``: one sequence's keys and values, contiguous [context_len, n_kv, d], read
    through its block table (a 1-D int tensor)."""

    def __call__(self, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, context_len: int,
                 /) -> tuple[Tensor, Tensor]: ...


class AttentionPrefill(Protocol):
    """``attention.prefill``: causal grouped-query attention of q [Lq, n_heads, d] over k, v
    [Lk, n_kv, d], Lk >= Lq, the last Lq keys the queries' own; returns [Lq, n_heads, d]."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float, /) -> Tensor: ...


class AttentionDecode(Protocol):
    """``attention.decode``: one query token per sequence, q [B, n_heads, d], over each sequence's
    first context_lens[i] cached tokens (block_tables [B, max_blocks], context_lens B ints);
    returns [B, n_heads, d]. `gather` is the table's ``kv.gather``, for implementations that read
    each context contiguously."""

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                 context_lens: Sequence[int], scale: float, gather: KVGather, /) -> Tensor: ...


class LinearQKV(Protocol):
    """``linear.qkv``: the attention input projections of one decoder layer for x [T, hidden]:
    flat q [T, n_heads * d], k and v [T, n_kv * d]."""

    def __call__(self, layer: nn.Module, x: Tensor, /) -> tuple[Tensor, Tensor, Tensor]: ...


class Sampler(Protocol):
    """``sampler``: one token id per row of logits [B, vocab], row i under params[i], drawing
    from generators[i] when it is not None (a seeded request)."""

    def __call__(self, logits: Tensor, params: list[SamplingParams],
                 generators: list[Generator | None], /) -> list[int]: ...


class SchedulerPolicy(Protocol):
    """``scheduler.policy``: the waiting sequences in the order they should be admitted, `now` on
    the clock of their arrival times."""

    def __call__(self, waiting: list[Request], now: float, /) -> list[Request]: ...


class RequestOutcome(Protocol):
    """``request.outcome``: consulted once per finished request: how long to hold its last event
    back (seconds), and whether to fail it (the default: no delay, no failure; the
    fault-injection test patches replace it)."""

    def __call__(self, seq: Request, /) -> tuple[float, bool]: ...


SLOTS: Mapping[str, type] = MappingProxyType({
    "kv.store": KVStore,
    "kv.gather": KVGather,
    "attention.prefill": AttentionPrefill,
    "attention.decode": AttentionDecode,
    "linear.qkv": LinearQKV,
    "sampler": Sampler,
    "scheduler.policy": SchedulerPolicy,
    "request.outcome": RequestOutcome,
})
"""Every patch point, by name, with the Protocol its implementations follow."""

SLOT_NAMES = tuple(SLOTS)


class SlotTable(Mapping[str, Callable[..., Any]]):
    """An immutable name -> implementation map over the names in `SLOTS`; `with_slots` returns a new table."""

    __slots__ = ("_impls",)

    def __init__(self, impls: Mapping[str, Callable[..., Any]]):
        unknown = set(impls) - set(SLOTS)
        if unknown:
            raise KeyError(f"unknown patch point(s): {sorted(unknown)}")
        self._impls = MappingProxyType(dict(impls))

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self._impls[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._impls)

    def __len__(self) -> int:
        return len(self._impls)

    def with_slots(self, changes: Mapping[str, Callable[..., Any]]) -> "SlotTable":
        return SlotTable({**self._impls, **changes})
