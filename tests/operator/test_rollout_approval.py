"""A manual approval step end to end: the operator holds a rollout at a step whose analysis passed
until `graft rollout promote`, the progress deadline waiting, then promotes it."""
import pytest

from graft.operator.kube import rollout_path

from operator_cluster import create, events_of, get_rollout, manifest, phase_is, rollout_cli, until

pytestmark = pytest.mark.timeout(120)


async def test_a_rollout_stops_at_a_manual_step_until_graft_rollout_promote(cluster, namespace, fleet, operator,
                                                                            prometheus, tmp_path):
    engines = await fleet(3)
    await operator()
    steps = [{"weight": 1, "pause": "1s"}, {"weight": 50, "untilApproved": True}, {"weight": 100}]
    await create(cluster, namespace, manifest(prometheus, steps=steps))
    path = rollout_path(namespace, "kv-align")

    async def awaiting():
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        s = obj.get("status") or {}
        return obj if s.get("reason") == "AwaitingApproval" else None

    obj = await until(awaiting, 60, what="the manual step waiting for approval")
    status = obj["status"]
    assert (status["phase"], status["stepIndex"]) == ("Progressing", 1)
    assert status["message"] == "step 2/3 at 50%: waiting for approval: graft rollout promote kv-align"
    assert status["awaitingApprovalSince"] and status["analysis"]["verdict"] == "Successful"
    assert sum(e.revision != "base" for e in engines) == 2

    # the progress deadline waits for the person: cut it to 2 s, and the rollout still waits
    await cluster.kube.merge_patch(path, {"spec": {"progressDeadline": "2s"}})
    last_run = status["analysis"]["lastRun"]

    async def judged_again():
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        s = obj["status"]
        return obj if s["analysis"]["lastRun"] > last_run and s["stepIndex"] == 1 else None

    for _ in range(4):                   # four more analysis runs, well past the deadline's 2 s
        obj = await until(judged_again, 20, what="another analysis run at the manual step")
        last_run = obj["status"]["analysis"]["lastRun"]
    assert (obj["status"]["phase"], obj["status"]["reason"]) == ("Progressing", "AwaitingApproval")
    assert obj["status"]["awaitingApprovalSince"] == status["awaitingApprovalSince"]
    await cluster.kube.merge_patch(path, {"spec": {"progressDeadline": "1m"}})

    code, out = await rollout_cli(cluster, namespace, tmp_path, "status", "kv-align")
    assert code == 0, out
    assert "1% → 50% (approval) → 100%" in out, out
    assert "Waiting for" in out and "graft rollout promote kv-align" in out, out

    code, out = await rollout_cli(cluster, namespace, tmp_path, "promote", "kv-align")
    assert code == 0 and "promotion of the current step requested" in out, out
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), 60, what="Promoted")
    assert "graft.dev/promote" not in (obj["metadata"].get("annotations") or {}), "consumed by the approval"
    assert obj["status"].get("awaitingApprovalSince") is None
    assert all(e.revision == "kv-align@3.2.1" for e in engines)
    reasons = [e["reason"] for e in await events_of(cluster.kube, namespace, "kv-align")]
    assert reasons.count("AwaitingApproval") == 1 and reasons.count("Approved") == 1, reasons
    assert "PromotedByUser" not in reasons and "ProgressDeadlineExceeded" not in reasons
    approved = [e["message"] for e in await events_of(cluster.kube, namespace, "kv-align")
                if e["reason"] == "Approved"]
    assert approved[0].startswith("step 2/3 approved (graft.dev/promote") and "after waiting" in approved[0]


def test_who_set_the_promote_annotation_is_read_from_managed_fields():
    from graft.operator.reconcile import annotation_manager

    def entry(manager, time, *keys):
        return {"manager": manager, "operation": "Update", "time": time, "fieldsV1": {
            "f:metadata": {"f:annotations": {f"f:{k}": {} for k in keys}}}}

    meta = {"managedFields": [entry("kopf", "2025-01-01T10:00:00Z", "kopf.zalando.org/last-handled-configuration"),
                              entry("kubectl-annotate", "2025-01-01T10:05:00Z", "graft.dev/promote"),
                              entry("graft", "2025-01-01T10:01:00Z", "graft.dev/promote", "graft.dev/abort"),
                              {"manager": "broken", "fieldsV1": "not an object"}]}
    assert annotation_manager(meta, "graft.dev/promote") == "kubectl-annotate at 2025-01-01T10:05:00Z"
    assert annotation_manager(meta, "graft.dev/abort") == "graft at 2025-01-01T10:01:00Z"
    assert annotation_manager(meta, "graft.dev/resume") is None
    assert annotation_manager({}, "graft.dev/promote") is None


def test_status_marks_manual_steps_in_either_spelling_and_says_how_to_approve():
    from rich.console import Console

    from graft.operator.render import render_status

    obj = {"metadata": {"name": "kv-align", "namespace": "llm"},
           "spec": {"patch": {"name": "kv-align", "version": "3.2.1"},
                    "steps": [{"weight": 5, "pause": {}}, {"weight": 50, "untilApproved": True},
                              {"weight": 100, "pause": "1m"}]},
           "status": {"phase": "Progressing", "reason": "AwaitingApproval", "stepIndex": 0, "weight": 5,
                      "message": "step 1/3 at 5%: waiting for approval: graft rollout promote kv-align",
                      "awaitingApprovalSince": "2025-01-01T10:00:00.000Z"}}
    console = Console(record=True, width=200, force_terminal=False)
    console.print(render_status(obj))
    out = console.export_text()
    assert "5% (approval) → 50% (approval) → 100%" in out, out
    assert ("approval since 2025-01-01T10:00:00.000Z: graft rollout promote kv-align (or the annotation "
            "graft.dev/promote=step) approves step 1; graft rollout abort kv-align rolls back") in out, out
    obj["status"] = {**obj["status"], "phase": "Promoted"}
    console = Console(record=True, width=200, force_terminal=False)
    console.print(render_status(obj))
    assert "Waiting for" not in console.export_text()
