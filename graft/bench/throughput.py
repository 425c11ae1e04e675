"""Suite `throughput`: the engine against a baseline on BBH chain-of-thought prompts.

Each pass sends N prompts at concurrency C with greedy decoding and exactly M new tokens each.
An engine pass starts a fresh `graft serve` with this run's engine flags (none given: the
out-of-the-box engine), warms it up with one short request, measures, and stops it. The baseline
is one of:

- `transformers`: `generate` on the same model file and dtype, batches of C, in this process;
- `llama-server`: llama.cpp's server on the same GGUF (when it is built or on PATH), at the
  setting (parallel slots, micro-batch) a short sweep before the rounds found fastest;
- `engine`: a second `graft serve` with `--baseline-engine-args` on top (prefix caching off, the
  plain 3.2.0 paths, another token budget, ...).

Passes alternate engine, baseline, engine, baseline, ... for `--rounds` rounds (see
graft/bench/method.py); the report gives the median per-round ratio with its min and max, and
the 1-minute load average before and after every pass.

Workloads: `mixed` takes prompts round-robin over all BBH tasks (no shared prefix); `one-task`
takes N examples of one task, which share the task's 3-shot prefix (the engine's prefix cache
reuses it; transformers recomputes it for every prompt).
"""
from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graft.bench import report, roofline
from graft.bench.args import ONE_TASK
from graft.bench.data import Prompt, bbh_prompts, mixed_bbh_prompts
from graft.bench.loadgen import LoadGenerator, LoadReport, Request
from graft.bench.method import alternation, load_average, ratio_spread
from graft.engine.launcher import launch_engine
from graft.engine.loader import load_config

WARMUP = Request("The capital of France is", max_tokens=4)


@dataclass(slots=True)
class ThroughputConfig:
    num_prompts: int = 16
    concurrency: int = 16
    max_tokens: int = 64
    workloads: list[str] = field(default_factory=lambda: ["mixed", "one-task"])
    task: str = ONE_TASK
    data_dir: str | None = None
    rounds: int = 1
    baseline: str = "transformers"              # transformers | llama-server | engine | none
    engine_args: list[str] = field(default_factory=list)           # `graft serve` flags of the engine
    baseline_engine_args: list[str] = field(default_factory=list)  # added for --baseline engine
    baseline_patches: str = ""                                      # its GRAFT_PATCHES
    model: str | None = None
    dtype: str = "bfloat16"                     # the engine's resolved dtype: transformers runs in it too
    llama_slots: list[int] = field(default_factory=lambda: [4, 16])     # the llama-server sweep:
    llama_ubatch: list[int] = field(default_factory=lambda: [512])      # -np x -ub, best one measured


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
class Pass:
    """One measured pass of one side."""

    side: str
    round: int
    output_tok_s: float
    errors: int
    load_before: float
    load_after: float
    cpu_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)   # per request, as the server counted them


# ---- the sides ----

async def _serve_pass(url: str, prompts: list[str], cfg: ThroughputConfig, label: str,
                      cpu: Callable[[], float | None] = lambda: None) -> tuple[LoadReport, float | None]:
    """Warm an OpenAI server up with one short request, then send every prompt at the concurrency."""
    async with LoadGenerator(url) as gen:
        warm = await gen.run([WARMUP], 1)
        if warm.errors:
            raise RuntimeError(f"{label}: the warm-up request failed: {warm.errors[0].error}")
        cpu0 = cpu()
        with report.progress_bar(label, len(prompts)) as advance:
            rep = await gen.run([Request(p, cfg.max_tokens) for p in prompts], cfg.concurrency,
                                on_result=lambda _: advance(1))
        cpu1 = cpu()
    return rep, None if cpu0 is None or cpu1 is None else cpu1 - cpu0


def _from_report(side: str, r: int, rep: LoadReport, cpu_s: float | None, load: float) -> Pass:
    s = rep.summary()
    return Pass(side, r, s.output_tok_s, s.errors, load, load_average(), cpu_s, s.as_dict(), rep.ttfts(),
                [r.prompt_tokens for r in rep.ok if r.prompt_tokens])


def engine_pass(args: list[str], side: str, r: int, prompts: list[str], cfg: ThroughputConfig, label: str,
                patches: str = "") -> Pass:
    """A fresh `graft serve` with `args` and GRAFT_PATCHES=`patches`, measured and stopped."""
    with report.status(f"starting graft serve {' '.join(args) or '(no flags)'}"
                       + (f", GRAFT_PATCHES={patches}" if patches else "")):
        eng = launch_engine(args, env={"GRAFT_PATCHES": patches})
    try:
        load = load_average()
        rep, cpu_s = asyncio.run(_serve_pass(eng.url, prompts, cfg, label, eng.cpu_seconds))
    finally:
        eng.stop()
    return _from_report(side, r, rep, cpu_s, load)


