"""One tick of a rollout: rounds of observe, `decide()`, act, until the decision asks for nothing more.

The operator (graft.operator.reconcile), the simulator (graft.rollout.simulate) and the state
machine's tests drive `decide()` through this one loop, each with its own `Effects`: the operator's
observe the cluster and call the engines, the simulator's play a simulated fleet. A round's actions
are carried out before the next observation, so each decision sees what the last one did (the
engines' new revisions, a refusal); a tick ends once a decision asks for nothing, or after
MAX_ROUNDS rounds (a decision that keeps asking waits for the next tick rather than spinning).

The effects are coroutines so that the operator's can wait on I/O; the simulator's never wait, and
`run_now` drives the loop for them without an event loop.
"""
from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from graft.api import Phase
from graft.rollout.decision import Action, Event
from graft.rollout.machine import decide
from graft.rollout.observation import Measurement, Observation
from graft.rollout.spec import RolloutSpec
from graft.rollout.status import RolloutStatus

MAX_ROUNDS = 5


class Effects(Protocol):
    """What one driver of `decide()` does to the world it drives."""

    async def observe(self, status: RolloutStatus, measurements: list[Measurement] | None) -> Observation:
        """The world as `status` should now find it; `measurements` go to the first round only."""

    async def start(self, status: RolloutStatus) -> bool:
        """A Pending rollout is about to act for the first time (`status` is its first Progressing
        one): claim what it acts on. False: it may not (nothing is carried out; it stays Pending)."""

    async def execute(self, status: RolloutStatus, actions: list[Action]) -> None:
        """Carry out one decision's `actions` (`status` is the decision's)."""


@dataclass(slots=True)
class Tick:
    status: RolloutStatus
    events: list[Event] = field(default_factory=list)
    held: bool = False          # `Effects.start` refused: `status` is the one the tick began with
    rounds: int = 0


async def tick(spec: RolloutSpec, status: RolloutStatus, now: float, effects: Effects,
               measurements: list[Measurement] | None = None) -> Tick:
    """Run `decide()` rounds on one rollout at time `now` until it is quiescent (at most MAX_ROUNDS)."""
    first = status
    out = Tick(status)
    for out.rounds in range(1, MAX_ROUNDS + 1):
        d = decide(spec, out.status, await effects.observe(out.status, measurements), now)
        starting = out.status.phase == Phase.PENDING and d.status.phase != Phase.PENDING
        out.status, measurements = d.status, None
        out.events += d.events
        if not d.actions:
            break
        if starting and not await effects.start(out.status):
            return Tick(first, [], held=True, rounds=out.rounds)
        await effects.execute(out.status, d.actions)
    return out


T = TypeVar("T")


def run_now(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never waits (the simulator's effects), without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("run_now: the coroutine waited on something; run it in an event loop")
