"""`graft demo` without running it whole (the full run takes minutes; run it by hand): where it
writes, its logs kept off the terminal, the scale-up after the promotion followed and reported, a
scale-up that does not happen said as a failure, the drift drill: passed only when
output-divergence rolled it back, and reported with its numbers and plotted, and the plot of a
rollout: the canary's traffic share, canary beside stable for each check with its limit."""
import json
import logging
import subprocess
import sys
import time

import pytest
import yaml

from graft.cli import build_parser
from graft.demo import (ACTS, EXAMPLES, EXPECTED, Join, Timeline, act_problem, checks_of, demo_paths, demo_rollout,
                        join_section, logs_to, plot, plot_panels, prepare_workdir, report, rollback_cause,
                        rollout_section, scale_up, series)
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

    from graft.operator.kube import Kube

    async with httpx.AsyncClient(base_url=api_server.url, timeout=10) as api:
        await api.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace",
                                                   "metadata": {"name": "llm"}})
        deployment = engine_deployment(ClusterOptions(workdir=".", pods=3, readiness_gates=(PATCHED_CONDITION,)))
        assert (await api.post("/apis/apps/v1/namespaces/llm/deployments", json=deployment)).status_code == 201
        # no pod runner plays the Deployment controller here: the new pod never comes
        async with Kube(api_server.url) as kube:        # the demo's client, Graft's one
            join = await scale_up(kube, "llm", "token", KV, TrafficStats(), timeout=0.5, interval=0.1)
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
    drill = demo_rollout(ROOT / "examples" / "rollout-drift-test.yaml", "llm", "8s", "2s")
    png = plot(timeline, tmp_path, checks_of(drill))
    assert png.exists() and png.stat().st_size > 10_000
    plotted = json.loads((tmp_path / "drift-drill-plot.json").read_text())
    divergence = plotted["panels"]["divergence"]["series"]
    assert divergence["divergent share"]["v"] == [None, 0.0, 50.0, pytest.approx(66.67, abs=0.01)]
    assert divergence["limit (5%)"] == {"t": [0.0, 31.0], "v": [5.0, 5.0], "limit": True}
    assert plotted["decided"] == 30.0
    text = "\n".join(rollout_section(timeline, final, [], png, {"revision": "drift@1,kv-align@3.2.1",
                                                                 "divergent": 4, "agree": 3, "mean_kl": 1.75}))
    assert "**Rolled back by `output-divergence`** at step 2/3 (weight 50%)" in text
    assert "4 divergent of 6 compared requests over the rollout so far (66.7%)" in text
    assert "lower bound of the divergent share, 9.4%, is above the 5% limit" in text
    assert "4 divergent, 3 agree, 0 error; mean KL of a compared request 1.75 nats" in text
    assert "| ttft-p99 | breaker (dry run) | Inconclusive |" in text
    assert "its series are in [drift-drill-plot.json](drift-drill-plot.json)" in text
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


def cpu_fleet_run(i: int) -> dict:
    """The kv-align rollout of the first act as its status stands after analysis run `i` (0, 1, 2):
    every check it judges the canary by, each with the numbers the operator records."""
    results = [
        {"name": "error-rate", "role": "breaker", "verdict": "Successful", "value": 0.01 * i,
         "numbers": {"requests": 20.0, "errors": 0.2 * i, "rate": 0.01 * i, "limit": 0.005}},
        {"name": "ttft-p99", "role": "breaker", "verdict": "Inconclusive" if i == 0 else "Successful",
         "value": None if i == 0 else (0.5 + 0.1 * i) / 0.4,
         "numbers": {"canary_quantile": 0.5 + 0.1 * i, "canary_samples": 250, "stable_quantile": 0.4,
                     "stable_samples": 400}},
        # no stable sample in run 1: a p99 of 0, which the plot leaves out (and so its limit)
        {"name": "tpot-p99", "role": "breaker", "verdict": "Inconclusive", "value": None,
         "numbers": {"canary_quantile": 0.2, "canary_samples": 40, "stable_quantile": 0.0 if i == 1 else 0.18,
                     "stable_samples": 0 if i == 1 else 90}},
        {"name": "output-divergence", "role": "breaker", "verdict": "Successful", "value": 0.0,
         "numbers": {"compared": 2.0 * i, "divergent": 0.0, "share": 0.0, "lower": 0.0, "limit": 0.05}},
        {"name": "error-rate-delta", "role": "gate", "verdict": "Inconclusive", "value": 0.0,
         "numbers": {"canary_requests": 10.0 * (i + 1), "canary_errors": float(i), "stable_requests": 30.0,
                     "stable_errors": 0.3 * i, "limit": 0.05}},
    ]
    return {"metadata": {"name": "kv-align-3-2-1-cpu"},
            "spec": {"patch": {"name": "kv-align", "version": "3.2.1"}},
            "status": {"phase": "Progressing", "stepIndex": 2 if i else 1, "weight": 50 if i else 20,
                       "trafficShare": 66.7 if i else 33.3,
                       "analysis": {"lastRun": f"run {i}", "results": results}}}


