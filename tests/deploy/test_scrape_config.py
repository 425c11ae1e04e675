"""deploy/prometheus/scrape-config.yaml in a real Prometheus: promtool accepts a config made of the
shipped job, and a running Prometheus scrapes a pod of the chart's engine fleet (and no other pod)
with the labels the operator's queries filter on.

Debian's Prometheus is built without Kubernetes service discovery, so the job's
`kubernetes_sd_configs` ([{role: pod}], checked below) is the one part swapped: a file lists the
targets Kubernetes discovery would hand over for each pod, with the same `__meta_kubernetes_*`
labels, and everything else (relabelling, path, port, interval) runs in Prometheus as shipped.
"""
from __future__ import annotations

import asyncio
import copy
import json
import shutil
import socket
import subprocess

import httpx
import yaml
from prometheus_client import start_http_server

from graft.engine.metrics import EngineMetrics
from tests.deploy.manifests import DEPLOY, one, pod_template, render
from tests.deploy.promql import discovered_targets, promtool

SCRAPE_CONFIG = DEPLOY / "prometheus" / "scrape-config.yaml"


def shipped_job() -> dict:
    (job,) = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))["scrape_configs"]
    return job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_file_sd(job: dict, targets_file) -> dict:
    """The job with Kubernetes discovery swapped for a targets file (see the module docstring)."""
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    out = {k: v for k, v in job.items() if k != "kubernetes_sd_configs"}
    return out | {"file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}]}


def check_config(path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), "check", "config", str(path)], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_a_config_made_of_the_shipped_job(tmp_path):
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "15s"},
                                      "scrape_configs": [as_file_sd(shipped_job(), targets)]}))
    done = check_config(config)
    assert done.returncode == 0, done.stdout + done.stderr
    broken = as_file_sd(shipped_job(), targets) | {"relabel_configs": [{"action": "keep", "regex": "("}]}
    config.write_text(yaml.safe_dump({"scrape_configs": [broken]}))
    assert check_config(config).returncode != 0


def engine_pod(template: dict, port: int) -> dict:
    """A pod of the chart's engine Deployment, its metrics port moved to `port` (free on this machine)."""
    pod = {"metadata": copy.deepcopy(template["metadata"]),
           "spec": {"containers": [{"name": c["name"], "ports": copy.deepcopy(c["ports"])}
                                   for c in template["spec"]["containers"]]}}
    (metrics,) = [p for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "metrics"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(metrics["containerPort"])
    pod["metadata"]["annotations"]["prometheus.io/port"] = str(port)
    metrics["containerPort"] = port
    return pod


async def until(probe, what: str, timeout: float = 30.0):
    for _ in range(int(timeout / 0.25)):
        if found := await probe():
            return found
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


async def test_prometheus_scrapes_the_chart_engines_with_the_shipped_job(chart, tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: apt-get install prometheus (make test does)"
    metrics = EngineMetrics()
    metrics.set_revision(None, "base")
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    engine = engine_pod(pod_template(one(render(chart, {"engine": {"enabled": True}}), "Deployment")), port)
    other = {"metadata": {"labels": {"app": "db"}},
             "spec": {"containers": [{"ports": [{"containerPort": free_port()}]}]}}
    discovered = (discovered_targets(engine, "llm", "graft-engine-a", "127.0.0.1")
                  + discovered_targets(engine, "llm", "graft-engine-b", "127.0.0.1", phase="Pending")
                  + discovered_targets(other, "llm", "postgres-0", "127.0.0.1"))
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps([{"targets": [t.pop("__address__")], "labels": t} for t in discovered]))
    job = as_file_sd(shipped_job(), targets) | {"scrape_interval": "1s"}
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": [job]}))
    web = f"127.0.0.1:{free_port()}"
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        prometheus = subprocess.Popen([binary, f"--config.file={config}", f"--web.listen-address={web}",
                                       f"--storage.tsdb.path={tmp_path / 'data'}"], stdout=out, stderr=out)
    try:
        async with httpx.AsyncClient(base_url=f"http://{web}", timeout=5) as http:
            async def scraped():
                try:
                    active = (await http.get("/api/v1/targets")).json()["data"]["activeTargets"]
                except (httpx.HTTPError, ValueError, KeyError):
                    return None
                return active if active and all(t["health"] == "up" for t in active) else None

            try:
                active = await until(scraped, "Prometheus to scrape the engine pod")
            except AssertionError as e:
                raise AssertionError(f"{e}; Prometheus said:\n{log.read_text()[-3000:]}") from None
            # one target for the pod's three ports (on its metrics port), none for the pending pod or the database
            assert [t["labels"] for t in active] == [{
                "instance": f"127.0.0.1:{port}", "job": job["job_name"], "namespace": "llm",
                "pod": "graft-engine-a", "track": "stable"}]
            assert active[0]["scrapeUrl"] == f"http://127.0.0.1:{port}/metrics"
            reply = (await http.get("/api/v1/query", params={
                "query": 'graft_engine_revision_info{namespace="llm", pod="graft-engine-a", revision="base"}'})).json()
            assert [r["value"][1] for r in reply["data"]["result"]] == ["1"]
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=10)
        server.shutdown()
