"""What one forward pass needs to know about the batch: the contract between runner, model and attention.

Layout of a step: the sequences of the batch, prefills first, then decodes (one query token each).
Their new tokens are concatenated into one flat batch of T tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepContext:
    positions: torch.Tensor       # [T] int64, position of each new token in its sequence
    slot_mapping: torch.Tensor    # [T] int64, flat KV-cache slot (block * block_size + offset) per new token
    query_lens: list[int]         # [B] new tokens per sequence
    context_lens: list[int]       # [B] tokens in the cache for each sequence once this step's are stored
    block_tables: torch.Tensor    # [B, max_blocks] int32, padded with 0
    context_lens_t: torch.Tensor  # [B] int32, context_lens on the device
    cu_query_lens: torch.Tensor   # [B + 1] int32, prefix sums of query_lens on the device
    logits_indices: torch.Tensor  # [B] int64, index in the flat batch of the token to sample from
    num_prefills: int             # the first num_prefills sequences are prefills, the rest decodes
    block_size: int = 64

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills
