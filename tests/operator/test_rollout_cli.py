"""`graft rollout` (and `kubectl graft`): each verb changes one field; status shows the numbers."""
import asyncio
import json
import re

import pytest
from rich.console import Console

from graft.devcluster.kubeconfig import write_kubeconfig
from graft.operator.cli import main_rollout
from graft.operator.kube import fleet_path, rollout_path
from graft.operator.podview import make_condition

from operator_cluster import create, get_rollout, manifest

pytestmark = pytest.mark.timeout(60)

STATUS = {
    "phase": "Progressing", "reason": "Progressing", "message": "step 2/3: weight 50%, 2 of 4 pods canary",
    "patch": "kv-align@3.2.1", "stepIndex": 1, "weight": 50, "stableRevision": "base",
    "canaryRevision": "kv-align@3.2.1",
    "pods": [{"name": "engine-0", "track": "canary", "revision": "kv-align@3.2.1", "restartCount": 1,
              "patchedAt": "2026-01-01T00:00:00.000Z"},
             {"name": "engine-1", "track": "stable", "revision": "base", "restartCount": 0}],
    "analysis": {"lastRun": "2026-01-01T00:00:05.000Z", "verdict": "Inconclusive", "errorRuns": 0,
                 "inconclusiveRuns": 2, "results": [
        {"name": "error-rate", "role": "breaker", "value": 0.0123, "threshold": "<= 0.005", "window": "60s",
         "verdict": "Failed", "breaches": 1, "conclusive": True,
         "message": "error-rate 1.23% (37 errors of 3000 canary requests in 60s): above the error rate 0.5% at "
                    "0.999 confidence (lower bound 0.758%) (breach 1/3)",
         "numbers": {"requests": 3000, "errors": 37, "lower": 0.00758}},
        {"name": "output-divergence", "role": "breaker", "value": 1.0, "threshold": "<= 0.05", "window": "step",
         "verdict": "Failed", "breaches": 1, "conclusive": True,
         "message": "output-divergence 3 divergent of 3 compared requests in the rollout so far (100%): above the 5% "
                    "limit at 0.999 confidence (lower bound 10%) (breach 1/1)",
         "numbers": {"compared": 3, "divergent": 3, "share": 1.0, "lower": 0.1, "upper": 1.0, "limit": 0.05}},
        {"name": "latency-p99", "role": "breaker", "value": 0.31, "threshold": "<= 0.8", "window": "30s",
         "verdict": "Successful", "breaches": 0, "dryRun": True},
        {"name": "error-rate-delta", "role": "gate", "threshold": "<= 0.001", "window": "step",
         "verdict": "Inconclusive", "short": True,
         "message": "error-rate-delta: upper bound +0.3 pp not yet within +0.1 pp (needs at least 2995 canary "
                    "requests)"}]},
}


@pytest.fixture
async def rollout(cluster, namespace, prometheus, tmp_path):
    await create(cluster, namespace, manifest(prometheus))
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align") + "/status", {"status": STATUS})
    kubeconfig = cluster.kubeconfig or str(write_kubeconfig(tmp_path / "kubeconfig", cluster.url, namespace=namespace))
    return kubeconfig


async def cli(kubeconfig, namespace, *argv):
    # wide enough that no analysis message wraps inside its cell
    console = Console(record=True, width=400, force_terminal=False)
    code = await asyncio.to_thread(main_rollout, [*argv, "-n", namespace, "--kubeconfig", kubeconfig], console)
    return code, console.export_text()


async def test_status_shows_step_weight_pods_and_metrics_against_thresholds(cluster, namespace, rollout):
    code, out = await cli(rollout, namespace, "status", "kv-align")
    assert code == 0
    for text in ("Progressing", "2/3", "50%", "kv-align@3.2.1", "engine-0", "canary", "error-rate", "0.0123",
                 "<= 0.005", "Failed", "breach 1/3", "latency-p99 (dry run)", "Inconclusive", "error-rate-delta",
                 "needs at least 2995 canary requests"):
        assert text in out, text
    # output-divergence: the divergent share with the counts behind it, and the bound in its detail
    row = next(line for line in out.splitlines() if "output-divergence" in line)
    assert re.search(r"output-divergence\s.*\sbreaker\s.*\s100% \(3 of 3\)\s.*<= 0\.05\s.*\sstep\s.*\sFailed\s.*\s1\s", row), row
    assert "3 divergent of 3 compared requests in the rollout so far (100%)" in row and "(lower bound 10%)" in row


