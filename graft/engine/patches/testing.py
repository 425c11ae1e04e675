"""Test-only patches, registered only with `graft serve --enable-test-patches`.

- `fault@1` fails a share of requests and/or adds latency to each (error rate and latency from the
  apply call's `config` ({"errorRate": 0.05, "latencyMs": 0}) or GRAFT_FAULT_ERROR_RATE /
  GRAFT_FAULT_LATENCY_MS);
- `slow@1` adds 300 ms to every request and fails none (a latency-only regression);
- `skew@1` is numerically wrong (attention output scaled), so the self-check must refuse it;
- `drift@1` is the engine's own decode attention (`attention.decode_attention_fast`, whichever
  kernel it picks) with each sequence's context cut to its first `fromTokens` tokens (the apply
  call's `config`, default 512): right on short contexts, wrong past that length, as a decode
  path that caps its context would be. The self-check refuses it when its probe reaches past
  `fromTokens` (`{"fromTokens": 128}`), and cannot see it when it does not (`4096`);
- `longctx-test@1` (graft.engine.patches.longctx) reads the keys past `fromTokens` (default 512)
  from the wrong positions: exact on short contexts, wrong answers on long ones;
- `kv-align@3.2.2-test` is a second version of the built-in `kv-align@3.2.1` with the same results
  by another path, to replace one with the other; `kv-align@3.2.2-skew` is a version whose values
  are wrong, so a replace by it must fail its self-check and keep the applied version.
"""
from __future__ import annotations

import os
import random
from collections.abc import Mapping
from typing import Any

import torch

from graft.engine import attention
from graft.engine.patches.base import Patch
from graft.engine.patches.longctx import longctx_patch


def outcome(error_rate: float, latency_s: float, seed: int | None = None):
    rng = random.Random(seed)

    def request_outcome(seq) -> tuple[float, bool]:
        return latency_s, rng.random() < error_rate
    return request_outcome


def _fault_config(config: Mapping[str, Any]) -> dict:
    rate = float(config.get("errorRate", os.environ.get("GRAFT_FAULT_ERROR_RATE", 0.05)))
    latency = float(config.get("latencyMs", os.environ.get("GRAFT_FAULT_LATENCY_MS", 0))) / 1000
    if not 0 <= rate <= 1:
        raise ValueError("errorRate must be within [0, 1]")
    if not 0 <= latency <= 60:
        raise ValueError("latencyMs must be within [0, 60000]")
    return {"request.outcome": outcome(rate, latency)}


DRIFT_FROM_TOKENS = 512


def _drift_config(config: Mapping[str, Any]) -> dict:
    limit = config.get("fromTokens", DRIFT_FROM_TOKENS)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError("fromTokens must be an integer >= 1")

    def capped_decode(q, k_cache, v_cache, block_tables, context_lens, scale, gather):
        return attention.decode_attention_fast(q, k_cache, v_cache, block_tables,
                                               [min(n, limit) for n in context_lens], scale, gather)
    return {"attention.decode": capped_decode}


def _skewed_prefill(q, k, v, scale):
    return attention.prefill_attention_naive(q, k, v, scale) * 0.5


def _skewed_decode(q, k_cache, v_cache, block_tables, context_lens, scale, gather):
    return attention.decode_attention_per_seq(q, k_cache, v_cache, block_tables, context_lens, scale, gather) * 0.5


def _gather_by_slot(k_cache, v_cache, block_table, context_len):
    """`kv.gather` through one index of token slots over the flattened cache: `gather_aligned`'s result."""
    block_size = k_cache.shape[1]
    pos = torch.arange(context_len, device=k_cache.device)
    slots = block_table.long()[pos // block_size] * block_size + pos % block_size
    return k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]


def _skewed_gather(k_cache, v_cache, block_table, context_len):
    k, v = attention.gather_aligned(k_cache, v_cache, block_table, context_len)
    return k, v * 0.5


def patches() -> list[Patch]:
    return [
        Patch("fault", "1", _fault_config({}), description="injects request errors and latency",
              configure=_fault_config, test_only=True),
        Patch("slow", "1", {"request.outcome": outcome(0.0, 0.3)}, description="adds 300 ms per request",
              test_only=True),
        Patch("skew", "1", {"attention.prefill": _skewed_prefill, "attention.decode": _skewed_decode},
              description="numerically wrong attention; the self-check refuses it", test_only=True),
        Patch("drift", "1", _drift_config({}), description="decode attention over at most the first "
              "fromTokens tokens of each context (default 512): wrong only past that length",
              configure=_drift_config, test_only=True),
        longctx_patch(),
        Patch("kv-align", "3.2.2-test", {"kv.gather": _gather_by_slot},
              description="kv-align by a per-token slot index: same values as 3.2.1", test_only=True),
        Patch("kv-align", "3.2.2-skew", {"kv.gather": _skewed_gather},
              description="kv-align with halved values; the self-check refuses it", test_only=True),
    ]
