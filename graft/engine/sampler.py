"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Two implementations of the `sampler` patch point. `sample_per_row` is the plain path: one row at a
time, reading each choice back to the host as it goes. `sample_batched` does the whole batch with
tensor ops and a single transfer to the host at the end (the `sync-free` patch).

Both work in float32 with guards, so that no accepted setting can produce a NaN: a temperature
below `GREEDY_TEMPERATURE` is greedy (`SamplingParams.greedy`) and others are clamped to it, top-k
is capped at the vocabulary, the most likely token always survives top-k/top-p (a top_p that
underflows float32 keeps it alone), and the exponential noise is never zero.
"""
from __future__ import annotations

import torch

from graft.engine.sequence import GREEDY_TEMPERATURE, SamplingParams

_TINY = torch.finfo(torch.float32).tiny


def _filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and nucleus; logits are [B, V] fp32."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def _filters(p: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p removes anything: without either, filtering (a sort of the whole
    vocabulary, the dearest part of sampling) is skipped."""
    return 0 < p.top_k < vocab or p.top_p < 1


def _exponential(shape: torch.Size, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    # a zero draw would turn a masked token's 0 / 0 into a NaN that argmax picks
    return torch.empty(shape, device=device).exponential_(generator=generator).clamp_min_(_TINY)


def _scaled(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits / temperature in float32, the temperature never below GREEDY_TEMPERATURE."""
    return logits.float() / temperatures.clamp_min(GREEDY_TEMPERATURE)


def _top_k(p: SamplingParams, vocab: int) -> int:
    return min(p.top_k, vocab)  # also keeps a huge top_k from overflowing an int64 tensor


def sample_per_row(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> list[int]:
    out: list[int] = []
    for row, p, gen in zip(logits, params, generators):
        if p.greedy:
            out.append(int(row.argmax().item()))
            continue
        dev = row.device
        row = _scaled(row.unsqueeze(0), torch.tensor([p.temperature], device=dev))
        if _filters(p, row.shape[-1]):
            row = _filter_logits(row, torch.tensor([_top_k(p, row.shape[-1])], device=dev),
                                 torch.tensor([p.top_p], device=dev))
        row = row[0]
        probs = row.softmax(dim=-1)
        out.append(int((probs / _exponential(probs.shape, row.device, gen)).argmax().item()))
    return out


def sample_batched(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> list[int]:
    greedy = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return greedy.tolist()
    dev = logits.device
    idx = torch.tensor(sampled_rows, device=dev)
    temps = torch.tensor([params[i].temperature for i in sampled_rows], device=dev)
    rows = _scaled(logits[idx], temps.unsqueeze(1))
    vocab = logits.shape[-1]
    if any(_filters(params[i], vocab) for i in sampled_rows):
        top_k = torch.tensor([_top_k(params[i], vocab) for i in sampled_rows], device=dev)
        top_p = torch.tensor([params[i].top_p for i in sampled_rows], device=dev)
        rows = _filter_logits(rows, top_k, top_p)
    probs = rows.softmax(dim=-1)
    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p; each seeded row gets its own noise
    noise = torch.stack([_exponential(probs.shape[1:], dev, generators[i]) for i in sampled_rows])
    choice = (probs / noise).argmax(dim=-1)
    greedy[idx] = choice
    return greedy.tolist()