def llama_server_pass(r: int, prompts: list[str], cfg: ThroughputConfig, label: str, setting) -> Pass:
    from graft.bench.llama_server import LlamaServer
    with report.status(f"starting llama-server {setting}"), LlamaServer(cfg.model, setting) as srv:
        load = load_average()
        rep, _ = asyncio.run(_serve_pass(srv.url, prompts, cfg, label))
    return _from_report("baseline", r, rep, None, load)


def llama_server_sweep(prompts: list[str], cfg: ThroughputConfig, kind: str) -> dict[str, Any]:
    """Serve the workload once at every setting of the sweep; the fastest is the one the rounds use.
    With a single setting there is nothing to choose and nothing is run here."""
    from graft.bench.llama_server import LlamaSetting
    settings = [LlamaSetting(n, ub) for n in cfg.llama_slots for ub in cfg.llama_ubatch]
    if len(settings) == 1:
        return {"chosen": settings[0], "passes": []}
    passes = [(s, llama_server_pass(-1, prompts, cfg, f"llama-server {s}, {kind} sweep", s)) for s in settings]
    best = max(passes, key=lambda sp: sp[1].output_tok_s)[0]
    report.console.print(f"llama-server sweep ({kind}): " + ", ".join(
        f"{s}: {p.output_tok_s:.1f} tok/s" for s, p in passes) + f"; measuring with {best}")
    return {"chosen": best, "passes": [{"setting": str(s), "slots": s.slots, "ubatch": s.ubatch,
                                        "output_tok_s": p.output_tok_s, "errors": p.errors,
                                        "load_before": p.load_before} for s, p in passes]}


class Sides:
    """Runs one pass of either side; holds what lives across passes (the loaded transformers model)."""

    def __init__(self, cfg: ThroughputConfig):
        self.cfg = cfg
        self._hf = None
        self.llama_setting = None           # chosen by the workload's sweep
        self.model_config = None            # the model's shape and this machine's rates: the roofline
        self.rates: dict[str, float] | None = None
        if cfg.baseline == "llama-server":
            from graft.bench.llama_server import gguf_file, llama_server_binary
            llama_server_binary(), gguf_file(cfg.model)   # refuse before any pass runs

    def run(self, side: str, r: int, prompts: list[str], label: str) -> Pass:
        cfg = self.cfg
        if side == "engine":
            return engine_pass(cfg.engine_args, side, r, prompts, cfg, label)
        if cfg.baseline == "engine":
            return engine_pass([*cfg.engine_args, *cfg.baseline_engine_args], side, r, prompts, cfg, label,
                               cfg.baseline_patches)
        if cfg.baseline == "llama-server":
            return llama_server_pass(r, prompts, cfg, label, self.llama_setting)
        if cfg.baseline == "transformers":
            return self._transformers(r, prompts, label)
        raise ValueError(f"unknown baseline {cfg.baseline!r}")

    def _transformers(self, r: int, prompts: list[str], label: str) -> Pass:
        from graft.bench.baseline import HFBaseline
        if self._hf is None:
            self._hf = HFBaseline(self.cfg.model, self.cfg.dtype)
        load = load_average()
        with report.progress_bar(label, len(prompts)) as advance:
            hf = self._hf.generate(prompts, batch_size=self.cfg.concurrency, max_new_tokens=self.cfg.max_tokens,
                                   on_batch=advance)
        return Pass("baseline", r, hf.output_tok_s, 0, load, load_average(), hf.cpu_s, hf.as_dict())


# ---- the suite ----

def run_workload(kind: str, prompts: list[Prompt], cfg: ThroughputConfig, sides: Sides) -> dict[str, Any]:
    """Every pass of one workload, alternating sides round by round."""
    texts = [p.text for p in prompts]
    order = ("engine", "baseline") if cfg.baseline != "none" else ("engine",)
    entry: dict[str, Any] = {"tasks": sorted({p.task for p in prompts})}
    if cfg.baseline == "llama-server":
        sweep = llama_server_sweep(texts, cfg, kind)
        sides.llama_setting = sweep["chosen"]
        entry["llama_server"] = {"setting": str(sweep["chosen"]), "sweep": sweep["passes"]}
    passes = [sides.run(side, r, texts, f"{side} {kind}, round {r + 1}/{cfg.rounds}")
              for r, side in alternation(cfg.rounds, order)]
    entry["passes"] = passes
    engine = [p.output_tok_s for p in passes if p.side == "engine"]
    entry["engine_tok_s"] = engine
    counted = next((p.prompt_tokens for p in passes if p.side == "engine" and len(p.prompt_tokens) == len(texts)), None)
    if getattr(sides, "rates", None) is not None and counted:
        bound = roofline.bound(sides.model_config, counted, cfg.max_tokens, sides.rates)
        entry["roofline"] = {**bound, "engine_share": statistics.median(engine) / bound["output_tok_s"]}
    if cfg.baseline != "none":
        base = [p.output_tok_s for p in passes if p.side == "baseline"]
        entry["baseline_tok_s"] = base
        entry["ratio"] = ratio_spread(engine, base)
    return entry


