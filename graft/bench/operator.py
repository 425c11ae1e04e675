"""`graft bench operator`: what the operator costs as fleets grow, and how fast a step reaches them.

The real operator (`graft.operator.main.main_operator`, what `graft operator` runs, so real kopf)
runs as a process of its own against the API server emulator (graft.devcluster.apiserver) with
light engine stand-ins (graft.bench.standins: the admin API, no model) behind every pod, and a
real Prometheus scraping the stand-ins' per-revision series. Two sweeps:

- fleet size: one fleet of N pods (one ReplicaSet), measured at rest, then during a rollout held at
  its 50% step (the time from the rollout's creation to its last canary patched);
- concurrent rollouts: R fleets of `rollout_fleet_size` pods, each in a namespace of its own, one
  rollout on each, all created at once.

Every tick (the operator's tick, `--tick`) the bench samples: the operator process's CPU time
(/proc, user + system) and resident memory, the admin calls the stand-ins answered (by kind), the
API server calls the operator made (by verb: list, watch, get, patch, ...), and the queries
Prometheus answered. Each sample also has its wall time (the interval, about one tick: the CPU
share of it is the operator's load). The API server notes when each rollout is read at the start of
its reconciliation: kopf runs a rollout's timer `tick` seconds after its previous run ended, so the
spacing of those reads less the tick is how late a rollout's tick comes (how long the run before
took, and the wait for the event loop), the measure of many rollouts ticking on time.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import httpx

from graft.bench import report
from graft.devcluster.apimachinery import parse_target, verb
from graft.devcluster.apiserver import ApiServer
from graft.devcluster.prometheus import PrometheusServer
from graft.operator.kube import Kube, KubeError, fleet_path, pods_path, rollout_path

ROOT = Path(__file__).resolve().parents[2]
BENCH_AGENT = "graft-bench"          # the bench's own API calls carry it and are not counted
APP = {"app": "llm-engine"}
PATCH = {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}}


@dataclass(slots=True)
class OperatorBenchConfig:
    fleet_sizes: list[int] = field(default_factory=lambda: [10, 100, 1000])
    rollouts: list[int] = field(default_factory=lambda: [1, 10, 50])
    rollout_fleet_size: int = 10          # pods per fleet in the concurrent-rollouts sweep
    tick: float = 5.0                     # the operator's GRAFT_TICK_SECONDS
    ticks: int = 4                        # ticks sampled at rest and again during the rollouts
    latency: float = 0.0                  # seconds a stand-in takes to answer an admin call
    failure_rate: float = 0.0             # share of admin calls a stand-in answers 503
    operator_source: str | None = None    # run the operator from this source tree (a before/after comparison)
    operator_env: dict[str, str] = field(default_factory=dict)   # further GRAFT_* settings for the operator
    converge_timeout: float = 600.0

    def check(self) -> None:
        for name in ("fleet_sizes", "rollouts"):
            if any(v < 0 for v in getattr(self, name)):
                raise ValueError(f"--{name.replace('_', '-')}: sizes must not be negative")
        if self.rollout_fleet_size < 1:
            raise ValueError(f"--rollout-fleet-size must be at least 1, got {self.rollout_fleet_size}")
        if not 0.0 <= self.failure_rate < 1.0:
            raise ValueError(f"--standin-failure-rate must be in [0, 1), got {self.failure_rate}")
        if self.latency < 0:
            raise ValueError(f"--standin-latency must not be negative, got {self.latency}")
        if self.tick <= 0 or self.ticks < 1:
            raise ValueError("--tick must be positive and --ticks at least 1")
        if self.operator_source and not (Path(self.operator_source) / "graft" / "operator").is_dir():
            raise ValueError(f"--operator-source {self.operator_source}: no graft/operator in it")


class CountingApiServer(ApiServer):
    """The emulator, counting the calls of every client but the bench by verb, and noting when each
    PatchFleet and PatchRollout was read by name."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.verbs: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()     # "verb resource[/subresource]"
        self.reads: dict[tuple[str, str, str], list[float]] = defaultdict(list)   # (plural, ns, name) -> times

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if not raw_request.headers.get("User-Agent", "").startswith(BENCH_AGENT):
            target = parse_target(raw_request.url.path)
            kind = verb(raw_request.method, target, dict(raw_request.query)) if target is not None else None
            self.verbs[kind or "other"] += 1
            if target is not None:
                sub = f"/{target.subresource}" if target.subresource else ""
                self.calls[f"{kind} {target.resource.plural}{sub}"] += 1
            if kind == "get" and target.subresource is None and str(target.resource.plural) in (
                    "patchfleets", "patchrollouts"):
                self.reads[(str(target.resource.plural), target.namespace or "", target.name)].append(time.monotonic())
        return await super().__call__(raw_request)


