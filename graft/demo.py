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
plot per rollout with the series it draws as JSON, and, in its cluster/ folder, the logs of this
process, the operator and each pod, which never reach the terminal while the live view runs.

SIGINT (Ctrl-C), SIGTERM and SIGHUP (its terminal closed) stop the run at once, and with it
everything it started: Prometheus, the operator and every engine, each given its grace period and
then killed, and whatever those started in turn (see `Shutdown`); the exit status is then 128 plus
the signal's number, as a shell reports a process the signal ended.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

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
from graft.adminapi import AdminClient, AdminError
from graft.operator.kube import Kube, KubeError, fleet_path, pods_path, scale_path
from graft.operator.pods import PATCHES_ANNOTATION, TRACK_LABEL, admin_address, is_ready
from graft.operator.podview import PodView, condition
from graft.operator.render import HISTORY_COLUMNS, history_rows, render_status
from graft.rollout.durations import format_duration, parse_duration
from graft.rollout.fleet import PATCHED_CONDITION
from graft.rollout.spec import DEFAULT_STEPS, Check, parse_spec
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


# stopping: on a signal as at the end
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LEFTOVER_GRACE = 5.0    # seconds a process left in a child's group has between SIGTERM and SIGKILL
T = TypeVar("T")


class Shutdown:
    """SIGINT, SIGTERM and SIGHUP end the run the way `graft dev-cluster` ends on SIGINT: the event
    loop takes the signal and the run's context managers unwind, each stopping what it started (the
    dev cluster stops the operator, every engine and Prometheus: SIGTERM, a grace period, SIGKILL).
    Here the signal cancels the run's task, which may be anywhere in the story.

    The first signal counts; one that comes once the stopping has begun (`begin`) is ignored, for
    stopping is bounded already and cutting it short is what would leave processes behind. After
    SIGHUP the terminal is gone, so nothing more is written to it. The process groups of this
    process's children as they were at the signal are kept in `groups` (see `child_groups`)."""

    def __init__(self, console: Console):
        self.console = console
        self.signal: int | None = None
        self.stopping = False
        self.groups: set[int] = set()
        self._task: asyncio.Task | None = None

    def __enter__(self) -> "Shutdown":
        self._task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        return self

    def __exit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if sig == signal.SIGHUP:
            self.console.quiet = True
        if self.signal is not None or self.stopping:
            logging.getLogger(__name__).info("%s while stopping: ignored", signal.Signals(sig).name)
            return
        self.signal = sig
        self.groups |= child_groups()
        logging.getLogger(__name__).warning("%s: stopping everything this run started", signal.Signals(sig).name)
        assert self._task is not None
        self._task.cancel()

    def begin(self) -> None:
        """The stopping has begun: a signal from now on leaves it to finish."""
        self.stopping = True


def child_groups() -> set[int]:
    """The process groups led by this process's children (read from /proc; none elsewhere). The
    dev cluster starts Prometheus, the operator and each engine in a session of its own, so each
    such group holds one of them and whatever it started, and it outlives its leader: a process
    whose parent has died keeps its group, while nothing links it to this process any more."""
    me, own = os.getpid(), os.getpgrp()
    groups = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, never the last ')'
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue    # gone meanwhile
        ppid, pgrp = int(fields[1]), int(fields[2])
        if ppid == me and pgrp != own:
            groups.add(pgrp)
    return groups


def end_groups(groups: set[int], grace: float = LEFTOVER_GRACE) -> list[int]:
    """SIGTERM to every process still in `groups`, SIGKILL to those left after `grace` seconds;
    answers the groups that had anyone left. Zombie children of this process in those groups are
    reaped, so that a dead one does not keep its group looking alive."""
    def alive(group: int) -> bool:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-group, os.WNOHANG)[0]:
                pass
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True

    def send(group: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)

    left = [g for g in sorted(groups) if alive(g)]
    for g in left:
        send(g, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(g) for g in left):
        time.sleep(0.1)
    for g in left:
        if alive(g):
            send(g, signal.SIGKILL)
    if left:
        logging.getLogger(__name__).warning("processes left in the process groups %s after the dev cluster stopped: "
                                            "ended", left)
    return left