async def test_pause_sets_spec_paused_and_resume_clears_it_and_ends_a_controller_pause(cluster, namespace, rollout):
    assert (await cli(rollout, namespace, "pause", "kv-align"))[0] == 0
    assert (await get_rollout(cluster.kube, namespace, "kv-align"))["spec"]["paused"] is True
    assert (await cli(rollout, namespace, "resume", "kv-align"))[0] == 0
    obj = await get_rollout(cluster.kube, namespace, "kv-align")
    assert obj["spec"]["paused"] is False and obj["metadata"]["annotations"]["graft.dev/resume"] == "true"


async def test_status_shows_a_controller_pause_and_how_to_end_it(cluster, namespace, rollout):
    paused = {"phase": "Paused", "reason": "AnalysisOutageLimit",
              "pauseConditions": [{"reason": "AnalysisOutageLimit", "message": "Prometheus could not be reached",
                                   "startTime": "2026-01-01T00:10:00.000Z"}]}
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align") + "/status", {"status": paused})
    code, out = await cli(rollout, namespace, "status", "kv-align")
    assert code == 0
    line = next(line for line in out.splitlines() if "Paused by" in line)
    assert "AnalysisOutageLimit since 2026-01-01T00:10:00.000Z" in line and "graft rollout resume kv-align" in line
    code, out = await cli(rollout, namespace, "resume", "kv-align")
    assert code == 0 and "ends its AnalysisOutageLimit pause" in out, out


@pytest.mark.parametrize("argv,key,value", [
    (["promote"], "graft.dev/promote", "step"),
    (["promote", "--full"], "graft.dev/promote", "full"),
    (["abort"], "graft.dev/abort", "true"),
])
async def test_promote_and_abort_set_their_annotation(cluster, namespace, rollout, argv, key, value):
    code, out = await cli(rollout, namespace, *argv, "kv-align")
    assert code == 0, out
    assert (await get_rollout(cluster.kube, namespace, "kv-align"))["metadata"]["annotations"][key] == value


async def test_finished_rollout_cannot_be_promoted_or_aborted(cluster, namespace, rollout):
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align") + "/status", {"status": {"phase": "Promoted"}})
    for verb in ("promote", "abort"):
        code, out = await cli(rollout, namespace, verb, "kv-align")
        assert code == 1 and "is Promoted" in out


async def test_unknown_rollout_is_an_error(cluster, namespace, rollout):
    code, out = await cli(rollout, namespace, "status", "nope")
    assert code == 1 and f"PatchRollout {namespace}/nope not found" in out


async def test_status_watch_follows_until_the_rollout_finishes(cluster, namespace, rollout):
    console = Console(record=True, width=220, force_terminal=False)
    watch = asyncio.create_task(asyncio.to_thread(
        main_rollout, ["status", "kv-align", "-w", "--interval", "0.1", "-n", namespace, "--kubeconfig", rollout],
        console))
    await asyncio.sleep(0.5)
    assert not watch.done()
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align") + "/status",
                                   {"status": {"phase": "Promoted", "stepIndex": 2, "weight": 100}})
    assert await asyncio.wait_for(watch, 10) == 0
    assert "Promoted" in console.export_text()



def watch_status(namespace, kubeconfig):
    """`graft rollout status -w` in a thread; answers the task (its exit code) and its console. Its
    watch windows last 5 s, so a finish and a deletion made together land in one (a deletion ends
    the window at once)."""
    console = Console(record=True, width=220, force_terminal=False)
    argv = ["status", "kv-align", "-w", "--interval", "5", "-n", namespace, "--kubeconfig", kubeconfig]
    return asyncio.create_task(asyncio.to_thread(main_rollout, argv, console)), console