class OperatorProcess:
    """`graft operator` in a process of its own; its CPU time and memory read from /proc."""

    def __init__(self, api_url: str, prometheus_url: str, cfg: OperatorBenchConfig, log: Path):
        env = {**os.environ, "GRAFT_KUBE_SERVER": api_url, "GRAFT_ADMIN_TOKEN": "bench-token",
               "GRAFT_ADMIN_SCHEME": "http", "GRAFT_ADMIN_PLAIN_HTTP": "true", "GRAFT_TICK_SECONDS": str(cfg.tick),
               "GRAFT_PROMETHEUS_ADDRESS": prometheus_url, "GRAFT_ADMIN_TIMEOUT": "10", **cfg.operator_env}
        for key in ("GRAFT_NAMESPACES", "GRAFT_KUBECONFIG", "GRAFT_ADMIN_TOKEN_SECRET", "GRAFT_ADMIN_CA_FILE"):
            env.pop(key, None)
        source = repr(str(Path(cfg.operator_source).resolve())) if cfg.operator_source else "None"
        code = (f"import sys; src = {source}; src and sys.path.insert(0, src); "
                "from graft.operator.main import main_operator; sys.exit(main_operator(sys.argv[1:]))")
        self._log = open(log, "ab")
        self.process = subprocess.Popen([sys.executable, "-c", code, "--all-namespaces"], env=env,
                                        stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        self._hz = os.sysconf("SC_CLK_TCK")

    def cpu(self) -> float:
        """User + system CPU seconds the operator has used."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / self._hz

    def rss(self) -> int:
        """Resident memory, bytes."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def prometheus_queries(url: str) -> int:
    """Queries Prometheus has answered (instant and range), from its own /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("prometheus_http_requests_total{") and ('handler="/api/v1/query"' in line
                                                                   or 'handler="/api/v1/query_range"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


class Sampler:
    """Counters of one case, read every tick: the differences are the per-tick figures."""

    def __init__(self, operator: OperatorProcess, api: CountingApiServer, standins, prometheus_url: str):
        self.operator, self.api, self.standins, self.prometheus_url = operator, api, standins, prometheus_url

    def read(self) -> dict[str, Any]:
        return {"t": time.monotonic(), "cpu": self.operator.cpu(), "rss": self.operator.rss(),
                "admin": self.standins.snapshot(), "api": Counter(self.api.verbs), "calls": Counter(self.api.calls),
                "prometheus": prometheus_queries(self.prometheus_url)}

    async def ticks(self, n: int, tick: float, advance=None) -> list[dict[str, Any]]:
        out = []
        last = self.read()
        for _ in range(n):
            await asyncio.sleep(tick)
            now = self.read()
            admin = now["admin"] - last["admin"]
            out.append({"wall_s": now["t"] - last["t"], "cpu_s": now["cpu"] - last["cpu"], "rss_bytes": now["rss"],
                        "admin_calls": sum(v for k, v in admin.items() if k != "failed"),
                        "admin_by_kind": dict(admin), "api_calls": dict(now["api"] - last["api"]),
                        "api_calls_by_resource": dict(now["calls"] - last["calls"]),
                        "prometheus_queries": now["prometheus"] - last["prometheus"]})
            last = now
            if advance:
                advance(1)
        return out


async def _setup(kube: Kube, namespace: str, pods, port: int) -> None:
    """A namespace, one ReplicaSet whose pods' admin port is the stand-ins' shared one, its pods
    (running, Ready, each at its stand-in's address), and a PatchFleet over them with no patches."""
    await kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    spec = {"containers": [{"name": "engine", "image": "graft:bench",
                            "ports": [{"name": "http", "containerPort": 8000}, {"name": "admin", "containerPort": port}]}]}
    owner = await kube.create(f"/apis/apps/v1/namespaces/{namespace}/replicasets", {
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": "engine"},
        "spec": {"replicas": len(pods), "selector": {"matchLabels": APP},
                 "template": {"metadata": {"labels": APP}, "spec": spec}}})
    ref = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "engine", "uid": owner["metadata"]["uid"],
           "controller": True, "blockOwnerDeletion": True}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
    limit = asyncio.Semaphore(16)

    async def one(i: int, standin) -> None:
        name = f"engine-{i}"
        async with limit:
            await kube.create(pods_path(namespace), {"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": name, "labels": dict(APP), "ownerReferences": [ref]}, "spec": spec})
            await kube.merge_patch(pods_path(namespace, name) + "/status", {"status": {
                "phase": "Running", "podIP": standin.ip,
                "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}],
                "containerStatuses": [{"name": "engine", "ready": True, "started": True, "restartCount": 0,
                                       "containerID": f"containerd://{namespace}-{name}-0", "image": "graft:bench",
                                       "imageID": "graft@sha256:0", "state": {"running": {"startedAt": started}}}]}})

    await asyncio.gather(*(one(i, s) for i, s in enumerate(pods)))
    await kube.create(fleet_path(namespace), {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet",
                                              "metadata": {"name": "llm-engine"},
                                              "spec": {"selector": {"matchLabels": APP}, "patches": []}})