async def to_the_end(aw: Awaitable[T]) -> T:
    """`aw` awaited to its end even if this task is cancelled meanwhile (a signal that came just as
    the stopping began): the cancellation is raised once it is done. Stopping cut short halfway
    leaves behind whatever it had not stopped yet."""
    inner = asyncio.ensure_future(aw)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(inner)
            break
        except asyncio.CancelledError as e:
            if inner.cancelled():
                raise
            cancelled = e
    if cancelled is not None:
        raise cancelled
    return result


@contextlib.asynccontextmanager
async def running_cluster(opts: ClusterOptions, console: Console, shutdown: Shutdown) -> AsyncIterator[DevCluster]:
    """The dev cluster for the length of the block, and everything it started stopped however the
    block ends: its end, an error, or a signal (`Shutdown`), also while the cluster is starting.
    The cluster stops its own processes first; then what is left in the process groups its
    children led (what an engine or the operator started itself) is ended too (`end_groups`)."""
    cluster = DevCluster(opts)
    groups: set[int] = set()
    try:
        with console.status("starting the dev cluster: API server, Prometheus, operator, engine pods ..."):
            await cluster.__aenter__()      # if that fails, it stops what it had started
        try:
            yield cluster
        finally:
            shutdown.begin()
            groups = child_groups()
            with console.status("stopping the dev cluster ..."):
                await to_the_end(cluster.__aexit__(None, None, None))
    finally:
        shutdown.begin()
        await to_the_end(asyncio.to_thread(end_groups, groups | shutdown.groups))


@contextlib.asynccontextmanager
async def dashboard(cluster: DevCluster, workdir: Path) -> AsyncIterator[str | None]:
    """`graft dashboard` on the dev cluster's namespace for as long as the demo runs (a free port,
    its log in WORKDIR/dashboard.log): its address, or None when it did not start (the demo goes on)."""
    import sys

    with open(workdir / "dashboard.log", "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "graft.cli", "dashboard", "--kubeconfig", str(cluster.kubeconfig.resolve()),
            "-n", cluster.namespace, "--port", "0", stdout=asyncio.subprocess.PIPE, stderr=log)
        try:
            try:
                line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            except TimeoutError:
                line = ""
            yield line.rsplit(" ", 1)[-1].strip() if line.startswith("Graft dashboard") else None
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                except TimeoutError:
                    proc.kill()


async def dashboard_section(cluster: DevCluster, url: str | None) -> list[str]:
    """The report's links to each rollout's view in the dashboard (live while the demo ran)."""
    from graft.operator.kube import rollouts_path

    if not url:
        return []
    async with kube_of(cluster) as kube:
        rollouts = await kube.list(rollouts_path(cluster.namespace))
    return ["## Dashboard", "", f"While the demo ran, `graft dashboard` served the rollouts live at {url}; "
            "each rollout's view (its steps, every check against its bounds, the Events, the history):", "",
            *[f"- [{o['metadata']['name']}]({url}#rollout/{o['metadata']['name']}): "
              f"{(o.get('status') or {}).get('phase', 'Pending')}" for o in rollouts], ""]


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
                             "share": st.get("trafficShare"), "step": st.get("stepIndex"),
                             "run": analysis.get("lastRun"), "results": results})


def _running(pod: dict[str, Any]) -> bool:
    """Its container is up and passes its readiness probe (the gate aside): its engine can be asked."""
    return PodView.of(pod).is_true("ContainersReady")


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
        view = PodView.of(pod)
        if view.is_true(PATCHED_CONDITION):
            self.moments.setdefault("gate", now)
        if is_ready(pod):
            self.moments.setdefault("ready", now)
            ready = view.condition("Ready")
            self.ready_condition = self.ready_condition or (ready.last_transition_time if ready else None)
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
    ro = next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "PatchRollout")
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


def checks_of(ro: dict[str, Any]) -> dict[str, Check]:
    """The rollout's checks by `role/name`, as the operator reads them: the plot draws their limits."""
    return {c.key: c for c in parse_spec(ro["spec"]).analysis.checks}


