"""Kubernetes Events for a rollout: every transition has its own reason.

The reasons are the members of `graft.api.Reason` (the same vocabulary as `status.reason`); each
says when it is used and the Event type it is posted with.
"""
from __future__ import annotations

from typing import Any

import kopf

from graft.rollout.decision import Event

MAX_MESSAGE = 1000   # the API server keeps at most 1 KiB of an event message


def post(body: Any, event: Event) -> None:
    """Queue `event` on the rollout `body` (kopf posts it in the background)."""
    message = event.message if len(event.message) <= MAX_MESSAGE else event.message[: MAX_MESSAGE - 1] + "…"
    kopf.event(body, type=event.type, reason=event.reason, message=message)
