"""The kopf handlers for PatchRollout: thin, each hands its rollout to `reconcile` under its lock.

- create / resume / update (spec, controls in annotations): reconcile at once;
- a timer every `tick` seconds: reconcile (pauses end, analysis runs, pods are re-checked);
- PatchFleets: on create, update and every `tick`, their pods are converged to their patches;
- every `tick`, finished rollouts past their TTL or their fleet's history limit are deleted (history);
- delete (behind the finalizer `graft.dev/finalizer`): a rollout still in flight is aborted and its
  canaries reverted before it goes; a promoted one leaves its patch in place;
- login: chosen by settings (a plain URL, a kubeconfig, or kopf's in-cluster/kubeconfig login).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import kopf

from graft.api import (ACTIVE_PHASES, FINAL_PHASES, FLEETS as FLEET_PLURAL, GROUP, ROLLOUTS as PLURAL, VERSION,
                       Reason)
from graft.operator import events, history
from graft.operator.fleet import reconcile_fleet
from graft.operator.kube import fleet_path, rollout_path
from graft.operator.reconcile import reconcile
from graft.operator.routers import RouteError, router_for
from graft.operator.runtime import Runtime
from graft.rollout.decision import Event
from graft.rollout.spec import SpecError, parse_spec
from graft.rollout.status import RolloutStatus

FINALIZER = "graft.dev/finalizer"


def build_registry(runtime: Runtime) -> kopf.OperatorRegistry:
    """A registry with every handler of the operator, bound to `runtime`."""
    registry = kopf.OperatorRegistry()
    resource = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry)

    @kopf.on.startup(registry=registry, id="configure")
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="graft.dev")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="graft.dev", key="last-handled-configuration")
        settings.posting.level = logging.WARNING     # events are posted on purpose, not from log lines
        settings.watching.connect_timeout = 10
        settings.watching.server_timeout = 300
        # a deleted object's timers that were mid-run are checked again this often until they exit
        # (kopf's 60 s held a rollout deleted during its tick, or by its own TTL timer, a minute)
        settings.background.cancellation_polling = runtime.settings.tick

    @kopf.on.login(registry=registry, id="login")
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return await runtime.login(**kwargs)

    @kopf.on.cleanup(registry=registry, id="cleanup")
    async def cleanup(**_: Any) -> None:
        await runtime.close()

    @kopf.on.create(**resource, id="create")
    async def created(body: kopf.Body, **_: Any) -> None:
        await reconcile_now(runtime, body)

    @kopf.on.resume(**resource, id="resume")
    async def resumed(body: kopf.Body, **_: Any) -> None:
        await reconcile_now(runtime, body)

    @kopf.on.update(**resource, id="update")
    async def updated(body: kopf.Body, **_: Any) -> None:
        await reconcile_now(runtime, body)

    @kopf.timer(**resource, id="tick", interval=runtime.settings.tick)
    async def ticked(body: kopf.Body, **_: Any) -> None:
        await reconcile_now(runtime, body)

    fleet = dict(group=GROUP, version=VERSION, plural=FLEET_PLURAL, registry=registry)

    @kopf.on.create(**fleet, id="fleet-create")
    async def fleet_created(body: kopf.Body, **_: Any) -> None:
        await converge_fleet_now(runtime, body)

    @kopf.on.update(**fleet, id="fleet-update")
    async def fleet_updated(body: kopf.Body, **_: Any) -> None:
        await converge_fleet_now(runtime, body)

    @kopf.timer(**fleet, id="fleet-tick", interval=runtime.settings.tick)
    async def fleet_ticked(body: kopf.Body, **_: Any) -> None:
        await converge_fleet_now(runtime, body)

    history.register(runtime, resource, fleet)     # finished rollouts: their TTL, the fleet's history limit

    @kopf.on.delete(**resource, id="finalize")
    async def deleted(body: kopf.Body, **_: Any) -> None:
        await finalize(runtime, body)

    return registry


async def _fresh(runtime: Runtime, body: kopf.Body) -> dict[str, Any] | None:
    # a handler's body can predate the last reconciliation's status: always start from the stored one
    meta = body["metadata"]
    return await runtime.kube.get(rollout_path(meta["namespace"], meta["name"]))


async def reconcile_now(runtime: Runtime, body: kopf.Body) -> None:
    """Reconcile one rollout now, and post the events of what changed."""
    if runtime.closed:
        return
    async with runtime.locks[body["metadata"]["uid"]]:
        current = await _fresh(runtime, body)
        if current is None or _settled(current):
            return
        result = await reconcile(runtime, current, time.time())
    meta = body["metadata"]
    runtime.metrics.observe(meta["namespace"], meta["name"], result.status)
    for event in result.events:
        events.post(body, event)


async def converge_fleet_now(runtime: Runtime, body: kopf.Body) -> None:
    """Converge one fleet's pods now, and post the events of what changed."""
    meta = body["metadata"]
    if runtime.closed:
        return
    async with runtime.locks["fleet/" + meta["uid"]]:
        current = await runtime.kube.get(fleet_path(meta["namespace"], meta["name"]))
        if current is None:
            return
        result = await reconcile_fleet(runtime, current)
    for reason, message, kind in result.events:
        events.post(body, Event(reason, message, kind))


def _settled(rollout: dict[str, Any]) -> bool:
    """A final phase needs nothing more, unless it is a refused spec that may have been fixed since."""
    status = RolloutStatus.from_dict(rollout.get("status"))
    return status.phase in FINAL_PHASES and status.reason != Reason.INVALID_SPEC


async def finalize(runtime: Runtime, body: kopf.Body) -> None:
    """Before a rollout goes: abort it if still in flight (canaries reverted), route back to stable."""
    async with runtime.locks[body["metadata"]["uid"]]:
        current = await _fresh(runtime, body) or dict(body)
        status = RolloutStatus.from_dict(current.get("status"))
        result = None
        if status.phase in ACTIVE_PHASES:
            result = await reconcile(runtime, current, time.time(), abort=True)
            status = result.status
    for event in result.events if result else []:
        events.post(body, event)
    if status.phase in ACTIVE_PHASES:
        raise kopf.TemporaryError(f"reverting before deletion: {status.message}", delay=runtime.settings.tick)
    runtime.locks.pop(body["metadata"]["uid"], None)
    runtime.metrics.forget(body["metadata"]["namespace"], body["metadata"]["name"])
    try:
        spec = parse_spec(current.get("spec") or {})
    except SpecError:
        return
    if status.phase != "Promoted":
        try:
            await router_for(spec.traffic_routing, runtime.kube, body["metadata"]["namespace"]).finalize()
        except RouteError as e:
            events.post(body, Event(e.reason, f"on deletion: {e.message}", "Warning"))