def rollout_manifest(tick: float) -> dict[str, Any]:
    """A rollout that holds at 50% (a pause of an hour) while its analysis runs every tick."""
    interval = f"{max(1, round(tick))}s"
    return {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout", "metadata": {"name": "kv-align"},
            "spec": {"selector": {"matchLabels": APP}, "patch": PATCH,
                     "steps": [{"weight": 50, "pause": "1h"}, {"weight": 100}],
                     "analysis": {"interval": interval, "inconclusiveLimit": 0,
                                  "breakers": [{"name": "error-rate", "max": 0.05, "window": "30s"}]},
                     "progressDeadline": "2h"}}


async def _until(probe, timeout: float, what: str, operator: OperatorProcess):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if not operator.alive():
            raise RuntimeError(f"the operator exited ({operator.process.returncode}) while waiting for {what}")
        last = await probe()
        if last:
            return last
        await asyncio.sleep(0.25)
    raise TimeoutError(f"{what}: not within {timeout:g}s (last: {last!r:.300})")


def _ticks_logged(log: Path) -> int:
    """Fleet ticks the operator has finished, by kopf's log lines."""
    with open(log, "rb") as f:
        return f.read().count(b"Timer 'fleet-tick' succeeded")


async def _after(value):
    return value


def _periods(times: list[float], tick: float) -> list[float]:
    """Seconds one reconciliation took, from the spacing of the reads that start them."""
    return [round(b - a - tick, 3) for a, b in zip(times, times[1:])]


async def run_case(cfg: OperatorBenchConfig, prometheus: PrometheusServer, fleets: dict[str, int], rollouts: int,
                   log: Path, label: str) -> dict[str, Any]:
    """One configuration: fleets (namespace -> pods) at rest, then `rollouts` of them rolling at once."""
    from graft.bench.standins import StandIns

    # the machine's 1-minute load when the case began: CPU time and call counts hold under load,
    # wall times (convergence, canaries, lateness) do not
    load = round(os.getloadavg()[0], 2)
    standins = StandIns(fleets, latency=cfg.latency, failure_rate=cfg.failure_rate).start()
    operator = None
    try:
        prometheus.set_targets([(f"127.0.0.1:{standins.metrics_port}",
                                 {"namespace": ns, "__metrics_path__": f"/metrics/{ns}"}) for ns in fleets])
        # KMock matches each request against the requests it keeps (quadratic in the history): keep few
        async with CountingApiServer(crd_paths=[ROOT / "crds"], history_limit=10) as api:
            kube = Kube(api.url, headers={"User-Agent": BENCH_AGENT})
            try:
                with report.status(f"{label}: {sum(fleets.values())} pods in {len(fleets)} namespaces"):
                    for ns, count in fleets.items():
                        await _setup(kube, ns, standins.by_fleet[ns], standins.port)
                operator = OperatorProcess(api.url, prometheus.url, cfg, log)
                start = time.monotonic()

                async def converged():
                    done = 0
                    for ns, count in fleets.items():
                        status = ((await kube.get(fleet_path(ns, "llm-engine"))) or {}).get("status") or {}
                        done += status.get("converged") == count and status.get("pods") == count
                    return done == len(fleets)

                with report.status(f"{label}: the operator converging every fleet"):
                    await _until(converged, cfg.converge_timeout, "every fleet converged", operator)
                converge_s = time.monotonic() - start
                # a fleet converged by its create handler may have its timer in kopf's back-off after
                # an error of the first, crowded ticks: sample only once every fleet has ticked again
                ticked = _ticks_logged(log)
                with report.status(f"{label}: every fleet ticking"):
                    await _until(lambda: _after(_ticks_logged(log) - ticked >= 2 * len(fleets)),
                                 cfg.converge_timeout, "every fleet ticking", operator)
                sampler = Sampler(operator, api, standins, prometheus.url)
                api.reads.clear()
                with report.progress_bar(f"{label}: ticks at rest", cfg.ticks) as advance:
                    rest = await sampler.ticks(cfg.ticks, cfg.tick, advance)
                result: dict[str, Any] = {"label": label, "fleets": len(fleets), "pods_per_fleet": max(fleets.values()),
                                          "pods": sum(fleets.values()), "rollouts": rollouts,
                                          "converge_s": round(converge_s, 2), "rest": rest, "rolling": [],
                                          "load_1m": load}
                if rollouts:
                    result.update(await _roll(cfg, kube, api, standins, operator, sampler, list(fleets)[:rollouts],
                                              fleets, label))
                result["rss_bytes_end"] = operator.rss()
                return result
            finally:
                if operator is not None:
                    operator.stop()
                await kube.aclose()
    finally:
        standins.stop()