def run_throughput(cfg: ThroughputConfig, out: Path) -> dict[str, Any]:
    """Run every workload; write JSON and plots under `out`."""
    import torch

    sides = Sides(cfg)
    with report.status("measuring this machine's matmul and copy rates for the roofline"):
        sides.model_config = load_config(cfg.model)
        sides.rates = roofline.measure(sides.model_config, getattr(torch, cfg.dtype))
    result: dict[str, Any] = {
        "suite": "throughput", "command": report.command_line(), "machine": report.machine_info(),
        "config": {"num_prompts": cfg.num_prompts, "concurrency": cfg.concurrency, "max_tokens": cfg.max_tokens,
                   "rounds": cfg.rounds, "dtype": cfg.dtype, "task": cfg.task, "baseline": cfg.baseline,
                   "engine_args": cfg.engine_args, "baseline_engine_args": cfg.baseline_engine_args,
                   "baseline_patches": cfg.baseline_patches,
                   **({"llama_slots": cfg.llama_slots, "llama_ubatch": cfg.llama_ubatch}
                      if cfg.baseline == "llama-server" else {})},
        "workloads": {}}
    for kind in cfg.workloads:
        prompts = workload_prompts(kind, cfg.num_prompts, cfg.data_dir, cfg.task)
        result["workloads"][kind] = run_workload(kind, prompts, cfg, sides)
    result["machine"]["load_average_end"] = report.load_average()
    data = report.plain(result)
    show_throughput(data)
    plot_throughput(data, out)
    report.write_json(out / "throughput.json", data)
    return data


def baseline_name(config: dict[str, Any], entry: dict[str, Any] | None = None) -> str:
    if config["baseline"] == "llama-server" and entry and "llama_server" in entry:
        return f"llama-server {entry['llama_server']['setting']}"
    if config["baseline"] == "engine":
        patches = config.get("baseline_patches")
        return " ".join(["engine", *config["baseline_engine_args"], *([f"+{patches}"] if patches else [])])
    return {"transformers": "transformers generate"}.get(config["baseline"], config["baseline"])


def show_throughput(result: dict[str, Any]) -> None:
    cfg = result["config"]
    for kind, entry in result["workloads"].items():
        from rich.table import Table
        t = Table(title=f"throughput, {kind} workload ({cfg['dtype']}, engine flags: "
                        f"{' '.join(cfg['engine_args']) or 'none'})", title_justify="left")
        for col in ("pass", "side", "tok/s", "errors", "load before", "load after"):
            t.add_column(col, justify="left" if col in ("pass", "side") else "right")
        for i, p in enumerate(entry["passes"]):
            side = "engine" if p["side"] == "engine" else baseline_name(cfg, entry)
            t.add_row(str(i + 1), side, f"{p['output_tok_s']:.1f}", str(p["errors"]), f"{p['load_before']:.2f}",
                      f"{p['load_after']:.2f}")
        report.show(t)
        if "roofline" in entry:
            roof = entry["roofline"]
            report.console.print(
                f"roofline: {roof['output_tok_s']:.0f} output tok/s ({roof['prefill_tflop']:.2f} TFLOP of prefill "
                f"at {roof['gemm_gflops']:.0f} GFLOPS = {roof['prefill_s']:.2f} s, decode steps at "
                f"{roof['copy_gbps']:.0f} GB/s or that rate = {roof['decode_s']:.2f} s); the engine's median pass: "
                f"[bold]{100 * roof['engine_share']:.0f}%[/] of it")
        if "ratio" in entry:
            ratio = entry["ratio"]
            report.console.print(f"engine / {baseline_name(cfg, entry)}: median [bold]{ratio['median']:.2f}x[/] "
                                 f"(min {ratio['min']:.2f}, max {ratio['max']:.2f}, {len(ratio['per_round'])} rounds)")


def plot_throughput(result: dict[str, Any], out: Path) -> None:
    cfg = result["config"]
    for kind, entry in result["workloads"].items():
        report.plot_passes(out / f"throughput-{kind}.png", entry["passes"], entry.get("ratio"),
                           names={"engine": "graft engine", "baseline": baseline_name(cfg, entry)},
                           title=f"BBH CoT {kind}: {cfg['num_prompts']} prompts, concurrency {cfg['concurrency']}, "
                                 f"{cfg['max_tokens']} new tokens, {cfg['dtype']}",
                           roofline=entry.get("roofline", {}).get("output_tok_s"))
    report.plot_cdf(out / "throughput-ttft-cdf.png",
                    {f"engine {k}": [x for p in e["passes"] if p["side"] == "engine" for x in p["ttft"]]
                     for k, e in result["workloads"].items()},
                    xlabel="time to first token (s)", title="engine TTFT, all requests start together")
