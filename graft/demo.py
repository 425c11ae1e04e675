"""`make demo` / `graft demo`: the whole story on one machine.

A dev cluster (API server emulator, three real engine pods behind the readiness gate
graft.dev/patched, a real Prometheus, the operator), steady BBH traffic, and, from examples/:

1. kv-align@3.2.1 promoted step by step (rollout-cpu-fleet.yaml, whose gate is sized for a fleet of
   about one request a second);
2. the fleet's durable state: the engine Deployment scaled up by one pod, which the PatchFleet
   controller patches to the promoted revision before its gate lets it take traffic; the demo fails
   if the new pod is not Ready at that revision, and answering, within --scale-timeout;
3. the silent-drift drill (rollout-drift-test.yaml): drift@1 answers wrongly past 208 tokens of
   context (beyond the self-check's probe, below every prompt the traffic sends) while its error
   rate and latency stay flat; it must be rolled back by output-divergence, the canary's comparison
   of its answers with the table it ran before;
4. the fault@1 fire drill, rolled back by its error-rate breaker (rollout-fault-test.yaml).

The examples run as written, their checks and thresholds included; only their pauses and analysis
interval are shortened (an act may hold its first step longer: the drift drill's evidence comes at
six comparisons a minute), and they ask the operator's Prometheus (the dev cluster's). The live view
shows each rollout as `graft rollout status` does (graft.operator.render) and the pods as the
cluster sees them. Everything is written under --out (.graft-demo by default): the report
(report.md, with the Events and the decision behind each, and what the new pod did when), a timeline
plot per rollout, and, in its cluster/ folder, the logs of this process, the operator and each pod,
which never reach the terminal while the live view runs.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from graft.api import FINAL_PHASES as FINAL
from graft.bench.data import bbh_prompts
from graft.devcluster.cluster import APP, ROOT, ClusterOptions, DevCluster, object_path
from graft.devcluster.traffic import TRAFFIC_TASKS, TrafficStats
from graft.operator.pods import PATCHES_ANNOTATION, TRACK_LABEL, admin_address, is_ready
from graft.operator.render import render_status
from graft.rollout.durations import format_duration, parse_duration
from graft.rollout.fleet import PATCHED_CONDITION
from graft.rollout.spec import DEFAULT_STEPS, parse_spec
from graft.rollout.status import from_time

DEMO_TASKS = list(TRAFFIC_TASKS)


@dataclass(frozen=True, slots=True)
class Act:
    """One rollout of the demo: an examples/ manifest and how it must end."""

    example: str
    expected: str                       # the phase it must end in
    rolled_back_by: str | None = None   # the check whose failure must have rolled it back
    first_pause: float = 0.0            # seconds its first step holds at least, whatever --pause says
    scale_up: bool = False              # once it is promoted, the fleet grows by one pod


# The drift drill's first step holds up to 90 s: it is rolled back as soon as its canary has compared
# 3 of its answers, all divergent, the least evidence that rolls back (docs/analysis.md), which takes
# 20-35 s on a quiet machine (at least 6 comparisons a minute once the first recorded requests have
# finished). The pause only matters on a loaded machine, where the patch's self-check and the
# comparisons take longer; a step that ends first changes only the step the drill is rolled back
# at: the breaker counts every comparison since the rollout began, and its gate holds the last
# step with stable pods.
DRIFT_FIRST_PAUSE = 90.0
ACTS = (
    Act("rollout-cpu-fleet.yaml", "Promoted", scale_up=True),
    Act("rollout-drift-test.yaml", "RolledBack", rolled_back_by="output-divergence", first_pause=DRIFT_FIRST_PAUSE),
    Act("rollout-fault-test.yaml", "RolledBack", rolled_back_by="error-rate"),
)
EXAMPLES = tuple(a.example for a in ACTS)
EXPECTED = [a.expected for a in ACTS]      # how each example ends
DEPLOYMENT = FLEET = "llm-engine"           # the dev cluster's engine Deployment, and the PatchFleet of its pods
ADMIN_PORT = 8081
ROLLED_BACK = ("RollingBack", "RolledBack", "Failed")
# a new pod's way into the fleet, in the order it goes
MOMENTS = (("created", "pod created"), ("running", "engine running (its readiness probe passes)"),
           ("patched", "engine runs the promoted revision"), ("gate", f"gate {PATCHED_CONDITION} open"),
           ("ready", "pod Ready: it takes traffic"), ("served", "first client request answered"))


class DemoError(Exception):
    """Something the demo shows did not happen: said on the terminal, and the exit code is 1."""


@dataclass(frozen=True, slots=True)
class DemoPaths:
    """Where a run writes: the report beside the dev cluster's folder of logs."""

    out: Path            # report.md, the timeline plots and their data
    workdir: Path        # the dev cluster: kubeconfig, operator.log, pods/<pod>.log, and demo.log

    @property
    def log(self) -> Path:
        """This process's log (dev cluster, API server, pod runner): kept off the terminal."""
        return self.workdir / "demo.log"

    @property
    def logs_hint(self) -> str:
        return f"{self.workdir}/ (demo.log, operator.log, pods/<pod>.log)"