# the live view
def pods_table(pods: Sequence[dict[str, Any]], stats: TrafficStats | None) -> Table:
    """The engine pods as the cluster has them: Ready (gate included), the gate, track and revision
    the operator marked, and the client requests each answered. On a narrow terminal only the
    revision gives way, folded onto a second line: every other cell is one short word, which an
    ellipsis would cut to nothing (a pod name is told apart by its last characters)."""
    table = Table(title="Engine pods (cluster)", title_justify="left")
    for col in ("pod", "ready", "gate", "track", "revision", "restarts", "requests"):
        table.add_column(col, **({"overflow": "fold"} if col == "revision" else {"no_wrap": True}))
    by_pod = stats.by_pod() if stats else {}
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name, meta = p["metadata"]["name"], p["metadata"]
        pod = PodView.of(p)
        gate = pod.condition(PATCHED_CONDITION)
        cs = pod.container_status(None)
        table.add_row(name, "[green]yes[/]" if is_ready(p) else "[yellow]no[/]",
                      {"True": "open", "False": "closed"}.get(gate.status if gate else "", "-"),
                      pod.labels.get(TRACK_LABEL, "-"), pod.annotations.get(PATCHES_ANNOTATION, "-"),
                      str(cs.restart_count if cs else 0), str(by_pod.get(name, 0)))
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
    converged = condition(fleet, "Converged")
    head.add_row(f"PatchFleet {FLEET}", (converged.message if converged else None) or "-")
    return Group(header(stats, paths), Panel(head, title="the fleet's durable state"), pods_table(pods, stats))


# the cluster
async def open_fleet(cluster: DevCluster, pods: int, timeout: float) -> None:
    """The fleet at `base`: a PatchFleet with no patch, whose controller opens each pod's readiness
    gate once it has seen its engine run `base` (with no fleet at all the gates stay shut)."""
    async with kube_of(cluster) as kube:
        try:
            await kube.create(fleet_path(cluster.namespace), {
                "apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet", "metadata": {"name": FLEET},
                "spec": {"selector": {"matchLabels": dict(APP)}, "patches": []}})
        except KubeError as e:
            raise DemoError(f"cannot create the PatchFleet {FLEET}: {e}") from None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = await cluster.pod_objects()
        if len(current) >= pods and all(is_ready(p) for p in current):
            return
        await asyncio.sleep(0.5)
    raise DemoError(f"the PatchFleet {FLEET} did not open the pods' readiness gates within {timeout:g} s")


def kube_of(cluster: DevCluster) -> Kube:
    """Graft's Kubernetes client on the dev cluster's API server (plain http, no credentials)."""
    return Kube(cluster.api_server.url, timeout=10.0)


async def engine_revision(admin: AdminClient, pod: dict[str, Any]) -> str | None:
    """The revision the pod's engine runs, asked of its admin API; None while it cannot answer."""
    address = admin_address(pod, ADMIN_PORT)
    if address is None:
        return None
    try:
        return await admin.revision(*address)
    except AdminError:
        return None


