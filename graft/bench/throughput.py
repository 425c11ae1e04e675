"""Suite `throughput`: the engine against Hugging Face transformers on BBH chain-of-thought prompts.

For each workload the engine runs in a fresh `graft serve` process (production configuration: the
3.2.1 patches applied through GRAFT_PATCHES), takes N prompts at concurrency C with greedy
decoding and exactly M new tokens each, and is stopped; then transformers generates the same
prompts in batches of C, with the same dtype, in this process. Both run one after the other, never
at the same time, and the ratio is taken within the run, so a slower or busier machine moves both.

Workloads: `mixed` takes prompts round-robin over all BBH tasks (no shared prefix); `one-task`
takes N examples of one task, which share the task's 3-shot prefix (the engine's prefix cache
reuses it; transformers recomputes it for every prompt).
"""
from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graft.bench import report
from graft.bench.args import ONE_TASK
from graft.bench.baseline import hf_generate
from graft.bench.data import Prompt, bbh_prompts, mixed_bbh_prompts
from graft.bench.engine import EngineOptions, EngineServer
from graft.bench.loadgen import LoadGenerator, LoadReport, Request

WARMUP = Request("The capital of France is", max_tokens=4)
REFUSED = re.compile(r"GRAFT_PATCHES: cannot apply (\S+?): (.*)")


@dataclass(slots=True)
class ThroughputConfig:
    num_prompts: int = 16
    concurrency: int = 16
    max_tokens: int = 64
    workloads: list[str] = field(default_factory=lambda: ["mixed", "one-task"])
    task: str = ONE_TASK
    data_dir: str | None = None
    baseline: bool = True
    engine: EngineOptions = field(default_factory=EngineOptions)


def workload_prompts(kind: str, n: int, data_dir: str | None, task: str) -> list[Prompt]:
    """The N prompts of a workload: `mixed` (all tasks, round-robin) or `one-task` (N examples of `task`)."""
    if kind == "mixed":
        return mixed_bbh_prompts(n, data_dir)
    if kind == "one-task":
        prompts = bbh_prompts(data_dir, tasks=[task], per_task=n)
        if len(prompts) < n:
            raise ValueError(f"task {task} has only {len(prompts)} examples, fewer than -n {n}")
        return prompts
    raise ValueError(f"unknown workload {kind!r}: mixed or one-task")


@dataclass(slots=True)
class EngineRun:
    report: LoadReport
    cpu_s: float | None        # CPU time the engine process spent on the measured requests
    load_before: float         # 1-minute load average when the run started (noise indicator)


async def measure_engine(server: EngineServer, prompts: list[str], concurrency: int, max_tokens: int,
                         label: str) -> EngineRun:
    """Warm the engine up with one short request, then send every prompt at `concurrency`."""
    async with LoadGenerator(server.url) as gen:
        warm = await gen.run([WARMUP], 1)
        if warm.errors:
            raise RuntimeError(f"the engine failed its warm-up request: {warm.errors[0].error}")
        load, cpu0 = os.getloadavg()[0], server.cpu_seconds()
        with report.progress_bar(label, len(prompts)) as advance:
            rep = await gen.run([Request(p, max_tokens) for p in prompts], concurrency,
                                on_result=lambda _: advance(1))
        cpu1 = server.cpu_seconds()
    return EngineRun(rep, None if cpu0 is None or cpu1 is None else cpu1 - cpu0, load)


def start_patched(opts: EngineOptions, refused: dict[str, str]) -> EngineServer:
    """Start the engine with GRAFT_PATCHES; a patch it refuses at start-up is dropped (and recorded
    in `refused`) and the engine started again without it, so the run measures what really serves."""
    while True:
        try:
            with report.status(f"starting graft serve ({opts.dtype}, patches: {opts.patches or 'none'})"):
                return EngineServer(opts).start()
        except RuntimeError as exc:
            found = REFUSED.search(str(exc))
            if not found:
                raise
        patch, why = found.group(1), found.group(2).strip()
        refused[patch] = why
        report.console.log(f"[yellow]the engine refused {patch}, measuring without it[/]: {why}")
        opts.patches = ",".join(p for p in opts.patches.split(",") if p.strip() != patch)


def run_engine(cfg: ThroughputConfig, prompts: list[str], label: str, refused: dict[str, str]) -> EngineRun:
    """A fresh engine for one workload, so nothing cached by an earlier workload helps it."""
    opts = cfg.engine
    opts.max_num_seqs = max(opts.max_num_seqs, cfg.concurrency)
    server = start_patched(opts, refused)
    try:
        return asyncio.run(measure_engine(server, prompts, cfg.concurrency, cfg.max_tokens, label))
    finally:
        server.stop()


