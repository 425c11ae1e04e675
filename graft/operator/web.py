"""The web metric provider: a check's number from any HTTP service that answers JSON.

A check with `web: {url, method, body, headers, jsonPath, timeout}` is asked once per analysis run:
the URL and body with their placeholders filled (graft.rollout.queries.render_web), the headers with
their values (a `valueFrom.secretKeyRef` read from the rollout's namespace), TLS always verified.
The answer is judged as a custom query's: a number against min/max.

What can go wrong is said as Prometheus' failures are (`ProviderError` kinds, graft.operator.prometheus):
unreachable, a timeout or a 5xx is an outage (the step holds and goes on by itself); a refusal
(4xx), a body that is not JSON, or something at the path that is not a number is an error (it counts
towards `errorLimit`); nothing at the path is no data. A boolean counts as 1 or 0.

The path is a small, safe subset of JSONPath: `$` then `.name`, `['name']` or `[index]` steps
(`json_path`); nothing is evaluated.

Which services a rollout may name is the cluster administrator's choice, as for Prometheus: a URL
must lie under one of `GRAFT_WEB_ALLOWED` (`address_allowed`), else the rollout fails with
WebNotAllowed before anything is sent.
"""
from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import httpx

from graft.operator.prometheus import HTTP, PARSE, TRANSPORT, ProviderError, address_allowed
from graft.rollout.observation import Measurement
from graft.rollout.queries import Series

_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\[([0-9]{1,6})\]|\['([^'\\]{1,256})'\]")
MAX_ANSWER = 1 << 20        # bytes of JSON a web check's answer may have


class _Missing:
    """Nothing at the path."""


MISSING = _Missing()


def json_path(doc: Any, path: str) -> Any:
    """What `path` ($, then .name, ['name'] or [index] steps) finds in `doc`; MISSING for nothing.
    ValueError for a path outside the subset."""
    node = doc
    for name, index, quoted in _steps(path):
        if index is not None:
            i = int(index)
            if not isinstance(node, list) or i >= len(node):
                return MISSING
            node = node[i]
        else:
            key = name if name is not None else quoted
            if not isinstance(node, dict) or key not in node:
                return MISSING
            node = node[key]
    return node


def _steps(path: str) -> list[tuple[str | None, str | None, str | None]]:
    """The whole path read before anything is looked up: a bad step anywhere is a ValueError."""
    if not path.startswith("$"):
        raise ValueError(f"{path!r} does not start with $")
    at, steps = 1, []
    while at < len(path):
        m = _STEP.match(path, at)
        if m is None:
            raise ValueError(f"{path!r}: cannot read a step at {path[at:]!r}")
        steps.append(m.groups())
        at = m.end()
    return steps


def allowed_url(url: str, allowed: list[str]) -> bool:
    """Whether a web check may ask `url`: its address without the query lies under one of `allowed`."""
    return address_allowed(url.split("#", 1)[0].split("?", 1)[0], allowed)


def number_at(doc: Any, path: str, where: str) -> float | None:
    """The number at `path` in `doc`: None for nothing there (no data); ProviderError for a non-number."""
    value = json_path(doc, path)
    if value is MISSING or value is None:
        return None
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ProviderError(PARSE, f"{where} has {value[:40]!r} at {path}, not a number") from None
    else:
        raise ProviderError(PARSE, f"{where} has a JSON {type(value).__name__} at {path}, not a number")
    if math.isinf(number):
        raise ProviderError(PARSE, f"{where} has {value!r} at {path}, not a finite number")
    return number


class WebProvider:
    """Asks each web check's service; one HTTP client for them all (TLS verified by the system's CAs)."""

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None):
        self._client = httpx.AsyncClient(transport=transport, follow_redirects=False)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def number(self, web: Any, headers: dict[str, str]) -> float | None:
        """The number the service answers at the check's path (None: no data)."""
        where = f"{web.method} {web.url}"
        try:
            r = await self._client.request(
                web.method, web.url, headers={"Accept": "application/json", **headers},
                content=None if web.body is None else web.body.encode(),
                timeout=httpx.Timeout(web.timeout))
        except httpx.TimeoutException:
            raise ProviderError(TRANSPORT, f"{where} did not answer within {web.timeout:g}s") from None
        except httpx.HTTPError as e:
            raise ProviderError(TRANSPORT, f"{where} is unreachable: {type(e).__name__}: {e}") from None
        if r.status_code >= 500:
            raise ProviderError(HTTP, f"{where} answered HTTP {r.status_code}", outage=True)
        if r.status_code >= 300:
            raise ProviderError(HTTP, f"{where} answered HTTP {r.status_code}")
        if len(r.content) > MAX_ANSWER:
            raise ProviderError(PARSE, f"{where} answered {len(r.content)} bytes, more than {MAX_ANSWER}")
        try:
            doc = r.json()
        except ValueError:
            raise ProviderError(PARSE, f"{where} answered HTTP {r.status_code} without JSON") from None
        return number_at(doc, web.json_path, where)

    async def measure(self, key: str, series: list[Series], headers: list[dict[str, str]]) -> Measurement:
        """A check's Measurement: each of its web series asked (with its headers), errors as data."""
        try:
            values = await asyncio.gather(*(self.number(s.web, h) for s, h in zip(series, headers)))
        except ProviderError as e:
            return Measurement(key, error=str(e), outage=e.outage)
        return Measurement(key, {s.key: v for s, v in zip(series, values)})