async def scale_up(kube: Kube, namespace: str, token: str, revision: str, stats: TrafficStats,
                   timeout: float, on_sample: Callable[[Join, list[dict[str, Any]]], Any] | None = None,
                   interval: float = 0.25) -> Join:
    """Add one pod to the engine Deployment (its scale subresource, as `kubectl scale` does) and
    follow it until it is Ready running `revision` and has answered a client request; `error` says
    what did not happen when `timeout` seconds pass first, or when it turns Ready on another revision."""
    scale = scale_path(namespace, DEPLOYMENT)
    try:
        current = await kube.get(scale)
    except KubeError as e:
        current, why = None, str(e)
    else:
        why = "404: not found"
    if current is None:
        raise DemoError(f"cannot read the scale of deployment/{DEPLOYMENT}: {why}")
    before = int(current["spec"]["replicas"])
    known = {p["metadata"]["name"] for p in await kube.list(pods_path(namespace))}
    try:
        await kube.merge_patch(scale, {"spec": {"replicas": before + 1}})
    except KubeError as e:
        raise DemoError(f"cannot scale deployment/{DEPLOYMENT}: {e}") from None
    join = Join(revision, (before, before + 1), time.time())
    deadline = time.monotonic() + timeout
    async with AdminClient(token, timeout=2.0, retries=0) as admin:
        while True:
            pods = await kube.list(pods_path(namespace))
            new = sorted((p for p in pods if p["metadata"]["name"] not in known),
                         key=lambda p: p["metadata"].get("creationTimestamp") or "")
            if new:
                join.observe(new[0], await engine_revision(admin, new[0]) if _running(new[0]) else None, stats)
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
    fleet: dict[str, Any] | None = None
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        def show(join: Join, pods: list[dict[str, Any]]) -> None:
            live.update(join_view(join, pods, fleet, traffic.stats, paths, timeout))

        async def follow_fleet() -> None:
            nonlocal fleet
            while True:
                fleet = await kube.get(fleet_path(cluster.namespace, FLEET))
                await asyncio.sleep(1.0)

        async with kube_of(cluster) as kube:
            follower = asyncio.create_task(follow_fleet())
            try:
                join = await scale_up(kube, cluster.namespace, cluster.token, revision, traffic.stats, timeout,
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
    async with kube_of(cluster) as kube:
        await kube.merge_patch(object_path(ro), {"metadata": {"annotations": {"graft.dev/abort": "true"}}})
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


def per_run(samples: Sequence[dict[str, Any]], key: str | None,
            value: Callable[[dict[str, Any]], float | None]) -> tuple[list[float], list[float]]:
    """What `value` makes of one check's result, one point per analysis run, as (seconds since the
    first sample, value); NaN where it has none (no point drawn)."""
    if key is None or not samples:
        return [], []
    t0, ts, vs, runs = samples[0]["t"], [], [], set()
    for x in samples:
        r = x["results"].get(key)
        if r is None or (x.get("run") is not None and x["run"] in runs):
            continue
        runs.add(x.get("run"))
        v = value(r)
        ts.append(x["t"] - t0)
        vs.append(float("nan") if v is None else float(v))
    return ts, vs


def series(samples: Sequence[dict[str, Any]], key: str | None, number: str | None = None,
           scale: float = 1.0, missing: float = float("nan")) -> tuple[list[float], list[float]]:
    """One check's value (or one of its `numbers`) over time, one point per analysis run, as
    (seconds since the first sample, value); `missing` where the run had none (NaN: no point)."""
    def value(r: dict[str, Any]) -> float:
        v = r.get("value") if number is None else (r.get("numbers") or {}).get(number)
        return missing if v is None else float(v) * scale
    return per_run(samples, key, value)


def _ratio(r: dict[str, Any], part: str, whole: str, scale: float = 100.0) -> float | None:
    """numbers[part] / numbers[whole], scaled; None when the run counted nothing."""
    nums = r.get("numbers") or {}
    return nums[part] / nums[whole] * scale if nums.get(whole) and part in nums else None


def _canary_share(r: dict[str, Any]) -> float | None:
    """The share of the requests canary pods answered, percent, of an error-rate-delta result
    (which counts both sides over the step); None before either side has answered one."""
    nums = r.get("numbers") or {}
    canary, stable = nums.get("canary_requests"), nums.get("stable_requests")
    return None if canary is None or stable is None or canary + stable <= 0 else 100 * canary / (canary + stable)


def _dry(samples: Sequence[dict[str, Any]], key: str | None) -> str:
    return " (dry run)" if key and any(x["results"].get(key, {}).get("dryRun") for x in samples) else ""


@dataclass
class Line:
    """One series of a plot panel, as drawn and as written to the plot's JSON."""

    label: str
    t: list[float]
    v: list[float]
    color: str
    style: str = "-"            # matplotlib's linestyle ("" for points alone)
    marker: str = "."
    limit: bool = False         # a limit a check judges against, not a measurement
    step: bool = False          # a value that holds until the next sample (the weight)

    @property
    def drawn(self) -> bool:
        return any(not math.isnan(v) for v in self.v)


@dataclass
class PlotPanel:
    """One panel of the timeline plot: its lines, what it says when none has a point, and how many
    of the analysis runs its checks judged (a run short of samples is Inconclusive: its numbers are
    drawn, yet they held nothing)."""

    key: str
    ylabel: str
    lines: list[Line]
    missing: str
    judged: str = ""
    log: bool = False
    ylim: tuple[float, float] | None = None


JUDGED = ("Successful", "Failed")


def judged(samples: Sequence[dict[str, Any]], *keys: str | None) -> str:
    """`error-rate judged at 30 of 52 runs` for each of the checks `keys` that ran."""
    parts = []
    for key in keys:
        _, verdicts = per_run(samples, key, lambda r: float(r.get("verdict") in JUDGED))
        if verdicts:
            parts.append(f"{key.split('/', 1)[1]} judged at {sum(verdicts):.0f} of {len(verdicts)} runs")
    return "; ".join(parts)


def _limit(label: str, value: float, end: float) -> Line:
    """A fixed limit across the whole plot."""
    return Line(label, [0.0, end], [value, value], "tab:red", "--", "", limit=True)


def plot_panels(timeline: Timeline, checks: dict[str, Check]) -> list[PlotPanel]:
    """What the timeline plot shows, panel by panel: the canary's traffic (the weight its step asks
    for, its pods' share of the pods, and the share of the requests its pods answered, as
    Prometheus counted them for error-rate-delta), then canary beside stable for the error rate and
    for TTFT and TPOT p99, each with the limit its check judges against (a ratio to stable drawn
    as that multiple of stable at each run), then the shadow comparisons behind output-divergence."""
    s = timeline.samples
    t0 = s[0]["t"]
    ts = [x["t"] - t0 for x in s]
    end = ts[-1]

    # the canary's share of the traffic: asked, by pod count, and measured
    delta = _key(s, "error-rate-delta")
    traffic = [Line("weight the step asks for", ts, [float(x["weight"] or 0) for x in s], "tab:blue", marker="",
                    step=True),
               Line("canary pods' share of the pods (status.trafficShare)", ts,
                    [float("nan") if x.get("share") is None else float(x["share"]) for x in s], "tab:cyan", "--",
                    marker="", step=True),
               Line("canary pods' share of the requests (measured, error-rate-delta)",
                    *per_run(s, delta, _canary_share), "tab:orange", "",
                    marker="o")]
    panels = [PlotPanel("traffic", "canary traffic %", traffic, "weight", ylim=(-5, 115))]

    # error rate: the canary's (error-rate, over its window), canary and stable over the step
    # (error-rate-delta), and the limits: error-rate's max, and stable plus error-rate-delta's max
    breaker = _key(s, "error-rate")
    errors = [Line(f"canary (error-rate, {_window(checks, breaker)}){_dry(s, breaker)}",
                   *series(s, breaker, scale=100), "tab:orange", marker="o"),
              Line(f"canary (error-rate-delta, {_window(checks, delta)}){_dry(s, delta)}",
                   *per_run(s, delta, lambda r: _ratio(r, "canary_errors", "canary_requests")), "tab:purple", ":"),
              Line(f"stable (error-rate-delta, {_window(checks, delta)})",
                   *per_run(s, delta, lambda r: _ratio(r, "stable_errors", "stable_requests")), "tab:green", ":")]
    if breaker in checks and checks[breaker].max is not None:
        errors.append(_limit(f"error-rate limit ({checks[breaker].max * 100:g}%)", checks[breaker].max * 100, end))
    if delta in checks and checks[delta].max is not None:
        most = checks[delta].max * 100
        errors.append(Line(f"error-rate-delta limit (stable + {most:g} pp)",
                           *per_run(s, delta, lambda r: _plus(_ratio(r, "stable_errors", "stable_requests"), most)),
                           "tab:purple", "--", "", limit=True))
    panels.append(PlotPanel("errors", "errors %", errors, "error-rate check", judged(s, breaker, delta)))

    # latency: canary beside stable, the limit a check judges the canary's p99 against; no panel
    # for a latency check the rollout does not have
    for name, title in (("ttft-p99", "TTFT"), ("tpot-p99", "TPOT")):
        key = _key(s, name) or next((k for k in (f"breaker/{name}", f"gate/{name}") if k in checks), None)
        if key is None:
            continue
        lines = [Line(f"{title} p99 {side}{_dry(s, key)}",
                      *per_run(s, key, lambda r, n=number: _positive(r, n, 1000)), color, style)
                 for side, number, color, style in (("canary", "canary_quantile", "tab:orange", "-"),
                                                    ("stable", "stable_quantile", "tab:green", "--"))]
        check = checks.get(key)
        if check is not None and check.max_ratio is not None:
            lines.append(Line(f"limit ({check.max_ratio:g} x stable)",
                              *per_run(s, key, lambda r, k=check.max_ratio: _positive(r, "stable_quantile", 1000 * k)),
                              "tab:red", "--", "", limit=True))
        if check is not None and check.max is not None:
            lines.append(_limit(f"limit ({check.max * 1000:g} ms)", check.max * 1000, end))
        panels.append(PlotPanel(name, f"{title} p99 ms\n(median over pods)", lines, f"{name} measurement",
                                judged(s, key), log=True))

    # output divergence: the shadow comparisons over the rollout so far
    key = _key(s, "output-divergence")
    compared = [Line("compared", *series(s, key, "compared", missing=0.0), "tab:blue", step=True),
                Line("divergent", *series(s, key, "divergent", missing=0.0), "tab:red", "--", "x", step=True)]
    share = [Line("divergent share", *series(s, key, scale=100), "tab:red"),
             Line("its lower bound (rollbackConfidence)", *series(s, key, "lower", scale=100), "tab:gray", ":")]
    if key in checks and checks[key].max is not None:
        share.append(_limit(f"limit ({checks[key].max * 100:g}%)", checks[key].max * 100, end))
    panels += [PlotPanel("compared", "shadow comparisons\n(rollout so far)", compared, "output-divergence check"),
               PlotPanel("divergence", "divergent %", share, "output-divergence check", judged(s, key),
                         ylim=(-5, 105))]
    return panels


def _window(checks: dict[str, Check], key: str | None) -> str:
    check = checks.get(key or "")
    return "over the step" if check is None or check.window is None else check.window_text


def _plus(value: float | None, more: float) -> float | None:
    return None if value is None else value + more


def _positive(r: dict[str, Any], number: str, scale: float) -> float | None:
    """A latency number of the result, scaled; None when it is missing or not above zero (no
    sample: a log scale has no place for it)."""
    v = (r.get("numbers") or {}).get(number)
    return v * scale if v is not None and v > 0 else None


def plot_data(timeline: Timeline, panels: Sequence[PlotPanel], decided: float | None) -> dict[str, Any]:
    """The plot as data: every line drawn, by panel and label (NaN, a run without a point, as null)."""
    def clean(vs: Sequence[float]) -> list[float | None]:
        return [None if math.isnan(v) else v for v in vs]
    return {"rollout": timeline.name, "decided": decided,
            "panels": {p.key: {"ylabel": p.ylabel, "judged": p.judged,
                               "series": {line.label: {"t": line.t, "v": clean(line.v), "limit": line.limit}
                                          for line in p.lines if line.drawn}}
                       for p in panels}}


def plot(timeline: Timeline, out: Path, checks: dict[str, Check]) -> Path:
    """The rollout over time (`plot_panels`) as a PNG, and beside it the same series as JSON
    (`<name>-plot.json`); answers the PNG's path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    s = timeline.samples
    t0 = s[0]["t"]
    panels = plot_panels(timeline, checks)
    decided = next((x["t"] - t0 for x in s if x["phase"] in ROLLED_BACK), None)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * len(panels)), sharex=True)
    for ax, panel in zip(axes, panels):
        drawn = [line for line in panel.lines if line.drawn]
        for line in drawn:
            kw = {"color": line.color, "label": line.label, "linestyle": line.style or "None",
                  "marker": line.marker or None, "markersize": 4}
            if line.step:
                ax.step(line.t, line.v, where="post", **kw)
            else:
                ax.plot(line.t, line.v, **kw)
        ax.set_ylabel(panel.ylabel)
        if panel.ylim:
            ax.set_ylim(*panel.ylim)
        if panel.judged:
            ax.set_title(panel.judged, loc="right", fontsize=8, color="0.35")
        if not any(not line.limit for line in drawn):
            ax.text(0.5, 0.5, f"no {panel.missing} in this rollout's analysis", transform=ax.transAxes,
                    ha="center", va="center", fontsize=9, color="0.4")
            continue
        if panel.log:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.legend(loc="best", fontsize=7, ncol=2 if len(drawn) > 3 else 1)
    first = axes[0]
    phases = [(x["t"] - t0, x["phase"]) for i, x in enumerate(s) if i == 0 or x["phase"] != s[i - 1]["phase"]]
    for t, ph in phases:
        first.annotate(ph, (t, 104), fontsize=8, rotation=12)
    if decided is not None:
        for ax in axes:
            ax.axvline(decided, color="0.5", linewidth=0.8)
    axes[-1].set_xlabel("seconds since the rollout was applied")
    fig.suptitle(f"PatchRollout {timeline.name}")
    fig.tight_layout()
    path, data_path = plot_paths(out, timeline.name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    data = json.dumps(plot_data(timeline, panels, decided), indent=1)
    data_path.write_text(data)
    return path


def plot_paths(out: Path, name: str) -> tuple[Path, Path]:
    """A rollout's timeline plot, and the JSON of the series it draws."""
    return out / f"{name}-timeline.png", out / f"{name}-plot.json"


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
    data = plot_paths(png.parent, timeline.name)[1].name
    return [f"## {timeline.name}: {st.get('phase')}", "",
            f"Patch `{ro['spec']['patch']['name']}@{ro['spec']['patch']['version']}`; "
            f"final weight {st.get('weight')}%; {st.get('message', '')}", "",
            *decision_lines(timeline, ro, shadow),
            f"![timeline]({png.name})", "",
            "The plot: the canary's share of the traffic (the weight asked, its pods' share of the pods, "
            "the share of the requests they answered), canary beside stable for the error rate (and for "
            "TTFT and TPOT p99 where the rollout checks them) with the limit each check judges against, "
            f"and the shadow comparisons behind output-divergence; its series are in [{data}]({data}).", "",
            *history_lines(ro), *_events_table(events), ""]


def history_lines(ro: dict[str, Any]) -> list[str]:
    """The analysis runs the rollout kept (status.analysisHistory, as `graft rollout history` shows
    them): every check's value, threshold, counts, bounds and verdict, run by run."""
    rows, _, _ = history_rows(ro)
    if not rows:
        return []
    kept = len((ro.get("status") or {}).get("analysisHistory") or [])
    retention = ((ro.get("spec") or {}).get("analysis") or {}).get("measurementRetention", 10)
    return [f"The analysis runs kept in `status.analysisHistory` ({kept}, at most `measurementRetention` "
            f"{retention}), oldest first:", "",
            "| " + " | ".join(HISTORY_COLUMNS) + " |", "|" + "---|" * len(HISTORY_COLUMNS),
            *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows), ""]


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
    with logs_to(paths.log), Shutdown(console) as shutdown:
        try:
            return await _story(args, paths, console, prompts, shutdown)
        except (DemoError, TimeoutError) as e:
            console.print(f"[bold red]graft demo failed:[/] {e}\nlogs: {paths.logs_hint}")
            return 1
        except asyncio.CancelledError:
            if shutdown.signal is None:
                raise
            asyncio.current_task().uncancel()
            console.print(f"[yellow]graft demo stopped by {signal.Signals(shutdown.signal).name}[/]: everything it "
                          f"started is stopped\n"
                          f"logs: {paths.logs_hint}")
            return 128 + shutdown.signal


