"""`make demo` / `graft demo`: the whole story on one machine.

A dev cluster (API server emulator, three real engine pods, a real Prometheus, the operator),
steady BBH traffic, and two rollouts from examples/: kv-align@3.2.1 promoted step by step
(rollout-cpu-fleet.yaml, whose gate is sized for a fleet of about one request a second), then the
fault@1 fire drill rolled back on its own (rollout-fault-test.yaml). The examples run as written,
their checks and thresholds included; only their pauses and analysis interval are shortened, and
they ask the operator's Prometheus (the dev cluster's). A live view shows step, weight, pods and every
breaker and gate against its threshold; the run ends with a report (Events and the decision behind
each) and a timeline plot per rollout, written under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from graft.bench.data import bbh_prompts
from graft.devcluster.cluster import ROOT, ClusterOptions, DevCluster, object_path
from graft.rollout.spec import DEFAULT_STEPS, parse_spec

FINAL = {"Promoted", "RolledBack", "Failed"}
DEMO_TASKS = ["date_understanding", "boolean_expressions", "sports_understanding"]
EXAMPLES = ("rollout-cpu-fleet.yaml", "rollout-fault-test.yaml")
# what the timeline plots, below the weight: a breaker's value and a gate's
PLOTTED = (("breaker/error-rate", "canary error rate"), ("gate/error-rate-delta", "canary - stable errors"))


@dataclass
class Timeline:
    name: str
    samples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, t: float, ro: dict[str, Any]) -> None:
        st = ro.get("status", {})
        results = {f'{r.get("role", "breaker")}/{r["name"]}': r for r in st.get("analysis", {}).get("results", [])}
        self.samples.append({"t": t, "phase": st.get("phase"), "weight": st.get("weight", 0),
                             "step": st.get("stepIndex"), "results": results})


def demo_rollout(path: Path, namespace: str, pause: str, interval: str) -> dict[str, Any]:
    """An examples/ manifest as the demo runs it: in the demo's namespace, each step's pause and the
    analysis interval shortened; its checks and thresholds exactly as the file has them."""
    ro = yaml.safe_load(path.read_text())
    ro["metadata"]["namespace"] = namespace
    spec = ro["spec"]
    steps = spec.get("steps") or DEFAULT_STEPS
    spec["steps"] = [{**s, **({"pause": pause} if "pause" in s else {})} for s in steps]
    spec.setdefault("analysis", {})["interval"] = interval
    return ro


def thresholds_of(ro: dict[str, Any]) -> dict[str, float]:
    """Each check's upper limit, by `role/name` (what the plot draws as a dashed line)."""
    return {c.key: c.max for c in parse_spec(ro["spec"]).analysis.checks if c.max is not None}


def view(cluster: DevCluster, ro: dict[str, Any] | None, traffic, pods: list[dict]) -> Group:
    head = Table.grid(padding=(0, 2))
    if ro is None:
        return Group(Panel("waiting for the rollout ..."))
    st, spec = ro.get("status", {}), ro["spec"]
    steps = [s["weight"] for s in spec.get("steps", [])]
    idx = st.get("stepIndex")
    head.add_row("rollout", f"[bold]{ro['metadata']['name']}[/]  patch {spec['patch']['name']}@{spec['patch']['version']}")
    head.add_row("phase", f"[bold]{st.get('phase', '-')}[/]  {st.get('message', '')}")
    head.add_row("step", f"{(idx or 0) + 1}/{len(steps)}  weights {steps}  now {st.get('weight', 0)}%")
    head.add_row("revisions", f"canary {st.get('canaryRevision', '-')}  stable {st.get('stableRevision', '-')}")
    pt = Table(title="pods", expand=True)
    for col in ("pod", "track", "revision", "ready", "restarts", "requests"):
        pt.add_column(col)
    by_pod = traffic.stats.by_pod() if traffic else {}
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name = p["metadata"]["name"]
        labels, ann = p["metadata"].get("labels", {}), p["metadata"].get("annotations", {})
        cs = (p.get("status", {}).get("containerStatuses") or [{}])[0]
        pt.add_row(name, labels.get("graft.dev/track", "-"), ann.get("graft.dev/patches", "-"),
                   "yes" if cs.get("ready") else "no", str(cs.get("restartCount", 0)), str(by_pod.get(name, 0)))
    mt = Table(title="analysis", expand=True)
    for col in ("check", "value", "threshold", "verdict", "breaches"):
        mt.add_column(col)
    for r in st.get("analysis", {}).get("results", []):
        v = r.get("value")
        colour = {"Successful": "green", "Failed": "red", "Inconclusive": "yellow"}.get(r.get("verdict"), "white")
        name = f'{r.get("role", "breaker")} {r["name"]}' + (" (dry run)" if r.get("dryRun") else "")
        mt.add_row(name, "-" if v is None else f"{v:.4g}", str(r.get("threshold", "")),
                   f"[{colour}]{r.get('verdict')}[/]", str(r.get("breaches", 0)) if r.get("role") != "gate" else "")
    failed = len(traffic.stats.failed()) if traffic else 0
    total = len(traffic.stats.outcomes) if traffic else 0
    foot = f"client requests: {total}, failed: {failed}"
    return Group(Panel(head, title="graft demo"), pt, mt, foot)


