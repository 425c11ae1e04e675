"""Suite `workload`: BBH, GSM8K and HumanEval alone and mixed, then a concurrency sweep.

Isolation. Three classes of requests share the engine: `bbh` (3-shot CoT, about 1,000-token
prompts that share a prefix per task), `gsm8k` (zero-shot questions, about 70 tokens) and
`humaneval` (code prompts, about 110 tokens). Each class first runs alone at its own concurrency
(`--class-concurrency`), then all classes run at once, each at that same concurrency: the mixed
pass is the alone passes side by side. A class's figures mixed divided by alone (output tok/s over
its own span, TTFT and TPOT p50/p99) say what sharing the engine costs it. Every stream of a pass
keeps its concurrency until every class has completed its `--class-prompts` requests (those in
flight then finish), so no class runs its last requests alone while the others are done; a faster
class completes more than its count. `--rounds` repeats alone, alone, alone, mixed round after
round; each ratio is the median of the per-round ratios with its min and max (graft/bench/method.py).

Targets (`isolation_targets`). A class's fair share of a round is the mixed pass's total output
tok/s split in proportion to the classes' tok/s alone (`isolation_table` says why). The goals:
the mixed total at least TARGET_TOTAL x the best class alone (mixing costs the engine little),
each class at least TARGET_FAIR_SHARE x its fair share (no class pays for the others), and each
short class's TTFT p99 mixed at most TARGET_SHORT_TTFT x alone (short requests do not wait
behind long prefills). `--scheduling fcfs` runs the engine with the order before `fair` for a
before/after comparison on one build. Each class is a tenant of the engine: its requests carry
TENANT_HEADER, which the engine is told to read (`--tenant-header`), as behind a gateway.

Sweep. The classes interleaved (bbh, gsm8k, humaneval, bbh, ...), closed loop at each concurrency
of `--sweep`, `--sweep-waves` times as many requests as the concurrency. The knee is where more
concurrency stops buying throughput (`find_knee`).

The engine. One fresh `graft serve` runs the whole suite, started with this run's engine flags and
room for the most requests in flight (`--max-num-seqs`): an engine per pass would spend more time
starting than small passes take. So that the order of the passes does not matter, no pass sends a
prompt an earlier one sent (each class hands its prompts out in order, `Pool`), and the engine is
first warmed with the 3-shot prefix of every BBH task the run uses: every pass finds the same
prefixes cached, as on a long-running server.

While a pass runs, the engine's /metrics (on its metrics port) is scraped every SCRAPE_EVERY_S for
KV cache usage and fragmentation (max, and mean over the samples taken while a sequence ran), the
most sequences running, and the preemptions during the pass.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from graft.bench import report
from graft.bench.args import SWEEP
from graft.bench.data import WORKLOAD_CLASSES, bbh_tasks, class_prompts, cot_prefix, resolve_data_dir
from graft.bench.loadgen import LoadGenerator, LoadReport, Request
from graft.bench.method import alternation, load_average, ratio_spread
from graft.bench.throughput import WARMUP
from graft.engine.launcher import EngineProcess, launch_engine

MIXED = "mixed"
KNEE_GAIN = 0.10            # less than 10% more throughput per doubling of concurrency: past the knee
SCRAPE_EVERY_S = 0.25
TENANT_HEADER = "X-Graft-Tenant"  # each class's requests carry their class as the engine's tenant
POOL_SIZE = 2048            # prompts loaded per class; a run that needs more sends them again
FIGURES = ("output_tok_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")
# the isolation goals (`isolation_targets`): what mixing may cost the engine, each class against
# its fair share, and the short classes' tail time to first token
TARGET_TOTAL = 0.95         # mixed total output tok/s >= this x the best class alone
TARGET_FAIR_SHARE = 0.90    # each class's mixed tok/s >= this x its fair share
TARGET_SHORT_TTFT = 2.0     # a short class's TTFT p99 mixed <= this x alone
SHORT_CLASSES = ("gsm8k", "humaneval")   # prompts of about a tenth of BBH's
GAUGES = {                  # /metrics sample -> the name it is recorded under (graft/engine/metrics.py)
    "graft_kv_cache_usage_ratio": "kv_usage",
    "graft_kv_cache_fragmentation_ratio": "kv_fragmentation",
    "graft_num_requests_running": "running",
    "graft_num_preemptions_total": "preemptions",
}


@dataclass(slots=True)
class WorkloadConfig:
    """What `graft bench workload` was asked for (see graft/bench/args.py for the flags)."""

    class_prompts: dict[str, int]
    class_concurrency: dict[str, int]
    sweep: list[int] = field(default_factory=lambda: list(SWEEP))
    sweep_waves: int = 2
    max_tokens: int = 64
    rounds: int = 1
    data_dir: str | None = None
    engine_args: list[str] = field(default_factory=list)     # `graft serve` flags of the engine
    dtype: str = "bfloat16"


# ---- prompts ----

class Pool:
    """One class's requests, handed out in order: passes on one engine never repeat a prompt
    (a repeated prompt would be answered from the prefix cache) until all POOL_SIZE are spent."""

    def __init__(self, requests: Sequence[Request]):
        if not requests:
            raise ValueError("a pool needs at least one request")
        self.requests = list(requests)
        self.cursor = 0

    def ahead(self) -> list[Request]:
        """Every request, starting with the next one not yet sent (for a stream to cycle over)."""
        return self.requests[self.cursor:] + self.requests[:self.cursor]

    def advance(self, n: int) -> None:
        self.cursor = (self.cursor + n) % len(self.requests)

    def take(self, n: int) -> list[Request]:
        out = [self.requests[(self.cursor + i) % len(self.requests)] for i in range(n)]
        self.advance(n)
        return out


def interleave(pools: Mapping[str, Pool], n: int) -> list[Request]:
    """n requests taken from the pools in turn (bbh, gsm8k, humaneval, bbh, ...)."""
    names = list(pools)
    return [pools[names[i % len(names)]].take(1)[0] for i in range(n)]


def tenant_flags(engine_args: list[str]) -> list[str]:
    """The engine's flags with `--tenant-header TENANT_HEADER` unless they name one: each class is a
    tenant, as a gateway in front of the engine would say."""
    if any(a == "--tenant-header" or a.startswith("--tenant-header=") for a in engine_args):
        return list(engine_args)
    return [*engine_args, "--tenant-header", TENANT_HEADER]


def load_requests(cfg: WorkloadConfig) -> dict[str, list[Request]]:
    """POOL_SIZE requests per class (the pool every pass on the engine takes its next ones from);
    BBH's round-robin over its first tasks, as many as it sends per pass (those `prefix_warmups` warms)."""
    return {name: [Request(p.text, cfg.max_tokens, headers={TENANT_HEADER: name})
                   for p in class_prompts(name, POOL_SIZE, cfg.data_dir, num_bbh_tasks=cfg.class_prompts["bbh"])]
            for name in WORKLOAD_CLASSES}


