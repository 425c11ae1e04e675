"""`graft bench operator` in its smallest configuration: the real operator process against the API
server emulator, engine stand-ins and a real Prometheus, through the command a user types. Its
counters must agree with each other and with what the stand-ins saw."""
from __future__ import annotations

import json
import math
import os

import pytest

from graft.bench.standins import StandIns
from graft.cli import main as graft_main

ROLLOUTS, PER_FLEET = 2, 3


def test_the_smallest_operator_bench_runs_and_its_counters_agree(tmp_path):
    # one case, the concurrent-rollouts one (a fleet-size case is the same with one namespace)
    code = graft_main(["bench", "operator", "--fleet-sizes", "", "--concurrent-rollouts", str(ROLLOUTS),
                       "--rollout-fleet-size", str(PER_FLEET), "--tick", "1", "--ticks", "2", "--allow-load",
                       "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "operator.json").read_text())
    assert (tmp_path / "operator.png").stat().st_size > 0
    cases = {c["label"]: c for c in data["cases"]}
    assert set(cases) == {f"{ROLLOUTS} rollouts"}
    assert cases[f"{ROLLOUTS} rollouts"]["pods"] == ROLLOUTS * PER_FLEET
    for case in data["cases"]:
        for sample in case["rest"] + case["rolling"]:
            # the admin calls are the stand-ins' answers by kind, failures aside
            assert sample["admin_calls"] == sum(v for k, v in sample["admin_by_kind"].items() if k != "failed")
            # CPU time within the wall time of the sample, on at most every core
            assert 0 <= sample["cpu_s"] <= sample["wall_s"] * os.cpu_count() + 0.05
            assert sample["rss_bytes"] > 10 * 2**20
            assert all(n >= 0 for n in sample["api_calls"].values())
        # at rest no rollout runs: nothing is applied and Prometheus is not asked
        assert all(s["admin_by_kind"].get("apply", 0) == 0 for s in case["rest"])
        assert sum(s["prometheus_queries"] for s in case["rest"]) == 0
        # every rollout reached its 50% step: half its pods (rounded up) patched, its analysis asking Prometheus
        assert case["rollout_phases"] == {"Progressing": case["rollouts"]}
        assert len(case["all_canaries_patched_s"]) == case["rollouts"]
        assert all(t > 0 for t in case["all_canaries_patched_s"].values())
        assert all(n == math.ceil(case["pods_per_fleet"] / 2) for n in case["canaries"].values())
        assert sum(s["prometheus_queries"] for s in case["rolling"]) > 0
        # the operator reads its fleets and rollouts from the API server every tick
        assert sum(s["api_calls"].get("get", 0) for s in case["rest"] + case["rolling"]) > 0
    (summary,) = data["summary"]
    assert summary["rest"]["admin_calls"] <= ROLLOUTS * PER_FLEET
    assert summary["canaries_patched_s"]["max"] == max(cases[f"{ROLLOUTS} rollouts"]["all_canaries_patched_s"].values())


def test_stand_ins_refuse_impossible_settings():
    with pytest.raises(ValueError, match="failure_rate"):
        StandIns({"f": 1}, failure_rate=1.0)
    with pytest.raises(ValueError, match="latency"):
        StandIns({"f": 1}, latency=-1)


def test_bad_operator_flags_are_refused_before_anything_starts(tmp_path, capsys):
    assert graft_main(["bench", "operator", "--standin-failure-rate", "2", "--out", str(tmp_path)]) == 2
    assert "--standin-failure-rate" in capsys.readouterr().err
    assert graft_main(["bench", "operator", "--operator-env", "TICK=1", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "operator.json").exists()