# 3, not 2: argparse's usage errors are 2, and a script must tell "did not promote" from "wrong command"
@pytest.mark.parametrize("phase,code", [("Promoted", 0), ("RolledBack", 3)])
async def test_status_watch_of_a_rollout_deleted_as_it_finishes_exits_as_its_final_phase(
        cluster, namespace, rollout, phase, code):
    """With `ttlSecondsAfterFinished: 0` the operator deletes a rollout as soon as it finishes: the
    watch still gets the final phase (it follows every change, not a poll that may miss it), and
    says the rollout is gone and why."""
    path = rollout_path(namespace, "kv-align")
    await cluster.kube.merge_patch(path, {"spec": {"ttlSecondsAfterFinished": 0}})
    watch, console = watch_status(namespace, rollout)
    await asyncio.sleep(0.5)
    assert not watch.done()
    await cluster.kube.merge_patch(path + "/status", {"status": {"phase": phase, "reason": phase}})
    await cluster.kube.delete(path)
    assert await asyncio.wait_for(watch, 10) == code
    out = console.export_text()
    assert phase in out and "not found" not in out, out
    assert f"PatchRollout {namespace}/kv-align was deleted after it finished {phase} " \
           "(ttlSecondsAfterFinished: 0)" in " ".join(out.split()), out


async def test_status_watch_of_a_rollout_deleted_before_it_finished_says_so_and_fails(cluster, namespace, rollout):
    watch, console = watch_status(namespace, rollout)
    await asyncio.sleep(0.5)
    await cluster.kube.delete(rollout_path(namespace, "kv-align"))
    assert await asyncio.wait_for(watch, 10) == 4
    out = " ".join(console.export_text().split())
    assert "step 2/3: weight 50%" in out                                # the last status it saw
    assert f"PatchRollout {namespace}/kv-align was deleted before it finished (last seen Progressing)" in out, out


# the status of a rollout whose first step pod-ratio routing cannot honour: 1% asked, one of two pods
COARSE = {**STATUS, "message": "step 1/3: weight 1%, 1 of 2 pods canary", "stepIndex": 0, "weight": 1,
          "canaryPods": 1, "trafficShare": 50.0}
# the operator's words (graft.rollout.machine), posted by kopf with the rollout as involvedObject
COARSE_MESSAGE = ("pod-ratio routing over 2 pods: the smallest share is one pod, 50% of the traffic, so steps below "
                  "that (first: 1%) send more than they ask; use Gateway API routing or more pods for finer steps")


async def post_event(cluster, namespace, obj, reason, message, uid=None):
    now = "2026-01-01T00:00:01.000000+00:00"
    meta = obj["metadata"]
    await cluster.kube.create(f"/api/v1/namespaces/{namespace}/events", {
        "apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "kopf-event-"},
        "type": "Warning", "reason": reason, "message": message, "source": {"component": "kopf"},
        "involvedObject": {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout", "name": meta["name"],
                           "uid": uid or meta["uid"], "namespace": namespace},
        "firstTimestamp": now, "lastTimestamp": now, "eventTime": now})


async def ready_pod(cluster, namespace, name, ip, ready=True):
    path = f"/api/v1/namespaces/{namespace}/pods"
    await cluster.kube.create(path, {"apiVersion": "v1", "kind": "Pod",
                                     "metadata": {"name": name, "labels": {"app": "llm-engine"}},
                                     "spec": {"containers": [{"name": "engine", "image": "graft:dev"}]}})
    await cluster.kube.merge_patch(f"{path}/{name}/status", {"status": {
        "phase": "Running", "podIP": ip, "conditions": [make_condition("Ready", ready)]}})


@pytest.fixture
async def coarse(cluster, namespace, rollout):
    """The rollout at its first step (1%) over two Ready pods (a third is not Ready)."""
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align") + "/status", {"status": COARSE})
    for i, ip in enumerate(("127.0.0.2", "127.0.0.3")):
        await ready_pod(cluster, namespace, f"engine-{i}", ip)
    await ready_pod(cluster, namespace, "engine-2", "127.0.0.4", ready=False)
    return await get_rollout(cluster.kube, namespace, "kv-align")


