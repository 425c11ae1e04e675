"""Gateway API: an HTTPRoute's backendRefs weights split traffic between two Services.

The stable Service selects `graft.dev/track: stable` pods, the canary Service `graft.dev/track:
canary` ones. Every rule of the route that references both Services gets weights (100 - w, w).
A missing route, or a route with no rule naming both Services, is reported, never guessed at.
"""
from __future__ import annotations

import copy
from typing import Any

from graft.api import Reason
from graft.operator.kube import Kube, KubeError, httproute_path
from graft.operator.routers import RouteError
from graft.rollout.spec import TrafficRouting


class GatewayAPIRouter:
    def __init__(self, kube: Kube, namespace: str, routing: TrafficRouting):
        self.kube, self.namespace = kube, namespace
        self.route, self.stable, self.canary = routing.http_route, routing.stable_service, routing.canary_service

    @property
    def where(self) -> str:
        return f"HTTPRoute {self.namespace}/{self.route}"

    async def _get(self) -> dict[str, Any]:
        route = await self.kube.get(httproute_path(self.namespace, self.route))
        if route is None:
            raise RouteError(Reason.HTTP_ROUTE_MISSING, f"{self.where} not found")
        return route

    def _rules(self, route: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(stable ref, canary ref) of each rule naming both Services."""
        pairs = []
        for rule in (route.get("spec") or {}).get("rules") or []:
            refs = {r.get("name"): r for r in rule.get("backendRefs") or [] if r.get("kind", "Service") == "Service"}
            if self.stable in refs and self.canary in refs:
                pairs.append((refs[self.stable], refs[self.canary]))
        if not pairs:
            raise RouteError(Reason.BACKEND_REFS_MISSING, f"{self.where} has no rule with backendRefs to both "
                                                   f"Service {self.stable} and Service {self.canary}")
        return pairs

    async def get_weight(self) -> int | None:
        pairs = self._rules(await self._get())
        weights = set()
        for stable, canary in pairs:
            s, c = int(stable.get("weight", 1)), int(canary.get("weight", 1))
            weights.add(round(100 * c / (s + c)) if s + c else 0)
        # rules that disagree are not at any one weight: report the highest, the setter evens them out
        return max(weights)

    async def set_weight(self, weight: int) -> None:
        if not 0 <= weight <= 100:
            raise ValueError(f"weight must be 0..100, got {weight}")
        route = await self._get()
        rules = copy.deepcopy((route.get("spec") or {}).get("rules") or [])
        self._rules({"spec": {"rules": rules}})
        for rule in rules:
            for ref in rule.get("backendRefs") or []:
                if ref.get("name") == self.stable:
                    ref["weight"] = 100 - weight
                elif ref.get("name") == self.canary:
                    ref["weight"] = weight
        body = {"metadata": {"resourceVersion": route["metadata"].get("resourceVersion")}, "spec": {"rules": rules}}
        try:
            await self.kube.merge_patch(httproute_path(self.namespace, self.route), body)
        except KubeError as e:
            raise RouteError(Reason.HTTP_ROUTE_UPDATE_FAILED, f"{self.where}: {e.message}") from None

    async def finalize(self) -> None:
        try:
            await self.set_weight(0)
        except RouteError as e:
            if e.reason != Reason.HTTP_ROUTE_MISSING:
                raise
