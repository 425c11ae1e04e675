"""The default analysis, judged by the simulator: what a user would check before trusting it.

Each scenario runs the real decision code (decide, the judge, the statistics) against a simulated
fleet of 100 requests/s for 20 seeds: a neutral patch must be promoted, a bad one never. Every
scenario's patched engines compare a share of their requests with their previous table, 0.5% of
them divergent (the Traffic default: a good bf16 patch flags a few long requests near ties).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from rich.console import Console

from graft.api import has_patch
from graft.operator.simulate_cli import main as simulate_cli, parse_regression
from graft.rollout.queries import Context, plan
from graft.rollout.simulate import Regression, Scenario, Simulation, Traffic, simulate, summarise
from graft.rollout.spec import BUILTIN_METRICS, parse_spec

ROOT = Path(__file__).resolve().parents[2]

SEEDS = 20
FLEETS = [pytest.param(10, False, id="10-pods-pod-ratio"), pytest.param(3, False, id="3-pods-pod-ratio"),
          pytest.param(10, True, id="10-pods-gateway"), pytest.param(3, True, id="3-pods-gateway")]


def default_spec(gateway: bool, **spec):
    routing = ({"gatewayAPI": {"httpRoute": "llm", "stableService": "llm-stable", "canaryService": "llm-canary"}}
               if gateway else {"podRatio": {}})
    return parse_spec({"selector": {"matchLabels": {"app": "llm-engine"}},
                       "patch": {"name": "kv-align", "version": "3.2.1"}, "trafficRouting": routing, **spec})


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


def blamed(outcome) -> str:
    """The check a rollback is blamed on ("breaker ttft-p99: ...", in the final message)."""
    return outcome.message.split(": ", 1)[1] if ": " in outcome.message else outcome.message


@pytest.mark.parametrize("pods,gateway", FLEETS[:2])
def test_a_ttft_regression_is_rolled_back_by_the_ttft_breaker(pods, gateway):
    """First tokens twice as slow (TPOT as before): only the TTFT breaker can see it."""
    outcomes = run(pods, gateway, Traffic(error_rate=0.0005), Regression(ttft=2.0))
    assert all(o.phase == "RolledBack" and o.step <= 2 and blamed(o).startswith("breaker ttft-p99")
               for o in outcomes), [(o.phase, o.step, o.message) for o in outcomes]


def test_the_default_traffic_flags_half_a_percent_of_compared_requests():
    from graft.engine.shadow import ShadowSettings
    t = Traffic()
    assert (t.divergence, t.shadow_rate) == (0.005, 0.1)
    assert t.shadow_floor == ShadowSettings().floor, "the simulated canaries compare at the engine's floor"


def test_a_good_patch_flagging_a_few_requests_is_promoted_with_its_comparisons_judged():
    """10 pods, 100 requests/s, 0.5% of compared requests divergent: promoted, and not for lack of
    evidence: the canaries compared thousands of requests, a few of them divergent, and the
    breaker's last run judged them."""
    spec, promoted = default_spec(False), 0
    for seed in range(SEEDS):
        sim = Simulation(spec, Scenario(pods=10, traffic=Traffic(error_rate=0.0005, divergence=0.005)), seed)
        outcome = sim.run()
        if outcome.phase != "Promoted":
            continue
        promoted += 1
        last = sim.status.analysis.result("output-divergence", "breaker")
        assert last.verdict == "Successful" and last.numbers["compared"] > 0, last.message
        canary = sim.status.canary_revision
        compared, divergent = (sim.counters.increase(canary, k, outcome.seconds, outcome.seconds)[0]
                               for k in ("compared", "divergent"))
        assert compared > 5000 and 0 < divergent < 0.01 * compared, (compared, divergent)
    assert promoted >= 19


DEV_CLUSTER = ROOT / "examples" / "rollout-dev-cluster.yaml"


def example_spec(path: Path):
    return parse_spec(yaml.safe_load(path.read_text())["spec"])


def divergent(spec, pods: int, rps: float, share: float = 0.6):
    sc = Scenario(pods=pods, traffic=Traffic(rps=rps, error_rate=0.0005), regression=Regression(divergence=share))
    return simulate(spec, sc, SEEDS)


@pytest.mark.parametrize("pods,rps", [pytest.param(10, 100.0, id="10-pods-100-rps"),
                                      pytest.param(3, 2.0, id="3-pods-2-rps-the-dev-cluster")])
def test_divergent_outputs_are_rolled_back_at_the_first_step(pods, rps):
    """60% of the canary's compared requests divergent: the default output-divergence breaker rolls
    it back at the first step, on a fleet of 100 requests a second and on the dev cluster's two."""
    outcomes = divergent(default_spec(False), pods, rps)
    assert all(o.phase == "RolledBack" and o.step == 1 and blamed(o).startswith("breaker output-divergence")
               for o in outcomes), [(o.phase, o.step, o.message) for o in outcomes]


