"""An asynchronous load generator for OpenAI-compatible servers (httpx, SSE streaming).

Each request streams `/v1/completions` (or `/v1/chat/completions`) and records, on the client's
own clock, when it was sent, when its first token arrived, when its last token arrived and when
the stream ended. From those:

- TTFT: first token minus sent;
- TPOT: (last token minus first token) / (output tokens - 1), the time per output token after the
  first, as vLLM's `benchmark_serving` defines it;
- latency: end of the stream minus sent;
- output tokens: the server's `usage.completion_tokens` when it sends one, else the number of
  token chunks.

`LoadGenerator.run` is closed-loop: at most `concurrency` requests in flight, the next one sent as
soon as one finishes. `LoadGenerator.run_until` keeps the same pressure up, cycling over its
requests, until an event is set (background load while something else is measured).
`LoadGenerator.run_at_rate` is open-loop: a fixed request rate, whatever the server's speed.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class Request:
    """One completion request. `extra` is merged into the JSON body (e.g. `user`, `priority`, `stop`);
    `headers` go with it (a gateway's tenant header, say)."""

    prompt: str
    max_tokens: int = 64
    temperature: float = 0.0
    ignore_eos: bool = True
    chat: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                                "ignore_eos": self.ignore_eos, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return {**body, **self.extra}


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times are `time.perf_counter()` seconds."""

    index: int
    sent_at: float
    done_at: float = math.nan
    first_token_at: float | None = None
    last_token_at: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    status: int = 0                     # HTTP status; 0 when the connection itself failed
    error: str | None = None
    finish_reason: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        if self.first_token_at is None or self.last_token_at is None or self.output_tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (self.output_tokens - 1)

    @property
    def latency(self) -> float:
        return self.done_at - self.sent_at


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default); NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    rank = (len(xs) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True, slots=True)
class Summary:
    """Aggregates of one run; latencies in seconds, NaN where no request measured them."""

    requests: int
    errors: int
    output_tokens: int
    prompt_tokens: int
    duration_s: float
    output_tok_s: float
    requests_per_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    latency_p50: float
    latency_p99: float
    latency_mean: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(slots=True)
class LoadReport:
    """Every request's result and the wall-clock span of the run."""

    results: list[RequestResult]
    started_at: float
    finished_at: float
    concurrency: int            # 0 for an open-loop (fixed-rate) run

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def errors(self) -> list[RequestResult]:
        return [r for r in self.results if not r.ok]

    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.ok if r.ttft is not None]

    def tpots(self) -> list[float]:
        return [r.tpot for r in self.ok if r.tpot is not None]

    def latencies(self) -> list[float]:
        return [r.latency for r in self.ok]

    def summary(self) -> Summary:
        """Output tok/s counts the tokens of successful requests over the whole run's wall time."""
        duration = self.finished_at - self.started_at
        ok = self.ok
        tokens = sum(r.output_tokens for r in ok)
        ttft, tpot, lat = self.ttfts(), self.tpots(), self.latencies()
        return Summary(
            requests=len(self.results), errors=len(self.results) - len(ok), output_tokens=tokens,
            prompt_tokens=sum(r.prompt_tokens or 0 for r in ok), duration_s=duration,
            output_tok_s=tokens / duration if duration > 0 else math.nan,
            requests_per_s=len(ok) / duration if duration > 0 else math.nan,
            ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
            tpot_p50=percentile(tpot, 50), tpot_p99=percentile(tpot, 99),
            latency_p50=percentile(lat, 50), latency_p99=percentile(lat, 99),
            latency_mean=sum(lat) / len(lat) if lat else math.nan)


OnResult = Callable[[RequestResult], None]