async def test_status_warns_of_coarse_steps_with_the_real_exposure_next_to_the_asked_weight(
        cluster, namespace, rollout, coarse):
    # an Event of an earlier rollout of the same name (another uid) says nothing about this one
    await post_event(cluster, namespace, coarse, "CoarseSteps", COARSE_MESSAGE, uid="an-earlier-rollout")
    code, out = await cli(rollout, namespace, "status", "kv-align")
    assert code == 0 and "CoarseSteps" not in out, out
    await post_event(cluster, namespace, coarse, "CoarseSteps", COARSE_MESSAGE)
    code, out = await cli(rollout, namespace, "status", "kv-align")
    assert code == 0, out
    assert "Warning CoarseSteps" in out
    assert "step 1 asks for 1% of the traffic; the canary gets 50% (1 of 2 Ready pods)" in out
    assert COARSE_MESSAGE in out
    assert re.search(r"^Ready pods +2 *$", out, re.M), "the not-Ready pod is not counted"


async def test_status_without_a_coarse_steps_event_shows_no_warning(cluster, namespace, rollout, coarse):
    await post_event(cluster, namespace, coarse, "WeightSet", "step 1/3: canary weight 1% (1 of 2 pods are canaries)")
    code, out = await cli(rollout, namespace, "status", "kv-align")
    assert code == 0 and "CoarseSteps" not in out and "asks for" not in out, out


async def test_the_demo_shows_a_rollout_in_the_very_lines_of_graft_rollout_status(cluster, namespace, rollout,
                                                                                  coarse, tmp_path):
    from graft.demo import DemoPaths, view
    from graft.operator.kube import pods_path

    await post_event(cluster, namespace, coarse, "CoarseSteps", COARSE_MESSAGE)
    code, out = await cli(rollout, namespace, "status", "kv-align")
    assert code == 0, out
    # what the demo's live view has at hand: the rollout, the events of the namespace, the pods
    events = await cluster.kube.list(f"/api/v1/namespaces/{namespace}/events")
    pods = await cluster.kube.list(pods_path(namespace))
    console = Console(record=True, width=400, force_terminal=False)
    console.print(view(coarse, events, pods, None, DemoPaths(tmp_path, tmp_path / "cluster")))
    demo = console.export_text().splitlines()
    status_lines = [line for line in out.splitlines() if line.strip()]
    assert len(status_lines) > 20 and "Warning CoarseSteps" in out
    # every line of `graft rollout status`, in its order, inside the demo's view
    at = 0
    for line in status_lines:
        assert line in demo[at:], line
        at = demo.index(line, at) + 1


# -- list, history, undo ------------------------------------------------------------------------------

FLEET_STATUS = {"revision": "kv-align@3.2.1", "pods": 3, "converged": 3,
                "conditions": [{"type": "Converged", "status": "True", "reason": "Converged",
                                "message": "3 of 3 pods run kv-align@3.2.1"}]}


