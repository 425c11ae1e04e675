"""`graft rollout simulate -f rollout.yaml`: check a rollout's thresholds before a real rollout does.

Runs the real decision code (graft.rollout.simulate) against a simulated fleet for many seeds: once
with a neutral patch, once per regression given with `--bad` (by default: +2% errors, TPOT x1.5, and
60% of the canary's shadow comparisons divergent),
and prints the chance of promoting the good patch, of catching each bad one, the step it is caught
at and the time to a decision; `--plot` draws them. A manual step (`untilApproved: true`, `pause: {}`)
is approved by a simulated person `--approve-after` into its wait (0s by default: at the next tick);
`--approve-after never` ends each run at the first wait instead, counted as awaiting approval.
"""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from graft.rollout.durations import format_duration, parse_duration
from graft.rollout.simulate import Outcome, Regression, Scenario, Traffic, simulatable, simulate, summarise
from graft.rollout.spec import SpecError, parse_spec

DEFAULT_BAD = ("errors=0.02", "tpot=1.5", "divergence=0.6")


def parser() -> argparse.ArgumentParser:
    from graft.operator.cli import EXIT_CODES

    p = argparse.ArgumentParser(prog="graft rollout simulate", epilog=EXIT_CODES,
                                description="Run a PatchRollout's decisions against a simulated fleet, many times.")
    p.add_argument("-f", "--filename", required=True, help="a PatchRollout manifest (YAML)")
    p.add_argument("--template", action="append", default=[], metavar="FILE",
                   help="a (Cluster)PatchAnalysisTemplate manifest the rollout references (repeatable)")
    p.add_argument("--pods", type=int, default=10, help="engine pods in the fleet")
    p.add_argument("--rps", type=float, default=100.0, help="requests per second to the whole fleet")
    p.add_argument("--error-rate", type=float, default=0.0001, help="background error rate of every revision")
    p.add_argument("--ttft", type=float, default=0.25, help="median time to first token, seconds")
    p.add_argument("--tpot", type=float, default=0.03, help="median time per output token, seconds")
    p.add_argument("--latency-sigma", type=float, default=0.25, help="log-normal shape of TPOT (TTFT: twice it)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--spikes-per-hour", type=float, default=0.0, help="latency spikes per pod per hour")
    p.add_argument("--spike-factor", type=float, default=1.8, help="how much slower a pod is during a spike")
    p.add_argument("--shadow-rate", type=float, default=0.1,
                   help="share of a patched engine's finished requests it compares with its previous table "
                        "(the engine records --shadow-rate of them and compares what its --shadow-budget allows)")
    p.add_argument("--shadow-floor", type=float, default=6.0,
                   help="shadow comparisons per pod a minute at least (never more than it finishes; "
                        "the engine's --shadow-floor)")
    p.add_argument("--divergence", type=float, default=0.005,
                   help="background share of compared requests that are divergent (a good patch)")
    p.add_argument("--restarts-per-hour", type=float, default=0.0, help="engine restarts per pod per hour")
    p.add_argument("--outage", metavar="FROM:UNTIL", help="Prometheus unreachable in this time span, e.g. 2m:30m")
    p.add_argument("--gateway", action="store_true", help="route by Gateway API weights instead of pod ratio")
    p.add_argument("--bad", action="append", metavar="SPEC",
                   help="a regression to catch: errors=0.02, tpot=1.5, ttft=2, cpu=0.3, divergence=0.6 "
                        "(the share of the canary's compared requests that diverge), from-step=3 "
                        "(comma-separated; repeatable; default: errors=0.02, tpot=1.5 and divergence=0.6)")
    p.add_argument("--seeds", type=int, default=20, help="runs per scenario")
    p.add_argument("--tick", type=float, default=5.0, help="seconds between operator ticks")
    p.add_argument("--horizon", default="6h", help="give up on a run after this long")
    p.add_argument("--approve-after", default="0s", metavar="DURATION|never",
                   help="how long a simulated person takes to approve a manual step (untilApproved, pause: {}) "
                        "once it waits; never: a run ends at the first wait (default: 0s, the next tick)")
    p.add_argument("--plot", help="write a PNG of the outcomes here")
    p.add_argument("--json", help="write every run's outcome here")
    return p


