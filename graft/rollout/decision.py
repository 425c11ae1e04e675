"""What the state machine asks the operator to do: actions on pods (`graft.rollout.actions`, shared
with the fleet) and on traffic and the rollout itself, events, a new status."""
from __future__ import annotations

from dataclasses import dataclass, field

from graft.rollout.actions import PodAction
from graft.rollout.status import RolloutStatus


@dataclass(slots=True, frozen=True)
class SetWeight:
    """Send `weight` percent of the traffic to the canary backend (Gateway API routing)."""
    weight: int


@dataclass(slots=True, frozen=True)
class ClearPromote:
    """Remove the graft.dev/promote annotation once acted on."""


@dataclass(slots=True, frozen=True)
class ClearResume:
    """Remove the graft.dev/resume annotation once acted on."""


@dataclass(slots=True, frozen=True)
class RecordPromotion:
    """Write the promoted patch into the fleet's durable state (its PatchFleet), for every pod to come."""


Action = PodAction | SetWeight | ClearPromote | ClearResume | RecordPromotion


@dataclass(slots=True, frozen=True)
class Event:
    reason: str
    message: str
    type: str = "Normal"       # Normal | Warning


@dataclass(slots=True)
class Decision:
    status: RolloutStatus
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