async def make_fleet(cluster, namespace, name="llm-engine", patches=None, status=None):
    patches = [{"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}}] if patches is None else patches
    await cluster.kube.create(fleet_path(namespace), {
        "apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet", "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"app": "llm-engine"}}, "patches": patches}})
    await cluster.kube.merge_patch(fleet_path(namespace, name) + "/status", {"status": status or FLEET_STATUS})


def table(out):
    """kubectl's plain columns as rows of cells (no cell of these tests holds a space)."""
    return [line.split() for line in out.splitlines() if line.strip()]


async def test_list_shows_every_rollout_and_fleet_as_plain_columns(cluster, namespace, prometheus, rollout):
    await create(cluster, namespace, manifest(prometheus, name="kv-align-new"))
    await make_fleet(cluster, namespace)
    code, out = await cli(rollout, namespace, "list")
    assert code == 0, out
    rows = table(out)
    assert rows[0] == ["NAME", "KIND", "PHASE", "STEP", "WEIGHT", "CANARY", "STABLE", "AGE"], out
    # rollouts first, then fleets, each kind by name; no box drawing, no colour codes
    assert [r[:7] for r in rows[1:]] == [
        ["kv-align", "PatchRollout", "Progressing", "2/3", "50%", "kv-align@3.2.1", "base"],
        ["kv-align-new", "PatchRollout", "Pending", "0/3", "0%", "-", "-"],
        ["llm-engine", "PatchFleet", "Converged", "-", "-", "-", "kv-align@3.2.1"]], out
    assert all(re.fullmatch(r"\d+s|\d+m\d*s?", r[7]) for r in rows[1:]), out
    assert "─" not in out and "\x1b" not in out


async def test_list_all_namespaces_adds_the_namespace_and_json_gives_the_fields(cluster, namespace, rollout):
    await make_fleet(cluster, namespace)
    console = Console(record=True, width=400, force_terminal=False)
    code = await asyncio.to_thread(main_rollout, ["list", "-A", "--kubeconfig", rollout], console)
    out = console.export_text()
    assert code == 0, out
    rows = table(out)
    assert rows[0][:2] == ["NAMESPACE", "NAME"] and [namespace, "kv-align", "PatchRollout"] in [r[:3] for r in rows]
    code, out = await cli(rollout, namespace, "list", "-o", "json")
    assert code == 0, out
    items = json.loads(out)
    assert [(i["kind"], i["name"], i["phase"]) for i in items] == [
        ("PatchRollout", "kv-align", "Progressing"), ("PatchFleet", "llm-engine", "Converged")]
    assert items[0]["step"] == "2/3" and items[0]["canary"] == "kv-align@3.2.1" and items[1]["pods"] == 3


async def test_list_on_a_terminal_is_a_table_and_an_empty_namespace_says_so(cluster, namespace, rollout):
    console = Console(record=True, width=200, force_terminal=True)
    code = await asyncio.to_thread(main_rollout, ["list", "-n", namespace, "--kubeconfig", rollout], console)
    out = console.export_text()
    assert code == 0 and "Name" in out and "kv-align" in out and "Progressing" in out and "NAME" not in out, out
    code, out = await cli(rollout, "default", "list")
    assert code == 0 and "No PatchRollouts or PatchFleets in default" in out, out


def run_record(time, step, verdict, value):
    return {"time": time, "step": step, "verdict": verdict, "results": [
        {"name": "error-rate", "role": "breaker", "value": value, "threshold": "<= 0.005", "window": "60s",
         "verdict": verdict, "breaches": 0, "numbers": {"requests": 3000, "errors": value * 3000,
                                                       "lower": value / 2, "upper": value * 2}},
        {"name": "error-rate-delta", "role": "gate", "threshold": "<= 0.001", "window": "step",
         "verdict": "Inconclusive", "numbers": {"canary_requests": 1000, "canary_errors": 2, "stable_requests": 900,
                                                "stable_errors": 1, "lower": -0.002, "upper": 0.004}}]}


async def test_history_shows_each_run_a_row_per_check(cluster, namespace, rollout):
    runs = [run_record("2026-01-01T00:00:01.000Z", 1, "Successful", 0.001),
            run_record("2026-01-01T00:00:02.000Z", 2, "Inconclusive", 0.002)]
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align") + "/status",
                                   {"status": {"analysisHistory": runs}})
    code, out = await cli(rollout, namespace, "history", "kv-align")
    assert code == 0, out
    assert f"PatchRollout {namespace}/kv-align: the last 2 analysis runs, oldest first (measurementRetention 10)" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("TIME"))
    assert lines[header].split() == ["TIME", "STEP", "RUN", "CHECK", "ROLE", "VALUE", "THRESHOLD", "COUNTS",
                                     "BOUNDS", "VERDICT"]
    first, second = lines[header + 1], lines[header + 3]
    assert first.startswith("2026-01-01T00:00:01.000Z") and "1/3" in first and "Successful" in first
    assert "error-rate " in first and "0.001 " in first and "3/3000 bad" in first and "[0.0005, 0.002]" in first
    gate = lines[header + 2]
    assert gate.split()[0] == "error-rate-delta" and "canary 2/1000, stable 1/900 errors" in gate, gate
    assert second.startswith("2026-01-01T00:00:02.000Z") and "2/3" in second and "Inconclusive" in second
    code, out = await cli(rollout, namespace, "history", "kv-align", "-o", "json")
    assert code == 0 and json.loads(out) == runs


async def test_history_of_a_rollout_without_runs_says_so(cluster, namespace, rollout):
    code, out = await cli(rollout, namespace, "history", "kv-align")
    assert code == 0 and "no analysis run kept (measurementRetention 10)" in out, out
    code, out = await cli(rollout, namespace, "history", "nope")
    assert code == 1 and "not found" in out


async def promoted(cluster, namespace, name="kv-align", **status):
    await cluster.kube.merge_patch(rollout_path(namespace, name) + "/status", {"status": {
        "phase": "Promoted", "reason": "Promoted", "stepIndex": 2, "weight": 100, "fleet": "llm-engine",
        "stableRevision": "kv-align@3.2.1", "canaryRevision": "kv-align@3.2.1", **status}})


async def test_undo_creates_the_revert_rollout_of_a_promoted_one(cluster, namespace, rollout):
    await make_fleet(cluster, namespace)
    await promoted(cluster, namespace)
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align"), {"spec": {"paused": True}})
    code, out = await cli(rollout, namespace, "undo", "kv-align")
    assert code == 0, out
    assert f"PatchRollout {namespace}/kv-align-undo created: it reverts kv-align@3.2.1 step by step, " \
           "undoing kv-align" in out, out
    original = await get_rollout(cluster.kube, namespace, "kv-align")
    undo = await get_rollout(cluster.kube, namespace, "kv-align-undo")
    assert undo["spec"]["action"] == "revert" and undo["spec"]["paused"] is False
    for key in ("selector", "patch", "steps", "analysis", "trafficRouting", "progressDeadline"):
        assert undo["spec"][key] == original["spec"][key], key
    assert undo["metadata"]["annotations"]["graft.dev/undo-of"] == "kv-align"
    # a second undo while the first has not finished is refused; once it has, the name is taken: -2
    code, out = await cli(rollout, namespace, "undo", "kv-align")
    assert code == 1 and f"is being undone already by PatchRollout {namespace}/kv-align-undo (Pending)" in out, out
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align-undo") + "/status",
                                   {"status": {"phase": "RolledBack"}})
    code, out = await cli(rollout, namespace, "undo", "kv-align", "-o", "name")
    assert code == 0 and out.strip() == "kv-align-undo-2", out


async def test_undo_of_a_revert_applies_the_patch_again(cluster, namespace, prometheus, rollout):
    await make_fleet(cluster, namespace, patches=[])
    await create(cluster, namespace, manifest(prometheus, name="kv-align-out", action="revert"))
    await promoted(cluster, namespace, "kv-align-out", stableRevision="base", canaryRevision="base")
    code, out = await cli(rollout, namespace, "undo", "kv-align-out")
    assert code == 0 and "it applies kv-align@3.2.1 step by step, undoing kv-align-out" in out, out
    assert (await get_rollout(cluster.kube, namespace, "kv-align-out-undo"))["spec"]["action"] == "apply"


@pytest.mark.parametrize("status,fleet_patches,why", [
    ({"phase": "Progressing"}, None, "is Progressing: only a Promoted rollout can be undone (graft rollout abort "
                                     "kv-align rolls it back)"),
    ({"phase": "RolledBack"}, None, "is RolledBack: only a Promoted rollout can be undone (nothing of it stays"),
    ({"phase": "Promoted", "fleet": "llm-engine", "stablePatch": "kv-align@3.2.0"}, None,
     "replaced kv-align@3.2.0 with kv-align@3.2.1: a revert would leave the pods with neither"),
    ({"phase": "Promoted", "fleet": "llm-engine"}, [{"name": "kv-align", "version": "3.2.2", "source": {"builtin": {}}}],
     "PatchFleet {ns}/llm-engine runs kv-align@3.2.2 now, not the kv-align@3.2.1 that PatchRollout {ns}/kv-align "
     "applied: a later rollout changed it"),
])
async def test_undo_refuses_what_it_cannot_undo(cluster, namespace, rollout, status, fleet_patches, why):
    await make_fleet(cluster, namespace, patches=fleet_patches)
    await cluster.kube.merge_patch(rollout_path(namespace, "kv-align") + "/status", {"status": status})
    code, out = await cli(rollout, namespace, "undo", "kv-align")
    assert code == 1 and why.format(ns=namespace) in " ".join(out.split()), out
    assert [o["metadata"]["name"] for o in await cluster.kube.list(rollout_path(namespace, "x")[:-2])] == ["kv-align"]
