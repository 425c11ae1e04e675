"""One loop drives `decide()` for the operator, the simulator and these tests: rounds until quiescent,
at most MAX_ROUNDS, a refused start touching nothing; the simulator carries out every action the
operator does."""
import asyncio

import pytest

from graft.rollout import loop
from graft.rollout.actions import ApplyPatch, LabelPod
from graft.rollout.decision import RecordPromotion
from graft.rollout.simulate import Scenario, Simulation
from graft.rollout.status import RolloutStatus
from tests.rollout.rollout_fleet import Fleet, make_spec


class Recording:
    """Effects over a fake fleet that count what the loop asks of them; `deaf`: actions change nothing."""

    def __init__(self, fleet: Fleet, deaf: bool = False, claim: bool = True):
        self.fleet, self.deaf, self.claim = fleet, deaf, claim
        self.observed = self.started = 0
        self.executed: list = []
        self.answered: dict[str, str] = {}

    async def observe(self, status, measurements):
        self.observed += 1
        return self.fleet.observe(status, {}, measurements, self.answered)

    async def start(self, status):
        self.started += 1
        return self.claim

    async def execute(self, status, actions):
        self.executed.append(list(actions))
        if not self.deaf:
            from graft.rollout.decision import Decision
            self.fleet.execute(Decision(status, list(actions)), self.answered)


def test_a_tick_runs_rounds_until_a_decision_asks_for_nothing():
    spec = make_spec()
    effects = Recording(Fleet.of(spec, 4))
    done = loop.run_now(loop.tick(spec, RolloutStatus(), 0.0, effects))
    assert done.status.phase == "Progressing" and not done.held
    assert effects.started == 1, "claimed once, in the round it starts"
    assert any(isinstance(a, ApplyPatch) for a in effects.executed[0])
    assert done.rounds == len(effects.executed) + 1 == effects.observed, "the last round asked for nothing"
    assert done.rounds < loop.MAX_ROUNDS


def test_a_decision_that_keeps_asking_waits_for_the_next_tick():
    spec = make_spec()
    effects = Recording(Fleet.of(spec, 4), deaf=True)      # the engines never change
    done = loop.run_now(loop.tick(spec, RolloutStatus(), 0.0, effects))
    assert done.rounds == loop.MAX_ROUNDS == len(effects.executed)


def test_a_refused_start_touches_nothing_and_keeps_the_status():
    spec = make_spec()
    before = RolloutStatus()
    effects = Recording(Fleet.of(spec, 4), claim=False)
    done = loop.run_now(loop.tick(spec, before, 0.0, effects))
    assert done.held and done.status is before and done.events == []
    assert effects.executed == []


def test_run_now_refuses_a_coroutine_that_waits():
    with pytest.raises(RuntimeError, match="waited"):
        loop.run_now(asyncio.sleep(0))


def test_the_simulator_records_a_promotion_in_its_fleet_and_relabels_every_pod():
    spec = make_spec(steps=[{"weight": 50}, {"weight": 100}])
    sim = Simulation(spec, Scenario(pods=4, horizon=600.0), seed=0)
    outcome = sim.run()
    assert outcome.phase == "Promoted"
    assert sim.fleet == [spec.patch], "RecordPromotion carried out"
    assert {(p.track, p.patches, p.revision) for p in sim.pods.values()} == {
        ("stable", "kv-align@3.2.1", "kv-align@3.2.1")}


def test_the_simulator_takes_an_approval_back_once_acted_on():
    spec = make_spec(steps=[{"weight": 50, "untilApproved": True}, {"weight": 100}])
    sim = Simulation(spec, Scenario(pods=4, horizon=600.0, approve_after=30.0), seed=0)
    assert sim.run().phase == "Promoted"
    assert sim.promote is None, "ClearPromote removed graft.dev/promote"
    assert "Approved" in [e.reason for e in sim.events]


def test_the_simulator_refuses_an_action_it_does_not_know():
    sim = Simulation(make_spec(), Scenario(pods=2), seed=0)
    with pytest.raises(TypeError, match="cannot carry out"):
        sim._execute([object()], {})
    sim._execute([RecordPromotion(), LabelPod("engine-0", "canary", "kv-align@3.2.1")], {})
    assert sim.pods["engine-0"].track == "canary" and sim.fleet == [sim.spec.patch]