def prefix_warmups(cfg: WorkloadConfig) -> list[Request]:
    """One single-token request per BBH task the run uses: its 3-shot prefix alone."""
    root = resolve_data_dir(cfg.data_dir)
    tasks = bbh_tasks(root)[:cfg.class_prompts["bbh"]]
    return [Request(cot_prefix(root, task), max_tokens=1) for task in tasks]


# ---- the engine's gauges ----

def engine_gauges(text: str) -> dict[str, float]:
    """KV usage and fragmentation, running sequences and preemptions from a /metrics exposition."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = GAUGES.get(sample.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + sample.value
    return out


def gauge_stats(samples: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """What the samples of one pass say. Usage and fragmentation count only samples taken while a
    sequence ran: an idle engine's zeros at the start and end of a pass are not its load."""
    busy = [s for s in samples if s.get("running", 0) > 0]

    def stat(key: str, f: Callable[[list[float]], float]) -> float | None:
        values = [s[key] for s in busy if key in s]
        return f(values) if values else None

    preempted = [s["preemptions"] for s in samples if "preemptions" in s]
    return {"samples": len(samples), "busy_samples": len(busy),
            "kv_usage_max": stat("kv_usage", max), "kv_usage_mean": stat("kv_usage", statistics.fmean),
            "kv_fragmentation_max": stat("kv_fragmentation", max),
            "kv_fragmentation_mean": stat("kv_fragmentation", statistics.fmean),
            "running_max": stat("running", max),
            "preemptions": preempted[-1] - preempted[0] if preempted else None}