def test_the_dev_cluster_example_rolls_back_a_patch_whose_every_answer_diverges():
    """Its 30 s pauses leave a canary comparing 4 requests a minute about two a step, and 3 of 3 is
    the least evidence that rolls back: a patch whose every answer diverges is rolled back before it
    reaches the last step, 60% divergent only most of the time (the example's comment says so)."""
    spec = example_spec(DEV_CLUSTER)
    outcomes = divergent(spec, 3, 2.0, share=1.0)
    assert all(o.phase == "RolledBack" and o.step <= 4 and blamed(o).startswith("breaker output-divergence")
               for o in outcomes), [(o.phase, o.step, o.message) for o in outcomes]
    assert summarise(divergent(spec, 3, 2.0)).rolled_back >= 12


def test_the_dev_cluster_example_still_promotes_a_good_patch():
    sc = Scenario(pods=3, traffic=Traffic(rps=2.0, error_rate=0.0005))
    assert summarise(simulate(example_spec(DEV_CLUSTER), sc, SEEDS)).promoted >= 19


def test_the_simulator_answers_every_series_the_plan_asks_for():
    """Every built-in check's numbers, computed from the simulated counters: none left unanswered
    once canary and stable pods have served (the shadow comparisons of the canary included)."""
    checks = [{"name": n, "maxRatio": 10} if b["kind"] == "quantile" else
              {"name": n, "min": 0.01} if n == "success-rate" else {"name": n, "max": 0.99}
              for n, b in BUILTIN_METRICS.items()]
    spec = parse_spec({"selector": {"matchLabels": {"app": "llm-engine"}},
                       "patch": {"name": "kv-align", "version": "3.2.1"},
                       "steps": [{"weight": 50, "pause": "1h"}, {"weight": 100}],
                       "analysis": {"breakers": checks}})
    sim = Simulation(spec, Scenario(pods=2, traffic=Traffic(rps=100.0)), 0)
    now = 0.0
    sim.counters.snapshot(now)
    sim._tick(now)
    while now < 150:
        now += 5.0
        sim._serve(now, 5.0)
        sim.counters.snapshot(now)
        sim._tick(now)
    assert sim.status.phase == "Progressing" and sim.status.step_index == 0, sim.status.message
    assert has_patch(sim.status.canary_revision, spec.patch.ref)
    measured = {m.check: m.values for m in sim._measure(now)}
    assert set(measured) == {c.key for c in spec.analysis.checks}
    for check in spec.analysis.checks:
        asked = {s.key for s in plan(check, Context("sim", "c", "s"), 60.0)}
        assert set(measured[check.key]) == asked, check.key
        assert all(v is not None and v >= 0 for v in measured[check.key].values()), (check.key, measured[check.key])
    divergence = measured["breaker/output-divergence"]
    assert divergence["canary_compared"] > 100 and divergence["canary_divergent"] <= divergence["canary_compared"]


def test_only_engines_that_took_the_patch_while_running_compare():
    """Stable pods have nothing to compare against, nor has a canary restarted into the patch, nor
    an engine the patch was taken out of (graft.engine.shadow compares nothing after a revert)."""
    spec = default_spec(False)
    sc = Scenario(pods=10, traffic=Traffic(error_rate=0.0005), regression=Regression(divergence=0.6),
                  restarts_per_hour=0.0)
    sim = Simulation(spec, sc, 0)
    sim.run()
    stable = sim.status.stable_revision
    assert sim.counters.increase(stable, "compared", 1e9, 1e9)[0] == 0
    assert sim.counters.increase(sim.status.canary_revision, "compared", 1e9, 1e9)[0] > 0
    assert sim.status.phase == "RolledBack" and not any(p.compares for p in sim.pods.values()), "reverted"
    # a restart brings the container back running its annotation, with no earlier table
    pod = next(p for p in sim.pods.values())
    pod.compares, sim.sc.restarts_per_hour = True, 1e9
    sim._churn(1e9, 5.0)
    assert not pod.compares


def test_the_cli_reads_every_regression_kind():
    assert parse_regression("ttft=2") == Regression(ttft=2.0)
    assert parse_regression("divergence=0.6,from-step=2") == Regression(divergence=0.6, from_step=2)
    assert parse_regression("errors=0.02,tpot=1.5,cpu=0.3") == Regression(errors=0.02, tpot=1.5, cpu=0.3)


def test_graft_rollout_simulate_catches_a_ttft_regression_and_divergent_outputs():
    console = Console(record=True, width=200, force_terminal=False)
    code = simulate_cli(["-f", str(ROOT / "examples" / "rollout-defaults.yaml"), "--seeds", "4",
                         "--bad", "ttft=2", "--bad", "divergence=0.6"], console)
    out = console.export_text()
    assert code == 0, out
    assert "chance of catching a bad one (TTFT x2): 100% (4/4; 4 rolled back, 0 paused)" in out, out
    assert "chance of catching a bad one (60% divergent outputs): 100% (4/4; 4 rolled back, 0 paused)" in out, out
    for bad, why in (("divergence=1.5", "divergence is a share between 0 and 1"), ("shade=1", "unknown 'shade'")):
        console = Console(record=True, width=200, force_terminal=False)
        assert simulate_cli(["-f", str(DEV_CLUSTER), "--bad", bad], console) == 2
        assert why in console.export_text()


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
def test_a_prometheus_outage_never_promotes_and_pauses_past_the_outage_limit(pods, gateway):
    spec = default_spec(gateway)
    outcomes = simulate(spec, Scenario(pods=pods, gateway=gateway, outage=(0.0, float("inf"))), 5)
    for o in outcomes:
        assert (o.phase, o.reason) == ("Paused", "AnalysisOutageLimit"), o
        # held from the first analysis run (one interval after the canaries took the patch) for
        # outageLimit, neither rolled back by the progress deadline nor paused sooner
        assert spec.analysis.outage_limit <= o.seconds <= spec.analysis.interval * 2 + spec.analysis.outage_limit + 10
        assert "Promoted" not in o.reasons and "RollingBack" not in o.reasons
        assert o.reasons.count("AnalysisUnavailable") == 1


