"""A real Prometheus scrapes local endpoints, answers PromQL, and survives a restart on its port."""

import threading
import time

import httpx
import prometheus_client
import pytest
from prometheus_api_client import PrometheusConnect

from graft.devcluster.prometheus import PrometheusNotFound, PrometheusServer

RATE = 40.0  # increments per second the counter endpoint makes


@pytest.fixture
def counter_endpoint():
    """A tiny /metrics endpoint whose counter grows at RATE per second while the test runs."""
    registry = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter("demo_requests", "Requests served.", registry=registry)
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    stop = threading.Event()

    def tick():
        while not stop.wait(0.05):
            counter.inc(RATE * 0.05)
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    yield f"127.0.0.1:{server.server_port}"
    stop.set()
    server.shutdown()
    server.server_close()


def query(prom: PrometheusServer, promql: str) -> list[dict]:
    return PrometheusConnect(prom.url, disable_ssl=True).custom_query(promql)


def wait_for(probe, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.1)


def test_prometheus_scrapes_a_counter_answers_rate_and_follows_target_changes(counter_endpoint):
    second = prometheus_client.CollectorRegistry()
    prometheus_client.Gauge("demo_up", "A second endpoint.", registry=second).set(1)
    server, _ = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=second)
    try:
        with PrometheusServer([(counter_endpoint, {"pod": "engine-0"})], scrape_interval="200ms") as prom:
            assert len(prom.wait_for_targets()) == 1
            # rate() underestimates until its window is full of samples (10 in 2 s at 200 ms).
            full = wait_for(lambda: [s for s in query(prom, "count_over_time(demo_requests_total[2s])")
                                     if int(s["value"][1]) >= 9])
            assert full, "Prometheus did not scrape every 200 ms"
            result = query(prom, "rate(demo_requests_total[2s])")
            assert result[0]["metric"]["pod"] == "engine-0" and result[0]["metric"]["job"] == "graft"
            assert RATE * 0.5 < float(result[0]["value"][1]) < RATE * 1.5

            prom.set_targets([(counter_endpoint, {"pod": "engine-0"}),
                              (f"127.0.0.1:{server.server_port}", {"pod": "engine-1"})])
            assert {t["labels"]["pod"] for t in prom.wait_for_targets(count=2)} == {"engine-0", "engine-1"}
            assert wait_for(lambda: query(prom, 'demo_up{pod="engine-1"}'))
    finally:
        server.shutdown()
        server.server_close()


def test_prometheus_stops_and_comes_back_on_the_same_port_with_its_data(counter_endpoint):
    with PrometheusServer([counter_endpoint], scrape_interval="200ms") as prom:
        url = prom.url
        prom.wait_for_targets()
        assert wait_for(lambda: query(prom, "demo_requests_total"))
        prom.stop()
        assert not prom.running
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/-/ready", timeout=1.0)

        prom.start()
        assert prom.url == url and prom.running
        samples = query(prom, "count_over_time(demo_requests_total[1m])")
        assert samples and int(samples[0]["value"][1]) >= 1  # what was scraped before the stop is kept
        assert wait_for(lambda: query(prom, "rate(demo_requests_total[2s])"))  # and scraping resumed


def test_a_missing_prometheus_binary_says_how_to_install_it(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(PrometheusNotFound, match="apt-get install prometheus"):
        PrometheusServer(["127.0.0.1:9"])


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="host:port"):
        PrometheusServer(["localhost"])
