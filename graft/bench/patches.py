"""Suites `patches` and `apply`: what the 3.2.1 hot patches buy, and what applying one costs.

`patches`: one engine process, the same long BBH prompts sent twice (or `rounds` times each,
alternating): on the plain 3.2.0 paths, then with the 3.2.1 set hot-applied through the admin
API. Prefix caching is off so the second pass cannot reuse the first pass's KV blocks.

`apply`: one engine process under a light background load; every 3.2.1 patch is applied and
reverted `cycles` times. Reported: the engine's own `applyMs` (the swap between two steps) and the
client's round trip of the admin call (which also waits for the step in flight to end and runs the
patch's self-check probe).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graft.bench import report
from graft.bench.args import PATCH_SET
from graft.bench.data import Prompt, bbh_prompts
from graft.bench.loadgen import LoadGenerator, LoadReport, Request, percentile
from graft.bench.method import alternation, load_average, ratio_spread
from graft.engine.launcher import EngineProcess, launch_engine
from graft.engine.patches.base import parse_patch_list
from graft.adminapi import AdminCall, AdminClient, AdminError, ApplyRequest

WARMUP = Request("The capital of France is", max_tokens=4)
LIGHT_TASK = "sports_understanding"   # the shortest BBH prompts (~240 tokens): steps stay short


@dataclass(slots=True)
class PatchesConfig:
    num_prompts: int = 16
    concurrency: int = 16
    max_tokens: int = 64
    rounds: int = 1
    cycles: int = 200
    light_concurrency: int = 2
    patch_set: str = PATCH_SET
    data_dir: str | None = None
    engine_args: list[str] = field(default_factory=list)   # `graft serve` flags; `--paths plain` is added
    dtype: str = "bfloat16"                                 # the engine's resolved dtype, for the report

    @property
    def patch_list(self) -> list[tuple[str, str]]:
        return parse_patch_list(self.patch_set)


def long_prompts(n: int, data_dir: str | None) -> list[Prompt]:
    """The n longest BBH CoT prompts (several examples per task, longest first)."""
    per_task = max(1, -(-n // 4))
    prompts = bbh_prompts(data_dir, per_task=per_task)
    return sorted(prompts, key=lambda p: len(p.text), reverse=True)[:n]


def _server(cfg: PatchesConfig, prefix_caching: bool) -> EngineProcess:
    """An engine on the plain 3.2.0 paths, the ones the 3.2.1 patches fix, with room for the load."""
    args = [*cfg.engine_args, "--paths", "plain",
            "--max-num-seqs", str(max(16, cfg.concurrency, cfg.light_concurrency))]
    if not prefix_caching:
        args.append("--no-prefix-caching")
    with report.status(f"starting graft serve ({cfg.dtype}, plain 3.2.0 paths)"):
        return launch_engine(args, env={"GRAFT_PATCHES": ""})


@dataclass(frozen=True, slots=True)
class TimedCall:
    """One admin call: the engine's own answer and the client-side round trip (the client's `on_call`)."""

    answer: dict[str, Any]
    round_trip_ms: float

    @property
    def apply_ms(self) -> float:
        return float(self.answer["applyMs"])


class TimedAdmin:
    """The operator's admin client on one engine, giving each call's whole answer and round trip.

    No retries: a retried call would time two calls as one.
    """

    def __init__(self, engine: EngineProcess):
        self._last: AdminCall | None = None
        self.client = AdminClient(engine.token, timeout=120.0, retries=0, on_call=self._record)
        self.host, self.port = engine.host, engine.admin_port

    def _record(self, call: AdminCall) -> None:
        self._last = call

    async def __aenter__(self) -> "TimedAdmin":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def patches(self) -> dict[str, Any]:
        return (await self.client.patches(self.host, self.port)).model_dump(by_alias=True)

    def _timed(self) -> TimedCall:
        assert self._last is not None
        return TimedCall(self._last.answer, self._last.round_trip_ms)

    async def apply_builtin(self, name: str, version: str) -> TimedCall:
        await self.client.apply_patch(self.host, self.port,
                                      ApplyRequest(name=name, version=version, source={"builtin": True}))
        return self._timed()

    async def revert_patch(self, name: str) -> TimedCall:
        await self.client.revert_patch(self.host, self.port, name)
        return self._timed()


# ---- suite: patches ----

async def _apply_set(admin: TimedAdmin, patch_list: list[tuple[str, str]]) -> tuple[list[str], dict[str, str]]:
    """Apply what applies; a patch the engine refuses is reported, not fatal."""
    applied, refused = [], {}
    for name, version in patch_list:
        try:
            await admin.apply_builtin(name, version)
            applied.append(f"{name}@{version}")
        except AdminError as exc:
            refused[f"{name}@{version}"] = str(exc)
            report.console.log(f"[yellow]{name}@{version} not applied[/]: {exc}")
    return applied, refused


async def _revert_all(admin: TimedAdmin) -> None:
    for entry in (await admin.patches())["applied"]:
        await admin.revert_patch(entry["name"])


async def _compare(server: EngineProcess, cfg: PatchesConfig, prompts: list[str]) -> dict[str, Any]:
    requests = [Request(p, cfg.max_tokens) for p in prompts]
    passes: dict[str, list[LoadReport]] = {"3.2.0": [], "3.2.1": []}
    cpu: dict[str, list[float]] = {"3.2.0": [], "3.2.1": []}
    loads: dict[str, list[tuple[float, float]]] = {"3.2.0": [], "3.2.1": []}   # load average before, after
    applied: list[str] = []
    refused: dict[str, str] = {}
    async with LoadGenerator(server.url) as gen, TimedAdmin(server) as admin:
        # one long prompt first, so the first measured pass does not pay for first-touch allocations
        await gen.run([WARMUP, Request(prompts[0], 2)], 1)
        for r, label in alternation(cfg.rounds, ("3.2.0", "3.2.1")):
            if label == "3.2.1":
                applied, refused = await _apply_set(admin, cfg.patch_list)
            cpu0, load0 = server.cpu_seconds(), load_average()
            with report.progress_bar(f"{label} round {r + 1}/{cfg.rounds}", len(requests)) as advance:
                passes[label].append(await gen.run(requests, cfg.concurrency, on_result=lambda _: advance(1)))
            cpu1 = server.cpu_seconds()
            loads[label].append((load0, load_average()))
            if cpu0 is not None and cpu1 is not None:
                cpu[label].append(cpu1 - cpu0)
            if label == "3.2.1":
                await _revert_all(admin)
    return {"passes": passes, "cpu": cpu, "loads": loads, "applied": applied, "refused": refused}


def _merge(reports: list[LoadReport], cpu: list[float]) -> dict[str, Any]:
    """Throughput averaged over passes; latency percentiles over every request of every pass."""
    summaries = [r.summary() for r in reports]
    tokens = sum(s.output_tokens for s in summaries)
    lat = [x for r in reports for x in r.latencies()]
    ttft = [x for r in reports for x in r.ttfts()]
    tpot = [x for r in reports for x in r.tpots()]
    return {"output_tok_s": sum(s.output_tok_s for s in summaries) / len(summaries),
            "passes": summaries, "errors": sum(s.errors for s in summaries),
            "latency_p50": percentile(lat, 50), "latency_p99": percentile(lat, 99),
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
            "cpu_s": cpu, "tok_per_cpu_s": tokens / sum(cpu) if cpu and sum(cpu) > 0 else None,
            "latency": lat, "ttft": ttft}


def run_patches(cfg: PatchesConfig, out: Path) -> dict[str, Any]:
    """Plain paths against the 3.2.1 set on the same engine process; JSON and plots under `out`."""
    machine = report.machine_info()
    prompts = long_prompts(cfg.num_prompts, cfg.data_dir)
    server = _server(cfg, prefix_caching=False)
    try:
        measured = asyncio.run(_compare(server, cfg, [p.text for p in prompts]))
    finally:
        server.stop()
    plain = _merge(measured["passes"]["3.2.0"], measured["cpu"]["3.2.0"])
    fixed = _merge(measured["passes"]["3.2.1"], measured["cpu"]["3.2.1"])
    result = {"suite": "patches", "command": report.command_line(), "machine": machine,
              "config": {"num_prompts": cfg.num_prompts, "concurrency": cfg.concurrency,
                         "max_tokens": cfg.max_tokens, "rounds": cfg.rounds, "dtype": cfg.dtype,
                         "patch_set": cfg.patch_set, "engine_args": cfg.engine_args,
                         "tasks": sorted({p.task for p in prompts})},
              "prompt_tokens_mean": plain["passes"][0].prompt_tokens / max(1, plain["passes"][0].requests),
              "applied": measured["applied"], "refused": measured["refused"],
              "plain": plain, "patched": fixed, "ratio": fixed["output_tok_s"] / plain["output_tok_s"],
              "ratio_spread": ratio_spread([s.output_tok_s for s in fixed["passes"]],
                                           [s.output_tok_s for s in plain["passes"]]).as_dict(),
              "load_before_after": measured["loads"],
              "p99_latency_ratio": fixed["latency_p99"] / plain["latency_p99"],
              "cpu_ratio": (fixed["tok_per_cpu_s"] / plain["tok_per_cpu_s"]
                            if fixed["tok_per_cpu_s"] and plain["tok_per_cpu_s"] else None)}
    result["machine"]["load_average_end"] = report.load_average()
    show_patches(result)
    label = "3.2.1 set (" + ", ".join(result["applied"]) + ")" if result["refused"] else "3.2.1 set"
    report.plot_throughput(out / "patches-throughput.png",
                           {"3.2.0 plain paths": plain["output_tok_s"], label: fixed["output_tok_s"]},
                           baseline="3.2.0 plain paths",
                           title=f"long BBH prompts (~{result['prompt_tokens_mean']:.0f} tokens), "
                                 f"concurrency {cfg.concurrency}, {cfg.max_tokens} new tokens, {cfg.dtype}")
    report.plot_cdf(out / "patches-latency-cdf.png", {"3.2.0": plain["latency"], "3.2.1": fixed["latency"]},
                    xlabel="end-to-end latency (s)", title="request latency, plain vs patched")
    report.write_json(out / "patches.json", result)
    return result


def show_patches(result: dict[str, Any]) -> None:
    rows = {f"{label} pass {i + 1}": s for label, key in (("3.2.0", "plain"), ("3.2.1", "patched"))
            for i, s in enumerate(result[key]["passes"])}
    report.show(report.summary_table(f"patches: long prompts (~{result['prompt_tokens_mean']:.0f} tokens)", rows,
                                     ratio_to="3.2.0 pass 1"))
    report.show(report.kv_table("3.2.1 set against the plain paths", [
        ("applied", ", ".join(result["applied"]) or "none"),
        ("refused", "; ".join(f"{k}: {v}" for k, v in result["refused"].items()) or "none"),
        ("throughput ratio (mean of passes)", f"{result['ratio']:.2f}x"),
        ("per-round ratio", f"median {result['ratio_spread']['median']:.2f}x, min {result['ratio_spread']['min']:.2f}, "
                            f"max {result['ratio_spread']['max']:.2f}"),
        ("tokens per engine CPU-second ratio", f"{result['cpu_ratio']:.2f}x" if result["cpu_ratio"] else "-"),
        ("p99 latency ratio", f"{result['p99_latency_ratio']:.2f}x")]))


# ---- suite: apply ----

async def _cycles(server: EngineProcess, cfg: PatchesConfig, light: list[Request]) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {}
    refused: dict[str, str] = {}
    stop = asyncio.Event()
    async with LoadGenerator(server.url) as gen, TimedAdmin(server) as admin:
        await gen.run([WARMUP], 1)
        load = asyncio.create_task(gen.run_until(stop, light, cfg.light_concurrency))
        try:
            with report.progress_bar("apply/revert cycles", cfg.cycles * len(cfg.patch_list)) as advance:
                for _ in range(cfg.cycles):
                    for name, version in cfg.patch_list:
                        pid = f"{name}@{version}"
                        if pid in refused:
                            advance(1)
                            continue
                        try:
                            on = await admin.apply_builtin(name, version)
                        except AdminError as exc:
                            refused[pid] = str(exc)
                            report.console.log(f"[yellow]{pid} refused, left out[/]: {exc}")
                            advance(1)
                            continue
                        off = await admin.revert_patch(name)
                        s = samples.setdefault(pid, {"apply_ms": [], "revert_ms": [], "apply_rtt_ms": [],
                                                     "revert_rtt_ms": [], "verify_ms": []})
                        s["apply_ms"].append(on.apply_ms)
                        s["verify_ms"].append(float(on.answer.get("verifyMs", 0.0)))
                        s["apply_rtt_ms"].append(on.round_trip_ms)
                        s["revert_ms"].append(off.apply_ms)
                        s["revert_rtt_ms"].append(off.round_trip_ms)
                        advance(1)
        finally:
            stop.set()
            background = await load
    return {"samples": samples, "refused": refused, "load": background.summary()}


def _stats(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values, default=float("nan")),
            "n": len(values)}


def run_apply(cfg: PatchesConfig, out: Path) -> dict[str, Any]:
    """Apply/revert latency of each patch under light load; JSON and a histogram under `out`."""
    machine = report.machine_info()
    light = [Request(p.text, 32) for p in bbh_prompts(cfg.data_dir, tasks=[LIGHT_TASK], per_task=8)]
    server = _server(cfg, prefix_caching=True)
    try:
        measured = asyncio.run(_cycles(server, cfg, light))
    finally:
        server.stop()
    per_patch = {pid: {k: _stats(v) for k, v in s.items()} for pid, s in measured["samples"].items()}
    all_apply = [x for s in measured["samples"].values() for x in s["apply_ms"]]
    all_revert = [x for s in measured["samples"].values() for x in s["revert_ms"]]
    result = {"suite": "apply", "command": report.command_line(), "machine": machine,
              "config": {"cycles": cfg.cycles, "patch_set": cfg.patch_set, "dtype": cfg.dtype,
                         "light_concurrency": cfg.light_concurrency, "light_task": LIGHT_TASK,
                         "engine_args": cfg.engine_args},
              "refused": measured["refused"], "per_patch": per_patch,
              "apply_ms": _stats(all_apply), "revert_ms": _stats(all_revert),
              "background_load": measured["load"], "samples": measured["samples"]}
    result["machine"]["load_average_end"] = report.load_average()
    show_apply(result)
    report.plot_histogram(out / "apply-latency.png",
                          {f"{pid} apply": s["apply_ms"] for pid, s in measured["samples"].items()}
                          | {"revert (all)": all_revert},
                          xlabel="swap time reported by the engine, applyMs (ms)", limit=8.0,
                          title=f"hot-patch swap time, {cfg.cycles} apply/revert cycles per patch under light "
                                f"load, {cfg.dtype}")
    report.plot_histogram(out / "apply-roundtrip.png",
                          {f"{pid} apply": s["apply_rtt_ms"] for pid, s in measured["samples"].items()}
                          | {"revert (all)": [x for s in measured["samples"].values() for x in s["revert_rtt_ms"]]},
                          xlabel="admin API round trip seen by the client (ms)",
                          title="the same calls end to end: waiting for the step in flight, the swap, and "
                                "the self-check probe (apply only)")
    report.write_json(out / "apply.json", result)
    return result


def show_apply(result: dict[str, Any]) -> None:
    from rich.table import Table
    t = Table(title="hot-patch apply/revert latency (ms)", title_justify="left")
    for col in ("patch", "n", "apply p50", "apply p99", "revert p50", "revert p99", "apply RTT p50",
                "apply RTT p99", "revert RTT p99"):
        t.add_column(col, justify="left" if col == "patch" else "right")
    for pid, s in result["per_patch"].items():
        t.add_row(pid, str(s["apply_ms"]["n"]), f"{s['apply_ms']['p50']:.2f}", f"{s['apply_ms']['p99']:.2f}",
                  f"{s['revert_ms']['p50']:.2f}", f"{s['revert_ms']['p99']:.2f}", f"{s['apply_rtt_ms']['p50']:.0f}",
                  f"{s['apply_rtt_ms']['p99']:.0f}", f"{s['revert_rtt_ms']['p99']:.0f}")
    report.show(t)
    for pid, why in result["refused"].items():
        report.console.print(f"[yellow]{pid} was refused by the engine[/]: {why}")
