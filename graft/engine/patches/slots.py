"""Patch points: the slot table the model and scheduler read their implementations from.

Every step reads `slots[name]` afresh, so swapping the table between two steps switches the
engine's behaviour atomically. The table itself is immutable; a patch produces a new table.

Slot signatures (tensors on the engine's device; cache tensors are [num_blocks, block_size, n_kv, d]):

- ``kv.store(k, v, k_cache, v_cache, slot_mapping) -> None``
  write the new tokens' keys and values ([T, n_kv, d]) into their cache slots.
- ``kv.gather(k_cache, v_cache, block_table, context_len) -> (k, v)``
  one sequence's keys and values, contiguous [context_len, n_kv, d]; block_table is a 1-D int tensor.
- ``attention.prefill(q, k, v, scale) -> out``
  causal attention of q [Lq, n_heads, d] over k, v [Lk, n_kv, d] (Lk >= Lq, the last Lq keys
  belong to the queries), grouped-query; returns [Lq, n_heads, d].
- ``attention.decode(q, k_cache, v_cache, block_tables, context_lens, scale, gather) -> out``
  one query token per sequence, q [B, n_heads, d], block_tables [B, max_blocks],
  context_lens a list[int] of length B; returns [B, n_heads, d].
- ``linear.qkv(layer, x) -> (q, k, v)``
  the attention input projections of one decoder layer for x [T, hidden].
- ``sampler(logits, params_list, generators) -> list[int]``
  one token id per row of logits [B, vocab].
- ``scheduler.policy(waiting, now) -> list``
  the waiting sequences in the order they should be admitted.
- ``request.outcome(seq) -> (delay_seconds, failed)``
  consulted once per finished request: how long to hold its last event back, and whether to fail it
  (the default: no delay, no failure; the fault-injection test patches replace it).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

SLOT_NAMES = (
    "kv.store",
    "kv.gather",
    "attention.prefill",
    "attention.decode",
    "linear.qkv",
    "sampler",
    "scheduler.policy",
    "request.outcome",
)


class SlotTable(Mapping[str, Callable[..., Any]]):
    """An immutable name -> implementation map; `with_slots` returns a new table."""

    __slots__ = ("_impls",)

    def __init__(self, impls: Mapping[str, Callable[..., Any]]):
        unknown = set(impls) - set(SLOT_NAMES)
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
