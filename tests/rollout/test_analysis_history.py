"""`status.analysisHistory`: every analysis run kept, oldest dropped first beyond
`spec.analysis.measurementRetention` (default 10, at most 100, 0: none), through the state machine
and a fake fleet; stored and read back unchanged, so it causes no status write of its own."""
import pytest

from graft.rollout.machine import analysis_due
from graft.rollout.spec import DEFAULT_MEASUREMENT_RETENTION, SpecError
from graft.rollout.status import AnalysisRun, CheckResult, RolloutStatus

from rollout_fleet import Fleet, breaching, healthy, make_spec


def drive(fleet, status, until, measure=healthy, stop=lambda s: s.phase in ("Promoted", "RolledBack")):
    runs = []
    for now in range(until):
        m = measure(fleet.spec) if analysis_due(fleet.spec, status, now) else None
        status = fleet.tick(status, now, m)
        if m is not None:
            runs.append(status.analysis.last_run)
        # what the operator stores and reads back at the next tick is the same status
        assert RolloutStatus.from_dict(status.to_dict()).to_dict() == status.to_dict()
        if stop(status):
            break
    return status, runs


def test_the_retention_defaults_to_10_and_takes_0_to_100():
    assert make_spec().analysis.measurement_retention == DEFAULT_MEASUREMENT_RETENTION == 10
    assert make_spec(analysis_measurementRetention=0).analysis.measurement_retention == 0
    assert make_spec(analysis_measurementRetention=100).analysis.measurement_retention == 100
    for bad in (101, -1, 2.5, "10", True):
        with pytest.raises(SpecError) as e:
            make_spec(analysis_measurementRetention=bad)
        assert e.value.paths == ["spec.analysis.measurementRetention"], bad


def test_every_run_is_kept_up_to_the_retention_the_oldest_dropped_first():
    spec = make_spec(analysis_measurementRetention=3)
    status, runs = drive(Fleet.of(spec, 4), RolloutStatus(), 200)
    assert status.phase == "Promoted" and len(runs) > 3
    kept = status.analysis_history
    assert [r.time for r in kept] == runs[-3:]
    assert kept[-1].verdict == status.analysis.verdict and kept[-1].step == status.step_index + 1
    assert [r.name for r in kept[-1].results] == [r.name for r in status.analysis.results]
    stored = status.to_dict()["analysisHistory"]
    assert len(stored) == 3 and all("message" not in c for run in stored for c in run["results"])
    assert stored[-1]["results"][0]["numbers"] == status.analysis.results[0].to_dict()["numbers"]


def test_a_failing_run_is_kept_and_none_when_the_retention_is_0():
    status, runs = drive(Fleet.of(make_spec(analysis_measurementRetention=5), 4), RolloutStatus(), 200,
                         measure=lambda spec: breaching(spec, "error-rate"))
    assert status.phase == "RolledBack" and [r.time for r in status.analysis_history] == runs[-5:]
    assert status.analysis_history[-1].verdict == "Failed"
    status, _ = drive(Fleet.of(make_spec(analysis_measurementRetention=0), 4), RolloutStatus(), 200)
    assert status.phase == "Promoted" and status.analysis_history == []
    assert status.to_dict()["analysisHistory"] is None     # a merge patch clears it


def test_a_lower_retention_trims_at_the_next_run():
    status = RolloutStatus()
    status.analysis_history = [AnalysisRun(float(t), 1, "Successful", [CheckResult("cpu", "Successful", "<= 1", "60s")])
                               for t in range(8)]
    status.analysis.last_run, status.analysis.verdict = 9.0, "Inconclusive"
    status.record_analysis(4)
    assert [r.time for r in status.analysis_history] == [5.0, 6.0, 7.0, 9.0]
    assert RolloutStatus.from_dict(status.to_dict()).analysis_history[-1].verdict == "Inconclusive"
