"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Two implementations of the `sampler` patch point. `sample_per_row` is the plain path: one row at a
time, reading each choice back to the host as it goes. `sample_batched` does the whole batch with
tensor ops and a single transfer to the host at the end (the `sync-free` patch).
"""
from __future__ import annotations

import torch

from graft.engine.sequence import SamplingParams


def _filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and nucleus; logits are [B, V] fp32."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always survives)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def _exponential(shape: torch.Size, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    return torch.empty(shape, device=device).exponential_(generator=generator)


def sample_per_row(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> list[int]:
    out: list[int] = []
    for row, p, gen in zip(logits, params, generators):
        if p.greedy:
            out.append(int(row.argmax().item()))
            continue
        row = _filter_logits((row.float() / p.temperature).unsqueeze(0),
                             torch.tensor([p.top_k], device=row.device),
                             torch.tensor([p.top_p], device=row.device))[0]
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
    top_k = torch.tensor([params[i].top_k for i in sampled_rows], device=dev)
    top_p = torch.tensor([params[i].top_p for i in sampled_rows], device=dev)
    rows = _filter_logits(logits[idx].float() / temps.unsqueeze(1), top_k, top_p)
    probs = rows.softmax(dim=-1)
    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p; each seeded row gets its own noise
    noise = torch.stack([_exponential(probs.shape[1:], dev, generators[i]) for i in sampled_rows])
    choice = (probs / noise).argmax(dim=-1)
    greedy[idx] = choice
    return greedy.tolist()
