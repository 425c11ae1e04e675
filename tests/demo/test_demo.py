"""`graft demo` without running it whole (the full run takes minutes; run it by hand): where it
writes, its logs kept off the terminal, the scale-up after the promotion followed and reported, a
scale-up that does not happen said as a failure, and the drift drill: passed only when
output-divergence rolled it back, and reported with its numbers and plotted."""
import logging
import subprocess
import sys
import time

import pytest
import yaml

from graft.cli import build_parser
from graft.demo import (ACTS, EXAMPLES, EXPECTED, Join, Timeline, act_problem, demo_paths, demo_rollout,
                        join_section, logs_to, plot, prepare_workdir, report, rollback_cause, rollout_section,
                        scale_up, series)
from graft.devcluster.apiserver import ApiServer
from graft.devcluster.cluster import CRDS, ROOT, ClusterOptions, engine_deployment
from graft.devcluster.traffic import Outcome, TrafficStats
from graft.rollout.fleet import PATCHED_CONDITION
from graft.rollout.spec import parse_spec

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


# the acts, and how a rollout's end is judged and reported
def drift_rolled_back(cause: str = "breaker output-divergence 4 divergent of 6 compared requests in the rollout "
                                   "so far (66.7%): above the 5% limit at 0.999 confidence (lower bound 9.4%) "
                                   "(breach 1/1)") -> dict:
    results = [
        {"name": "error-rate", "role": "breaker", "verdict": "Successful", "value": 0.0,
         "message": "error-rate 0% (0 errors of 22 canary requests in 60s): not shown above the error rate 0.5%",
         "numbers": {"requests": 22, "errors": 0, "rate": 0, "lower": 0, "upper": 0.13, "limit": 0.005}},
        {"name": "ttft-p99", "role": "breaker", "dryRun": True, "verdict": "Inconclusive",
         "message": "ttft-p99: 11 canary samples in 30s, fewer than the 200 a p99 needs",
         "numbers": {"canary_quantile": 1.9, "canary_samples": 11, "stable_quantile": 2.1, "stable_samples": 30}},
        {"name": "output-divergence", "role": "breaker", "verdict": "Failed", "value": 0.667,
         "message": cause.removeprefix("breaker "),
         "numbers": {"compared": 6, "divergent": 4, "share": 0.667, "lower": 0.094, "upper": 0.937, "limit": 0.05}},
    ]
    return {"metadata": {"name": "drift-drill"},
            "spec": {"patch": {"name": "drift", "version": "1"},
                     "steps": [{"weight": 20}, {"weight": 50}, {"weight": 100}]},
            "status": {"phase": "RolledBack", "reason": "AnalysisFailed", "stepIndex": 1, "weight": 0,
                       "cause": f"analysis failed at step 2/3: {cause}",
                       "message": "drift@1 reverted on every pod; all run kv-align@3.2.1",
                       "analysis": {"lastRun": "2026-12-01T22:23:03Z", "verdict": "Failed", "results": results}}}


def test_the_third_act_is_the_drift_drill_rolled_back_by_output_divergence():
    assert EXAMPLES == ("rollout-cpu-fleet.yaml", "rollout-drift-test.yaml", "rollout-fault-test.yaml")
    assert EXPECTED == ["Promoted", "RolledBack", "RolledBack"]
    assert [a.rolled_back_by for a in ACTS] == [None, "output-divergence", "error-rate"]
    assert ACTS[0].scale_up and not any(a.scale_up for a in ACTS[1:])


def test_the_drift_example_acts_on_errors_and_divergence_alone():
    ro = yaml.safe_load((ROOT / "examples" / "rollout-drift-test.yaml").read_text())
    assert ro["spec"]["patch"] == {"name": "drift", "version": "1", "source": {"builtin": {}},
                                   "config": {"fromTokens": 208}}
    checks = parse_spec(ro["spec"]).analysis.checks
    assert {(c.role, c.name) for c in checks if not c.dry_run} == {
        ("breaker", "error-rate"), ("breaker", "output-divergence"), ("gate", "error-rate-delta"),
        ("gate", "output-divergence")}
    assert {c.name for c in checks if c.dry_run} == {"ttft-p99", "tpot-p99", "cpu"}


