"""`graft bench [all|throughput|patches|apply]`: run the suites, print tables, write JSON and PNGs."""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from graft.bench import report
from graft.bench.data import resolve_data_dir
from graft.bench.engine import EngineOptions
from graft.engine.patches.base import parse_patch_list

SUITES = ("throughput", "patches", "apply")


def _check(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "concurrency", "max_tokens", "cycles", "rounds", "light_concurrency"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    # a malformed list fails here, not after minutes of benchmarking
    patches = parse_patch_list(args.patches)
    if not patches and args.suite != "throughput":
        raise ValueError(f"the {args.suite} suite needs patches to compare and apply: --patches names none")


def _engine_options(args: argparse.Namespace) -> EngineOptions:
    patches = "" if args.patches == "base" else args.patches
    return EngineOptions(model=args.model, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
                         max_num_seqs=max(16, args.concurrency), max_num_batched_tokens=args.max_num_batched_tokens,
                         patches=patches)


def main(args: argparse.Namespace) -> int:
    """Run the chosen suite(s); 0 when every benchmark request succeeded, 1 otherwise, 2 on bad input."""
    try:
        _check(args)
        data_dir = str(resolve_data_dir(args.data_dir))
    except (ValueError, FileNotFoundError) as exc:
        report.console.print(f"[red]graft bench: {exc}[/]")
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one INFO line per benchmark request
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # transformers' GGUF loader draws a tqdm bar per tensor; tqdm reads this when first imported
    os.environ.setdefault("TQDM_DISABLE", "1")
    out = Path(args.out)
    suites = SUITES if args.suite == "all" else (args.suite,)
    errors = 0
    for suite in suites:
        report.console.rule(f"graft bench {suite}")
        errors += _run(suite, args, data_dir, out)
    report.console.print(f"results in {out}/")
    return 1 if errors else 0


def _run(suite: str, args: argparse.Namespace, data_dir: str, out: Path) -> int:
    """One suite; returns how many benchmark requests failed."""
    if suite == "throughput":
        from graft.bench.throughput import ThroughputConfig, run_throughput
        workloads = ["mixed", "one-task"] if args.workload == "both" else [args.workload]
        result = run_throughput(ThroughputConfig(
            num_prompts=args.num_prompts, concurrency=args.concurrency, max_tokens=args.max_tokens,
            workloads=workloads, task=args.task, data_dir=data_dir, baseline=not args.no_baseline,
            engine=_engine_options(args)), out)
        return sum(w["engine"].errors for w in result["workloads"].values())
    from graft.bench.patches import PatchesConfig, run_apply, run_patches
    cfg = PatchesConfig(num_prompts=args.num_prompts, concurrency=args.concurrency, max_tokens=args.max_tokens,
                        rounds=args.rounds, cycles=args.cycles, light_concurrency=args.light_concurrency,
                        patch_set=args.patches if args.patches != "base" else "", data_dir=data_dir,
                        engine=_engine_options(args))
    if suite == "patches":
        result = run_patches(cfg, out)
        return result["plain"]["errors"] + result["patched"]["errors"]
    result = run_apply(cfg, out)
    return result["background_load"].errors