def demo_paths(args: argparse.Namespace) -> DemoPaths:
    out = Path(args.out)
    return DemoPaths(out, Path(args.workdir) if args.workdir else out / "cluster")


def prepare_workdir(workdir: Path) -> None:
    """A fresh dev cluster folder: the last run's logs removed, and a .gitignore of its own, so a
    run with `--out docs/demo` leaves the report to commit and nothing else."""
    (workdir / "pods").mkdir(parents=True, exist_ok=True)
    (workdir / ".gitignore").write_text("# logs and state of a graft demo run\n*\n")
    for old in [workdir / "demo.log", workdir / "operator.log", *(workdir / "pods").glob("*.log")]:
        old.unlink(missing_ok=True)


@contextlib.contextmanager
def logs_to(path: Path) -> Iterator[None]:
    """Every log record of this process goes to `path` alone while the block runs (a line on the
    terminal would tear the live view), then the handlers are as they were."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    chatty = {name: logging.getLogger(name).level for name in ("httpx", "aiohttp.access")}
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers[:] = [handler]
    if level == logging.NOTSET or level > logging.INFO:
        root.setLevel(logging.INFO)
    for name in chatty:         # a line per request: the API server and the traffic make several a second
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for name, was in chatty.items():
            logging.getLogger(name).setLevel(was)
        root.handlers[:] = handlers
        root.setLevel(level)
        handler.close()


@dataclass
class Timeline:
    name: str
    samples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, t: float, ro: dict[str, Any]) -> None:
        st = ro.get("status", {})
        analysis = st.get("analysis") or {}
        results = {f'{r.get("role", "breaker")}/{r["name"]}': r for r in analysis.get("results", [])}
        self.samples.append({"t": t, "phase": st.get("phase"), "weight": st.get("weight", 0),
                             "step": st.get("stepIndex"), "run": analysis.get("lastRun"), "results": results})


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def _running(pod: dict[str, Any]) -> bool:
    """Its container is up and passes its readiness probe (the gate aside): its engine can be asked."""
    return condition(pod, "ContainersReady").get("status") == "True"


@dataclass
class Join:
    """A pod added after the promotion, from the scale-up to its first answered request."""

    revision: str                           # the promoted revision the new pod must run
    replicas: tuple[int, int]               # before, after
    scaled_at: float
    pod: str | None = None
    moments: dict[str, float] = field(default_factory=dict)   # MOMENTS key -> epoch seconds
    engine_revisions: list[str] = field(default_factory=list)  # as its engine answered, in order
    revision_at_ready: str | None = None    # what the engine ran when the pod was first seen Ready
    ready_condition: str | None = None      # the Ready condition's lastTransitionTime, as the cluster keeps it
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.revision_at_ready == self.revision and "served" in self.moments

    def after(self, key: str) -> str:
        return f"+{self.moments[key] - self.scaled_at:.1f} s" if key in self.moments else "-"

    def observe(self, pod: dict[str, Any], revision: str | None, stats: TrafficStats) -> None:
        """Take in one look at the new pod (and what its engine answered, None if it did not), and
        the client requests it has answered so far."""
        now = time.time()
        self.pod = pod["metadata"]["name"]
        self.moments.setdefault("created", now)
        if _running(pod):
            self.moments.setdefault("running", now)
        if revision is not None and (not self.engine_revisions or self.engine_revisions[-1] != revision):
            self.engine_revisions.append(revision)
        if revision == self.revision:
            self.moments.setdefault("patched", now)
        if condition(pod, PATCHED_CONDITION).get("status") == "True":
            self.moments.setdefault("gate", now)
        if is_ready(pod):
            self.moments.setdefault("ready", now)
            self.ready_condition = self.ready_condition or condition(pod, "Ready").get("lastTransitionTime")
            if self.revision_at_ready is None and revision is not None:
                self.revision_at_ready = revision
                if revision != self.revision:
                    self.error = f"pod {self.pod} turned Ready running {revision}, not the promoted {self.revision}"
        answered = [o.at + o.latency for o in stats.outcomes if o.pod == self.pod and o.status == 200]
        if answered and self.revision_at_ready == self.revision:
            self.moments.setdefault("served", min(answered))


def demo_rollout(path: Path, namespace: str, pause: str, interval: str, first_pause: float = 0.0) -> dict[str, Any]:
    """An examples/ manifest as the demo runs it: in the demo's namespace, each step's pause and the
    analysis interval shortened (the first step's to no less than `first_pause` seconds); its checks
    and thresholds exactly as the file has them."""
    ro = yaml.safe_load(path.read_text())
    ro["metadata"]["namespace"] = namespace
    spec = ro["spec"]
    steps = spec.get("steps") or DEFAULT_STEPS
    spec["steps"] = [{**s, **({"pause": pause} if "pause" in s else {})} for s in steps]
    first = spec["steps"][0]
    if "pause" in first and parse_duration(first["pause"]) < first_pause:
        first["pause"] = format_duration(first_pause)
    spec.setdefault("analysis", {})["interval"] = interval
    return ro


def rollback_cause(ro: dict[str, Any]) -> list[str]:
    """The checks whose failure rolled the rollout back, as its status names them (reason
    AnalysisFailed, the cause `analysis failed at step 1/3: breaker output-divergence ...; ...`);
    empty when it was not rolled back by its analysis (aborted, a deadline, a refused patch)."""
    st = ro.get("status") or {}
    if st.get("reason") != "AnalysisFailed":
        return []
    known = {r.get("name") for r in (st.get("analysis") or {}).get("results") or []}
    named = re.findall(r"(?:^|: |; )(?:breaker|gate) ([A-Za-z0-9_.-]+)", st.get("cause") or st.get("message") or "")
    return [n for n in dict.fromkeys(named) if n in known]


def act_problem(act: Act, ro: dict[str, Any]) -> str | None:
    """Why the act did not end as the demo expects it to; None when it did."""
    st = ro.get("status") or {}
    name = ro["metadata"]["name"]
    if st.get("phase") != act.expected:
        return f"{name} ended {st.get('phase')}, not {act.expected} ({st.get('message', '')})"
    if act.rolled_back_by is not None:
        causes = rollback_cause(ro)
        if act.rolled_back_by not in causes:
            return (f"{name} was rolled back by {', '.join(causes) or st.get('reason') or 'nothing named'}, "
                    f"not by {act.rolled_back_by} ({st.get('message', '')})")
    return None


def thresholds_of(ro: dict[str, Any]) -> dict[str, float]:
    """Each check's upper limit, by `role/name` (what the plot draws as a dashed line)."""
    return {c.key: c.max for c in parse_spec(ro["spec"]).analysis.checks if c.max is not None}


# the live view
def pods_table(pods: Sequence[dict[str, Any]], stats: TrafficStats | None) -> Table:
    """The engine pods as the cluster has them: Ready (gate included), the gate, track and revision
    the operator marked, and the client requests each answered."""
    table = Table(title="Engine pods (cluster)", title_justify="left")
    for col in ("pod", "ready", "gate", "track", "revision", "restarts", "requests"):
        table.add_column(col)
    by_pod = stats.by_pod() if stats else {}
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name, meta = p["metadata"]["name"], p["metadata"]
        gate = condition(p, PATCHED_CONDITION).get("status")
        cs = ((p.get("status") or {}).get("containerStatuses") or [{}])[0]
        table.add_row(name, "[green]yes[/]" if is_ready(p) else "[yellow]no[/]",
                      {"True": "open", "False": "closed"}.get(gate or "", "-"),
                      (meta.get("labels") or {}).get(TRACK_LABEL, "-"),
                      (meta.get("annotations") or {}).get(PATCHES_ANNOTATION, "-"),
                      str(cs.get("restartCount", 0)), str(by_pod.get(name, 0)))
    return table


def header(stats: TrafficStats | None, paths: DemoPaths) -> str:
    """The first lines of the live view (what a short terminal cuts is the bottom): traffic, logs."""
    total, failed = (len(stats.outcomes), len(stats.failed())) if stats else (0, 0)
    return f"client requests: {total}, failed: {failed}   logs: {paths.logs_hint}"


def view(ro: dict[str, Any] | None, events: Sequence[dict[str, Any]], pods: Sequence[dict[str, Any]],
         stats: TrafficStats | None, paths: DemoPaths) -> Group:
    """A rollout as `graft rollout status` shows it, then the cluster's pods and the client traffic."""
    rollout = render_status(ro, events=events, pods=pods) if ro is not None else Panel("waiting for the rollout ...")
    return Group(header(stats, paths), rollout, pods_table(pods, stats))


def join_view(join: Join, pods: Sequence[dict[str, Any]], fleet: dict[str, Any] | None,
              stats: TrafficStats | None, paths: DemoPaths, timeout: float) -> Group:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    before, after = join.replicas
    head.add_row("scale-up", f"deployment/{DEPLOYMENT}: {before} -> {after} pods; the new pod must run "
                             f"{join.revision} before it is Ready (bound {timeout:g} s)")
    head.add_row("new pod", join.pod or "not created yet")
    for key, label in MOMENTS:
        head.add_row(f"  {label}", join.after(key) if key in join.moments else "[dim]waiting[/]")
    head.add_row("engine answered", " -> ".join(join.engine_revisions) or "-")
    converged = next((c for c in ((fleet or {}).get("status") or {}).get("conditions") or []
                      if c.get("type") == "Converged"), {})
    head.add_row(f"PatchFleet {FLEET}", converged.get("message") or "-")
    return Group(header(stats, paths), Panel(head, title="the fleet's durable state"), pods_table(pods, stats))


# the cluster
async def open_fleet(cluster: DevCluster, pods: int, timeout: float) -> None:
    """The fleet at `base`: a PatchFleet with no patch, whose controller opens each pod's readiness
    gate once it has seen its engine run `base` (with no fleet at all the gates stay shut)."""
    assert cluster.api is not None
    reply = await cluster.api.post(f"/apis/graft.dev/v1alpha1/namespaces/{cluster.namespace}/patchfleets", json={
        "apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet", "metadata": {"name": FLEET},
        "spec": {"selector": {"matchLabels": dict(APP)}, "patches": []}})
    if reply.status_code >= 400:
        raise DemoError(f"cannot create the PatchFleet {FLEET}: {reply.status_code} {reply.text[:200]}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = await cluster.pod_objects()
        if len(current) >= pods and all(is_ready(p) for p in current):
            return
        await asyncio.sleep(0.5)
    raise DemoError(f"the PatchFleet {FLEET} did not open the pods' readiness gates within {timeout:g} s")


async def engine_revision(client: httpx.AsyncClient, pod: dict[str, Any], token: str) -> str | None:
    """The revision the pod's engine runs, asked of its admin API; None while it cannot answer."""
    address = admin_address(pod, ADMIN_PORT)
    if address is None:
        return None
    try:
        r = await client.get(f"http://{address[0]}:{address[1]}/admin/patches",
                             headers={"Authorization": f"Bearer {token}"})
        return r.json().get("revision") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def scale_up(api: httpx.AsyncClient, namespace: str, token: str, revision: str, stats: TrafficStats,
                   timeout: float, on_sample: Callable[[Join, list[dict[str, Any]]], Any] | None = None,
                   interval: float = 0.25) -> Join:
    """Add one pod to the engine Deployment (its scale subresource, as `kubectl scale` does) and
    follow it until it is Ready running `revision` and has answered a client request; `error` says
    what did not happen when `timeout` seconds pass first, or when it turns Ready on another revision."""
    scale_path = f"/apis/apps/v1/namespaces/{namespace}/deployments/{DEPLOYMENT}/scale"
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    scale = await api.get(scale_path)
    if scale.status_code != 200:
        raise DemoError(f"cannot read the scale of deployment/{DEPLOYMENT}: {scale.status_code} {scale.text[:200]}")
    before = int(scale.json()["spec"]["replicas"])
    known = {p["metadata"]["name"] for p in (await api.get(pods_path)).json()["items"]}
    reply = await api.patch(scale_path, json={"spec": {"replicas": before + 1}},
                            headers={"content-type": "application/merge-patch+json"})
    if reply.status_code >= 400:
        raise DemoError(f"cannot scale deployment/{DEPLOYMENT}: {reply.status_code} {reply.text[:200]}")
    join = Join(revision, (before, before + 1), time.time())
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as admin:
        while True:
            pods = (await api.get(pods_path)).json()["items"]
            new = sorted((p for p in pods if p["metadata"]["name"] not in known),
                         key=lambda p: p["metadata"].get("creationTimestamp") or "")
            if new:
                join.observe(new[0], await engine_revision(admin, new[0], token) if _running(new[0]) else None,
                             stats)
            if on_sample is not None:
                on_sample(join, pods)
            if join.done or join.error:
                return join
            if time.monotonic() > deadline:
                join.error = _not_joined(join, timeout)
                return join
            await asyncio.sleep(interval)


def _not_joined(join: Join, timeout: float) -> str:
    if join.pod is None:
        return f"no new pod appeared within {timeout:g} s of scaling deployment/{DEPLOYMENT} to {join.replicas[1]}"
    missing = next(label for key, label in MOMENTS if key not in join.moments)
    seen = " -> ".join(join.engine_revisions) or "no answer"
    return (f"pod {join.pod} did not reach the promoted revision {join.revision} within {timeout:g} s: "
            f"still waiting for '{missing}' (its engine answered: {seen})")


async def run_rollout(cluster: DevCluster, ro: dict[str, Any], traffic, console: Console, timeout: float,
                      paths: DemoPaths) -> tuple[Timeline, dict[str, Any]]:
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
            live.update(view(cur, await cluster.events(name), pods, traffic.stats, paths))
            if cur is not None and cur.get("status", {}).get("phase") in FINAL:
                break
            await asyncio.sleep(1.0)
    return timeline, last


async def run_scale_up(cluster: DevCluster, traffic, console: Console, revision: str, timeout: float,
                       paths: DemoPaths) -> tuple[Join, list[dict[str, Any]]]:
    """The scale-up with its live view; the PatchFleet's Events from the scale on come back with it."""
    assert cluster.api is not None
    fleet_path = f"/apis/graft.dev/v1alpha1/namespaces/{cluster.namespace}/patchfleets/{FLEET}"
    fleet: dict[str, Any] | None = None
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        def show(join: Join, pods: list[dict[str, Any]]) -> None:
            live.update(join_view(join, pods, fleet, traffic.stats, paths, timeout))

        async def follow_fleet() -> None:
            nonlocal fleet
            while True:
                fleet = await cluster.get(fleet_path)
                await asyncio.sleep(1.0)

        follower = asyncio.create_task(follow_fleet())
        try:
            join = await scale_up(cluster.api, cluster.namespace, cluster.token, revision, traffic.stats, timeout,
                                  on_sample=show)
        finally:
            follower.cancel()
    events = [e for e in await cluster.events(FLEET) if (e.get("involvedObject") or {}).get("kind") == "PatchFleet"
              and _epoch(e.get("lastTimestamp") or e.get("eventTime")) >= join.scaled_at - 1]
    return join, events


def _epoch(text: str | None) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else 0.0


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


# the report
def _key(samples: Sequence[dict[str, Any]], name: str) -> str | None:
    """The `role/name` under which a check's results were recorded (a breaker first)."""
    for key in (f"breaker/{name}", f"gate/{name}"):
        if any(key in x["results"] for x in samples):
            return key
    return None


def series(samples: Sequence[dict[str, Any]], key: str | None, number: str | None = None,
           scale: float = 1.0, missing: float = float("nan")) -> tuple[list[float], list[float]]:
    """One check's value (or one of its `numbers`) over time, one point per analysis run, as
    (seconds since the first sample, value); `missing` where the run had none (NaN: no point)."""
    if key is None or not samples:
        return [], []
    t0, ts, vs, runs = samples[0]["t"], [], [], set()
    for x in samples:
        r = x["results"].get(key)
        if r is None or (x.get("run") is not None and x["run"] in runs):
            continue
        runs.add(x.get("run"))
        v = r.get("value") if number is None else (r.get("numbers") or {}).get(number)
        ts.append(x["t"] - t0)
        vs.append(missing if v is None else float(v) * scale)
    return ts, vs


def _dry(samples: Sequence[dict[str, Any]], key: str | None) -> str:
    return " (dry run)" if key and any(x["results"].get(key, {}).get("dryRun") for x in samples) else ""


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this rollout's analysis", transform=ax.transAxes, ha="center",
            va="center", fontsize=9, color="0.4")


def plot(timeline: Timeline, out: Path, thresholds: dict[str, float]) -> Path:
    """The rollout over time: its weight, then what the analysis saw at each run: the canary's error
    rate (and its difference from stable), TTFT and TPOT p99 of canary and stable, and the shadow
    comparisons behind output-divergence (compared and divergent counts, the divergent share with
    the lower bound the breaker judges)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = timeline.samples
    t0 = s[0]["t"]
    ts = [x["t"] - t0 for x in s]
    fig, axes = plt.subplots(5, 1, figsize=(9, 12.5), sharex=True,
                             gridspec_kw={"height_ratios": [1, 1.1, 1.3, 1.1, 1.1]})
    weight, errors, latency, compared, share = axes
    weight.step(ts, [x["weight"] or 0 for x in s], where="post", color="tab:blue")
    weight.set_ylabel("canary weight %")
    weight.set_ylim(-5, 115)
    phases = [(x["t"] - t0, x["phase"]) for i, x in enumerate(s) if i == 0 or x["phase"] != s[i - 1]["phase"]]
    for t, ph in phases:
        weight.annotate(ph, (t, 104), fontsize=8, rotation=12)
    decided = next((x["t"] - t0 for x in s if x["phase"] in ROLLED_BACK), None)

    # error rate: the canary's, and canary minus stable
    key, gate = _key(s, "error-rate"), _key(s, "error-rate-delta")
    drawn = False
    for k, label, color, style in ((key, "canary error rate", "tab:orange", "o-"),
                                   (gate, "canary - stable (pp)", "tab:purple", ".--")):
        x, y = series(s, k, scale=100)
        if x:
            errors.plot(x, y, style, markersize=4, color=color, label=label + _dry(s, k))
            drawn = True
    if key in thresholds:
        errors.axhline(thresholds[key] * 100, color="tab:red", linestyle="--", label="error-rate limit")
    errors.set_ylabel("errors %")
    errors.legend(loc="upper left", fontsize=8) if drawn else _empty(errors, "error-rate check")

    # latency: canary solid, stable dashed
    drawn = False
    for name, color in (("ttft-p99", "tab:green"), ("tpot-p99", "tab:brown")):
        k = _key(s, name)
        for number, style, side in (("canary_quantile", "-", "canary"), ("stable_quantile", "--", "stable")):
            x, y = series(s, k, number, scale=1000)
            if x and any(not math.isnan(v) and v > 0 for v in y):
                latency.plot(x, [v if v > 0 else float("nan") for v in y], style, marker=".", color=color,
                             label=f"{name.split('-')[0].upper()} p99 {side}{_dry(s, k)}")
                drawn = True
    if drawn:
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
        latency.set_yscale("log")
        latency.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        latency.yaxis.set_major_formatter(ScalarFormatter())
        latency.yaxis.set_minor_formatter(NullFormatter())
        latency.legend(loc="upper left", fontsize=8, ncol=2)
    else:
        _empty(latency, "latency check")
    latency.set_ylabel("p99 ms (median over pods)")

    # output divergence: the shadow comparisons over the rollout so far
    key = _key(s, "output-divergence")
    x, n = series(s, key, "compared", missing=0.0)     # a run with no comparison saw none
    if x:
        _, k = series(s, key, "divergent", missing=0.0)
        compared.step(x, n, where="post", color="tab:blue", linewidth=2.5, alpha=0.6, label="compared")
        compared.plot(x, n, ".", color="tab:blue")
        compared.step(x, k, where="post", color="tab:red", linestyle="--", label="divergent")
        compared.plot(x, k, "x", color="tab:red")
        compared.set_ylim(-0.5, max(max(n), 3) * 1.15)
        compared.legend(loc="upper left", fontsize=8)
        _, v = series(s, key, scale=100)
        _, lo = series(s, key, "lower", scale=100)
        share.plot(x, v, marker=".", color="tab:red", label="divergent share")
        share.plot(x, lo, marker=".", linestyle=":", color="tab:gray", label="its lower bound (rollbackConfidence)")
        if key in thresholds:
            share.axhline(thresholds[key] * 100, color="tab:red", linestyle="--", label="limit")
        share.set_ylim(-5, 105)
        share.legend(loc="upper left", fontsize=8)
    else:
        _empty(compared, "output-divergence check")
        _empty(share, "output-divergence check")
    compared.set_ylabel("shadow comparisons\n(rollout so far)")
    share.set_ylabel("divergent %")
    if decided is not None:
        for ax in axes:
            ax.axvline(decided, color="0.5", linewidth=0.8)
    share.set_xlabel("seconds since the rollout was applied")
    fig.suptitle(f"PatchRollout {timeline.name}")
    fig.tight_layout()
    path = out / f"{timeline.name}-timeline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def _events_table(events: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| time | reason | message |", "|---|---|---|"]
    for e in events:
        when = e.get("lastTimestamp") or e.get("eventTime") or ""
        msg = (e.get("message") or "").replace("|", "\\|")
        lines.append(f"| {when} | {e.get('reason')} | {msg} |")
    return lines


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.3g}%"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def decision_lines(timeline: Timeline, ro: dict[str, Any], shadow: dict[str, float] | None = None) -> list[str]:
    """What decided the rollout, in numbers: the check that rolled it back (or the comparisons
    behind a promotion), when, and what every check saw in the last analysis run."""
    st = ro.get("status") or {}
    results = (st.get("analysis") or {}).get("results") or []
    by_name: dict[str, dict[str, Any]] = {}     # a check by name: its failing result first, a breaker's next
    for r in sorted(results, key=lambda r: (r.get("verdict") != "Failed", r.get("role", "breaker") != "breaker")):
        by_name.setdefault(r["name"], r)
    t0 = timeline.samples[0]["t"] if timeline.samples else None
    run = from_time((st.get("analysis") or {}).get("lastRun"))
    after = f"{run - t0:.0f} s after the rollout was applied" if run and t0 else "at the last analysis run"
    lines: list[str] = []
    causes = rollback_cause(ro)
    if causes:
        steps = ro["spec"].get("steps") or DEFAULT_STEPS
        index = min(int(st.get("stepIndex") or 0), len(steps) - 1)
        lines.append(f"**Rolled back by {', '.join(f'`{c}`' for c in causes)}** at step "
                     f"{index + 1}/{len(steps)} (weight {steps[index].get('weight')}%), {after}:")
        lines.append("")
        for c in causes:
            r = by_name[c]
            nums = r.get("numbers") or {}
            if "compared" in nums:
                lines.append(f"- `{c}`: {nums['divergent']:.0f} divergent of {nums['compared']:.0f} compared "
                             f"requests over the rollout so far ({_pct(nums.get('share'))}); the lower bound of the "
                             f"divergent share, {_pct(nums.get('lower'))}, is above the {_pct(nums.get('limit'))} "
                             f"limit.")
            elif "requests" in nums:
                lines.append(f"- `{c}`: {nums['errors']:.0f} errors of {nums['requests']:.0f} canary requests in "
                             f"{r.get('window')} ({_pct(nums.get('rate'))}); the lower bound, "
                             f"{_pct(nums.get('lower'))}, is above the {_pct(nums.get('limit'))} limit.")
            else:
                lines.append(f"- `{c}`: {r.get('message')}")
        lines.append("")
    elif st.get("phase") == "Promoted" and "output-divergence" in by_name:
        nums = by_name["output-divergence"].get("numbers") or {}
        if "compared" in nums:
            lines += [f"Output divergence at the promotion: {nums['divergent']:.0f} divergent of "
                      f"{nums['compared']:.0f} compared requests over the rollout.", ""]
    if shadow:
        mean = shadow.get("mean_kl")
        lines += [f"The canaries' own counters in Prometheus (`graft_shadow_requests_total`, revision "
                  f"`{shadow.get('revision')}`): {shadow.get('divergent', 0):.0f} divergent, "
                  f"{shadow.get('agree', 0):.0f} agree, {shadow.get('error', 0):.0f} error"
                  + (f"; mean KL of a compared request {mean:.3g} nats (`graft_shadow_divergence_nats`)."
                     if mean is not None else "."), ""]
    if results:
        lines += [f"The last analysis run, {after}:", "",
                  "| check | role | verdict | what it saw |", "|---|---|---|---|"]
        for r in results:
            role = r.get("role", "breaker") + (" (dry run)" if r.get("dryRun") else "")
            lines.append(f"| {r['name']} | {role} | {r.get('verdict')} | {_cell(r.get('message') or '')} |")
        lines.append("")
    return lines


def rollout_section(timeline: Timeline, ro: dict[str, Any], events: Sequence[dict[str, Any]], png: Path,
                    shadow: dict[str, float] | None = None) -> list[str]:
    st = ro.get("status", {})
    return [f"## {timeline.name}: {st.get('phase')}", "",
            f"Patch `{ro['spec']['patch']['name']}@{ro['spec']['patch']['version']}`; "
            f"final weight {st.get('weight')}%; {st.get('message', '')}", "",
            *decision_lines(timeline, ro, shadow),
            f"![timeline]({png.name})", "", *_events_table(events), ""]


def join_section(join: Join, events: Sequence[dict[str, Any]]) -> list[str]:
    """What the new pod did when: the moments after the scale-up, its revision, the fleet's Events."""
    before, after = join.replicas
    verdict = (f"pod `{join.pod}` joined at `{join.revision}`" if join.done
               else f"FAILED: {join.error}")
    lines = [f"## Scale-up after the promotion: {verdict}", "",
             f"`deployment/{DEPLOYMENT}` scaled from {before} to {after} pods at {_utc(join.scaled_at)} UTC. "
             f"The PatchFleet controller patches a new pod to the fleet's patches before its readiness gate "
             f"`{PATCHED_CONDITION}` lets it take traffic.", ""]
    if join.pod:
        lines += [f"- new pod: `{join.pod}`",
                  f"- Ready at: {_utc(join.moments['ready']) + ' UTC' if 'ready' in join.moments else 'never'}"
                  + (f" (its Ready condition: {join.ready_condition})" if join.ready_condition else ""),
                  f"- revision when Ready: `{join.revision_at_ready or '-'}` (asked of its engine's admin API)",
                  f"- its engine answered, in order: {' -> '.join(join.engine_revisions) or '-'}", "",
                  "| moment | time (UTC) | after the scale-up |", "|---|---|---|"]
        lines += [f"| {label} | {_utc(join.moments[key]) if key in join.moments else '-'} | {join.after(key)} |"
                  for key, label in MOMENTS]
        lines.append("")
    if events:
        lines += [f"Events of the PatchFleet `{FLEET}`:", "", *_events_table(events), ""]
    return lines


def report(out: Path, sections: Sequence[list[str]], stats: TrafficStats, started: float, pods: int) -> Path:
    lines = ["# Graft demo report", "",
             f"Run on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))} with `make demo`: "
             f"{pods} engine pods (SmolLM2-135M-Instruct on CPU) behind the readiness gate `{PATCHED_CONDITION}`, "
             "a real Prometheus, the operator, and steady BBH traffic through a pod-ratio router.", ""]
    for section in sections:
        lines += section
    total = len(stats.outcomes)
    failed = stats.failed()
    lines += ["## Client traffic", "", f"{total} requests, {len(failed)} not answered 200.", ""]
    if failed:
        by: dict[tuple[str, int, str], int] = {}
        for o in failed:
            by[(o.pod, o.status, o.error[:80])] = by.get((o.pod, o.status, o.error[:80]), 0) + 1
        lines += ["| pod | status | error | count |", "|---|---|---|---|"]
        lines += [f"| {p} | {s} | {e} | {n} |" for (p, s, e), n in sorted(by.items())]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# the run
async def _demo(args: argparse.Namespace) -> int:
    console = Console()
    paths = demo_paths(args)
    paths.out.mkdir(parents=True, exist_ok=True)
    prepare_workdir(paths.workdir)
    # two questions per task: their shared 3-shot prefix stays in each engine's prefix cache
    prompts = [p.text for p in bbh_prompts(args.data_dir, tasks=DEMO_TASKS, per_task=2)]
    with logs_to(paths.log):
        try:
            return await _story(args, paths, console, prompts)
        except (DemoError, TimeoutError) as e:
            console.print(f"[bold red]graft demo failed:[/] {e}\nlogs: {paths.logs_hint}")
            return 1


async def _story(args: argparse.Namespace, paths: DemoPaths, console: Console, prompts: list[str]) -> int:
    started = time.time()
    with console.status("starting the dev cluster: API server, Prometheus, operator, engine pods ..."):
        cluster = DevCluster(ClusterOptions(workdir=paths.workdir, pods=args.pods,
                                            readiness_gates=(PATCHED_CONDITION,)))
        await cluster.__aenter__()
    try:
        with console.status("waiting for the engine pods to load the model ..."):
            await cluster.wait_ready(timeout=300)
        with console.status(f"the fleet at base: PatchFleet {FLEET} opens the pods' readiness gates ..."):
            await open_fleet(cluster, args.pods, timeout=120)
        console.print(f"[green]fleet ready[/]: {args.pods} pods. Watch from another terminal:\n"
                      f"  kubectl --kubeconfig {cluster.kubeconfig.resolve()} get patchrollouts,patchfleets,pods -n "
                      f"{cluster.namespace}\nlogs: {paths.logs_hint}")
        sections: list[list[str]] = []
        problems: list[str] = []
        ran = 0
        join: Join | None = None
        async with cluster.traffic(prompts, rate=args.rate, max_tokens=4) as traffic:
            with console.status("warming up: traffic on the stable fleet ..."):
                await asyncio.sleep(args.warmup)
            for act in ACTS:
                final = await _one_rollout(cluster, act, traffic, console, args, paths, sections)
                ran += 1
                problem = act_problem(act, final)
                if problem:
                    problems.append(problem)
                    console.print(f"[bold red]{problem}[/]")
                if not act.scale_up:
                    continue
                if final.get("status", {}).get("phase") != "Promoted":
                    console.print("[yellow]not promoted: no scale-up into the fleet's promoted state[/]")
                    continue
                revision = final["status"]["stableRevision"]
                console.rule(f"scale-up: one more pod, which must run {revision} before it is Ready")
                join, events = await run_scale_up(cluster, traffic, console, revision, args.scale_timeout, paths)
                sections.append(join_section(join, events))
                (paths.out / "scale-up.json").write_text(json.dumps(asdict(join), indent=1))
                if not join.done:
                    break
                console.print(f"[bold]{join.pod}[/]: Ready {join.after('ready')} after the scale-up, running "
                              f"{join.revision_at_ready}; first request answered {join.after('served')}")
        path = report(paths.out, sections, traffic.stats, started, args.pods)
        console.print(f"report: {path}  ({time.time() - started:.0f} s in all)\nlogs: {paths.logs_hint}")
        if join is not None and not join.done:
            raise DemoError(f"the new pod did not join the fleet at its promoted revision: {join.error}")
        if problems or ran < len(ACTS):
            raise DemoError("; ".join(problems) or f"{ran} of the {len(ACTS)} rollouts ran (see the report and the logs)")
        return 0
    finally:
        with console.status("stopping the dev cluster ..."):
            await cluster.__aexit__(None, None, None)


async def shadow_totals(cluster: DevCluster, revision: str | None, window: float) -> dict[str, Any] | None:
    """The canaries' own shadow counters for `revision` as Prometheus scraped them over the last
    `window` seconds (each engine's highest count: a canary reverted since keeps what it counted):
    compared requests by result, and the mean KL of a compared request; None when it cannot say."""
    if not revision or cluster.prometheus is None:
        return None
    sel = f'namespace="{cluster.namespace}",revision="{revision}"'
    w = f"[{max(1, math.ceil(window))}s]"

    def total(metric: str) -> str:
        return f"sum(max_over_time({metric}{{{sel}}}{w}))"
    queries = {"by_result": f"sum by (result) (max_over_time(graft_shadow_requests_total{{{sel}}}{w}))",
               "mean_kl": f"{total('graft_shadow_divergence_nats_sum')} / {total('graft_shadow_divergence_nats_count')}"}
    out: dict[str, Any] = {"revision": revision}
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            for what, promql in queries.items():
                reply = await client.get(f"{cluster.prometheus.url}/api/v1/query", params={"query": promql})
                reply.raise_for_status()
                for item in reply.json()["data"]["result"]:
                    value = float(item["value"][1])
                    if what == "by_result":
                        out[item["metric"].get("result", "?")] = value
                    elif math.isfinite(value):
                        out["mean_kl"] = value
    except (httpx.HTTPError, KeyError, ValueError):
        return None
    return out if len(out) > 1 else None


async def _one_rollout(cluster: DevCluster, act: Act, traffic, console: Console, args: argparse.Namespace,
                       paths: DemoPaths, sections: list[list[str]]) -> dict[str, Any]:
    ro = demo_rollout(ROOT / "examples" / act.example, cluster.namespace, args.pause, args.interval,
                      first_pause=act.first_pause)
    console.rule(f"{act.example}: {ro['spec']['patch']['name']}@{ro['spec']['patch']['version']}")
    timeline, final = await run_rollout(cluster, ro, traffic, console, args.timeout, paths)
    if final.get("status", {}).get("phase") not in FINAL:
        console.print(f"[yellow]{ro['metadata']['name']} did not finish within {args.timeout:g} s: "
                      f"aborting it[/] ({final.get('status', {}).get('message', '')})")
        final = await abort_unfinished(cluster, ro)
    events = await cluster.events(ro["metadata"]["name"])
    since = timeline.samples[0]["t"] if timeline.samples else time.time() - args.timeout
    shadow = await shadow_totals(cluster, final.get("status", {}).get("canaryRevision"), time.time() - since + 10)
    png = plot(timeline, paths.out, thresholds_of(ro))
    sections.append(rollout_section(timeline, final, events, png, shadow))
    (paths.out / f"{timeline.name}-timeline.json").write_text(json.dumps(timeline.samples, indent=1))
    console.print(f"[bold]{timeline.name}[/]: {final.get('status', {}).get('phase')} "
                  f"— {final.get('status', {}).get('message', '')}")
    return final


def main(args: argparse.Namespace) -> int:
    return asyncio.run(_demo(args))
