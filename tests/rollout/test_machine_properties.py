"""Property: no sequence of observations promotes a rollout past a failing check."""
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from graft.rollout.machine import analysis_due
from graft.rollout.observation import Measurement
from graft.rollout.status import RolloutStatus

from rollout_fleet import Fleet, breaching, healthy, make_spec

SPEC = make_spec(analysis_noData="hold")
CHECKS = [c.name for c in SPEC.analysis.metrics]

tick = st.tuples(
    st.floats(min_value=0.5, max_value=15.0),                                       # time passing
    st.sampled_from(["healthy"] * 6 + ["breach", "nodata", "error"]),          # what Prometheus says
    st.sampled_from(CHECKS),                                                       # which check breaches
    st.sampled_from([None, None, None, "restart", "vanish", "join"]),              # what the pods do
)


def measure(kind: str, name: str) -> list[Measurement]:
    if kind == "healthy":
        return healthy(SPEC)
    if kind == "breach":
        return breaching(SPEC, name)
    if kind == "nodata":
        return [Measurement(c.name, None, 0) for c in SPEC.analysis.metrics]
    return [Measurement(c.name, error="timeout") for c in SPEC.analysis.metrics]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tick, min_size=1, max_size=80), st.integers(min_value=1, max_value=6))
def test_no_sequence_of_observations_promotes_past_a_failing_check(ticks, pods):
    fleet = Fleet.of(SPEC, pods)
    status, now, joined = RolloutStatus(), 0.0, 0
    for dt, kind, name, pod_event in ticks:
        now += dt
        names = sorted(fleet.pods)
        if pod_event == "restart" and names:
            fleet.restart(names[int(now) % len(names)])
        elif pod_event == "vanish" and len(names) > 1:
            del fleet.pods[names[int(now) % len(names)]]
        elif pod_event == "join":
            joined += 1
            fleet.add(f"joined-{joined}")
        due = analysis_due(SPEC, status, now)
        before = status
        status = fleet.tick(status, now, measure(kind, name) if due else None)
        a = status.analysis
        limit_reached = due and kind in ("breach",) and any(
            r.breaches >= c.consecutive for c in SPEC.analysis.metrics for r in a.results
            if r.name == c.name and r.verdict == "Failed")
        if limit_reached:
            assert status.phase in ("RollingBack", "RolledBack"), "a check at its limit must roll back"
        advanced = status.step_index > before.step_index and before.phase == "Progressing"
        if advanced or (status.phase == "Promoted" and before.phase != "Promoted"):
            assert a.verdict == "Successful" and a.last_run is not None
            assert before.step_ready_at is not None and a.last_run > before.step_ready_at
            assert now >= before.step_ready_at + SPEC.step(before.step_index).pause
        changed = status.phase != before.phase
        if status.phase == "Promoted" and changed:
            assert all(r.verdict in ("Successful", "Skipped") for r in a.results)
            assert fleet.patched() == {n for n, p in fleet.pods.items() if p.ready}
        if status.phase == "RolledBack" and changed:
            assert fleet.patched() == set()
        if before.phase in ("RolledBack", "Failed", "Promoted"):
            assert status.phase == before.phase
    event(f"ended {status.phase}")
