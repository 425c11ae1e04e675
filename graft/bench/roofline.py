"""The roofline of a throughput pass: how fast these cores could serve the work at best.

Measured in the same run as the passes it judges, because the figure it rests on, the rate of the
model's own matmuls in the engine's dtype, varies with the machine and its load:

- `gemm_gflops`: the model's linear layers (the fused QKV, attention output, gate-and-up and
  down projections) over a chunk of `tokens` rows, timed with torch on this process's threads;
- `copy_gbps`: a 256 MiB copy, bytes read plus bytes written per second.

`bound()` then costs the pass as a perfect engine would run it: every prompt token through every
linear layer and causal attention over its prompt at the matmul rate (prefill; the vocabulary
projection only for the last token of a prompt), and one decode step per new token in which all
sequences together read every weight and their KV cache once at the copy rate, or compute at
the matmul rate, whichever takes longer. Nothing else costs anything: no scheduling, sampling,
Python, HTTP or tokenizer, so a real server stays below it.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from graft.engine.loader import ModelConfig


def _best_ms(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def linear_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of each linear layer of a transformer block, QKV and gate-and-up fused."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(cfg.hidden_size, q + 2 * kv), (q, cfg.hidden_size),
            (cfg.hidden_size, 2 * cfg.intermediate_size), (cfg.intermediate_size, cfg.hidden_size)]


def measure(cfg: ModelConfig, dtype: torch.dtype, tokens: int = 1024, rounds: int = 5) -> dict[str, float]:
    """This machine's rates for the model: its matmuls at `tokens` rows, and memory copies.

    A roofline is what the machine can do, so each figure is the best of `rounds` rounds a tenth
    of a second apart (of five calls each): a round that another process interrupted is not the
    machine's rate. Every round's matmul rate is kept (`gemm_gflops_rounds`) to show the spread.
    """
    gen = torch.Generator().manual_seed(0)
    shapes = []
    for d_in, d_out in linear_shapes(cfg):
        shapes.append((torch.randn(tokens, d_in, generator=gen).to(dtype),
                       torch.randn(d_out, d_in, generator=gen).to(dtype)))
    flops = sum(2.0 * tokens * w.shape[0] * w.shape[1] for _, w in shapes)
    src = torch.empty(64 << 20, dtype=torch.float32)       # 256 MiB
    src.fill_(1.0)
    dst = torch.empty_like(src)
    best = [float("inf")] * len(shapes)
    per_round, copy_s = [], float("inf")
    with torch.inference_mode():
        for r in range(rounds):
            if r:
                time.sleep(0.1)
            times = [_best_ms(lambda x=x, w=w: F.linear(x, w)) / 1000 for x, w in shapes]
            best = [min(b, t) for b, t in zip(best, times)]
            per_round.append(flops / sum(times) / 1e9)
            copy_s = min(copy_s, _best_ms(lambda: dst.copy_(src), reps=2) / 1000)
    return {"gemm_gflops": flops / sum(best) / 1e9, "copy_gbps": 2 * src.numel() * 4 / copy_s / 1e9,
            "gemm_gflops_rounds": [round(g, 1) for g in per_round], "gemm_tokens": tokens,
            "dtype": str(dtype).removeprefix("torch.")}


def block_params(cfg: ModelConfig) -> int:
    return sum(d_in * d_out for d_in, d_out in linear_shapes(cfg))


def bound(cfg: ModelConfig, prompt_tokens: Sequence[int], max_tokens: int, rates: dict[str, float],
          dtype_bytes: int = 2) -> dict[str, Any]:
    """The fastest pass over prompts of `prompt_tokens` tokens, `max_tokens` new tokens each, all at once."""
    gemm, copy = rates["gemm_gflops"] * 1e9, rates["copy_gbps"] * 1e9
    layers, vocab_flops = cfg.num_layers, 2.0 * cfg.hidden_size * cfg.vocab_size
    linear_flops = 2.0 * block_params(cfg) * layers                          # per token
    attn = 4.0 * cfg.num_heads * cfg.head_dim * layers                        # per (query, key) pair
    n = len(prompt_tokens)
    prefill_flops = sum(linear_flops * p + attn * p * (p + 1) / 2 + vocab_flops for p in prompt_tokens)
    prefill_s = prefill_flops / gemm
    weight_bytes = (block_params(cfg) * layers + cfg.hidden_size * cfg.vocab_size) * dtype_bytes
    kv_per_token = 2 * layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    decode_s = 0.0
    for step in range(1, max_tokens):      # the first new token comes out of the prefill
        context = sum(prompt_tokens) + n * step
        flops = n * (linear_flops + vocab_flops) + attn * context
        decode_s += max(flops / gemm, (weight_bytes + kv_per_token * context) / copy)
    total = prefill_s + decode_s
    return {"prompt_tokens": sum(prompt_tokens), "output_tokens": n * max_tokens,
            "prefill_tflop": prefill_flops / 1e12, "prefill_s": prefill_s, "decode_s": decode_s,
            "pass_s": total, "output_tok_s": n * max_tokens / total, **rates}