@contextlib.asynccontextmanager
async def scraping(url: str, every: float = SCRAPE_EVERY_S) -> AsyncIterator[list[dict[str, float]]]:
    """Scrape `url`/metrics (`url`: the engine's metrics port) every `every` seconds, once at the
    start and once at the end, into a list; a scrape that fails is skipped (the pass goes on)."""
    samples: list[dict[str, float]] = []
    stop = asyncio.Event()

    async def loop(client: httpx.AsyncClient) -> None:
        while True:
            last = stop.is_set()        # set before this scrape began: it is the one at the end
            with contextlib.suppress(httpx.HTTPError, ValueError):
                resp = await client.get("/metrics")
                if resp.status_code == 200:
                    samples.append(engine_gauges(resp.text))
            if last:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every)

    async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
        task = asyncio.create_task(loop(client))
        try:
            yield samples
        finally:
            stop.set()
            await task


# ---- measuring ----

@dataclass(frozen=True, slots=True)
class Stream:
    """One class's closed loop within a pass: `concurrency` in flight until it has `target` results."""

    name: str
    requests: list[Request]
    concurrency: int
    target: int


async def run_streams(gen: LoadGenerator, streams: Sequence[Stream], label: str) -> dict[str, LoadReport]:
    """Every stream at once, each cycling over its requests, until every one has its target number of
    results (failures count, so a failing engine cannot hang a pass); requests in flight finish."""
    stop = asyncio.Event()
    counts = {s.name: 0 for s in streams}

    with report.progress_bar(label, sum(s.target for s in streams)) as advance:
        def counter(stream: Stream) -> Callable[[Any], None]:
            def on_result(_: Any) -> None:
                counts[stream.name] += 1
                if counts[stream.name] <= stream.target:
                    advance(1)
                if all(counts[s.name] >= s.target for s in streams):
                    stop.set()
            return on_result

        reports = await asyncio.gather(*(gen.run_until(stop, s.requests, s.concurrency, counter(s))
                                         for s in streams))
    return {s.name: rep for s, rep in zip(streams, reports)}


async def warm_up(gen: LoadGenerator, prefixes: Sequence[Request]) -> None:
    """One short request, then the BBH prefixes; a failure here means the engine cannot be measured."""
    for requests, concurrency in (([WARMUP], 1), (prefixes, 4)):
        if requests:
            rep = await gen.run(requests, concurrency)
            if rep.errors:
                raise RuntimeError(f"the engine failed a warm-up request: {rep.errors[0].error}")


