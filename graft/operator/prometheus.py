"""The Prometheus metrics provider: runs a rollout's check queries, off the event loop, with timeouts.

A query that cannot be answered (Prometheus unreachable, a bad query, a timeout, several series
where one number is needed) becomes a Measurement with `error` set: the check's verdict is Error,
which holds the rollout and never promotes it.
"""
from __future__ import annotations

import asyncio
import math

from prometheus_api_client import PrometheusConnect
from urllib3.util.retry import Retry

from graft.rollout.observation import Measurement
from graft.rollout.queries import MetricQuery


class ProviderError(Exception):
    pass


class PrometheusProvider:
    def __init__(self, address: str, timeout: float = 5.0):
        self.address, self.timeout = address, timeout
        # no retries inside a query: the next analysis run is the retry, and a refusal shows at once
        self._client = PrometheusConnect(url=address, disable_ssl=True, timeout=timeout, retry=Retry(total=0))

    def _query_sync(self, promql: str) -> float | None:
        try:
            result = self._client.custom_query(promql, params={"timeout": f"{self.timeout:g}s"})
        except Exception as e:   # the client raises requests', urllib3's and its own errors
            raise ProviderError(f"{type(e).__name__}: {e}") from None
        if isinstance(result, list):
            if not result:
                return None
            if len(result) > 1:
                raise ProviderError(f"the query returned {len(result)} series; a check needs one number")
            raw = result[0]["value"][1]
        else:   # scalar: [time, "value"]
            raw = result[1]
        value = float(raw)
        return None if math.isnan(value) else value

    async def query(self, promql: str) -> float | None:
        """One number, or None when the query has no data."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._query_sync, promql), self.timeout + 1)
        except TimeoutError:
            raise ProviderError(f"Prometheus at {self.address} did not answer within {self.timeout:g}s") from None

    async def measure(self, queries: list[MetricQuery]) -> list[Measurement]:
        return list(await asyncio.gather(*(self._measure(q) for q in queries)))

    async def _measure(self, q: MetricQuery) -> Measurement:
        try:
            value, requests, stable = await asyncio.gather(
                self.query(q.value),
                self.query(q.requests) if q.requests else _none(),
                self.query(q.stable_requests) if q.stable_requests else _none())
        except ProviderError as e:
            return Measurement(q.name, error=str(e))
        return Measurement(q.name, value,
                           None if q.requests is None else (requests or 0.0),
                           None if q.stable_requests is None else (stable or 0.0))


async def _none() -> None:
    return None