async def _roll(cfg, kube: Kube, api: CountingApiServer, standins, operator: OperatorProcess, sampler: Sampler,
                namespaces: list[str], fleets: dict[str, int], label: str) -> dict[str, Any]:
    body = rollout_manifest(cfg.tick)
    ref = f"{PATCH['name']}@{PATCH['version']}"
    start = time.monotonic()
    await asyncio.gather(*(kube.create(rollout_path(ns, "")[:-1], body) for ns in namespaces))
    want = {ns: max(1, math.ceil(fleets[ns] * 50 / 100)) for ns in namespaces}
    patched: dict[str, float] = {}

    async def all_patched():
        for ns in namespaces:
            if ns not in patched:
                times = standins.patched(ns, ref)
                if len(times) >= want[ns]:
                    patched[ns] = times[want[ns] - 1] - start
        return len(patched) == len(namespaces)

    with report.status(f"{label}: {len(namespaces)} rollouts patching their 50% canaries"):
        await _until(all_patched, cfg.converge_timeout, "every canary patched", operator)
    api.reads.clear()
    with report.progress_bar(f"{label}: ticks during the rollouts", cfg.ticks) as advance:
        rolling = await sampler.ticks(cfg.ticks, cfg.tick, advance)
    periods = {(ns, name): _periods(ts, cfg.tick) for (plural, ns, name), ts in api.reads.items()
               if plural == "patchrollouts"}
    late = [p for ps in periods.values() for p in ps]
    phases = []
    for ns in namespaces:
        try:
            phases.append(((await kube.get(rollout_path(ns, "kv-align"))) or {}).get("status", {}).get("phase"))
        except KubeError:
            phases.append(None)
    return {"canaries": want, "all_canaries_patched_s": {ns: round(t, 3) for ns, t in patched.items()},
            "rolling": rolling, "rollout_tick_late_s": late, "rollout_phases": dict(Counter(phases)),
            # reconciliations begun (reads of a rollout by name) per rollout per tick: 1 is on time
            "rollout_reconciles_per_tick": round(sum(len(ts) for (plural, _, _), ts in api.reads.items()
                                                     if plural == "patchrollouts") / (len(namespaces) * cfg.ticks), 2)}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(case: dict[str, Any]) -> dict[str, Any]:
    """The per-tick medians of a case, at rest and during its rollouts."""
    def per_tick(samples: list[dict[str, Any]]) -> dict[str, Any]:
        if not samples:
            return {}
        verbs = sorted({v for s in samples for v in s["api_calls"]})
        return {"cpu_ms": round(1000 * _median([s["cpu_s"] for s in samples]), 1),
                "admin_calls": _median([s["admin_calls"] for s in samples]),
                "api_calls": {v: _median([s["api_calls"].get(v, 0) for s in samples]) for v in verbs},
                "prometheus_queries": _median([s["prometheus_queries"] for s in samples]),
                "rss_mb": round(max(s["rss_bytes"] for s in samples) / 2**20, 1)}
    out = {"label": case["label"], "pods": case["pods"], "fleets": case["fleets"], "rollouts": case["rollouts"],
           "converge_s": case["converge_s"], "rest": per_tick(case["rest"]), "load_1m": case.get("load_1m")}
    if case.get("rolling"):
        out["rolling"] = per_tick(case["rolling"])
        times = list(case["all_canaries_patched_s"].values())
        out["canaries_patched_s"] = {"max": max(times), "median": _median(times)}
        late = case["rollout_tick_late_s"]
        out["rollout_tick_late_s"] = {"median": _median(late), "max": max(late) if late else None}
        out["rollout_reconciles_per_tick"] = case["rollout_reconciles_per_tick"]
    return out


