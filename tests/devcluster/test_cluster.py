"""`graft dev-cluster`: logs go to files in its folder, and `--traffic RPS` sends BBH prompts."""

import argparse
import asyncio
import json
import logging
import sys
import time

import aiohttp.web
import httpx
import pytest

from graft.cli import build_parser
from graft.devcluster import cluster
from graft.devcluster.apiserver import ApiServer
from graft.devcluster.traffic import TRAFFIC_TASKS, Router, Traffic


@pytest.fixture
def restored_logging():
    """route_logs changes process-wide logging: put it back after the test. httpx's logger starts
    as a fresh process has it (another test in this process may have quietened it, as the
    operator's and the bench's entry points do)."""
    root, access, client = logging.getLogger(), logging.getLogger("aiohttp.access"), logging.getLogger("httpx")
    saved = (root.level, list(root.handlers), [h.level for h in root.handlers], list(access.handlers), access.propagate)
    client_level = client.level
    client.setLevel(logging.NOTSET)
    yield
    client.setLevel(client_level)
    root.setLevel(saved[0])
    for handler in root.handlers[:]:
        if handler not in saved[1]:
            root.removeHandler(handler)
            handler.close()
    for handler, level in zip(saved[1], saved[2]):
        handler.setLevel(level)
    access.handlers[:], access.propagate = saved[3], saved[4]


async def test_api_calls_are_logged_to_a_file_in_the_cluster_folder_not_the_terminal(tmp_path, capfd,
                                                                                     restored_logging):
    logging.getLogger().addHandler(logging.StreamHandler(sys.stderr))  # what `graft`'s basicConfig sets up
    logging.getLogger().setLevel(logging.INFO)
    cluster.route_logs(tmp_path)
    async with ApiServer() as api, httpx.AsyncClient(base_url=api.url) as client:
        for _ in range(3):
            assert (await client.get("/api/v1/namespaces")).status_code == 200
    logging.getLogger("graft.devcluster.test").warning("a warning still reaches the terminal")
    for handler in logging.getLogger("aiohttp.access").handlers + logging.getLogger().handlers:
        handler.flush()
    terminal = capfd.readouterr().err
    assert "GET /api/v1/namespaces" not in terminal and "HTTP Request" not in terminal
    assert "a warning still reaches the terminal" in terminal
    access = (tmp_path / "apiserver.log").read_text()
    assert access.count('"GET /api/v1/namespaces HTTP/1.1" 200') == 3
    assert "HTTP Request: GET" in (tmp_path / "devcluster.log").read_text()


@pytest.fixture
def bbh(tmp_path, monkeypatch):
    """The traffic's BBH tasks in the real data set's layout, found through GRAFT_DATA_DIR."""
    for task in TRAFFIC_TASKS:
        for folder in ("bbh", "cot-prompts"):
            (tmp_path / "data" / "bbh" / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / "bbh" / "bbh" / f"{task}.json").write_text(json.dumps(
            {"examples": [{"input": f"{task} question {i}", "target": "No"} for i in range(3)]}))
        (tmp_path / "data" / "bbh" / "cot-prompts" / f"{task}.txt").write_text(f"canary\n-----\n{task} examples")
    monkeypatch.setenv("GRAFT_DATA_DIR", str(tmp_path / "data"))


def test_dev_cluster_takes_a_traffic_rate():
    args = build_parser().parse_args(["dev-cluster", "--traffic", "2.5"])
    assert args.traffic == 2.5 and build_parser().parse_args(["dev-cluster"]).traffic == 0


def test_traffic_without_bbh_data_fails_before_the_cluster_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no bbh/ folder"):
        cluster.main(argparse.Namespace(dir=str(tmp_path / "cluster"), pods=1, traffic=2.0))
    assert not (tmp_path / "cluster").exists()


async def test_traffic_sends_bbh_prompts_through_the_router_at_its_rate(bbh):
    received: list[dict] = []

    async def completions(request: aiohttp.web.Request) -> aiohttp.web.Response:
        received.append(await request.json())
        return aiohttp.web.json_response({"choices": [{"text": "Yes"}]})

    app = aiohttp.web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with ApiServer() as api, httpx.AsyncClient(base_url=api.url) as client:
            pods = "/api/v1/namespaces/default/pods"
            await client.post(pods, json={"metadata": {"name": "engine-0", "labels": cluster.APP}, "spec": {}})
            await client.patch(f"{pods}/engine-0/status", headers={"Content-Type": "application/merge-patch+json"},
                               json={"status": {"podIP": "127.0.0.1", "conditions": [
                                   {"type": "Ready", "status": "True"}]}})
            prompts = cluster.traffic_prompts(8)
            started = time.monotonic()
            async with Traffic(Router(client, "default", dict(cluster.APP)), prompts, rate=20, port=port) as traffic:
                await asyncio.sleep(1.0)
            elapsed = time.monotonic() - started
    finally:
        await runner.cleanup()
    assert 0.6 * 20 * elapsed <= len(received) <= 20 * elapsed + 2
    assert {r["prompt"] for r in received} <= set(prompts) and len({r["prompt"] for r in received}) > 1
    assert all(r["prompt"].endswith("A: Let's think step by step.") for r in received)
    assert traffic.stats.failed() == [] and set(traffic.stats.by_pod()) == {"engine-0"}


def test_prometheus_scrapes_each_engine_on_its_metrics_port_alone(tmp_path):
    """The engine pods serve /metrics on the container port named `metrics` (the public port answers
    404 there), and the dev cluster's Prometheus scrapes that port, as the chart's PodMonitor does;
    a pod that names no such port (a trap pod, a database) is not scraped."""
    from graft.devcluster.podrunner import Container

    (engine,) = cluster.engine_deployment(cluster.ClusterOptions(workdir=tmp_path))["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    args = build_parser().parse_known_args(engine["args"])[0]
    assert args.metrics_port == ports["metrics"] == cluster.METRICS_PORT != args.port == ports["http"]
    engines = [Container("llm-engine-a", "127.0.0.2", ports=ports), Container("llm-engine-b", "127.0.0.3", ports=ports)]
    trap = Container("trap", "127.0.0.4", ports={"http": 8000, "admin": 8081})
    assert cluster.scrape_targets([trap, *engines[::-1]], "llm") == [
        (f"127.0.0.2:{ports['metrics']}", {"namespace": "llm", "pod": "llm-engine-a"}),
        (f"127.0.0.3:{ports['metrics']}", {"namespace": "llm", "pod": "llm-engine-b"})]
