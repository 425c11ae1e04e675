"""Suite `shadow`: what the shadow comparison costs the requests of a patched engine.

Two sides, alternated (A/B/A/B), each on a fresh `graft serve` process with the flags given (none:
the engine as it comes) and the patch set hot-applied through the admin API, so that the engine has
a previous table to compare against: `off` runs with `--shadow-rate 0`, `on` with the shadowing
defaults. The same long BBH prompts go to both, in a stream long enough for the comparisons to
run many times per pass. Reported per side: output tokens/s, TTFT and TPOT p99, and for `on` what
the engine says it did (requests compared and divergent, step-loop seconds spent).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from graft.bench import report
from graft.bench.args import PATCH_SET
from graft.bench.loadgen import LoadGenerator, LoadReport, Request
from graft.bench.method import alternation, load_average, ratio_spread
from graft.bench.patches import WARMUP, TimedAdmin, _apply_set, _merge, long_prompts
from graft.engine.launcher import EngineProcess, launch_engine
from graft.engine.patches.base import parse_patch_list

SIDES = ("off", "on")


@dataclass(slots=True)
class ShadowBenchConfig:
    num_prompts: int = 48
    concurrency: int = 16
    max_tokens: int = 64
    rounds: int = 2
    patch_set: str = PATCH_SET
    data_dir: str | None = None
    engine_args: list[str] = field(default_factory=list)
    dtype: str = "bfloat16"


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def _shadow_counts(engine: EngineProcess) -> dict[str, float]:
    text = httpx.get(engine.metrics_url + "/metrics", timeout=10).text
    return {result: _metric(text, "graft_shadow_requests_total", result=result)
            for result in ("agree", "divergent", "error")} | {
        "seconds": _metric(text, "graft_shadow_seconds_total"),
        "positions": _metric(text, "graft_shadow_positions_total")}


async def _pass(engine: EngineProcess, cfg: ShadowBenchConfig, requests: list[Request], label: str) -> LoadReport:
    async with LoadGenerator(engine.url) as gen, TimedAdmin(engine) as admin:
        await gen.run([WARMUP], 1)
        applied, refused = await _apply_set(admin, parse_patch_list(cfg.patch_set))
        if not applied:
            raise RuntimeError(f"no patch of {cfg.patch_set} applied: {refused}")
        with report.progress_bar(label, len(requests)) as advance:
            return await gen.run(requests, cfg.concurrency, on_result=lambda _: advance(1))


def run_shadow(cfg: ShadowBenchConfig, out: Path) -> dict[str, Any]:
    """Shadowing off against on, alternated, a fresh engine per pass; JSON and a plot under `out`."""
    machine = report.machine_info()
    prompts = long_prompts(min(cfg.num_prompts, 64), cfg.data_dir)
    requests = [Request(prompts[i % len(prompts)].text, cfg.max_tokens) for i in range(cfg.num_prompts)]
    passes: dict[str, list[LoadReport]] = {s: [] for s in SIDES}
    cpu: dict[str, list[float]] = {s: [] for s in SIDES}
    loads: dict[str, list[tuple[float, float]]] = {s: [] for s in SIDES}
    shadow: list[dict[str, float]] = []
    for r, side in alternation(cfg.rounds, SIDES):
        flags = [*cfg.engine_args, "--max-num-seqs", str(max(16, cfg.concurrency))]
        if side == "off":
            flags += ["--shadow-rate", "0"]
        with report.status(f"starting graft serve (shadowing {side})"):
            engine = launch_engine(flags, env={"GRAFT_PATCHES": ""})
        try:
            load0, cpu0 = load_average(), engine.cpu_seconds()
            passes[side].append(asyncio.run(_pass(engine, cfg, requests, f"shadowing {side}, round {r + 1}")))
            cpu1 = engine.cpu_seconds()
            loads[side].append((load0, load_average()))
            if cpu0 is not None and cpu1 is not None:
                cpu[side].append(cpu1 - cpu0)
            if side == "on":
                shadow.append(_shadow_counts(engine))
        finally:
            engine.stop()
    off, on = _merge(passes["off"], cpu["off"]), _merge(passes["on"], cpu["on"])
    spread = ratio_spread([s.output_tok_s for s in on["passes"]], [s.output_tok_s for s in off["passes"]])
    result = {"suite": "shadow", "command": report.command_line(), "machine": machine,
              "config": {"num_prompts": cfg.num_prompts, "concurrency": cfg.concurrency,
                         "max_tokens": cfg.max_tokens, "rounds": cfg.rounds, "dtype": cfg.dtype,
                         "patch_set": cfg.patch_set, "engine_args": cfg.engine_args},
              "off": off, "on": on, "throughput_ratio": spread.as_dict(),
              "ttft_p99_ratio": on["ttft_p99"] / off["ttft_p99"], "tpot_p99_ratio": on["tpot_p99"] / off["tpot_p99"],
              "shadow": shadow, "load_before_after": loads}
    result["machine"]["load_average_end"] = report.load_average()
    show_shadow(result)
    report.plot_cdf(out / "shadow-ttft-cdf.png", {"shadowing off": off["ttft"], "shadowing on": on["ttft"]},
                    xlabel="time to first token (s)",
                    title=f"long BBH prompts, concurrency {cfg.concurrency}, {cfg.max_tokens} new tokens, "
                          f"{cfg.dtype}: shadow comparison off vs on")
    report.write_json(out / "shadow.json", result)
    return result


def show_shadow(result: dict[str, Any]) -> None:
    rows = {f"shadowing {side} pass {i + 1}": s for side in SIDES for i, s in enumerate(result[side]["passes"])}
    report.show(report.summary_table("shadow comparison: its cost to clients", rows, ratio_to="shadowing off pass 1"))
    compared = [s["agree"] + s["divergent"] for s in result["shadow"]]
    t = result["throughput_ratio"]
    report.show(report.kv_table("shadowing on against off", [
        ("throughput ratio (per round)", f"median {t['median']:.3f}x, min {t['min']:.3f}, max {t['max']:.3f}"),
        ("TTFT p99 ratio", f"{result['ttft_p99_ratio']:.2f}x"),
        ("TPOT p99 ratio", f"{result['tpot_p99_ratio']:.2f}x"),
        ("requests compared per pass", ", ".join(f"{c:.0f}" for c in compared) or "-"),
        ("divergent", ", ".join(f"{s['divergent']:.0f}" for s in result["shadow"]) or "-"),
        ("step-loop seconds on shadow work", ", ".join(f"{s['seconds']:.1f}" for s in result["shadow"]) or "-")]))