async def _story(args: argparse.Namespace, paths: DemoPaths, console: Console, prompts: list[str],
                 shutdown: Shutdown) -> int:
    started = time.time()
    opts = ClusterOptions(workdir=paths.workdir, pods=args.pods, readiness_gates=(PATCHED_CONDITION,))
    async with running_cluster(opts, console, shutdown) as cluster, dashboard(cluster, paths.workdir) as board:
        if board:
            console.print(f"[green]dashboard[/]: {board}  (graft dashboard --kubeconfig {cluster.kubeconfig.resolve()} "
                          f"-n {cluster.namespace})")
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
        sections.insert(0, await dashboard_section(cluster, board))
        path = report(paths.out, sections, traffic.stats, started, args.pods)
        console.print(f"report: {path}  ({time.time() - started:.0f} s in all)\nlogs: {paths.logs_hint}")
        if join is not None and not join.done:
            raise DemoError(f"the new pod did not join the fleet at its promoted revision: {join.error}")
        if problems or ran < len(ACTS):
            raise DemoError("; ".join(problems) or f"{ran} of the {len(ACTS)} rollouts ran (see the report and the logs)")
        return 0


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
    png = plot(timeline, paths.out, checks_of(ro))
    sections.append(rollout_section(timeline, final, events, png, shadow))
    (paths.out / f"{timeline.name}-timeline.json").write_text(json.dumps(timeline.samples, indent=1))
    console.print(f"[bold]{timeline.name}[/]: {final.get('status', {}).get('phase')} "
                  f"— {final.get('status', {}).get('message', '')}")
    return final


def main(args: argparse.Namespace) -> int:
    return asyncio.run(_demo(args))