def plot(timeline: Timeline, out: Path, thresholds: dict[str, float]) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = timeline.samples
    t0 = s[0]["t"]
    ts = [x["t"] - t0 for x in s]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    axes[0].step(ts, [x["weight"] or 0 for x in s], where="post", color="tab:blue")
    axes[0].set_ylabel("canary weight %")
    axes[0].set_ylim(-5, 105)
    for ax, (metric, label) in zip(axes[1:], PLOTTED):
        vals = [x["results"].get(metric, {}).get("value") for x in s]
        ax.plot(ts, [v if v is not None else float("nan") for v in vals], marker=".", color="tab:orange")
        if metric in thresholds:
            ax.axhline(thresholds[metric], color="tab:red", linestyle="--", label="threshold")
            ax.legend(loc="upper left")
        ax.set_ylabel(label)
    phases = [(x["t"] - t0, x["phase"]) for i, x in enumerate(s) if i == 0 or x["phase"] != s[i - 1]["phase"]]
    for t, ph in phases:
        axes[0].annotate(ph, (t, 102), fontsize=8, rotation=20)
    axes[2].set_xlabel("seconds")
    fig.suptitle(f"PatchRollout {timeline.name}")
    fig.tight_layout()
    path = out / f"{timeline.name}-timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


async def run_rollout(cluster: DevCluster, ro: dict[str, Any], traffic, console: Console,
                      timeout: float) -> tuple[Timeline, dict[str, Any]]:
    name = ro["metadata"]["name"]
    await cluster.apply(ro)
    timeline = Timeline(name)
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = ro
    with Live(console=console, refresh_per_second=2, transient=False) as live:
        while time.monotonic() < deadline:
            cur = await cluster.rollout(name)
            pods = await cluster.pod_objects()
            if cur is not None:
                last = cur
                timeline.add(time.time(), cur)
            live.update(view(cluster, cur, traffic, pods))
            if cur is not None and cur.get("status", {}).get("phase") in FINAL:
                break
            await asyncio.sleep(1.0)
    return timeline, last


