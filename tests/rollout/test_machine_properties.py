"""Property: no sequence of observations promotes a rollout past a failing check.

Hypothesis draws the rollout (steps, pauses, routing, each breaker's `consecutive`), the pods (some
un-Ready, some refusing the patch or unreachable) and, for every analysis run, numbers that straddle
each check's threshold. The test decides from those numbers alone, with the binomial distribution
as its oracle, which runs breach each breaker and whether the gate holds; it keeps its own breach
counts and asserts what the state machine must never do:

- leave a breaker at its limit without rolling back;
- advance a step (or promote) on a run in which a breaker breached;
- leave the last step with stable pods (promote, in the end) on a run whose gate was not passing.

Only checks that do not compare with stable pods are in the oracle (a comparison is Skipped once
no stable pod is left, which depends on which pods the machine made canaries); the rollout also
carries error-rate-delta, which may hold it but is not needed to keep it safe.
"""
import math

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from scipy.stats import binom

from graft.rollout.machine import analysis_due
from graft.rollout.observation import Measurement, PodError
from graft.api import FINAL_PHASES
from graft.rollout.status import RolloutStatus

from rollout_fleet import Fleet, make_spec

ERROR_MAX, LATENCY_MAX, CPU_MAX, SUCCESS_MIN = 0.005, 0.8, 0.92, 0.999
ROLLBACK_CONFIDENCE, CONFIDENCE = 0.999, 0.95


def breaches(errors: int, requests: int) -> bool:
    """Oracle: this many errors would be rarer than 1 - rollbackConfidence at the error-rate limit."""
    # a Python bool: scipy answers numpy booleans, and the caller tells a clean run by `is False`
    return bool(requests > 0 and errors > 0 and binom.sf(errors - 1, requests, ERROR_MAX) < 1 - ROLLBACK_CONFIDENCE)


def gate_passes(failed: int, requests: int) -> bool:
    """Oracle: so few failures would be rarer than 1 - confidence at the success-rate limit."""
    return bool(requests > 0 and binom.cdf(failed, requests, 1 - SUCCESS_MIN) <= 1 - CONFIDENCE)


def first(pred, n: int) -> int:
    return next((k for k in range(n + 1) if pred(k)), n + 1)


# numbers that straddle each threshold
REQUESTS = [0, 40, 400, 5000]
FLIP = {n: first(lambda k: breaches(k, n), n) for n in REQUESTS}        # the fewest errors that breach
GATE_REQUESTS = [0, 1000, 2995, 3000, 20000]
GATE_FLIP = {n: first(lambda k: not gate_passes(k, n), n) for n in GATE_REQUESTS}  # fewest failures that fail


