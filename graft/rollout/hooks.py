"""Webhooks a rollout calls at its turning points (Flagger's hook types, Graft's meaning of each).

Gates, awaited during a reconciliation, whose answer decides:

- `confirm-rollout`: before the first canary; while it answers anything but 2xx the rollout waits
  (Pending, reason AwaitingConfirmation), touching no pod;
- `pre-rollout`: before the first canary, once confirmed; a failure (non-2xx after its retries)
  ends the rollout Failed before any pod is touched;
- `rollout`: at every analysis run; a failure fails the run as a breaker named `webhook/<name>`
  would, and the rollout rolls back;
- `confirm-promotion`: before a manual step (`untilApproved`, `pause: {}`) goes on and before the
  move to the last step; while it answers anything but 2xx the step waits (AwaitingConfirmation), and a 2xx
  counts as the approval a manual step waits for.

Fired, never awaited (through the operator's outbox, with retries):

- `post-rollout`: once, when the rollout ends (Promoted, RolledBack or Failed);
- `rollback`: once, when a rollback begins;
- `event`: every Event the rollout posts.

Every call POSTs the notification payload (graft.rollout.notifications.payload) with `hook` (the
type), `name` and the hook's `metadata`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class HookType(StrEnum):
    CONFIRM_ROLLOUT = "confirm-rollout"
    PRE_ROLLOUT = "pre-rollout"
    ROLLOUT = "rollout"
    CONFIRM_PROMOTION = "confirm-promotion"
    POST_ROLLOUT = "post-rollout"
    ROLLBACK = "rollback"
    EVENT = "event"


GATES = frozenset({HookType.CONFIRM_ROLLOUT, HookType.PRE_ROLLOUT, HookType.ROLLOUT, HookType.CONFIRM_PROMOTION})
FIRED = frozenset({HookType.POST_ROLLOUT, HookType.ROLLBACK, HookType.EVENT})


@dataclass(frozen=True, slots=True)
class Hook:
    name: str
    type: HookType
    url: str
    timeout: float = 10.0
    retries: int = 2
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def check_name(self) -> str:
        """The check a `rollout` hook's answer is judged as."""
        return f"webhook/{self.name}"


@dataclass(frozen=True, slots=True)
class HookAnswer:
    """What a gate said: 2xx or not, with the status and a short reason for the rollout's message."""

    hook: str
    ok: bool
    status: int | None = None
    message: str = ""


def hook_body(hook: Hook, payload: dict[str, Any]) -> dict[str, Any]:
    """The body a hook receives: the rollout's payload, which hook is called, and its metadata."""
    return payload | {"hook": hook.type.value, "name": hook.name, "metadata": dict(hook.metadata)}
