"""`graft rollout undo`, `history` and `list` with the real operator: kopf, the API server emulator,
fake engines and a real Prometheus. The undo's revert rollout is run and promoted by the operator
like any other; the analysis history is the operator's, trimmed to `measurementRetention` runs."""
import json

import pytest

from graft.operator.kube import fleet_path

from operator_cluster import CHECKS, create, get_rollout, manifest, phase_is, rollout_cli, until

pytestmark = pytest.mark.timeout(240)

# as in test_fleet_operator: in `make test` the other worker runs real fleets beside this operator
# thread, whose Prometheus then scrapes late; 8 s windows, no inconclusive pause, a long deadline
PROMOTED_WITHIN = 150
WIDE = {**{role: [{**check, "window": "8s"} for check in checks] for role, checks in CHECKS.items()},
        "inconclusiveLimit": 0}


async def test_undo_creates_a_revert_rollout_that_the_operator_runs_and_promotes(
        cluster, namespace, fleet, operator, prometheus, tmp_path):
    engines = await fleet(2)
    await operator()
    await create(cluster, namespace, manifest(prometheus, analysis=WIDE, progressDeadline="3m"))
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), PROMOTED_WITHIN, what="promoted")
    assert all(e.revision == "kv-align@3.2.1" for e in engines)

    code, out = await rollout_cli(cluster, namespace, tmp_path, "undo", "kv-align", "-o", "name")
    assert code == 0 and out.strip() == "kv-align-undo", out
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align-undo", "Promoted", "RolledBack", "Failed"),
                      PROMOTED_WITHIN, what="the undo promoted")
    assert obj["status"]["phase"] == "Promoted", obj["status"]
    assert obj["spec"]["action"] == "revert" and obj["status"]["stableRevision"] == "base"
    assert [e.applied for e in engines] == [{}, {}] and all(e.revision == "base" for e in engines)
    (pfl,) = await cluster.kube.list(fleet_path(namespace))
    assert pfl["spec"].get("patches") in ([], None)

    # what it undid is in the fleet no more: a second undo of the first rollout is refused
    code, out = await rollout_cli(cluster, namespace, tmp_path, "undo", "kv-align")
    assert code == 1 and "runs no version of kv-align now, not the kv-align@3.2.1" in " ".join(out.split()), out

    code, out = await rollout_cli(cluster, namespace, tmp_path, "list", "-o", "json")
    assert code == 0, out
    rows = {(r["kind"], r["name"]): r for r in json.loads(out)}
    assert set(rows) == {("PatchRollout", "kv-align"), ("PatchRollout", "kv-align-undo"),
                         ("PatchFleet", pfl["metadata"]["name"])}
    assert rows[("PatchRollout", "kv-align")]["phase"] == rows[("PatchRollout", "kv-align-undo")]["phase"] == "Promoted"
    assert rows[("PatchRollout", "kv-align-undo")]["action"] == "revert"
    fleet_row = rows[("PatchFleet", pfl["metadata"]["name"])]
    assert fleet_row["stable"] == "base" and fleet_row["step"] == "-"


async def test_history_keeps_the_latest_runs_up_to_the_retention(cluster, namespace, fleet, operator, prometheus,
                                                                 tmp_path):
    await fleet(2)
    await operator()
    analysis = {**WIDE, "measurementRetention": 2}
    # pauses of 3 s with a run a second: several runs a step, more than the two kept
    steps = [{"weight": 1, "pause": "3s"}, {"weight": 50, "pause": "3s"}, {"weight": 100}]
    await create(cluster, namespace, manifest(prometheus, analysis=analysis, steps=steps, progressDeadline="3m"))
    seen: set[str] = set()
    longest = 0

    async def done():
        nonlocal longest
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        runs = (obj.get("status") or {}).get("analysisHistory") or []
        seen.update(r["time"] for r in runs)
        longest = max(longest, len(runs))
        return await phase_is(cluster, namespace, "kv-align", "Promoted", "RolledBack", "Failed")

    obj = await until(done, PROMOTED_WITHIN, interval=0.05, what="promoted")
    assert obj["status"]["phase"] == "Promoted", obj["status"]
    runs = obj["status"]["analysisHistory"]
    # more runs were made than are kept: the oldest went first, two at most at any time
    # two at most at any time, the oldest dropped first: the runs of step 1 (it cannot end without
    # one) are gone, the latest is the one status.analysis shows
    assert longest == len(runs) == 2, (longest, sorted(seen))
    assert all(r["step"] >= 2 for r in runs), (runs, sorted(seen))
    assert runs[0]["time"] < runs[1]["time"] and runs[-1]["time"] == obj["status"]["analysis"]["lastRun"]
    assert runs[-1]["verdict"] == "Successful" and runs[-1]["step"] == 3
    names = {(r["role"], r["name"]) for r in runs[-1]["results"]}
    assert names == {("breaker", "error-rate"), ("breaker", "latency-p99"), ("gate", "error-rate-delta")}
    rate = next(r for r in runs[-1]["results"] if r["name"] == "error-rate")
    assert rate["numbers"]["requests"] > 0 and "lower" in rate["numbers"] and "message" not in rate

    code, out = await rollout_cli(cluster, namespace, tmp_path, "history", "kv-align")
    assert code == 0, out
    assert f"PatchRollout {namespace}/kv-align: the last 2 analysis runs, oldest first (measurementRetention 2)" in out
    starts = [line for line in out.splitlines() if line[:4].isdigit()]
    assert [line.split()[0] for line in starts] == [r["time"] for r in runs], out
    assert all(line.split()[1] == f"{r['step']}/3" for line, r in zip(starts, runs)), out