async def measure(url: str, cfg: WorkloadConfig, requests: Mapping[str, list[Request]],
                  metrics_url: str | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Warm the engine up, then the isolation passes and the sweep points, from one set of pools.
    Requests go to `url`; the gauges are scraped from `metrics_url` (the engine's metrics port;
    `url` when None)."""
    pools = {name: Pool(requests[name]) for name in WORKLOAD_CLASSES}
    metrics_url = metrics_url or url
    async with LoadGenerator(url) as gen:
        await warm_up(gen, prefix_warmups(cfg))
        passes = [await isolation_pass(gen, metrics_url, cfg, pools, phase, r)
                  for r, phase in alternation(cfg.rounds, (*WORKLOAD_CLASSES, MIXED))]
        points = [await sweep_point(gen, metrics_url, cfg, pools, c) for c in cfg.sweep]
    return passes, points


async def isolation_pass(gen: LoadGenerator, metrics_url: str, cfg: WorkloadConfig, pools: Mapping[str, Pool],
                         phase: str, r: int) -> dict[str, Any]:
    """One class alone, or every class at once (`phase` MIXED), each at its own concurrency."""
    names = WORKLOAD_CLASSES if phase == MIXED else (phase,)
    streams = [Stream(n, pools[n].ahead(), cfg.class_concurrency[n], cfg.class_prompts[n]) for n in names]
    load = load_average()
    async with scraping(metrics_url) as samples:
        reports = await run_streams(gen, streams, f"{phase}, round {r + 1}/{cfg.rounds}")
    for name, rep in reports.items():
        pools[name].advance(len(rep.results))
    return {"phase": phase, "round": r, "load_before": load, "load_after": load_average(),
            "engine": gauge_stats(samples), "classes": {name: rep.summary() for name, rep in reports.items()}}


async def sweep_point(gen: LoadGenerator, metrics_url: str, cfg: WorkloadConfig, pools: Mapping[str, Pool],
                      concurrency: int) -> dict[str, Any]:
    """The classes interleaved, `sweep_waves` times `concurrency` requests, closed loop."""
    batch = interleave(pools, concurrency * cfg.sweep_waves)
    load = load_average()
    async with scraping(metrics_url) as samples:
        with report.progress_bar(f"sweep, concurrency {concurrency}", len(batch)) as advance:
            rep = await gen.run(batch, concurrency, on_result=lambda _: advance(1))
    return {"concurrency": concurrency, "load_before": load, "load_after": load_average(),
            "summary": rep.summary(), "engine": gauge_stats(samples)}


@contextlib.contextmanager
def engine(args: list[str]) -> Iterator[EngineProcess]:
    """A fresh `graft serve` with `args` (this run's engine flags), stopped on the way out."""
    with report.status(f"starting graft serve {' '.join(args) or '(no flags)'}"):
        eng = launch_engine(args)
    try:
        yield eng
    finally:
        eng.stop()


# ---- what the figures say ----

def find_knee(points: Sequence[tuple[int, float | None]], gain: float = KNEE_GAIN) -> int | None:
    """The smallest concurrency past which doubling the concurrency buys less than `gain` more throughput.

    `points` are (concurrency, output tok/s); points without a throughput are left out. A point is
    the knee when every larger concurrency c' measured less than its throughput times
    (1 + gain) ** log2(c' / c): judged against all the points after it rather than the next one
    alone, one noisy step neither makes a knee nor hides one. None when no point before the last
    qualifies: throughput was still rising at the end of the sweep (or there were too few points).
    """
    valid = sorted((c, t) for c, t in points if t is not None and not math.isnan(t) and t > 0)
    for i, (c, t) in enumerate(valid[:-1]):
        if all(t2 < t * (1 + gain) ** math.log2(c2 / c) for c2, t2 in valid[i + 1:]):
            return c
    return None


def slowdown(alone: Sequence[float | None], mixed: Sequence[float | None]) -> dict[str, Any] | None:
    """mixed / alone, round by round, as the median with its min and max; None if a round lacks a figure."""
    if not alone or len(alone) != len(mixed) or any(x is None or x <= 0 for x in (*alone, *mixed)):
        return None
    return ratio_spread(list(mixed), list(alone)).as_dict()


def isolation_table(passes: Sequence[Mapping[str, Any]], classes: Sequence[str] = WORKLOAD_CLASSES
                    ) -> dict[str, Any]:
    """Per class: the median of each figure alone and mixed, mixed / alone paired by round, and the
    class's fair share of the mixed throughput; then the mixed total and the targets.

    A class's fair share of a round is the mixed pass's total output tok/s split in proportion to
    the classes' throughput alone: `total mixed x alone / sum of alone`. The classes run mixed at
    their alone concurrencies, and a class's tok/s alone already prices its own cost per token (a
    BBH token carries a long prefill, a GSM8K one little), which a split by requests in flight would
    not: this is the share each class would get if all kept the same fraction of their throughput
    alone. A class below its share pays for the others;
    the mixed total against the best class alone says what mixing costs the engine as a whole.

    `passes` are plain dicts as `isolation_passes` returns them after `report.plain` (a missing
    figure is None)."""
    rounds = sorted({p["round"] for p in passes if p["phase"] == MIXED})

    def figure(phase: str, name: str, r: int) -> float | None:
        found = [p["classes"][name]["output_tok_s"] for p in passes if p["phase"] == phase and p["round"] == r]
        return found[0] if found and found[0] is not None and found[0] > 0 else None

    alone = {n: [figure(n, n, r) for r in rounds] for n in classes}
    mixed = {n: [figure(MIXED, n, r) for r in rounds] for n in classes}
    complete = [i for i in range(len(rounds)) if all(alone[n][i] and mixed[n][i] for n in classes)]
    total = [sum(mixed[n][i] for n in classes) for i in complete]
    best_alone = [max(alone[n][i] for n in classes) for i in complete]
    fair = {n: [total[k] * alone[n][i] / sum(alone[m][i] for m in classes) for k, i in enumerate(complete)]
            for n in classes}
    table: dict[str, Any] = {}
    for name in classes:
        alone_s = [p["classes"][name] for p in passes if p["phase"] == name]
        mixed_s = [p["classes"][name] for p in passes if p["phase"] == MIXED]
        table[name] = {
            "alone": {f: _median([s[f] for s in alone_s]) for f in FIGURES},
            "mixed": {f: _median([s[f] for s in mixed_s]) for f in FIGURES},
            "mixed_over_alone": {f: slowdown([s[f] for s in alone_s], [s[f] for s in mixed_s]) for f in FIGURES},
            "fair_share_tok_s": _median(fair[name]),
            "mixed_over_fair_share": slowdown(fair[name], [mixed[name][i] for i in complete]),
            "requests_alone": sum(s["requests"] for s in alone_s),
            "requests_mixed": sum(s["requests"] for s in mixed_s),
            "errors": sum(s["errors"] for s in (*alone_s, *mixed_s)),
        }
    mixed_total = {"output_tok_s": _median(total), "best_alone_tok_s": _median(best_alone),
                   "over_best_alone": slowdown(best_alone, total)}
    return {"classes": table, "mixed_total": mixed_total, "targets": isolation_targets(table, mixed_total)}


def isolation_targets(table: Mapping[str, Mapping[str, Any]], mixed_total: Mapping[str, Any]
                      ) -> list[dict[str, Any]]:
    """The isolation goals, each a median ratio against its limit: `pass` is None when a figure is missing."""
    def goal(what: str, spread: Mapping[str, Any] | None, limit: float, at_least: bool) -> dict[str, Any]:
        value = None if spread is None else spread["median"]
        ok = None if value is None else (value >= limit if at_least else value <= limit)
        return {"target": what, "value": value, "limit": limit, "at_least": at_least, "pass": ok}

    goals = [goal("mixed total tok/s / best class alone", mixed_total["over_best_alone"], TARGET_TOTAL, True)]
    goals += [goal(f"{name} mixed tok/s / its fair share", entry["mixed_over_fair_share"], TARGET_FAIR_SHARE, True)
              for name, entry in table.items()]
    goals += [goal(f"{name} TTFT p99 mixed / alone", table[name]["mixed_over_alone"]["ttft_p99"],
                   TARGET_SHORT_TTFT, False) for name in SHORT_CLASSES if name in table]
    return goals


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


# ---- the suite ----

def run_workload_suite(cfg: WorkloadConfig, out: Path) -> dict[str, Any]:
    """The isolation passes and the sweep on one engine; tables, plots and workload.json under `out`."""
    requests = load_requests(cfg)
    result: dict[str, Any] = {
        "suite": "workload", "command": report.command_line(), "machine": report.machine_info(),
        "config": {"classes": {n: {"prompts": cfg.class_prompts[n], "concurrency": cfg.class_concurrency[n]}
                               for n in WORKLOAD_CLASSES},
                   "sweep": cfg.sweep, "sweep_waves": cfg.sweep_waves, "max_tokens": cfg.max_tokens,
                   "rounds": cfg.rounds, "dtype": cfg.dtype, "knee_gain": KNEE_GAIN,
                   "engine_args": cfg.engine_args}}
    with engine(tenant_flags(cfg.engine_args)) as eng:
        passes, points = report.plain(asyncio.run(measure(eng.url, cfg, requests, eng.metrics_url)))
    result["isolation"] = {"passes": passes, **isolation_table(passes)}
    knee = find_knee([(p["concurrency"], p["summary"]["output_tok_s"]) for p in points])
    result["sweep"] = {"points": points, "knee": knee}
    result["errors"] = (sum(c["errors"] for p in passes for c in p["classes"].values())
                        + sum(p["summary"]["errors"] for p in points))
    result["machine"]["load_average_end"] = report.load_average()
    data = report.plain(result)
    show_workload(data)
    plot_isolation(out / "workload-isolation.png", data)
    plot_sweep(out / "workload-sweep.png", data)
    report.write_json(out / "workload.json", data)
    return data


# ---- tables and plots ----

def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:,.0f}"


def _tok(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ratio(spread: Mapping[str, Any] | None) -> str:
    if spread is None:
        return "-"
    if len(spread["per_round"]) == 1:
        return f"{spread['median']:.2f}x"
    return f"{spread['median']:.2f}x ({spread['min']:.2f}..{spread['max']:.2f})"


def show_workload(result: Mapping[str, Any]) -> None:
    from rich.table import Table
    cfg = result["config"]
    t = Table(title=f"isolation: each class alone vs all mixed ({cfg['max_tokens']} new tokens, {cfg['dtype']}, "
                    f"medians of {cfg['rounds']} round(s))", title_justify="left")
    for col in ("class", "pass", "in flight", "requests", "tok/s", "fair share", "TTFT p50 ms", "TTFT p99 ms",
                "TPOT p50 ms", "TPOT p99 ms"):
        t.add_column(col, justify="left" if col in ("class", "pass") else "right")
    for name, entry in result["isolation"]["classes"].items():
        c = str(cfg["classes"][name]["concurrency"])
        for side in ("alone", "mixed"):
            s = entry[side]
            fair = _tok(entry["fair_share_tok_s"]) if side == "mixed" else ""
            t.add_row(name, side, c, str(entry[f"requests_{side}"]), _tok(s["output_tok_s"]), fair,
                      *(_ms(s[f]) for f in FIGURES[1:]))
        ratios = [_ratio(entry["mixed_over_alone"][f]) for f in FIGURES]
        t.add_row(name, "[bold]mixed / alone[/]", "", "", ratios[0], "", *ratios[1:])
        t.add_row(name, "[bold]mixed / fair share[/]", "", "", _ratio(entry["mixed_over_fair_share"]), "", "", "", "",
                  "", end_section=True)
    report.show(t)
    total = result["isolation"]["mixed_total"]
    g = Table(title=f"isolation targets (mixed total {_tok(total['output_tok_s'])} tok/s, the best class alone "
                    f"{_tok(total['best_alone_tok_s'])})", title_justify="left")
    for col in ("target", "median", "limit", "result"):
        g.add_column(col, justify="left" if col == "target" else "right")
    for goal in result["isolation"]["targets"]:
        verdict = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "-"}[goal["pass"]]
        value = "-" if goal["value"] is None else f"{goal['value']:.2f}x"
        g.add_row(goal["target"], value, f"{'>=' if goal['at_least'] else '<='} {goal['limit']:.2f}x", verdict)
    report.show(g)
    s = Table(title="concurrency sweep: bbh, gsm8k and humaneval interleaved", title_justify="left")
    for col in ("in flight", "requests", "errors", "tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "KV used max/mean",
                "KV frag max/mean", "running max", "preempted", "load"):
        s.add_column(col, justify="right")
    for p in result["sweep"]["points"]:
        m, e = p["summary"], p["engine"]
        s.add_row(str(p["concurrency"]), str(m["requests"]), str(m["errors"]),
                  "-" if m["output_tok_s"] is None else f"{m['output_tok_s']:.1f}",
                  f"{_ms(m['ttft_p50'])} / {_ms(m['ttft_p99'])}", f"{_ms(m['tpot_p50'])} / {_ms(m['tpot_p99'])}",
                  f"{_share(e['kv_usage_max'])} / {_share(e['kv_usage_mean'])}",
                  f"{_share(e['kv_fragmentation_max'])} / {_share(e['kv_fragmentation_mean'])}",
                  "-" if e["running_max"] is None else f"{e['running_max']:.0f}",
                  "-" if e["preemptions"] is None else f"{e['preemptions']:.0f}", f"{p['load_before']:.2f}")
    report.show(s)
    knee = result["sweep"]["knee"]
    rule = f"less than {cfg['knee_gain']:.0%} more throughput per doubling past it"
    report.console.print(f"knee: [bold]{knee} in flight[/] ({rule})" if knee is not None
                         else f"knee: not reached within the sweep ({rule})")


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def plot_isolation(path: Path, result: Mapping[str, Any]) -> Path:
    """One panel per figure: each class's bar alone and mixed, the mixed bar labelled with mixed / alone;
    on the throughput panel a line across each mixed bar marks the class's fair share."""
    plt = report._pyplot()
    classes = result["isolation"]["classes"]
    names = list(classes)
    titles = {"output_tok_s": "output tok/s", "ttft_p50": "TTFT p50 (ms)", "ttft_p99": "TTFT p99 (ms)",
              "tpot_p50": "TPOT p50 (ms)", "tpot_p99": "TPOT p99 (ms)"}
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(3.2 * len(FIGURES), 3.8))
    width = 0.38
    for ax, f in zip(axes, FIGURES):
        scale = 1.0 if f == "output_tok_s" else 1000.0
        for k, (side, color) in enumerate((("alone", "#9aa5b1"), ("mixed", "#2f6fb0"))):
            xs = [i + (k - 0.5) * width for i in range(len(names))]
            values = [(classes[n][side][f] or 0.0) * scale for n in names]
            rects = ax.bar(xs, values, width, color=color, label=side)
            if side == "mixed":
                fair = [(classes[n]["fair_share_tok_s"] or 0.0) if f == "output_tok_s" else 0.0 for n in names]
                if any(fair):
                    ax.hlines(fair, [x - width / 2 for x in xs], [x + width / 2 for x in xs], colors="#b03030",
                              linewidth=1.5, label="fair share")
                for rect, n, top in zip(rects, names, fair):
                    ax.annotate(_ratio(classes[n]["mixed_over_alone"][f]),
                                (rect.get_x() + rect.get_width() / 2, max(rect.get_height(), top)), ha="center",
                                va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_title(titles[f], fontsize=9)
        ax.margins(y=0.2)
    axes[0].legend(fontsize=8)
    cfg = result["config"]
    mix = ", ".join(f"{n} {c['prompts']}x{c['concurrency']}" for n, c in cfg["classes"].items())
    fig.suptitle(f"each class alone vs all mixed (requests x in flight: {mix}; {cfg['max_tokens']} new tokens, "
                 f"{cfg['dtype']}); labels: mixed / alone", fontsize=9)
    return report._save(fig, plt, path)


def plot_sweep(path: Path, result: Mapping[str, Any]) -> Path:
    """Throughput with the knee, latencies, and KV usage and fragmentation, against concurrency."""
    plt = report._pyplot()
    points = result["sweep"]["points"]
    cs = [p["concurrency"] for p in points]

    def series(key: str, part: str = "summary", scale: float = 1.0) -> list[float]:
        return [math.nan if p[part][key] is None else p[part][key] * scale for p in points]

    fig, (tput, lat, kv) = plt.subplots(1, 3, figsize=(14, 4))
    tput.plot(cs, series("output_tok_s"), marker="o", color="#2f6fb0")
    knee = result["sweep"]["knee"]
    if knee is not None:
        tput.axvline(knee, color="#b03030", linestyle="--", linewidth=1, label=f"knee: {knee} in flight")
        tput.legend(fontsize=8)
    tput.set_ylabel("output tokens/s")
    tput.set_ylim(bottom=0)
    tput.set_title("throughput", fontsize=9)
    for key, style, color, label in (("ttft_p50", "-o", "#2f6fb0", "TTFT p50"),
                                     ("ttft_p99", "--o", "#2f6fb0", "TTFT p99"),
                                     ("tpot_p50", "-s", "#d08030", "TPOT p50"),
                                     ("tpot_p99", "--s", "#d08030", "TPOT p99")):
        lat.plot(cs, series(key, scale=1000.0), style, color=color, label=label, markersize=4)
    latencies = [v for key in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99") for v in series(key)]
    if any(v > 0 for v in latencies):   # a log axis with no positive value cannot be drawn (a tiny run)
        lat.set_yscale("log")
    lat.set_ylabel("ms")
    lat.set_title("latency", fontsize=9)
    lat.legend(fontsize=7)
    for key, style, color, label in (("kv_usage_max", "-o", "#2f6fb0", "used, max"),
                                     ("kv_usage_mean", "--o", "#2f6fb0", "used, mean"),
                                     ("kv_fragmentation_max", "-s", "#b03030", "fragmentation, max"),
                                     ("kv_fragmentation_mean", "--s", "#b03030", "fragmentation, mean")):
        kv.plot(cs, series(key, "engine"), style, color=color, label=label, markersize=4)
    kv.set_ylim(0, 1.05)
    kv.set_ylabel("share of the KV cache")
    kv.set_title("KV cache", fontsize=9)
    kv.legend(fontsize=7)
    for ax in (tput, lat, kv):
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(cs) / 1.25, max(cs) * 1.25)   # a panel whose figures are all missing has no data limits
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("requests in flight")
        ax.grid(alpha=0.3)
    cfg = result["config"]
    fig.suptitle(f"concurrency sweep: bbh, gsm8k and humaneval interleaved, {cfg['sweep_waves']} x the concurrency "
                 f"requests per point, {cfg['max_tokens']} new tokens, {cfg['dtype']}", fontsize=9)
    return report._save(fig, plt, path)
