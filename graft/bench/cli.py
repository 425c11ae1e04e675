"""`graft bench [all|throughput|patches|apply|kernels|workload|shadow|operator]`: run the suites, print tables, write JSON and PNGs."""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from graft.bench import report
from graft.bench.args import MAX_LOAD
from graft.bench.data import require_workload_data, resolve_data_dir
from graft.bench.llama_server import BaselineUnavailable
from graft.bench.method import MachineBusy, check_load
from graft.engine.config import config_from_args, engine_argv
from graft.engine.patches.base import parse_patch_list

SUITES = ("throughput", "patches", "apply")    # what `all` runs; `kernels` and `workload` (many minutes) by name
EXIT_BAD_INPUT, EXIT_BUSY = 2, 3


def _check(args: argparse.Namespace) -> None:
    if args.suite == "operator":
        operator_config(args).check()
        return
    for name in ("num_prompts", "concurrency", "max_tokens", "cycles", "rounds", "light_concurrency", "sweep_waves"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    # a malformed list fails here, not after minutes of benchmarking
    patches = parse_patch_list(args.patches)
    if not patches and args.suite in ("patches", "apply", "shadow"):
        raise ValueError(f"the {args.suite} suite needs patches to compare and apply: --patches names none")
    parse_patch_list(args.baseline_patches)
    if (args.baseline_engine_args or args.baseline_patches) and args.baseline != "engine":
        raise ValueError("--baseline-engine-args and --baseline-patches are for --baseline engine")


def engine_flags(args: argparse.Namespace, concurrency: int | None = None) -> list[str]:
    """The engine's `graft serve` flags: the ones given (none: the out-of-the-box engine), with room
    for every request in flight (`concurrency`, default -c)."""
    flags = engine_argv(args)
    concurrency = args.concurrency if concurrency is None else concurrency
    if concurrency > args.max_num_seqs:
        flags += ["--max-num-seqs", str(concurrency),
                  "--max-num-batched-tokens", str(max(concurrency, args.max_num_batched_tokens))]
    return flags


def main(args: argparse.Namespace) -> int:
    """Run the chosen suite(s): 0 when every benchmark request succeeded, 1 otherwise, 2 on bad
    input, 3 when the machine is too busy (see --allow-load)."""
    try:
        _check(args)
        config = config_from_args(args)     # also resolves --dtype auto, for the baseline to match
        data_dir = None if args.suite in ("kernels", "operator") else str(resolve_data_dir(args.data_dir))
        if args.suite == "workload":
            require_workload_data(data_dir)
    except (ValueError, FileNotFoundError) as exc:
        report.console.print(f"[red]graft bench: {exc}[/]")
        return EXIT_BAD_INPUT
    try:
        load = check_load(MAX_LOAD, args.allow_load)
    except MachineBusy as exc:
        report.console.print(f"[red]graft bench: {exc}[/]")
        return EXIT_BUSY
    report.console.log(f"1-minute load average {load:.2f}")
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
        try:
            errors += _run(suite, args, config.dtype, data_dir, out)
        except BaselineUnavailable as exc:
            report.console.print(f"[red]graft bench: {exc}[/]")
            return EXIT_BAD_INPUT
    report.console.print(f"results in {out}/")
    return 1 if errors else 0


def _run(suite: str, args: argparse.Namespace, dtype: str, data_dir: str | None, out: Path) -> int:
    """One suite; returns how many benchmark requests (or kernel cases) failed."""
    if suite == "operator":
        return _run_operator(args, out)
    if suite == "kernels":
        from graft.bench.kernels import run_kernels
        return run_kernels(out / "kernels.json", quick=args.quick, budget_s=args.budget_s)
    if suite == "workload":
        from graft.bench.workload import WorkloadConfig, run_workload_suite
        result = run_workload_suite(WorkloadConfig(
            class_prompts=args.class_prompts, class_concurrency=args.class_concurrency, sweep=args.sweep,
            sweep_waves=args.sweep_waves, max_tokens=args.max_tokens, rounds=args.rounds, data_dir=data_dir,
            engine_args=engine_flags(args, max(sum(args.class_concurrency.values()), *args.sweep)), dtype=dtype), out)
        return result["errors"]
    if suite == "shadow":
        from graft.bench.shadow import ShadowBenchConfig, run_shadow
        result = run_shadow(ShadowBenchConfig(
            num_prompts=args.num_prompts, concurrency=args.concurrency, max_tokens=args.max_tokens,
            rounds=args.rounds, patch_set=args.patches, data_dir=data_dir, engine_args=engine_argv(args),
            dtype=dtype), out)
        return result["on"]["errors"] + result["off"]["errors"]
    if suite == "throughput":
        from graft.bench.throughput import ThroughputConfig, run_throughput
        workloads = ["mixed", "one-task"] if args.workload == "both" else [args.workload]
        result = run_throughput(ThroughputConfig(
            num_prompts=args.num_prompts, concurrency=args.concurrency, max_tokens=args.max_tokens,
            workloads=workloads, task=args.task, data_dir=data_dir, rounds=args.rounds, baseline=args.baseline,
            engine_args=engine_flags(args), baseline_engine_args=args.baseline_engine_args,
            baseline_patches=args.baseline_patches, model=args.model,
            dtype=dtype, llama_slots=args.llama_slots, llama_ubatch=args.llama_ubatch), out)
        return sum(p["errors"] for w in result["workloads"].values() for p in w["passes"])
    from graft.bench.patches import PatchesConfig, run_apply, run_patches
    cfg = PatchesConfig(num_prompts=args.num_prompts, concurrency=args.concurrency, max_tokens=args.max_tokens,
                        rounds=args.rounds, cycles=args.cycles, light_concurrency=args.light_concurrency,
                        patch_set=args.patches, data_dir=data_dir, engine_args=engine_flags(args), dtype=dtype)
    if suite == "patches":
        result = run_patches(cfg, out)
        return result["plain"]["errors"] + result["patched"]["errors"]
    result = run_apply(cfg, out)
    return result["background_load"].errors


def operator_config(args: argparse.Namespace):
    """The operator suite's configuration from its flags."""
    from graft.bench.operator import OperatorBenchConfig
    env = {}
    for item in args.operator_env:
        name, eq, value = item.partition("=")
        if not eq or not name.startswith("GRAFT_"):
            raise ValueError(f"--operator-env {item!r}: expected GRAFT_NAME=VALUE")
        env[name] = value
    return OperatorBenchConfig(
        fleet_sizes=args.fleet_sizes, rollouts=args.concurrent_rollouts, rollout_fleet_size=args.rollout_fleet_size,
        tick=args.tick, ticks=args.ticks, latency=args.standin_latency, failure_rate=args.standin_failure_rate,
        operator_source=args.operator_source, operator_env=env)


def _run_operator(args: argparse.Namespace, out: Path) -> int:
    """The operator suite (no engine, no data): 0 when every case ran."""
    from graft.bench.operator import run_operator_bench
    run_operator_bench(operator_config(args), out)
    return 0
