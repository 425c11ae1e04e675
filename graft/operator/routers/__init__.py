"""Traffic routers: one file per way of splitting traffic, behind one small interface.

`get_weight()` is the canary's current share in percent, or None when the router has no weight of
its own (pod ratio: the share of canary pods is the weight); `set_weight(w)` sends w percent to
the canary; `finalize()` sends everything back to stable when a rollout goes away. Each raises
RouteError saying what is missing when the router cannot do its job.
"""
from __future__ import annotations

from typing import Protocol

from graft.operator.kube import Kube
from graft.rollout.spec import TrafficRouting


class RouteError(Exception):
    """The router cannot do its job; `reason` is the event reason, the message says what is missing."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


class Router(Protocol):
    async def get_weight(self) -> int | None: ...
    async def set_weight(self, weight: int) -> None: ...
    async def finalize(self) -> None: ...


def router_for(routing: TrafficRouting, kube: Kube, namespace: str) -> Router:
    """The router a rollout's `spec.trafficRouting` asks for."""
    if routing.kind == "gatewayAPI":
        from graft.operator.routers.gatewayapi import GatewayAPIRouter
        return GatewayAPIRouter(kube, namespace, routing)
    from graft.operator.routers.podratio import PodRatioRouter
    return PodRatioRouter()
