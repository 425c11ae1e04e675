"""Pod ratio: the Service spreads requests over all pods, so the share of canary pods is the weight.

Nothing to route: the state machine sets the weight by choosing how many pods run the patch.
"""
from __future__ import annotations


class PodRatioRouter:
    async def get_weight(self) -> int | None:
        return None

    async def set_weight(self, weight: int) -> None:
        return None

    async def finalize(self) -> None:
        return None