def test_an_act_may_hold_its_first_step_longer_than_the_pause_flag():
    assert ACTS[1].first_pause == 90
    ro = demo_rollout(ROOT / "examples" / "rollout-drift-test.yaml", "llm", "8s", "2s", first_pause=ACTS[1].first_pause)
    assert [s.get("pause") for s in ro["spec"]["steps"]] == ["1m30s", "8s", None]
    assert ro["spec"]["patch"]["config"] == {"fromTokens": 208}
    assert ro["spec"]["analysis"]["interval"] == "2s" and ro["metadata"]["namespace"] == "llm"
    ro = demo_rollout(ROOT / "examples" / "rollout-drift-test.yaml", "llm", "90s", "2s", first_pause=50)
    assert [s.get("pause") for s in ro["spec"]["steps"]] == ["90s", "90s", None]


def test_an_act_passes_only_when_the_named_check_rolled_it_back():
    drift = ACTS[1]
    ro = drift_rolled_back()
    assert rollback_cause(ro) == ["output-divergence"] and act_problem(drift, ro) is None
    other = drift_rolled_back("breaker error-rate 30% (3 errors of 10 canary requests in 30s): above ...")
    other["status"]["analysis"]["results"][0]["verdict"] = "Failed"
    assert rollback_cause(other) == ["error-rate"]
    assert act_problem(drift, other).startswith("drift-drill was rolled back by error-rate, not by output-divergence")
    promoted = drift_rolled_back()
    promoted["status"].update(phase="Promoted", reason="Promoted")
    assert rollback_cause(promoted) == []
    assert act_problem(drift, promoted).startswith("drift-drill ended Promoted, not RolledBack")
    aborted = drift_rolled_back()
    aborted["status"]["reason"] = "Aborted"
    assert act_problem(drift, aborted).startswith("drift-drill was rolled back by Aborted, not by output-divergence")


def test_the_report_says_what_rolled_the_drill_back_in_numbers_and_plots_the_divergence(tmp_path):
    final = drift_rolled_back()
    t0 = 1_796_000_000.0
    timeline = Timeline("drift-drill")
    for i, (compared, divergent, phase) in enumerate([(0, 0, "Progressing"), (1, 0, "Progressing"),
                                                      (4, 2, "Progressing"), (6, 4, "RolledBack")]):
        ro = drift_rolled_back()
        ro["status"].update(phase=phase, weight=20 if phase == "Progressing" else 0)
        ro["status"]["analysis"]["lastRun"] = f"run {i}"
        div = ro["status"]["analysis"]["results"][2]
        div["numbers"].update(compared=compared, divergent=divergent)
        div["value"] = divergent / compared if compared else None
        timeline.add(t0 + 10 * i, ro)
        timeline.add(t0 + 10 * i + 1, ro)       # the same run seen twice: one point
    png = plot(timeline, tmp_path, {"breaker/output-divergence": 0.05, "breaker/error-rate": 0.005})
    assert png.exists() and png.stat().st_size > 10_000
    text = "\n".join(rollout_section(timeline, final, [], png, {"revision": "drift@1,kv-align@3.2.1",
                                                                 "divergent": 4, "agree": 3, "mean_kl": 1.75}))
    assert "**Rolled back by `output-divergence`** at step 2/3 (weight 50%)" in text
    assert "4 divergent of 6 compared requests over the rollout so far (66.7%)" in text
    assert "lower bound of the divergent share, 9.4%, is above the 5% limit" in text
    assert "4 divergent, 3 agree, 0 error; mean KL of a compared request 1.75 nats" in text
    assert "| ttft-p99 | breaker (dry run) | Inconclusive |" in text
    assert "| error-rate | breaker | Successful | error-rate 0% (0 errors of 22 canary requests" in text


def test_the_divergence_series_has_one_point_per_analysis_run():
    timeline = Timeline("x")
    for i, run in enumerate(["a", "a", "b", "c", "c"]):
        ro = drift_rolled_back()
        ro["status"]["analysis"]["lastRun"] = run
        ro["status"]["analysis"]["results"][2]["numbers"]["compared"] = i
        timeline.add(100.0 + i, ro)
    assert series(timeline.samples, "breaker/output-divergence", "compared") == ([0.0, 2.0, 3.0], [0.0, 2.0, 3.0])
    assert series(timeline.samples, "breaker/output-divergence", "lower", scale=100)[1] == [9.4, 9.4, 9.4]
    assert series(timeline.samples, "gate/tpot-p99") == ([], [])