async def abort_unfinished(cluster: DevCluster, ro: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """A rollout still running when its time is up is aborted (graft.dev/abort): the operator runs one
    rollout per fleet at a time, so the next would wait behind it for ever."""
    name = ro["metadata"]["name"]
    await cluster.api.patch(object_path(ro), json={"metadata": {"annotations": {"graft.dev/abort": "true"}}},
                            headers={"content-type": "application/merge-patch+json"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cur = await cluster.rollout(name)
        if cur is None or cur.get("status", {}).get("phase") in FINAL:
            break
        await asyncio.sleep(1.0)
    return cur or ro


def report(out: Path, runs: list[tuple[Timeline, dict[str, Any], list[dict], Path]], traffic,
           started: float) -> Path:
    lines = ["# Graft demo report", "",
             f"Run on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))} with `make demo`: "
             "three engine pods (SmolLM2-135M-Instruct on CPU), a real Prometheus, the operator, "
             "and steady BBH traffic through a pod-ratio router.", ""]
    for timeline, ro, events, png in runs:
        st = ro.get("status", {})
        lines += [f"## {timeline.name}: {st.get('phase')}", "",
                  f"Patch `{ro['spec']['patch']['name']}@{ro['spec']['patch']['version']}`; "
                  f"final weight {st.get('weight')}%; {st.get('message', '')}", "",
                  f"![timeline]({png.name})", "", "| time | reason | message |", "|---|---|---|"]
        for e in events:
            when = e.get("lastTimestamp") or e.get("eventTime") or ""
            msg = (e.get("message") or "").replace("|", "\\|")
            lines.append(f"| {when} | {e.get('reason')} | {msg} |")
        lines.append("")
    total = len(traffic.stats.outcomes)
    failed = traffic.stats.failed()
    lines += ["## Client traffic", "", f"{total} requests, {len(failed)} not answered 200.", ""]
    if failed:
        by = {}
        for o in failed:
            by.setdefault((o.pod, o.status, o.error[:80]), 0)
            by[(o.pod, o.status, o.error[:80])] += 1
        lines += ["| pod | status | error | count |", "|---|---|---|---|"]
        lines += [f"| {p} | {s} | {e} | {n} |" for (p, s, e), n in sorted(by.items())]
    path = out / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path


async def _demo(args: argparse.Namespace) -> int:
    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    import logging
    for noisy in ("httpx", "aiohttp.access", "kopf"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # two questions per task: their shared 3-shot prefix stays in each engine's prefix cache
    prompts = [p.text for p in bbh_prompts(args.data_dir, tasks=DEMO_TASKS, per_task=2)]
    workdir = Path(args.workdir)
    with console.status("starting the dev cluster: API server, Prometheus, operator, engine pods ..."):
        cluster = DevCluster(ClusterOptions(workdir=workdir, pods=args.pods))
        await cluster.__aenter__()
    try:
        with console.status("waiting for the engine pods to load the model and turn ready ..."):
            await cluster.wait_ready(timeout=300)
        console.print(f"[green]fleet ready[/]: {args.pods} pods. Watch from another terminal:\n"
                      f"  kubectl --kubeconfig {cluster.kubeconfig.resolve()} get patchrollouts -n llm -w")
        runs = []
        async with cluster.traffic(prompts, rate=args.rate, max_tokens=4) as traffic:
            with console.status("warming up: traffic on the stable fleet ..."):
                await asyncio.sleep(args.warmup)
            for example in EXAMPLES:
                ro = demo_rollout(ROOT / "examples" / example, cluster.namespace, args.pause, args.interval)
                console.rule(f"{example}: {ro['spec']['patch']['name']}@{ro['spec']['patch']['version']}")
                timeline, final = await run_rollout(cluster, ro, traffic, console, timeout=args.timeout)
                if final.get("status", {}).get("phase") not in FINAL:
                    console.print(f"[yellow]{ro['metadata']['name']} did not finish within {args.timeout:g} s: "
                                  f"aborting it[/] ({final.get('status', {}).get('message', '')})")
                    await abort_unfinished(cluster, ro)
                events = await cluster.events(ro["metadata"]["name"])
                png = plot(timeline, out, thresholds_of(ro))
                runs.append((timeline, final, events, png))
                (out / f"{timeline.name}-timeline.json").write_text(json.dumps(timeline.samples, indent=1))
                console.print(f"[bold]{timeline.name}[/]: {final.get('status', {}).get('phase')} "
                              f"— {final.get('status', {}).get('message', '')}")
        path = report(out, runs, traffic, started)
        et = Table(title="what happened")
        for col in ("rollout", "phase", "events", "plot"):
            et.add_column(col)
        for timeline, final, events, png in runs:
            et.add_row(timeline.name, final.get("status", {}).get("phase", "-"), str(len(events)), str(png))
        console.print(et)
        console.print(f"report: {path}  ({time.time() - started:.0f} s in all)")
        phases = [final.get("status", {}).get("phase") for _, final, _, _ in runs]
        return 0 if phases == ["Promoted", "RolledBack"] else 1
    finally:
        with console.status("stopping the dev cluster ..."):
            await cluster.__aexit__(None, None, None)


def main(args: argparse.Namespace) -> int:
    return asyncio.run(_demo(args))