def parse_regression(text: str) -> Regression:
    reg = Regression()
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        try:
            match key:
                case "errors":
                    reg.errors = float(value)
                case "tpot":
                    reg.tpot = float(value)
                case "ttft":
                    reg.ttft = float(value)
                case "cpu":
                    reg.cpu = float(value)
                case "divergence":
                    reg.divergence = float(value)
                    if not 0 <= reg.divergence <= 1:
                        raise argparse.ArgumentTypeError(f"--bad {text!r}: divergence is a share between 0 and 1")
                case "from-step":
                    reg.from_step = int(value)
                case _:
                    raise argparse.ArgumentTypeError(
                        f"--bad {text!r}: unknown {key!r} (errors, tpot, ttft, cpu, divergence, from-step)")
        except ValueError:
            raise argparse.ArgumentTypeError(f"--bad {text!r}: {key} needs a number, not {value!r}") from None
    return reg


def _load(path: str) -> dict:
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except (OSError, yaml.YAMLError) as e:
        raise SystemExit(f"error: cannot read {path}: {e}") from None
    if not docs:
        raise SystemExit(f"error: {path} holds no manifest")
    return docs[0]


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    args = parser().parse_args(argv)
    console = console or Console()
    manifest = _load(args.filename)
    if manifest.get("kind") != "PatchRollout":
        console.print(f"[red]error:[/red] {args.filename} is a {manifest.get('kind')!r}, not a PatchRollout")
        return 1
    templates = {}
    for path in args.template:
        t = _load(path)
        templates[(t["metadata"]["name"], t.get("kind") == "ClusterPatchAnalysisTemplate")] = t.get("spec") or {}
    try:
        spec = parse_spec(manifest.get("spec") or {}, templates)
        bad = [parse_regression(b) for b in (args.bad or DEFAULT_BAD)]
        for flag, value in (("--shadow-rate", args.shadow_rate), ("--divergence", args.divergence)):
            if not 0 <= value <= 1:
                raise ValueError(f"{flag} is a share between 0 and 1, not {value:g}")
        if args.shadow_floor < 0:
            raise ValueError(f"--shadow-floor is comparisons a minute, not {args.shadow_floor:g}")
        approve_after = None if args.approve_after == "never" else parse_duration(args.approve_after)
        outage = None
        if args.outage:
            start, _, end = args.outage.partition(":")
            outage = (parse_duration(start), parse_duration(end) if end else math.inf)
    except SpecError as e:
        console.print(f"[red]error:[/red] invalid spec: {e}")
        return 1
    except (argparse.ArgumentTypeError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    spec, dropped = simulatable(spec)
    if dropped:
        console.print(f"[yellow]note:[/yellow] custom PromQL checks cannot be simulated and are left out: "
                      f"{', '.join(dropped)}")
    manual = [str(i + 1) for i, step in enumerate(spec.steps) if step.until_approved]
    if manual:
        if approve_after is None:
            how = "nobody approves here: a run ends at the first wait (awaiting approval)"
        else:
            how = f"a simulated person approves {format_duration(approve_after)} into the wait" \
                  + (" (at the next tick)" if approve_after == 0 else "")
        console.print(f"[yellow]note:[/yellow] manual step{'s' if len(manual) > 1 else ''} {', '.join(manual)} "
                      f"wait{'' if len(manual) > 1 else 's'} for approval (graft rollout promote); {how}")
    traffic = Traffic(rps=args.rps, error_rate=args.error_rate, ttft_median=args.ttft, ttft_sigma=2 * args.latency_sigma,
                      tpot_median=args.tpot, tpot_sigma=args.latency_sigma, tokens=args.tokens,
                      spike_per_hour=args.spikes_per_hour, spike_factor=args.spike_factor,
                      shadow_rate=args.shadow_rate, shadow_floor=args.shadow_floor, divergence=args.divergence)
    scenarios = [("good patch", Regression())] + [(r.describe(), r) for r in bad]
    results: dict[str, list[Outcome]] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        for name, reg in scenarios:
            task = progress.add_task(name, total=args.seeds)
            sc = Scenario(pods=args.pods, gateway=args.gateway, traffic=traffic, regression=reg,
                          restarts_per_hour=args.restarts_per_hour, outage=outage, tick=args.tick,
                          horizon=parse_duration(args.horizon), approve_after=approve_after)
            results[name] = simulate(spec, sc, args.seeds, progress=lambda _: progress.advance(task))
    _report(console, args, results)
    if args.plot:
        plot(results, Path(args.plot), title=f"{Path(args.filename).name}: {args.pods} pods, {args.rps:g} req/s, "
                                              f"background errors {args.error_rate * 100:g}%"
                                              + (", Gateway API" if args.gateway else ", pod ratio"))
        console.print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {name: [{"phase": o.phase, "reason": o.reason, "seconds": o.seconds, "step": o.step}
                    for o in outs] for name, outs in results.items()}, indent=1))
    return 0


