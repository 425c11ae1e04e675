"""Request metrics a rollout is judged on: series per revision, CPU quota, bucket resolution."""
from __future__ import annotations

import math
import os
from statistics import NormalDist

import httpx
import pytest

from graft.engine.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, EngineMetrics, cpu_quota_cores
from tests.support import metric_value, start_engine

MODEL = "SmolLM2-135M-Instruct"
REQUEST_SERIES = ("graft_requests_total", "graft_request_duration_seconds_count",
                  "graft_time_to_first_token_seconds_count", "graft_inter_token_latency_seconds_count",
                  "graft_request_queue_seconds_count", "graft_prompt_tokens_total", "graft_generation_tokens_total")


def series_of(text: str, revision: str) -> list[str]:
    return [line for line in text.splitlines()
            if line.startswith("graft_") and f'revision="{revision}"' in line and "revision_info" not in line]


def observe(m: EngineMetrics, revision: str) -> None:
    m.requests.labels(revision, "ok").inc()
    for h in (m.duration, m.ttft, m.itl, m.queue):
        h.labels(revision).observe(0.1)
    m.prompt_tokens.labels(revision).inc(3)
    m.generation_tokens.labels(revision).inc(2)


# item: series of former revisions are dropped

def test_a_former_revision_is_dropped_after_its_last_request_and_one_more_scrape():
    m = EngineMetrics()
    m.set_revision(None, "base")
    m.request_started("base")
    observe(m, "base")
    m.set_revision("base", "slow@1")
    assert series_of(m.render().decode(), "base")       # a request admitted under it is in flight
    assert series_of(m.render().decode(), "base")
    m.request_ended("base")
    last = m.render().decode()                           # the final values are scraped once...
    assert metric_value(last, "graft_requests_total", revision="base", status="ok") == 1
    assert series_of(m.render().decode(), "base") == []  # ...then the series are gone
    current = m.render().decode()
    for status in ("ok", "error", "rejected"):           # the current revision's zero series stay
        assert f'graft_requests_total{{revision="slow@1",status="{status}"}} 0.0' in current


def test_a_revision_applied_again_keeps_its_series():
    m = EngineMetrics()
    m.set_revision(None, "base")
    observe(m, "base")
    m.set_revision("base", "fault@1")
    m.set_revision("fault@1", "base")
    m.render()
    text = m.render().decode()
    assert metric_value(text, "graft_requests_total", revision="base", status="ok") == 1
    assert series_of(text, "fault@1") == []


@pytest.mark.slow
def test_a_live_engine_keeps_only_the_current_revisions_series(tmp_path):
    eng = start_engine(tmp_path, "--enable-test-patches")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    try:
        with eng.admin() as admin:
            # fault@1 injects no errors here (its default fails 5% of requests at random): this is
            # about which revisions' series stay, not about the fault
            for patch, config in (("slow", {}), ("fault", {"errorRate": 0})):
                r = admin.post("/admin/patches", json={"name": patch, "version": "1", "source": {"builtin": True},
                                                       "config": config})
                assert r.status_code == 200, r.text
                assert httpx.post(eng.url + "/v1/completions", json=body, timeout=60).status_code == 200
                assert admin.delete(f"/admin/patches/{patch}").status_code == 200
        assert httpx.post(eng.url + "/v1/completions", json=body, timeout=60).status_code == 200
        httpx.get(eng.metrics_url + "/metrics")
        text = httpx.get(eng.metrics_url + "/metrics").text
    finally:
        eng.stop()
    revisions = {line.split('revision="')[1].split('"')[0] for line in text.splitlines()
                 if line.startswith("graft_") and 'revision="' in line}
    assert revisions == {"base"}
    assert metric_value(text, "graft_requests_total", revision="base", status="ok") == 1
    for name in REQUEST_SERIES:
        assert name in text, name


# item: CPU quota

@pytest.mark.parametrize("files, cores", [
    ({"cpu.max": "250000 100000\n"}, 2.5),
    ({"cpu.max": "50000 100000"}, 0.5),
    ({"cpu.max": "200000"}, 2.0),
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "400000", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, 4.0),
])
def test_cpu_quota_comes_from_the_cgroup(tmp_path, files, cores):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota_cores(tmp_path) == cores


@pytest.mark.parametrize("files", [
    {}, {"cpu.max": "max 100000\n"}, {"cpu.max": "garbage"}, {"cpu.max": ""},
    {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, {"cpu/cpu.cfs_quota_us": "100000"},
])
def test_without_a_quota_the_cpus_this_process_may_run_on(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota_cores(tmp_path) == len(os.sched_getaffinity(0))


def test_without_affinity_the_cpu_count(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity")
    assert cpu_quota_cores(tmp_path) == os.cpu_count()


def test_cpu_quota_is_exported():
    text = EngineMetrics().render().decode()
    assert metric_value(text, "graft_cpu_quota_cores") == cpu_quota_cores()
    assert metric_value(text, "graft_cpu_quota_cores") > 0


# item: histogram buckets fine enough for ratio checks

def test_bucket_constants_are_the_documented_geometric_series():
    assert TOKEN_BUCKETS == tuple(float(f"{0.001 * 1.2 ** i:.4g}") for i in range(48))
    assert LATENCY_BUCKETS == tuple(float(f"{0.005 * 1.25 ** i:.4g}") for i in range(46))
    assert TOKEN_BUCKETS[0] == 0.001 and 4.5 < TOKEN_BUCKETS[-1] < 5.5
    assert LATENCY_BUCKETS[0] == 0.005 and 100 < LATENCY_BUCKETS[-1] < 140
    assert all(type(b) is float for b in TOKEN_BUCKETS + LATENCY_BUCKETS)


@pytest.mark.parametrize("buckets, factor", [(TOKEN_BUCKETS, 1.2), (LATENCY_BUCKETS, 1.25)])
def test_neighbouring_buckets_are_closer_than_the_ratio_tolerance(buckets, factor):
    ratios = [b / a for a, b in zip(buckets, buckets[1:])]
    assert all(math.isclose(r, factor, rel_tol=2e-3) for r in ratios)


def _p99(samples: list[float], buckets: tuple[float, ...]) -> float:
    """p99 from cumulative buckets with linear interpolation, as PromQL's histogram_quantile does."""
    counts = [sum(s <= b for s in samples) for b in buckets]
    rank = 0.99 * len(samples)
    i = next(i for i, c in enumerate(counts) if c >= rank)
    lo, below = (buckets[i - 1], counts[i - 1]) if i else (0.0, 0)
    return lo + (buckets[i] - lo) * (rank - below) / (counts[i] - below)


@pytest.mark.parametrize("buckets", [TOKEN_BUCKETS, LATENCY_BUCKETS], ids=["token", "latency"])
def test_a_1_2x_slower_canary_is_told_apart_from_a_1_05x_one_by_p99(buckets):
    """Log-normal latencies at medians across the whole range: the p99 ratio read from the buckets
    stays under 1.1 for a 1.05x canary and over 1.15 for a 1.2x one (the old buckets read 1.01)."""
    n = 2000
    spread = [math.exp(0.35 * NormalDist().inv_cdf((i + 0.5) / n)) for i in range(n)]
    median = buckets[0] * 4
    while median * 3 < buckets[-1]:
        stable = [median * x for x in spread]
        close = _p99([s * 1.05 for s in stable], buckets) / _p99(stable, buckets)
        slower = _p99([s * 1.2 for s in stable], buckets) / _p99(stable, buckets)
        assert close < 1.1 and slower > 1.15, (median, close, slower)
        median *= 1.1
