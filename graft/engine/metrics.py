"""The engine's Prometheus metrics (names follow vLLM's, prefixed `graft_`).

Every request metric carries the engine's `revision` at the moment the request ended, so canary and
stable traffic are told apart in Prometheus without any relabelling. The series of a revision that
is no longer current are dropped once no request admitted under it is still in flight and one
scrape has seen their final values, so a long-lived engine does not keep one set per revision ever
applied.

The latency histograms use geometric buckets fine enough for canary-versus-stable quantile ratio
checks: with a bucket factor f, interpolated quantiles resolve ratios to about f, so a 1.2x
tolerance can be told from noise.
"""
from __future__ import annotations

import math
import os
import threading
from collections import Counter as Tally
from pathlib import Path

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector,
                               ProcessCollector, generate_latest)


def geometric_buckets(start: float, stop: float, factor: float) -> tuple[float, ...]:
    """start * factor**i for i = 0..n, n the power nearest `stop`, each rounded to 4 significant digits."""
    n = round(math.log(stop / start) / math.log(factor))
    return tuple(float(f"{start * factor ** i:.4g}") for i in range(n + 1))


TOKEN_BUCKETS = geometric_buckets(0.001, 5.0, 1.2)        # 1 ms .. 5.266 s, 48 buckets
LATENCY_BUCKETS = geometric_buckets(0.005, 120.0, 1.25)   # 5 ms .. 114.8 s, 46 buckets
DIVERGENCE_BUCKETS = geometric_buckets(1e-6, 10.0, 10 ** 0.5)   # nats: 1e-6 .. 10, two buckets a decade
APPLY_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.25, 0.5, 1.0, 5.0)
# abandoned: the client hung up first; timeout: the engine ended it at the server's request timeout
STATUSES = ("ok", "error", "rejected", "abandoned", "timeout")
SHADOW_RESULTS = ("agree", "divergent", "error")     # graft.engine.shadow's verdicts


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_quota_cores(root: Path = CGROUP_ROOT) -> float:
    """The CPU this process may use, in cores: what `rate(process_cpu_seconds_total)` is divided by.

    The container's CFS quota (cgroup v2 `cpu.max`, else cgroup v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`); without a quota, the CPUs this process may run on.
    """
    quota = _cgroup_v2_quota(root / "cpu.max")
    if quota is None:
        for folder in (root / "cpu", root / "cpu,cpuacct", root):
            quota = _cgroup_v1_quota(folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us")
            if quota is not None:
                break
    if quota is not None:
        return quota
    try:
        return float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return float(os.cpu_count() or 1)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_v2_quota(path: Path) -> float | None:
    """`cpu.max` holds `<quota> <period>` in microseconds, or `max <period>` when unlimited."""
    text = _read(path)
    if not text:
        return None
    parts = text.split()
    try:
        if parts[0] == "max":
            return None
        quota, period = int(parts[0]), int(parts[1]) if len(parts) > 1 else 100_000
    except (ValueError, IndexError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _cgroup_v1_quota(quota_path: Path, period_path: Path) -> float | None:
    """cgroup v1 writes -1 in `cpu.cfs_quota_us` when unlimited."""
    quota, period = _read(quota_path), _read(period_path)
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.requests = Counter("graft_requests", "Requests by outcome.", ["revision", "status"], registry=r)
        self.duration = Histogram("graft_request_duration_seconds", "End-to-end request latency.",
                                  ["revision"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("graft_time_to_first_token_seconds", "Time to first token.",
                              ["revision"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("graft_inter_token_latency_seconds", "Time between output tokens.",
                             ["revision"], buckets=TOKEN_BUCKETS, registry=r)
        self.queue = Histogram("graft_request_queue_seconds", "Time from arrival to first schedule.",
                               ["revision"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("graft_prompt_tokens", "Prompt tokens processed.", ["revision"], registry=r)
        self.generation_tokens = Counter("graft_generation_tokens", "Tokens generated.", ["revision"], registry=r)
        self.running = Gauge("graft_num_requests_running", "Sequences running.", registry=r)
        self.waiting = Gauge("graft_num_requests_waiting", "Sequences waiting.", registry=r)
        self.kv_usage = Gauge("graft_kv_cache_usage_ratio", "Share of KV blocks in use.", registry=r)
        self.kv_fragmentation = Gauge("graft_kv_cache_fragmentation_ratio",
                                      "Share of allocated KV slots holding no token.", registry=r)
        self.preemptions = Counter("graft_num_preemptions", "Sequences preempted (recomputed).", registry=r)
        self.patch_info = Gauge("graft_patch_info", "1 for each applied patch.",
                                ["name", "version", "digest"], registry=r)
        self.patch_apply = Histogram("graft_patch_apply_seconds", "Time to swap a patch in or out.",
                                     ["op"], buckets=APPLY_BUCKETS, registry=r)
        self.patch_failures = Counter("graft_patch_failures", "Patch applies that failed or were refused.",
                                      ["name", "reason"], registry=r)
        self.revision_info = Gauge("graft_engine_revision_info", "The engine's current revision.",
                                   ["revision"], registry=r)
        # shadow comparison (graft.engine.shadow): by the revision whose answers were compared
        self.shadow_requests = Counter("graft_shadow_requests", "Requests compared against the previous table, by result.",
                                       ["revision", "result"], registry=r)
        self.shadow_divergence = Histogram("graft_shadow_divergence_nats",
                                           "Mean KL divergence (nats) of each compared request from the previous table.",
                                           ["revision"], buckets=DIVERGENCE_BUCKETS, registry=r)
        self.shadow_positions = Counter("graft_shadow_positions", "Generated positions compared.", ["revision"],
                                        registry=r)
        self.shadow_skipped = Counter("graft_shadow_skipped", "Recorded requests not compared, by reason.",
                                      ["reason"], registry=r)
        self.shadow_seconds = Counter("graft_shadow_seconds", "Step-loop time spent on shadow comparison.",
                                      registry=r)
        self.slot_faults = Counter("graft_slot_faults", "Patch slots that failed on live traffic (their patch "
                                   "was taken out).", ["slot"], registry=r)
        self.cpu_quota = Gauge("graft_cpu_quota_cores", "CPU cores this process may use (its cgroup quota).",
                               registry=r)
        self.cpu_quota.set_function(cpu_quota_cores)
        self._lock = threading.Lock()
        self._current: str | None = None
        self._in_flight: Tally[str] = Tally()   # requests in flight by the revision that admitted them
        self._retired: set[str] = set()         # former revisions whose series are still exported

    def set_revision(self, old: str | None, new: str) -> None:
        with self._lock:
            if old is not None:
                self.revision_info.remove(old)
                if old != new:
                    self._retired.add(old)
            self._retired.discard(new)
            self._current = new
        self.revision_info.labels(revision=new).set(1)
        # every outcome's series exists from the start at 0, so rate() sees a revision's first error
        for status in STATUSES:
            self.requests.labels(new, status)

    def request_started(self, revision: str) -> None:
        with self._lock:
            self._in_flight[revision] += 1

    def request_ended(self, revision: str) -> None:
        with self._lock:
            self._in_flight[revision] -= 1
            if self._in_flight[revision] <= 0:
                del self._in_flight[revision]

    def render(self) -> bytes:
        """The exposition; former revisions it showed for the last time are dropped after it."""
        with self._lock:
            done = {rev for rev in self._retired if not self._in_flight[rev]}
        text = generate_latest(self.registry)
        for rev in done:
            self._drop(rev)
        return text

    def _drop(self, revision: str) -> None:
        with self._lock:
            if revision == self._current or self._in_flight[revision]:
                return  # applied again, or a request admitted under it since
            self._retired.discard(revision)
        for status in STATUSES:
            self._remove(self.requests, revision, status)
        for result in SHADOW_RESULTS:
            self._remove(self.shadow_requests, revision, result)
        for metric in (self.duration, self.ttft, self.itl, self.queue, self.prompt_tokens,
                       self.generation_tokens, self.shadow_divergence, self.shadow_positions):
            self._remove(metric, revision)

    @staticmethod
    def _remove(metric, *labels: str) -> None:
        try:
            metric.remove(*labels)
        except KeyError:
            pass
