"""Notifications: tell a chat channel or any JSON endpoint when a rollout starts, moves, pauses and
ends, with the decision in numbers.

Receivers are the operator's (the chart's `notifications.receivers`: a name, a type, a URL read
from a Secret, the moments they get by default); a rollout picks among them with
`spec.notifications` (absent: every receiver with its defaults; present: exactly the receivers it
lists, with the moments it lists). Two types:

- `slack`: a Slack incoming webhook (Mattermost and Rocket.Chat take the same body): a headline,
  the reason, and every check of the last analysis as value vs threshold with its counts;
- `webhook`: the documented JSON payload (graft.rollout.notifications.payload) as it is.

Sending goes through an Outbox: a reconciliation never waits on a receiver.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from graft.api import Reason
from graft.operator.outbox import Delivery, Outbox
from graft.operator.render import bounds_text, counts_text, value_text
from graft.rollout.decision import Event
from graft.rollout.notifications import DEFAULT_MOMENTS, Moment, moments, payload

log = logging.getLogger("graft.notify")

KINDS = ("slack", "webhook")
ENV = "GRAFT_NOTIFICATIONS"


class NotifyConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Receiver:
    name: str
    kind: str                         # slack | webhook
    url: str
    moments: tuple[Moment, ...] = DEFAULT_MOMENTS
    timeout: float = 5.0


def receivers_from_env(env: Mapping[str, str] = os.environ) -> list[Receiver]:
    """The receivers `GRAFT_NOTIFICATIONS` declares: a JSON list of `{name, type, urlEnv, moments}`,
    each URL read from the environment variable `urlEnv` names (the chart fills it from a Secret,
    so no URL is ever written into a manifest or a values file)."""
    text = env.get(ENV, "").strip()
    if not text:
        return []
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise NotifyConfigError(f"{ENV}: not JSON: {e}") from None
    if not isinstance(items, list):
        raise NotifyConfigError(f"{ENV}: a list of receivers is expected")
    out, seen = [], set()
    for i, item in enumerate(items):
        where = f"{ENV}[{i}]"
        if not isinstance(item, dict):
            raise NotifyConfigError(f"{where}: an object is expected")
        name, kind = str(item.get("name") or ""), str(item.get("type") or "")
        if not name or name in seen:
            raise NotifyConfigError(f"{where}.name: {'missing' if not name else f'{name!r} given twice'}")
        if kind not in KINDS:
            raise NotifyConfigError(f"{where}.type: {kind!r} is not one of {', '.join(KINDS)}")
        url = env.get(str(item.get("urlEnv") or ""), "") or str(item.get("url") or "")
        if not url.startswith(("http://", "https://")):
            raise NotifyConfigError(f"{where}: no http(s) URL (urlEnv {item.get('urlEnv')!r} is unset or empty)")
        seen.add(name)
        out.append(Receiver(name, kind, url, parse_moments(item.get("moments"), f"{where}.moments"),
                            float(item.get("timeoutSeconds") or 5.0)))
    return out


def parse_moments(value: Any, where: str) -> tuple[Moment, ...]:
    if value is None:
        return DEFAULT_MOMENTS
    if not isinstance(value, list):
        raise NotifyConfigError(f"{where}: a list is expected")
    try:
        return tuple(Moment(v) for v in value)
    except ValueError:
        known = ", ".join(m.value for m in Moment)
        raise NotifyConfigError(f"{where}: {value!r} has a moment not among {known}") from None


# the Event that says best why a moment happened (its reason and message go into the message)
_EVENTS: dict[Moment, tuple[str, ...]] = {
    Moment.STARTED: (Reason.STEP_STARTED,),
    Moment.STEP: (Reason.STEP_STARTED,),
    Moment.PAUSED: (Reason.AWAITING_APPROVAL, Reason.INCONCLUSIVE_LIMIT, Reason.ANALYSIS_ERROR_LIMIT,
                    Reason.ANALYSIS_OUTAGE_LIMIT, Reason.PAUSED),
    Moment.PROMOTED: (Reason.PROMOTED,),
    Moment.ROLLED_BACK: (Reason.ROLLED_BACK,),
    Moment.FAILED: (),
}


def why(moment: Moment, events: Iterable[Event]) -> Event | None:
    events = list(events)
    for reason in _EVENTS[moment]:
        found = next((e for e in events if e.reason == reason), None)
        if found is not None:
            return found
    return next((e for e in reversed(events) if e.type == "Warning"), None)


def slack_message(p: dict[str, Any]) -> dict[str, Any]:
    """The payload as an incoming-webhook message, every check of the last analysis in numbers."""
    ref, where = p["patch"]["ref"], f"{p['namespace']}/{p['rollout']}"
    verb = {"started": "started", "step": "moved on", "paused": "paused", "promoted": "promoted",
            "rolledBack": "rolled back", "failed": "failed"}.get(p["moment"], p["moment"])
    lines = [f"*{ref} {verb} in {where}* (step {p['step']}/{p['steps']}, weight {p['weight']}%)"]
    if p.get("reason") or p.get("message"):
        lines.append(f"{p.get('reason', '')}: {p.get('message', '')}".strip(": "))
    results = p["analysis"]["results"]
    if results:
        lines.append(f"Last analysis: {p['analysis'].get('verdict') or '-'}")
        for r in results:
            numbers = r.get("numbers") or {}
            extra = "; ".join(t for t in (counts_text(numbers), bounds_text(numbers)) if t)
            lines.append(f"• {r.get('name')} {value_text(r)} vs {r.get('threshold', '?')}: {r.get('verdict', '?')}"
                         + (f" ({extra})" if extra else ""))
    text = "\n".join(lines)
    return {"text": text, "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text[:3000]}}]}


class Notifier:
    def __init__(self, receivers: list[Receiver], outbox: Outbox):
        self.receivers = {r.name: r for r in receivers}
        self.outbox = outbox

    def wanted(self, rollout: dict[str, Any]) -> list[tuple[Receiver, tuple[Moment, ...]]]:
        """Which receivers get which moments for this rollout. A `spec.notifications` the operator
        cannot read (the rollout's spec is refused as a whole then) counts as absent, so that its
        failure is still heard by every receiver."""
        chosen = (rollout.get("spec") or {}).get("notifications")
        defaults = [(r, r.moments) for r in self.receivers.values()]
        if chosen is None or not isinstance(chosen, list) or not all(isinstance(c, dict) for c in chosen):
            return defaults
        out = []
        for rule in chosen:
            receiver = self.receivers.get(str(rule.get("receiver", "")))
            if receiver is None:
                log.warning("%s: notification receiver %r is not configured",
                            _name(rollout), rule.get("receiver"))
                continue
            try:
                moments_wanted = (parse_moments(rule["moments"], "moments") if rule.get("moments") is not None
                                  else receiver.moments)
            except NotifyConfigError:
                return defaults
            out.append((receiver, moments_wanted))
        return out

    def publish(self, rollout: dict[str, Any], before: dict[str, Any] | None, after: dict[str, Any],
                events: Iterable[Event], now: float) -> list[Moment]:
        """Send what changed between two statuses to whoever wants it; returns the moments."""
        happened = moments(before, after)
        if not happened or not self.receivers:
            return happened
        events = list(events)
        when = datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
        for moment in happened:
            event = why(moment, events)
            body = payload(rollout, after, moment, reason=event.reason if event else None,
                           message=event.message if event else "", event_type=event.type if event else "",
                           now=when)
            for receiver, moments_wanted in self.wanted(rollout):
                if moment in moments_wanted:
                    self.outbox.send(Delivery(receiver.url, slack_message(body) if receiver.kind == "slack" else body,
                                              what=f"{receiver.name}/{moment}", timeout=receiver.timeout))
        return happened


def _name(rollout: dict[str, Any]) -> str:
    meta = rollout.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"
