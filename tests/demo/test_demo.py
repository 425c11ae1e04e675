"""`graft demo` without running it whole (the full run takes minutes; run it by hand): where it
writes, its logs kept off the terminal, the scale-up after the promotion followed and reported, and a
scale-up that does not happen said as a failure."""
import logging
import subprocess
import sys
import time

import pytest

from graft.cli import build_parser
from graft.demo import Join, demo_paths, join_section, logs_to, prepare_workdir, report, scale_up
from graft.devcluster.apiserver import ApiServer
from graft.devcluster.cluster import CRDS, ClusterOptions, engine_deployment
from graft.devcluster.traffic import Outcome, TrafficStats
from graft.rollout.fleet import PATCHED_CONDITION

KV = "kv-align@3.2.1"


def test_the_report_goes_under_dot_graft_demo_unless_out_says_otherwise():
    paths = demo_paths(build_parser().parse_args(["demo"]))
    assert (str(paths.out), str(paths.workdir), str(paths.log)) == (
        ".graft-demo", ".graft-demo/cluster", ".graft-demo/cluster/demo.log")
    paths = demo_paths(build_parser().parse_args(["demo", "--out", "docs/demo"]))
    assert (str(paths.out), str(paths.workdir)) == ("docs/demo", "docs/demo/cluster")
    paths = demo_paths(build_parser().parse_args(["demo", "--workdir", "/tmp/x", "--scale-timeout", "9"]))
    assert (str(paths.out), str(paths.workdir)) == (".graft-demo", "/tmp/x")


def test_the_cluster_folder_holds_nothing_for_git_and_no_log_of_an_earlier_run(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    workdir = tmp_path / "docs" / "demo" / "cluster"
    (workdir / "pods").mkdir(parents=True)
    (workdir / "operator.log").write_text("the last run\n")
    (workdir / "pods" / "llm-engine-old.log").write_text("the last run\n")
    prepare_workdir(workdir)
    assert not (workdir / "operator.log").exists() and not list((workdir / "pods").iterdir())
    (workdir / "demo.log").write_text("this run\n")
    (workdir / "kubeconfig").write_text("apiVersion: v1\n")
    (tmp_path / "docs" / "demo" / "report.md").write_text("# report\n")
    status = subprocess.run(["git", "-C", str(tmp_path), "status", "--porcelain", "--untracked-files=all"],
                            capture_output=True, text=True, check=True).stdout
    assert status.splitlines() == ["?? docs/demo/report.md"]


def test_log_records_go_to_the_file_and_not_to_the_terminal_while_the_view_runs(tmp_path, capfd):
    root = logging.getLogger()
    terminal = logging.StreamHandler(sys.stderr)
    root.addHandler(terminal)
    try:
        with logs_to(tmp_path / "demo.log"):
            logging.getLogger("graft.devcluster.podrunner").info("pod llm-engine-x started")
            logging.getLogger("graft.devcluster.podrunner").warning("pod llm-engine-x: probe failed")
        logging.getLogger("graft.demo.test").warning("after the view")
    finally:
        root.removeHandler(terminal)
    err = capfd.readouterr().err
    logged = (tmp_path / "demo.log").read_text()
    assert "pod llm-engine-x started" in logged and "probe failed" in logged
    assert "llm-engine-x" not in err and "after the view" in err, "the terminal handler is back afterwards"


def pod(name, *, running=False, gate=None, ready=False):
    conditions = [{"type": "ContainersReady", "status": str(running)},
                  {"type": "Ready", "status": str(ready), "lastTransitionTime": "2026-01-01T00:01:02Z"}]
    if gate is not None:
        conditions.append({"type": PATCHED_CONDITION, "status": str(gate)})
    return {"metadata": {"name": name}, "status": {"phase": "Running", "podIP": "127.0.0.5", "conditions": conditions}}


def test_a_new_pod_joins_once_ready_at_the_promoted_revision_and_answering():
    join, stats = Join(KV, (3, 4), time.time()), TrafficStats()
    join.observe(pod("llm-engine-new"), None, stats)
    join.observe(pod("llm-engine-new", running=True), "base", stats)
    join.observe(pod("llm-engine-new", running=True, gate=True), KV, stats)
    join.observe(pod("llm-engine-new", running=True, gate=True, ready=True), KV, stats)
    assert not join.done, "Ready, but no client request answered yet"
    stats.outcomes.append(Outcome(time.time(), "llm-engine-new", 200, 0.2))
    join.observe(pod("llm-engine-new", running=True, gate=True, ready=True), KV, stats)
    assert join.done and join.error is None
    assert join.engine_revisions == ["base", KV] and join.revision_at_ready == KV
    assert list(join.moments) == ["created", "running", "patched", "gate", "ready", "served"]
    lines = "\n".join(join_section(join, []))
    assert f"pod `llm-engine-new` joined at `{KV}`" in lines
    assert f"revision when Ready: `{KV}`" in lines and "its Ready condition: 2026-01-01T00:01:02Z" in lines
    assert "| pod Ready: it takes traffic |" in lines and "base -> kv-align@3.2.1" in lines


def test_a_new_pod_ready_on_another_revision_is_a_failure(tmp_path):
    join = Join(KV, (3, 4), time.time())
    join.observe(pod("llm-engine-new", running=True, ready=True), "base", TrafficStats())
    assert not join.done
    assert join.error == f"pod llm-engine-new turned Ready running base, not the promoted {KV}"
    path = report(tmp_path, [join_section(join, [])], TrafficStats(), time.time(), 4)
    assert f"## Scale-up after the promotion: FAILED: {join.error}" in path.read_text()


@pytest.fixture
async def api_server():
    async with ApiServer(crd_paths=[CRDS]) as server:
        yield server


async def test_a_scale_up_whose_pod_never_comes_fails_saying_what_did_not_happen(api_server):
    import httpx

    async with httpx.AsyncClient(base_url=api_server.url, timeout=10) as api:
        await api.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace",
                                                   "metadata": {"name": "llm"}})
        deployment = engine_deployment(ClusterOptions(workdir=".", pods=3, readiness_gates=(PATCHED_CONDITION,)))
        assert (await api.post("/apis/apps/v1/namespaces/llm/deployments", json=deployment)).status_code == 201
        # no pod runner plays the Deployment controller here: the new pod never comes
        join = await scale_up(api, "llm", "token", KV, TrafficStats(), timeout=0.5, interval=0.1)
        assert (await api.get("/apis/apps/v1/namespaces/llm/deployments/llm-engine")).json()["spec"]["replicas"] == 4
    assert join.replicas == (3, 4) and not join.done
    assert join.error == "no new pod appeared within 0.5 s of scaling deployment/llm-engine to 4"