def _entry(run: EngineRun, prompts: list[Prompt], cfg: ThroughputConfig, label: str) -> dict[str, Any]:
    s = run.report.summary()
    entry: dict[str, Any] = {"engine": s, "engine_cpu_s": run.cpu_s, "engine_load_before": run.load_before,
                             "engine_ttft": run.report.ttfts(), "engine_latency": run.report.latencies(),
                             "tasks": sorted({p.task for p in prompts})}
    if run.cpu_s:
        entry["engine_tok_per_cpu_s"] = s.output_tokens / run.cpu_s
    if cfg.baseline:
        with report.progress_bar(label, len(prompts)) as advance:
            hf = hf_generate([p.text for p in prompts], model=cfg.engine.model, dtype=cfg.engine.dtype,
                             batch_size=cfg.concurrency, max_new_tokens=cfg.max_tokens, on_batch=advance)
        entry["transformers"] = hf.as_dict()
        entry["ratio"] = s.output_tok_s / hf.output_tok_s
        if run.cpu_s:
            entry["cpu_ratio"] = entry["engine_tok_per_cpu_s"] / hf.tok_per_cpu_s
    return entry


def run_throughput(cfg: ThroughputConfig, out: Path) -> dict[str, Any]:
    """Run every workload on the engine, then on transformers; write JSON and plots under `out`."""
    requested = cfg.engine.patches
    refused: dict[str, str] = {}
    result: dict[str, Any] = {"suite": "throughput", "command": report.command_line(),
                              "machine": report.machine_info(),
                              "config": {"num_prompts": cfg.num_prompts, "concurrency": cfg.concurrency,
                                         "max_tokens": cfg.max_tokens, "dtype": cfg.engine.dtype,
                                         "task": cfg.task},
                              "workloads": {}}
    prompts = {kind: workload_prompts(kind, cfg.num_prompts, cfg.data_dir, cfg.task) for kind in cfg.workloads}
    runs = {kind: run_engine(cfg, [p.text for p in ps], f"engine {kind}", refused) for kind, ps in prompts.items()}
    result["config"] |= {"patches_requested": requested or "base", "patches": cfg.engine.patches or "base",
                         "patches_refused": refused, "engine_args": cfg.engine.argv()}
    for kind, run in runs.items():
        result["workloads"][kind] = _entry(run, prompts[kind], cfg, f"transformers {kind}")
    result["machine"]["load_average_end"] = report.load_average()
    show_throughput(result)
    plot_throughput(result, out)
    report.write_json(out / "throughput.json", result)
    return result


def show_throughput(result: dict[str, Any]) -> None:
    for patch, why in result["config"]["patches_refused"].items():
        report.console.print(f"[yellow]measured without {patch}, which the engine refused[/]: {why}")
    for kind, entry in result["workloads"].items():
        rows = {"engine": entry["engine"]}
        report.show(report.summary_table(f"throughput, {kind} workload ({result['config']['dtype']})", rows))
        if "transformers" in entry:
            hf = entry["transformers"]
            rows = [("batch", str(hf["batch_size"])), ("output tokens", str(hf["output_tokens"])),
                    ("generate time s", f"{hf['duration_s']:.1f}"), ("tok/s", f"{hf['output_tok_s']:.1f}"),
                    ("engine / transformers, tok/s", f"{entry['ratio']:.2f}x")]
            if "cpu_ratio" in entry:
                rows.append(("engine / transformers, tok per CPU-s", f"{entry['cpu_ratio']:.2f}x"))
            report.show(report.kv_table(f"transformers generate, {kind}", rows))


def plot_throughput(result: dict[str, Any], out: Path) -> None:
    cfg = result["config"]
    for kind, entry in result["workloads"].items():
        if "transformers" in entry:
            report.plot_throughput(
                out / f"throughput-{kind}.png",
                {"transformers generate": entry["transformers"]["output_tok_s"],
                 "graft engine": entry["engine"].output_tok_s},
                baseline="transformers generate",
                title=f"BBH CoT {kind}: {cfg['num_prompts']} prompts, concurrency {cfg['concurrency']}, "
                      f"{cfg['max_tokens']} new tokens, {cfg['dtype']}")
    report.plot_cdf(out / "throughput-ttft-cdf.png",
                    {f"engine {k}": e["engine_ttft"] for k, e in result["workloads"].items()},
                    xlabel="time to first token (s)", title="engine TTFT, all requests start together")