class LoadGenerator:
    """Streams completions from one OpenAI-compatible server. Use as `async with LoadGenerator(url) as gen`.

    `model=None` asks the server's `/v1/models` for the first model it serves.
    """

    def __init__(self, base_url: str, model: str | None = None, *, timeout: float = 600.0,
                 headers: Mapping[str, str] | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=dict(headers or {}),
                                         timeout=httpx.Timeout(timeout, connect=10.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def __aenter__(self) -> "LoadGenerator":
        if self.model is None:
            self.model = await self.model_name()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def model_name(self) -> str:
        resp = await self._client.get("/v1/models")
        resp.raise_for_status()
        data = resp.json().get("data") or []
        if not data:
            raise RuntimeError(f"{self.base_url}/v1/models lists no model")
        return data[0]["id"]

    async def complete(self, request: Request, index: int = 0) -> RequestResult:
        """Send one streaming request and measure it; failures are recorded, never raised."""
        if self.model is None:
            self.model = await self.model_name()
        path = "/v1/chat/completions" if request.chat else "/v1/completions"
        result = RequestResult(index=index, sent_at=time.perf_counter())
        try:
            async with self._client.stream("POST", path, json=request.body(self.model),
                                           headers=dict(request.headers) or None) as resp:
                result.status = resp.status_code
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    result.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                else:
                    await _read_stream(resp, result)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:   # an event that is not JSON
            result.error = f"malformed stream event: {exc}"
        result.done_at = time.perf_counter()
        return result

    async def run(self, requests: Sequence[Request], concurrency: int,
                  on_result: OnResult | None = None) -> LoadReport:
        """Send every request once, keeping at most `concurrency` in flight."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        todo = iter(enumerate(requests))
        return await self._drive(todo, concurrency, on_result, None)

    async def run_until(self, stop: asyncio.Event, requests: Sequence[Request], concurrency: int,
                        on_result: OnResult | None = None) -> LoadReport:
        """Cycle over `requests` with `concurrency` in flight until `stop` is set; in-flight ones finish."""
        if not requests:
            raise ValueError("run_until needs at least one request to cycle over")
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        todo = zip(itertools.count(), itertools.cycle(requests))
        return await self._drive(todo, concurrency, on_result, stop)

    async def run_at_rate(self, stop: asyncio.Event, requests: Sequence[Request], rate: float, *,
                          poisson: bool = False, seed: int = 0, on_result: OnResult | None = None) -> LoadReport:
        """Open loop: send `rate` requests per second, cycling over `requests`, until `stop` is set.

        Arrivals are evenly spaced, or exponentially spaced (a Poisson process) with `poisson`; a
        slow server does not slow the arrivals down. Requests in flight when `stop` is set finish.
        """
        if not requests:
            raise ValueError("run_at_rate needs at least one request to cycle over")
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        rng = random.Random(seed)
        results: list[RequestResult] = []
        tasks: set[asyncio.Task] = set()

        async def one(index: int, request: Request) -> None:
            result = await self.complete(request, index)
            results.append(result)
            if on_result is not None:
                on_result(result)

        started = time.perf_counter()
        due = started
        for index, request in zip(itertools.count(), itertools.cycle(requests)):
            task = asyncio.create_task(one(index, request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            due += rng.expovariate(rate) if poisson else 1.0 / rate
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, due - time.perf_counter()))
            if stop.is_set():
                break
        if tasks:
            await asyncio.gather(*tasks)
        results.sort(key=lambda r: r.index)
        return LoadReport(results, started, time.perf_counter(), concurrency=0)

    async def _drive(self, todo, concurrency: int, on_result: OnResult | None,
                     stop: asyncio.Event | None) -> LoadReport:
        results: list[RequestResult] = []

        async def worker() -> None:
            # one shared iterator: workers take the next request as soon as theirs finishes
            for index, request in todo:
                if stop is not None and stop.is_set():
                    return
                result = await self.complete(request, index)
                results.append(result)
                if on_result is not None:
                    on_result(result)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        finished = time.perf_counter()
        results.sort(key=lambda r: r.index)
        return LoadReport(results, started, finished, concurrency)


async def _read_stream(resp: httpx.Response, result: RequestResult) -> None:
    chunks = 0
    parts: list[str] = []
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            result.error = _error_message(json.dumps(event))
            break
        now = time.perf_counter()
        for choice in event.get("choices") or []:
            # the server sends a choice chunk only when a token arrived (its text may still be
            # empty while a multi-byte character is incomplete)
            chunks += 1
            if result.first_token_at is None:
                result.first_token_at = now
            result.last_token_at = now
            parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            result.finish_reason = choice.get("finish_reason") or result.finish_reason
        usage = event.get("usage")
        if usage:
            result.output_tokens = int(usage.get("completion_tokens", 0))
            result.prompt_tokens = usage.get("prompt_tokens")
    if not result.output_tokens:
        result.output_tokens = chunks
    result.text = "".join(parts)
    if result.error is None and result.first_token_at is None:
        result.error = "the stream ended without a token"


def _error_message(body: str) -> str:
    try:
        err = json.loads(body).get("error")
    except (json.JSONDecodeError, AttributeError):
        return body[:200]
    if isinstance(err, dict):
        return str(err.get("message", err))[:200]
    return str(err)[:200]
