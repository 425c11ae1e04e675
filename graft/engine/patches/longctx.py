"""`longctx-test@1`: a test patch that is right on short contexts and wrong on long ones.

Its prefill and decode attention read the keys and values of position p from position
p mod `fromTokens` (the apply call's `config`, default 512), as a KV walk whose block index wraps
after fromTokens / 64 blocks would: below `fromTokens` tokens it is the engine's own fast
attention, value for value; past it the model reads its prompt's opening again where the question
should be, and its answers go wrong. The self-check's probe (contexts up to 196 tokens) and
short-prompt traffic cannot see it; BBH's 3-shot CoT prompts (240 to 2,500 tokens, most past 700)
can, and so can `graft eval bbh`, which is what the LLM quality gate (docs/analysis.md) is for.

Registered, like every test patch, only with `graft serve --enable-test-patches`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graft.engine import attention
from graft.engine.patches.base import Patch

WRAP_FROM_TOKENS = 512


def _wrapped(k: torch.Tensor, v: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [L, n_kv, d] with row p read from row p mod limit."""
    if k.shape[0] <= limit:
        return k, v
    idx = torch.arange(k.shape[0], device=k.device) % limit
    return k.index_select(0, idx), v.index_select(0, idx)


def _longctx_config(config: Mapping[str, Any]) -> dict:
    limit = config.get("fromTokens", WRAP_FROM_TOKENS)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError("fromTokens must be an integer >= 1")

    def prefill(q, k, v, scale):
        k, v = _wrapped(k, v, limit)
        return attention.prefill_attention_fast(q, k, v, scale)

    def decode(q, k_cache, v_cache, block_tables, context_lens, scale, gather):
        out = attention.decode_attention_fast(q, k_cache, v_cache, block_tables, context_lens, scale, gather)
        # only the long contexts take the slow way: short traffic runs exactly as fast as before
        for i, n in enumerate(context_lens):
            if n > limit:
                k, v = _wrapped(*gather(k_cache, v_cache, block_tables[i], n), limit)
                out[i] = attention.prefill_attention_fast(q[i:i + 1], k, v, scale)[0]
        return out
    return {"attention.prefill": prefill, "attention.decode": decode}


def longctx_patch() -> Patch:
    return Patch("longctx-test", "1", _longctx_config({}), configure=_longctx_config, test_only=True,
                 description="attention that reads position p's keys from p mod fromTokens (default 512): "
                             "exact on short contexts, wrong on long ones")