def run_operator_bench(cfg: OperatorBenchConfig, out: Path) -> dict[str, Any]:
    """Both sweeps; writes operator.json and operator.png under `out` and prints the tables."""
    cfg.check()
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)     # a line per API server request
    out.mkdir(parents=True, exist_ok=True)
    log = out / "operator.log"
    log.write_text("")
    cases = [(f"{n} pods", {"bench-fleet": n}, 1) for n in cfg.fleet_sizes if n]
    cases += [(f"{r} rollouts", {f"bench-r{i}": cfg.rollout_fleet_size for i in range(r)}, r) for r in cfg.rollouts if r]
    results = []
    with PrometheusServer(scrape_interval="1s") as prometheus:
        for label, fleets, rollouts in cases:
            report.console.rule(f"graft bench operator: {label}")
            results.append(asyncio.run(run_case(cfg, prometheus, fleets, rollouts, log, label)))
    summary = [summarize(c) for c in results]
    data = {"config": cfg, "machine": report.machine_info(), "command": report.command_line(),
            "summary": summary, "cases": results}
    report.write_json(out / "operator.json", data)
    report.show(_table(summary))
    if summary:
        plot(out / "operator.png", summary)
    return data


def _table(summary: list[dict[str, Any]]):
    from rich.table import Table
    t = Table(title="operator per tick (medians)", title_justify="left")
    for col in ("case", "pods", "rest cpu ms", "rest admin", "rest api (verb:n)", "rest prom q",
                "rss MB", "canaries patched s", "roll cpu ms", "roll admin", "roll prom q", "rollout tick late s"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for s in summary:
        rest, roll = s["rest"], s.get("rolling") or {}
        api = " ".join(f"{k}:{v:g}" for k, v in rest.get("api_calls", {}).items())
        late = s.get("rollout_tick_late_s") or {}
        t.add_row(s["label"], str(s["pods"]), f"{rest['cpu_ms']:g}", f"{rest['admin_calls']:g}", api,
                  f"{rest['prometheus_queries']:g}",
                  f"{max(rest['rss_mb'], roll.get('rss_mb', 0)):g}",
                  _fmt((s.get("canaries_patched_s") or {}).get("max")), _fmt(roll.get("cpu_ms")),
                  _fmt(roll.get("admin_calls")), _fmt(roll.get("prometheus_queries")),
                  f"{_fmt(late.get('median'))} / {_fmt(late.get('max'))}" if late else "-")
    return t


def _fmt(x) -> str:
    return "-" if x is None else f"{x:g}"


def plot(path: Path, summary: list[dict[str, Any]]) -> Path:
    """Per tick at rest against pods: operator CPU ms, admin calls, resident MB; and canary times."""
    plt = report._pyplot()     # noqa: SLF001 - the suites share the report module's matplotlib setup
    sizes = [s for s in summary if s["fleets"] == 1]
    many = [s for s in summary if s["fleets"] > 1]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, key, title in ((axes[0], "cpu_ms", "operator CPU ms per tick"), (axes[1], "admin_calls", "admin calls per tick"),
                           (axes[2], "rss_mb", "operator resident MB")):
        for group, marker, name in ((sizes, "o-", "one fleet, by pods"), (many, "s--", "fleets of rollouts, by pods")):
            if group:
                ax.plot([s["pods"] for s in group], [s["rest"][key] for s in group], marker, label=f"{name} (rest)")
                ax.plot([s["pods"] for s in group], [(s.get("rolling") or s["rest"])[key] for s in group], marker,
                        alpha=0.5, label=f"{name} (rolling)")
        ax.set_xscale("log")
        ax.set_xlabel("pods")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[3]
    rolled = [s for s in summary if s.get("canaries_patched_s")]
    ax.bar(range(len(rolled)), [s["canaries_patched_s"]["max"] for s in rolled], color="#2f6fb0")
    ax.set_xticks(range(len(rolled)), [s["label"] for s in rolled], fontsize=8, rotation=30)
    ax.set_ylabel("s")
    ax.set_title("rollout created -> every 50% canary patched", fontsize=10)
    return report._save(fig, plt, path)    # noqa: SLF001