def test_the_plot_sets_canary_beside_stable_for_each_check_with_its_limit_and_the_traffic_share(tmp_path):
    timeline = Timeline("kv-align-3-2-1-cpu")
    for i in range(3):
        timeline.add(1_796_000_000.0 + 10 * i, cpu_fleet_run(i))
    rollout = demo_rollout(ROOT / "examples" / "rollout-cpu-fleet.yaml", "llm", "8s", "2s")
    png = plot(timeline, tmp_path, checks_of(rollout))
    assert png.exists() and png.stat().st_size > 10_000
    plotted = json.loads((tmp_path / "kv-align-3-2-1-cpu-plot.json").read_text())
    panels = plotted["panels"]
    assert list(panels) == ["traffic", "errors", "ttft-p99", "tpot-p99", "compared", "divergence"]

    def v(panel: str, label: str) -> list:
        return panels[panel]["series"][label]["v"]

    # the traffic: asked, by pod count, and measured (canary requests of all, over the step)
    assert v("traffic", "weight the step asks for") == [20, 50, 50]
    assert v("traffic", "canary pods' share of the pods (status.trafficShare)") == [33.3, 66.7, 66.7]
    assert v("traffic", "canary pods' share of the requests (measured, error-rate-delta)") == pytest.approx(
        [100 * 10 / 40, 100 * 20 / 50, 100 * 30 / 60])
    # the error rate: the breaker's canary rate, canary beside stable over the step, both limits
    assert v("errors", "canary (error-rate, 60s)") == pytest.approx([0.0, 1.0, 2.0])
    assert v("errors", "canary (error-rate-delta, over the step)") == pytest.approx([0.0, 5.0, 2 / 30 * 100])
    assert v("errors", "stable (error-rate-delta, over the step)") == pytest.approx([0.0, 1.0, 2.0])
    assert v("errors", "error-rate limit (0.5%)") == [0.5, 0.5]
    assert v("errors", "error-rate-delta limit (stable + 5 pp)") == pytest.approx([5.0, 6.0, 7.0])
    assert all(panels["errors"]["series"][k]["limit"] == k.startswith("error-rate") for k in panels["errors"]["series"])
    assert panels["errors"]["judged"] == "error-rate judged at 3 of 3 runs; error-rate-delta judged at 0 of 3 runs"
    # latency: canary and stable p99 in ms, the limit the check judges by (maxRatio x stable)
    assert v("ttft-p99", "TTFT p99 canary") == pytest.approx([500.0, 600.0, 700.0])
    assert v("ttft-p99", "TTFT p99 stable") == pytest.approx([400.0, 400.0, 400.0])
    assert v("ttft-p99", "limit (1.5 x stable)") == pytest.approx([600.0, 600.0, 600.0])
    assert panels["ttft-p99"]["judged"] == "ttft-p99 judged at 2 of 3 runs"
    stable, limit = v("tpot-p99", "TPOT p99 stable"), v("tpot-p99", "limit (1.3 x stable)")
    assert stable[1] is None and limit[1] is None
    assert [stable[0], stable[2], limit[0], limit[2]] == pytest.approx([180.0, 180.0, 234.0, 234.0])
    assert panels["tpot-p99"]["judged"] == "tpot-p99 judged at 0 of 3 runs"
    assert v("compared", "compared") == [0.0, 2.0, 4.0]
    assert plotted["decided"] is None


def test_a_rollout_without_latency_checks_gets_no_latency_panels():
    timeline = Timeline("fault-drill")
    run = cpu_fleet_run(1)
    run["status"]["analysis"]["results"] = [r for r in run["status"]["analysis"]["results"]
                                            if not r["name"].endswith("-p99")]
    timeline.add(1_796_000_000.0, run)
    fault = demo_rollout(ROOT / "examples" / "rollout-fault-test.yaml", "llm", "8s", "2s")
    panels = plot_panels(timeline, checks_of(fault))
    assert [p.key for p in panels] == ["traffic", "errors", "compared", "divergence"]
    errors = {line.label: line for line in panels[1].lines}
    assert errors["error-rate-delta limit (stable + 0.1 pp)"].v == pytest.approx([1.1])
    assert [line.v for line in panels[0].lines] == [[50.0], [66.7], [pytest.approx(40.0)]]


def test_the_report_keeps_every_analysis_run_of_the_history_with_its_numbers(tmp_path):
    final = drift_rolled_back()
    final["spec"].setdefault("analysis", {})["measurementRetention"] = 3
    final["status"]["analysisHistory"] = [
        {"time": "2026-12-05T00:00:00Z", "step": 1, "verdict": "Successful",
         "results": [{"name": "output-divergence", "role": "breaker", "verdict": "Successful", "value": 0.0,
                      "threshold": "<= 0.05", "numbers": {"compared": 4, "divergent": 0, "lower": 0.0,
                                                          "upper": 0.49}}]},
        {"time": "2026-12-05T00:00:02Z", "step": 2, "verdict": "Failed",
         "results": [{"name": "output-divergence", "role": "breaker", "verdict": "Failed", "value": 0.667,
                      "threshold": "<= 0.05", "numbers": {"compared": 6, "divergent": 4, "lower": 0.094,
                                                          "upper": 0.94}}]}]
    timeline = Timeline("drift-drill")
    timeline.add(1_796_000_000.0, final)
    text = "\n".join(rollout_section(timeline, final, [], tmp_path / "drift-drill.png"))
    assert "The analysis runs kept in `status.analysisHistory` (2, at most `measurementRetention` 3)" in text
    rows = [line for line in text.splitlines() if line.startswith("| 2026-12-05")]
    assert len(rows) == 2
    assert "| 1/3 | Successful | output-divergence | breaker |" in rows[0] and "0/4 divergent" in rows[0]
    assert "| 2/3 | Failed |" in rows[1] and "4/6 divergent" in rows[1] and "[0.094, 0.94]" in rows[1]