@st.composite
def error_counts(draw):
    n = draw(st.sampled_from(REQUESTS))
    k = draw(st.sampled_from([0, FLIP[n] - 1, FLIP[n], FLIP[n] + 1, n // 2]))
    return n, min(max(k, 0), n)


@st.composite
def gate_counts(draw):
    n = draw(st.sampled_from(GATE_REQUESTS))
    k = draw(st.sampled_from([0, GATE_FLIP[n] - 1, GATE_FLIP[n], GATE_FLIP[n] + 1, n // 50]))
    return n, min(max(k, 0), n)


straddling = st.fixed_dictionaries({
    "kind": st.sampled_from(["measured"] * 8 + ["error", "empty"]),
    "errors": error_counts(),
    "latency": st.tuples(st.sampled_from([0, 199, 200, 1000]),
                         st.sampled_from([None, 0.5, LATENCY_MAX, math.nextafter(LATENCY_MAX, 9), 2.0])),
    "cpu": st.sampled_from([None, 0.3, CPU_MAX, math.nextafter(CPU_MAX, 9), 1.5]),
    "success": gate_counts(),
    "delta": st.sampled_from([(100_000, 0, 100_000, 0), (500, 0, 50_000, 5), (5000, 250, 5000, 0), (0, 0, 0, 0)]),
})
HEALTHY = {"kind": "measured", "errors": (5000, 0), "latency": (1000, 0.5), "cpu": 0.3, "success": (20000, 0),
           "delta": (100_000, 0, 100_000, 0)}
# most runs of a rollout are healthy, so that many rollouts get far enough to be promoted
run = st.integers(min_value=0, max_value=9).flatmap(lambda i: st.just(HEALTHY) if i < 6 else straddling)

tick = st.tuples(
    st.floats(min_value=0.5, max_value=8.0),                                    # time passing
    run,                                                                        # what Prometheus says
    st.sampled_from([None] * 6 + ["flip-ready", "heal"]),                        # what a pod does
    st.integers(min_value=0, max_value=5),                                      # which pod
)


@st.composite
def specs(draw):
    weights = sorted(draw(st.sets(st.integers(min_value=1, max_value=99), max_size=3))) + [100]
    pauses = [draw(st.sampled_from(["0s", "3s", "10s"])) for _ in weights]
    steps = [{"weight": w, "pause": p} for w, p in zip(weights, pauses)]
    consecutive = {name: draw(st.integers(min_value=1, max_value=3)) for name in ("error-rate", "latency-p99", "cpu")}
    gateway = draw(st.booleans())
    routing = ({"gatewayAPI": {"httpRoute": "llm", "stableService": "s", "canaryService": "c"}} if gateway
               else {"podRatio": {}})
    analysis = {
        "interval": draw(st.sampled_from(["2s", "5s"])), "noData": "hold",
        "breakers": [{"name": "error-rate", "max": ERROR_MAX, "consecutive": consecutive["error-rate"]},
                     {"name": "latency-p99", "max": LATENCY_MAX, "consecutive": consecutive["latency-p99"]},
                     {"name": "cpu", "max": CPU_MAX, "consecutive": consecutive["cpu"]}],
        "gates": [{"name": "success-rate", "min": SUCCESS_MIN}, {"name": "error-rate-delta", "max": 0.001}],
    }
    return make_spec(steps=steps, trafficRouting=routing, analysis=analysis), gateway


pods = st.lists(st.tuples(st.booleans() | st.just(True),                      # ready (mostly)
                          st.sampled_from([None] * 8 + ["unreachable", "unknown-patch", "verify-failed"])),
                min_size=1, max_size=6)


def measurements(spec, r) -> list[Measurement]:
    if r["kind"] == "error":
        return [Measurement(c.key, error="Prometheus is unreachable") for c in spec.analysis.checks]
    if r["kind"] == "empty":
        return [Measurement(c.key, {}) for c in spec.analysis.checks]
    n, k = r["errors"]
    samples, q = r["latency"]
    gn, gk = r["success"]
    cn, ck, sn, sk = r["delta"]
    return [
        Measurement("breaker/error-rate", {"canary_requests": n, "canary_matching": k}),
        Measurement("breaker/latency-p99", {"canary_quantile": q, "canary_samples": samples}),
        Measurement("breaker/cpu", {"value": r["cpu"]}),
        Measurement("gate/success-rate", {"canary_requests": gn, "canary_matching": gn - gk}),
        Measurement("gate/error-rate-delta", {"canary_requests": cn, "canary_errors": ck,
                                              "stable_requests": sn, "stable_errors": sk}),
    ]


def oracle(r) -> tuple[dict[str, bool | None], bool]:
    """Per breaker: True (breached), False (clean: resets its count), None (no verdict: count kept);
    and whether the gate passes. From the numbers alone."""
    if r["kind"] != "measured":
        return {"error-rate": None, "latency-p99": None, "cpu": None}, False
    n, k = r["errors"]
    samples, q = r["latency"]
    gn, gk = r["success"]
    return {
        "error-rate": None if n == 0 else breaches(k, n),
        "latency-p99": None if samples < 200 or q is None else q > LATENCY_MAX,
        "cpu": None if r["cpu"] is None else r["cpu"] > CPU_MAX,
    }, gate_passes(gk, gn)


def _measured(errors: tuple[int, int], good: bool) -> dict:
    if good:
        return {"kind": "measured", "errors": errors, "latency": (1000, 0.5), "cpu": 0.3, "success": (20000, 0),
                "delta": (100000, 0, 100000, 0)}
    return {"kind": "measured", "errors": errors, "latency": (0, None), "cpu": None, "success": (0, 0),
            "delta": (100000, 0, 100000, 0)}


# breach, clean, breach of a breaker with consecutive 2: the clean run in between resets the count
# (found when the oracle's verdicts were numpy booleans, which `is False` never matches)
BREACH_CLEAN_BREACH = (
    (make_spec(steps=[{"weight": 100, "pause": "0s"}], analysis={
        "interval": "5s", "noData": "hold",
        "breakers": [{"name": "error-rate", "max": ERROR_MAX, "consecutive": 2},
                     {"name": "latency-p99", "max": LATENCY_MAX, "consecutive": 1},
                     {"name": "cpu", "max": CPU_MAX, "consecutive": 1}],
        "gates": [{"name": "success-rate", "min": SUCCESS_MIN}, {"name": "error-rate-delta", "max": 0.001}]}), False),
    [(True, None)],
    [(1.0, _measured((5000, 0), True), None, 0), (5.0, _measured((40, 4), False), None, 0),
     (4.0, _measured((5000, 0), True), None, 0), (1.0, _measured((40, 3), False), None, 0),
     (4.0, _measured((5000, 0), True), None, 0), (1.0, _measured((40, 4), False), None, 0)],
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs(), pods, st.lists(tick, min_size=1, max_size=80))
@example(*BREACH_CLEAN_BREACH)
def test_no_sequence_of_observations_promotes_past_a_failing_check(drawn, pod_setup, ticks):
    spec, gateway = drawn
    limits = {c.name: c.consecutive for c in spec.analysis.breakers}
    fleet = Fleet.of(spec, len(pod_setup), gateway=gateway)
    for (ready, refuse), pod in zip(pod_setup, fleet.pods.values()):
        pod.ready = ready
        if refuse == "unreachable":
            pod.unreachable = True
        elif refuse is not None:
            pod.refuse = PodError(refuse, f"refused ({refuse})")
    count = {name: 0 for name in limits}       # the test's own breach counts
    last = None                                # the oracle of the latest judged run
    status, now = RolloutStatus(), 0.0
    for dt, r, pod_event, which in ticks:
        now += dt
        names = sorted(fleet.pods)
        target = fleet.pods[names[which % len(names)]]
        if pod_event == "flip-ready":
            target.ready = not target.ready
        elif pod_event == "heal":
            target.unreachable = False
        before = status
        due = analysis_due(spec, status, now)
        status = fleet.tick(status, now, measurements(spec, r) if due else None)
        judged = due and status.analysis.last_run == now
        if judged:
            verdicts, gate = oracle(r)
            for name, breached in verdicts.items():
                if breached:
                    count[name] += 1
                elif breached is False:
                    count[name] = 0
            last = (any(verdicts.values()), gate)
        at_limit = [name for name in limits if count[name] >= limits[name]]
        if judged and at_limit:
            event("a breaker reached its limit")
            assert status.phase in ("RollingBack", "RolledBack", "Failed"), \
                f"breakers {at_limit} at their limit, the rollout is {status.phase}"
        if before.phase in FINAL_PHASES:
            assert status.phase == before.phase, "a final phase is final"
            continue
        left = before.phase in ("Progressing", "Paused") and (
            status.step_index > before.step_index or status.phase == "Promoted")
        if left:
            assert last is not None, "a step advanced without any analysis run"
            breached, gate = last
            assert not breached, "a step advanced on a run in which a breaker breached"
            if before.step_index + 2 >= len(spec.steps):
                assert gate, "left the last step with stable pods on a run whose gate was not passing"
                event("left the last step with stable pods")
        if status.phase == "Promoted":
            assert not any(count[name] >= limits[name] for name in limits)
            assert fleet.patched() >= {n for n, p in fleet.pods.items() if p.ready}
        if status.phase == "RolledBack" and before.phase != "RolledBack":
            assert not fleet.patched() & {n for n, p in fleet.pods.items() if p.ready}
    event(f"ended {status.phase}")
