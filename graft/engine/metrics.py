"""The engine's Prometheus metrics (names follow vLLM's, prefixed `graft_`).

Every request metric carries the engine's `revision` at the moment the request ended, so canary and
stable traffic are told apart in Prometheus without any relabelling.
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector,
                               ProcessCollector, generate_latest)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0,
                   8.0, 12.0, 20.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
APPLY_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.25, 0.5, 1.0, 5.0)


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

    def set_revision(self, old: str | None, new: str) -> None:
        if old is not None:
            self.revision_info.remove(old)
        self.revision_info.labels(revision=new).set(1)
        # every outcome's series exists from the start at 0, so rate() sees a revision's first error
        for status in ("ok", "error", "rejected"):
            self.requests.labels(new, status)

    def render(self) -> bytes:
        return generate_latest(self.registry)
