"""Finished PatchRollouts deleted, so they do not pile up: the kopf side of graft.rollout.history.

- A timer on each finished PatchRollout that sets `spec.ttlSecondsAfterFinished` (kopf runs it for
  those only) deletes it once its TTL has run out, with the Event TTLExpired on the rollout. It
  needs no fleet: a rollout whose fleet is gone still expires.
- A timer on each PatchFleet lists the rollouts that target it and deletes the finished ones beyond
  its `spec.revisionHistoryLimit`, oldest first, with the Event HistoryPruned on the fleet naming
  each one (and, on the way, any whose TTL has run out).

A TTL is checked every tick, a fleet's history every four (each time a list of its namespace's
rollouts), so a deletion comes at most that late. Each one is made under the rollout's own lock,
after reading it again: a rollout retried (`graft rollout retry`) or finished anew since the list
was read is left alone. The DELETE then names that read's uid and resourceVersion as preconditions, so
one written after it (even by someone else, under no lock of ours) is refused by the API server and
stays, for the next tick to decide on. The finalizer then runs as for any deletion; a finished rollout
has nothing left to revert.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import kopf

from graft.operator import events
from graft.operator.kube import KubeError, fleet_path, rollout_path, rollouts_path
from graft.operator.runtime import Runtime
from graft.rollout.decision import Event
from graft.api import Reason
from graft.rollout.history import Deletion, finished, plan, record, targets
from graft.rollout.spec import SpecError, parse_fleet_spec

TTL_FIELD = "ttlSecondsAfterFinished"
PRUNE_TICKS = 4      # housekeeping: a fleet's rollouts are listed every few ticks, not every one


def register(runtime: Runtime, rollouts: dict[str, Any], fleets: dict[str, Any]) -> None:
    """Add both timers; `rollouts` and `fleets` are the kopf resource arguments (with the registry)."""

    @kopf.timer(**rollouts, id="ttl", interval=runtime.settings.tick, when=_may_expire)
    async def ttl_ticked(body: kopf.Body, **_: Any) -> None:
        await expire(runtime, body)

    @kopf.timer(**fleets, id="fleet-history", interval=runtime.settings.tick * PRUNE_TICKS)
    async def history_ticked(body: kopf.Body, **_: Any) -> None:
        await prune(runtime, body)


def _may_expire(spec: kopf.Spec, status: kopf.Status, **_: Any) -> bool:
    return spec.get(TTL_FIELD) is not None and finished(status)


async def expire(rt: Runtime, body: kopf.Body) -> None:
    """Delete this rollout if its own TTL has run out."""
    meta = body["metadata"]
    if rt.closed:
        return
    current = await rt.kube.get(rollout_path(meta["namespace"], meta["name"]))
    if current is None:
        return
    for deletion in plan([record(current)], limit=None, now=time.time()):
        if (deleted := await delete(rt, meta["namespace"], deletion)) is not None:
            events.post(deleted, Event(deletion.reason, deletion.message, "Normal"))


async def prune(rt: Runtime, body: kopf.Body) -> None:
    """Delete the fleet's finished rollouts beyond its history limit (and any past their TTL)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    if rt.closed:
        return
    fleet = await rt.kube.get(fleet_path(namespace, name))
    if fleet is None:
        return
    try:
        spec = parse_fleet_spec(fleet.get("spec") or {})
    except SpecError:
        return                 # the fleet controller reports it; nothing is deleted on a spec we cannot read
    refs = [p.ref for p in spec.patches]
    query = spec.selector.to_query()
    mine = [record(r, refs) for r in await rt.kube.list(rollouts_path(namespace)) if targets(r, name, query)]
    for deletion in plan(mine, limit=spec.revision_history_limit, now=time.time()):
        if (deleted := await delete(rt, namespace, deletion, refs)) is not None:
            on = fleet if deletion.reason == Reason.HISTORY_PRUNED else deleted
            events.post(on, Event(deletion.reason, deletion.message, "Normal"))


async def delete(rt: Runtime, namespace: str, deletion: Deletion,
                 fleet_patches: Iterable[str] = ()) -> dict[str, Any] | None:
    """Delete the rollout `deletion` names if it is still the one decided on, finished as it was
    then; answer it as it was, or None when it was left alone.

    The DELETE names the uid and resourceVersion just read as its preconditions, so a write landing
    after that read (the rollout retried, edited, or deleted and created again under its name) makes
    the API server refuse it: the rollout stays, and the next tick decides on it afresh."""
    planned = deletion.rollout
    path = rollout_path(namespace, planned.name)
    async with rt.locks[planned.uid]:
        current = await rt.kube.get(path)
        if current is None or current["metadata"].get("deletionTimestamp"):
            return None
        fresh = record(current, fleet_patches)
        if (fresh.uid, fresh.finished, fresh.finished_at) != (planned.uid, True, planned.finished_at):
            return None
        meta = current["metadata"]
        try:
            deleted = await rt.kube.delete(path, {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]})
        except KubeError as e:
            if e.status == 409:         # a precondition failed: written since it was read
                return None
            raise
    return current if deleted is not None else None
