"""One OpenAI-compatible endpoint as an evaluation sees it: greedy completions, and what went wrong.

An endpoint that cannot be reached (nothing listening, no route, a name that does not resolve) is
`Unreachable`: the evaluation cannot say anything and stops. A request the endpoint refuses (4xx
other than 429) is `Refused`: the evaluation asked wrongly (a prompt too long for the model, an
unknown model) and stops too. A 5xx, a dropped connection or a timeout is the engine failing that
one question: `complete` answers None and the caller counts it as an error and a wrong answer.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

MAX_RETRIES_429 = 20          # a full queue is waited out (its Retry-After), not counted as wrong


class Unreachable(Exception):
    """The endpoint does not answer at all."""


class Refused(Exception):
    """The endpoint refused a request as malformed (4xx): the evaluation's mistake, not the engine's."""


def base_url(url: str) -> str:
    """`http://host:port`, `http://host:port/` and `http://host:port/v1` all name the same API."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _reason(e: httpx.HTTPError) -> str:
    return str(e) or type(e).__name__


def _retry_after(reply: httpx.Response) -> float:
    try:
        return min(max(float(reply.headers.get("retry-after") or 1), 0.1), 30)
    except ValueError:       # an HTTP date: wait a second and ask again
        return 1.0


@dataclass
class Endpoint:
    url: str
    model: str
    client: httpx.AsyncClient

    @classmethod
    async def open(cls, client: httpx.AsyncClient, url: str) -> "Endpoint":
        """The endpoint at `url` and the model it serves (the first of `GET /v1/models`)."""
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL:
            parsed = None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
            raise Refused(f"{url!r} is not an http:// or https:// URL with a host")
        url = base_url(url)
        try:
            reply = await client.get(f"{url}/v1/models", timeout=30)
        except (httpx.TransportError, httpx.InvalidURL) as e:
            raise Unreachable(f"{url} is unreachable: {_reason(e)}") from None
        if reply.status_code != 200:
            raise Unreachable(f"{url}/v1/models answered {reply.status_code}: {reply.text[:200]}")
        try:
            model = reply.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise Unreachable(f"{url}/v1/models lists no model: {reply.text[:200]}") from None
        return cls(url, model, client)

    async def complete(self, prompt: str, max_tokens: int, stop: list[str], timeout: float) -> str | None:
        """The greedy (temperature 0) completion of `prompt`, or None when the engine failed it."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stop": stop}
        for _ in range(MAX_RETRIES_429 + 1):
            try:
                reply = await self.client.post(f"{self.url}/v1/completions", json=body, timeout=timeout)
            except httpx.ConnectError as e:
                raise Unreachable(f"{self.url} is unreachable: {_reason(e)}") from None
            except httpx.TransportError:
                return None          # a timeout or a connection the engine dropped: its failure
            if reply.status_code == 429:
                await asyncio.sleep(_retry_after(reply))
                continue
            if reply.status_code >= 500:
                return None
            if reply.status_code != 200:
                raise Refused(f"{self.url}/v1/completions refused a question with {reply.status_code}: "
                              f"{reply.text[:300]}")
            try:
                return reply.json()["choices"][0]["text"]
            except (ValueError, KeyError, IndexError, TypeError):
                return None
        return None
