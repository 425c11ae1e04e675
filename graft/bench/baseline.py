"""The reference point: Hugging Face transformers' batched `generate` on the same model file and dtype.

Static batching as a plain transformers user would run it: left padding, `batch_size` prompts per
`generate` call, exactly `max_new_tokens` new tokens for every prompt (greedy, EOS ignored by
`min_new_tokens`). Loaded offline from the same GGUF (or Hugging Face folder) the engine serves.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class BaselineResult:
    prompts: int
    batch_size: int
    output_tokens: int
    prompt_tokens: int          # real (unpadded) prompt tokens
    padded_tokens: int          # prompt tokens after left padding, what the forward passes computed
    duration_s: float           # generate calls only: loading and warm-up are excluded
    cpu_s: float                # CPU time of this process during those calls (all threads)
    load_s: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def tok_per_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_s

    def as_dict(self) -> dict[str, float | int]:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "tok_per_cpu_s": self.tok_per_cpu_s}


def _load(model: str | None, dtype: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # its per-tensor progress bar and a GGUF dtype notice that does not apply to llama files, which
    # transformers dequantizes into a plain dense model in the asked dtype
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    from graft.engine.loader import default_model_path

    path = Path(model or default_model_path())
    torch_dtype = getattr(torch, dtype)
    if path.suffix == ".gguf":
        where, kw = str(path.parent), {"gguf_file": path.name}
    else:
        where, kw = str(path), {}
    tokenizer = AutoTokenizer.from_pretrained(where, **kw)
    lm = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, **kw).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, lm


class HFBaseline:
    """transformers loaded once (on first use) and kept for every pass of a run."""

    def __init__(self, model: str | None, dtype: str):
        self.model, self.dtype = model, dtype
        self._loaded = None
        self.load_s = 0.0

    def generate(self, prompts: Sequence[str], *, batch_size: int = 16, max_new_tokens: int = 64,
                 on_batch: Callable[[int], None] | None = None) -> BaselineResult:
        """Generate `max_new_tokens` for every prompt, `batch_size` at a time; `on_batch(n)` after each batch."""
        import torch

        if batch_size < 1 or max_new_tokens < 1:
            raise ValueError("batch_size and max_new_tokens must be at least 1")
        if self._loaded is None:
            t0 = time.perf_counter()
            self._loaded = _load(self.model, self.dtype)
            self.load_s = time.perf_counter() - t0
        tokenizer, lm = self._loaded
        gen_kw = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                      pad_token_id=tokenizer.pad_token_id)
        with torch.inference_mode():
            # first-call costs (allocator, kernel selection) are not what is being compared
            warm = tokenizer(["Hello there"], return_tensors="pt")
            lm.generate(**warm, **{**gen_kw, "max_new_tokens": 2, "min_new_tokens": 2})
            out_tokens = prompt_tokens = padded = 0
            duration = cpu = 0.0
            for start in range(0, len(prompts), batch_size):
                batch = list(prompts[start:start + batch_size])
                enc = tokenizer(batch, return_tensors="pt", padding=True)
                t1, c1 = time.perf_counter(), time.process_time()
                out = lm.generate(**enc, **gen_kw)
                duration += time.perf_counter() - t1
                cpu += time.process_time() - c1
                new = out[:, enc["input_ids"].shape[1]:]
                out_tokens += new.numel()  # min_new_tokens == max_new_tokens: every row is full length
                prompt_tokens += int(enc["attention_mask"].sum())
                padded += int(enc["input_ids"].numel())
                if on_batch is not None:
                    on_batch(len(batch))
        return BaselineResult(len(prompts), batch_size, out_tokens, prompt_tokens, padded, duration, cpu,
                              self.load_s)