def _report(console: Console, args, results: dict[str, list[Outcome]]) -> None:
    table = Table(title=f"{args.seeds} runs per scenario: {args.pods} pods, {args.rps:g} req/s, "
                        f"background errors {args.error_rate * 100:g}%, "
                        f"{'Gateway API' if args.gateway else 'pod ratio'}")
    awaiting = any(summarise(outs).awaiting for outs in results.values())
    for col in ("scenario", "promoted", "rolled back", "paused") + (("awaiting approval",) if awaiting else ()) \
            + ("undecided", "median time to decision", "rolled back at step"):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for name, outs in results.items():
        s = summarise(outs)
        steps = ", ".join(f"{k}: {v}" for k, v in s.steps.items()) or "-"
        median = format_duration(round(s.median_seconds)) if not math.isnan(s.median_seconds) else "-"
        table.add_row(name, str(s.promoted), str(s.rolled_back), str(s.paused),
                      *((str(s.awaiting),) if awaiting else ()), str(s.undecided), median, steps)
    console.print(table)
    names = list(results)
    good = summarise(results[names[0]])
    console.print(f"chance of promoting a good patch: [bold]{good.promote_rate:.0%}[/bold] "
                  f"({good.promoted}/{good.runs}" + (f"; {good.awaiting} awaiting approval" if good.awaiting else "")
                  + ")")
    for name in names[1:]:
        s = summarise(results[name])
        console.print(f"chance of catching a bad one ({name}): [bold]{s.catch_rate:.0%}[/bold] "
                      f"({s.runs - s.promoted - s.awaiting}/{s.runs}; {s.rolled_back} rolled back, {s.paused} paused"
                      + (f"; {s.awaiting} reached a person, awaiting approval" if s.awaiting else "") + ")")


def plot(results: dict[str, list[Outcome]], path: Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.9 * len(names) + 2.5))
    colours = {"Promoted": "#2ca02c", "RolledBack": "#d62728", "Failed": "#8c1c13", "Paused": "#ff7f0e",
               "other": "#999999"}
    for i, name in enumerate(names):
        outs = results[name]
        left_edge = 0.0
        for phase, colour in colours.items():
            n = sum((o.phase == phase) if phase != "other" else (o.phase not in colours) for o in outs)
            if n:
                left.barh(i, n / len(outs), left=left_edge, color=colour, label=phase if i == 0 or True else None)
                left_edge += n / len(outs)
        for o in outs:
            right.scatter(o.seconds / 60, i, color=colours.get(o.phase, colours["other"]), alpha=0.6, s=18)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    left.legend(handles, list(colours), loc="lower right", fontsize=8)
    for ax in (left, right):
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
    left.set_xlim(0, 1)
    left.set_xlabel("share of runs")
    left.set_title("outcome")
    right.set_xlabel("minutes to the decision")
    right.set_title("time to decision (each dot a run)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