@pytest.mark.parametrize("pods,gateway", FLEETS[:2])
@pytest.mark.parametrize("start,length", [(0.0, 240.0), (200.0, 500.0), (900.0, 590.0)])
def test_an_outage_shorter_than_the_limit_passes_by_itself(pods, gateway, start, length):
    """Prometheus down for minutes at any point: the rollout holds, then promotes on its own; the
    progress deadline (2m here, below every outage) waits for it."""
    spec = default_spec(gateway, progressDeadline="2m")
    outcomes = simulate(spec, Scenario(pods=pods, gateway=gateway, traffic=Traffic(error_rate=0.0001),
                                       outage=(start, start + length)), 5)
    for o in outcomes:
        assert o.phase == "Promoted", o
        assert o.reasons.count("AnalysisUnavailable") == o.reasons.count("AnalysisAvailable") <= 1
        assert "Paused" not in o.reasons and "RollingBack" not in o.reasons


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


# manual approval steps (untilApproved: true, pause: {})
MANUAL_STEPS = [{"weight": 10, "pause": "2m"}, {"weight": 50, "untilApproved": True}, {"weight": 100, "pause": {}}]


def test_a_simulated_person_approves_each_manual_step_after_a_while():
    spec = default_spec(False, steps=MANUAL_STEPS)
    outcomes = simulate(spec, Scenario(pods=10, approve_after=600.0), 4)
    s = summarise(outcomes)
    assert s.promoted == 4 and s.approvals == 8 and s.awaiting == 0, [o.message for o in outcomes]
    for o in outcomes:
        assert o.reasons.count("AwaitingApproval") == o.reasons.count("Approved") == 2
        assert o.seconds >= 2 * 600 + 120, "each wait of 10m is in the time to the decision"


def test_with_nobody_to_approve_a_run_ends_awaiting_approval():
    spec = default_spec(False, steps=MANUAL_STEPS)
    outcomes = simulate(spec, Scenario(pods=10, approve_after=None), 4)
    assert {(o.phase, o.reason, o.step) for o in outcomes} == {("Progressing", "AwaitingApproval", 2)}
    assert "graft rollout promote" in outcomes[0].message
    s = summarise(outcomes)
    assert (s.awaiting, s.undecided, s.promoted, s.catch_rate) == (4, 0, 0, 0.0)


def test_a_regression_is_still_caught_while_its_step_waits_for_approval():
    spec = default_spec(False, steps=MANUAL_STEPS)
    # the patch goes bad once the manual step is reached, and nobody approves for an hour
    sc = Scenario(pods=10, regression=Regression(errors=0.02, from_step=2), approve_after=3600.0)
    outcomes = simulate(spec, sc, 4)
    assert {(o.phase, o.step) for o in outcomes} == {("RolledBack", 2)}, [o.message for o in outcomes]
    assert all("Approved" not in o.reasons for o in outcomes)


def test_graft_rollout_simulate_says_how_it_treats_manual_steps(tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / "rollout-defaults.yaml").read_text())
    doc["spec"]["steps"] = MANUAL_STEPS
    path = tmp_path / "manual.yaml"
    path.write_text(yaml.safe_dump(doc))
    console = Console(record=True, width=200, force_terminal=False)
    assert simulate_cli(["-f", str(path), "--seeds", "2", "--bad", "errors=0.02"], console) == 0
    out = console.export_text()
    assert ("note: manual steps 2, 3 wait for approval (graft rollout promote); a simulated person approves "
            "0s into the wait (at the next tick)") in out, out
    assert "chance of promoting a good patch: 100% (2/2)" in out, out
    console = Console(record=True, width=200, force_terminal=False)
    assert simulate_cli(["-f", str(path), "--seeds", "2", "--bad", "errors=0.02", "--approve-after", "never"],
                        console) == 0
    out = console.export_text()
    assert "nobody approves here: a run ends at the first wait (awaiting approval)" in out, out
    assert any("awaiting approval" in line and "undecided" in line for line in out.splitlines()), out
    assert "chance of promoting a good patch: 0% (0/2; 2 awaiting approval)" in out, out
    console = Console(record=True, width=200, force_terminal=False)
    assert simulate_cli(["-f", str(path), "--approve-after", "soon"], console) == 2
    assert "'soon' is not a duration" in console.export_text()
