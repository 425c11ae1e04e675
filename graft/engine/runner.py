"""The model runner: owns the device, the weights and the paged KV cache; turns a scheduled batch
into one forward pass and sampled tokens.

On CUDA, decode steps of common batch sizes replay CUDA graphs captured at start-up; everywhere
else the same code runs eagerly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from graft.engine.config import EngineConfig
from graft.engine.context import StepContext
from graft.engine.loader import ModelConfig
from graft.engine.patches.slots import SlotTable
from graft.engine.scheduler import ScheduledBatch
from graft.engine.sequence import Sequence

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    """How many blocks of KV cache fit in the configured memory budget."""
    per_block = (2 * model_config.num_layers * config.block_size * model_config.num_kv_heads
                 * model_config.head_dim * torch.empty((), dtype=dtype).element_size())
    blocks = config.kv_cache_memory // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes holds no {per_block}-byte KV block")
    return int(blocks)


def _tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """seq.token_ids[start:end] without building the whole list (a decode needs one token)."""
    n = seq.num_prompt_tokens
    if end <= n:
        return seq.prompt_token_ids[start:end]
    if start >= n:
        return seq.output_token_ids[start - n:end - n]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[:end - n]


@dataclass(slots=True)
class PreparedStep:
    input_ids: torch.Tensor
    ctx: StepContext
    sampled: list[Sequence]     # the sequences that get a token from this step, in logits order


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig,
                 device: torch.device, dtype: torch.dtype):
        self.config = config
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.num_blocks = num_kv_blocks(config, model_config, dtype)
        shape = (self.num_blocks, config.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(model_config.num_layers)]
        self.generators: dict[int, torch.Generator] = {}
        if config.threads:
            torch.set_num_threads(config.threads)
        if config.paths == "fast":
            model.fuse_qkv(pin=True)   # the fast `linear.qkv` is one matmul over these
            model.fuse_mlp()
            if model.use_native_layers():
                log.info("native CPU layers on (RMSNorm, RoPE, SiLU-and-mul, small-row linear)")

    # inputs
    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        bs = self.config.block_size
        items = [*batch.prefills, *((seq, 1) for seq in batch.decodes)]
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Sequence] = []
        tables: list[list[int]] = []
        for seq, n in items:
            start = seq.num_computed_tokens
            end = start + n
            tokens = _tokens(seq, start, end)
            input_ids.extend(tokens)
            table = seq.block_table
            for pos in range(start, end):
                positions.append(pos)
                slot_mapping.append(table[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            context_lens.append(end)
            tables.append(table)
            if end == len(seq):
                logits_indices.append(len(input_ids) - 1)
                sampled.append(seq)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        ctx = StepContext(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            context_lens_t=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            num_prefills=len(batch.prefills),
            block_size=bs,
        )
        return PreparedStep(torch.tensor(input_ids, dtype=torch.long, device=dev), ctx, sampled)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.params.seed
        if seed is None or seq.params.greedy:
            return None
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[seq.seq_id] = gen
        return gen

    @torch.inference_mode()
    def forward(self, step: PreparedStep, slots: SlotTable) -> torch.Tensor:
        return self.model(step.input_ids, step.ctx, self.kv_caches, slots)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, slots: SlotTable) -> dict[int, int]:
        """One step: forward, then sample a token for each sequence whose known tokens are all computed."""
        step = self.prepare(batch)
        logits = self.forward(step, slots)
        if not step.sampled:
            return {}
        params = [s.params for s in step.sampled]
        gens = [self._generator(s) for s in step.sampled]
        tokens = slots["sampler"](logits, params, gens)
        return {seq.seq_id: tok for seq, tok in zip(step.sampled, tokens)}

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)

    @torch.inference_mode()
    def probe_logits(self, token_ids: list[int], slots: SlotTable, scratch_blocks: list[int]) -> torch.Tensor:
        """Logits of every position of `token_ids`, computed in scratch blocks; used by the patch self-check.

        The tokens go through the paths a request takes: a first prefill chunk, a second chunk over
        the cached first (`kv.gather`), and the last token as a decode step (`attention.decode`), so
        a patch that is wrong in any of them changes the logits.
        """
        bs = self.config.block_size
        n = len(token_ids)
        assert n >= 3 and len(scratch_blocks) * bs >= n, "probe needs 3 tokens and room for them"
        seq = Sequence(prompt_token_ids=list(token_ids[:-1]))
        seq.block_table = list(scratch_blocks)
        logits = []
        for chunk in ((n - 1) // 2, n - 1 - (n - 1) // 2):
            step = self.prepare(ScheduledBatch(prefills=[(seq, chunk)], decodes=[], preempted=[]))
            step.ctx.logits_indices = torch.arange(chunk, device=self.device)
            logits.append(self.forward(step, slots))
            seq.num_computed_tokens += chunk
        seq.output_token_ids.append(token_ids[-1])
        logits.append(self.forward(self.prepare(ScheduledBatch(prefills=[], decodes=[seq], preempted=[])), slots))
        return torch.cat(logits).float()
