"""The default analysis, judged by the simulator: what a user would check before trusting it.

Each scenario runs the real decision code (decide, the judge, the statistics) against a simulated
fleet of 100 requests/s for 20 seeds: a neutral patch must be promoted, a bad one never.
"""
from __future__ import annotations

import pytest

from graft.rollout.simulate import Regression, Scenario, Traffic, simulate, summarise
from graft.rollout.spec import parse_spec

SEEDS = 20
FLEETS = [pytest.param(10, False, id="10-pods-pod-ratio"), pytest.param(3, False, id="3-pods-pod-ratio"),
          pytest.param(10, True, id="10-pods-gateway"), pytest.param(3, True, id="3-pods-gateway")]


def default_spec(gateway: bool):
    routing = ({"gatewayAPI": {"httpRoute": "llm", "stableService": "llm-stable", "canaryService": "llm-canary"}}
               if gateway else {"podRatio": {}})
    return parse_spec({"selector": {"matchLabels": {"app": "llm-engine"}},
                       "patch": {"name": "kv-align", "version": "3.2.1"}, "trafficRouting": routing})


def run(pods, gateway, traffic=None, regression=None, **scenario):
    sc = Scenario(pods=pods, gateway=gateway, traffic=traffic or Traffic(), regression=regression or Regression(),
                  **scenario)
    return simulate(default_spec(gateway), sc, SEEDS)


@pytest.mark.parametrize("pods,gateway", FLEETS)
@pytest.mark.parametrize("traffic", [
    pytest.param(Traffic(error_rate=0.0001), id="errors-0.01%"),
    pytest.param(Traffic(error_rate=0.0005), id="errors-0.05%"),
    pytest.param(Traffic(error_rate=0.0005, spike_per_hour=1.0, spike_factor=1.8), id="p99-spikes"),
])
def test_a_neutral_patch_is_promoted(pods, gateway, traffic):
    outcomes = run(pods, gateway, traffic)
    s = summarise(outcomes)
    assert s.promoted >= 19, [(o.phase, o.step, o.message) for o in outcomes if o.phase != "Promoted"]


@pytest.mark.parametrize("pods,gateway", FLEETS)
@pytest.mark.parametrize("regression", [
    pytest.param(Regression(errors=0.02), id="2%-errors"),
    pytest.param(Regression(tpot=1.5), id="tpot+50%"),
])
def test_a_clearly_bad_patch_is_rolled_back_at_the_first_or_second_step(pods, gateway, regression):
    outcomes = run(pods, gateway, Traffic(error_rate=0.0005), regression)
    assert all(o.phase == "RolledBack" and o.step <= 2 for o in outcomes), \
        [(o.phase, o.step, o.message) for o in outcomes]


@pytest.mark.parametrize("pods,gateway", FLEETS)
def test_a_small_error_regression_is_never_promoted(pods, gateway):
    # 0.3% errors on the canary against 0.05% on stable: below the 0.5% breaker, above the 0.1 pp gate
    outcomes = run(pods, gateway, Traffic(error_rate=0.0005), Regression(errors=0.0025))
    assert not any(o.phase == "Promoted" for o in outcomes)
    # every run ends in a decision a person sees: rolled back, or paused with the numbers
    assert all(o.phase in ("RolledBack", "Paused") for o in outcomes)


def test_a_regression_that_starts_at_a_later_step_is_caught_there():
    outcomes = run(10, False, Traffic(error_rate=0.0001), Regression(errors=0.02, from_step=3))
    assert all(o.phase == "RolledBack" and o.step == 3 for o in outcomes), [(o.phase, o.step) for o in outcomes]


@pytest.mark.parametrize("pods,gateway", FLEETS[:2])
def test_a_prometheus_outage_never_promotes_and_pauses_after_the_error_limit(pods, gateway):
    spec = default_spec(gateway)
    outcomes = simulate(spec, Scenario(pods=pods, gateway=gateway, outage=(0.0, float("inf"))), 5)
    for o in outcomes:
        assert (o.phase, o.reason) == ("Paused", "AnalysisErrorLimit"), o
        # the first analysis run is one interval after the canaries took the patch; four runs then fail
        assert o.seconds <= spec.analysis.interval * (spec.analysis.error_limit + 1) + 10
        assert "Promoted" not in o.reasons


def test_pod_restarts_do_not_turn_a_neutral_patch_into_a_rollback():
    outcomes = run(10, False, Traffic(error_rate=0.0005), restarts_per_hour=2.0)
    assert summarise(outcomes).promoted >= 19


def test_the_simulator_sees_the_engine_histograms():
    from graft.engine.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS
    from graft.rollout import simulate as sim
    assert (sim.TOKEN_BUCKETS, sim.LATENCY_BUCKETS) == (TOKEN_BUCKETS, LATENCY_BUCKETS)


def test_histogram_quantile_interpolates_as_prometheus_does():
    import numpy as np

    from graft.rollout.simulate import histogram_quantile
    bounds = (0.1, 0.2, 0.4)
    # 50 in (0, 0.1], 30 in (0.1, 0.2], 20 in (0.2, 0.4], none above
    counts = np.array([50.0, 30.0, 20.0, 0.0])
    assert histogram_quantile(0.5, bounds, counts) == pytest.approx(0.1)
    assert histogram_quantile(0.65, bounds, counts) == pytest.approx(0.15)
    assert histogram_quantile(0.9, bounds, counts) == pytest.approx(0.3)
    # a rank in the +Inf bucket answers the highest finite bound
    assert histogram_quantile(0.99, bounds, np.array([0.0, 0.0, 1.0, 5.0])) == pytest.approx(0.4)
    assert np.isnan(histogram_quantile(0.5, bounds, np.zeros(4)))
