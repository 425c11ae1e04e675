"""The OpenAI-compatible HTTP front of the engine (FastAPI), plus health and readiness; and the
metrics app, which answers /metrics on a port of its own (`build_metrics_app`).

Every error is an OpenAI-style JSON body `{"error": {"message", "type", "param", "code"}}`: 400 for
anything wrong with the request (including what FastAPI would answer 422; the OpenAPI schema says
400 too), 404 for an unknown model, 429 when the queue is full, 500 when this request alone failed
inside the engine, 503 while shutting down. A stream that fails after its first byte ends with an
SSE error event and `[DONE]`.

`build_app` holds the routes and nothing else; the serving classes answer them, as vLLM's
OpenAIServing classes do: `OpenAIServingCompletion`, `OpenAIServingChat` (both on the shared
`OpenAIServing`: model check, admission, streamed or whole answers) and `OpenAIServingModels`. A
refusal names its field because the error says which (`InvalidParam`, `InvalidPrompt`: `param`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2.exceptions import TemplateError
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from graft.engine.engine import SHUTDOWN, EngineDraining, InvalidPrompt, LLMEngine, RequestHandle
from graft.engine.options import PublicLimitSettings
from graft.engine.protocol import (PRIORITY_MAX, PRIORITY_MIN, ChatCompletionRequest, CompletionRequest,
                                   error_body, new_id, now, usage)
from graft.engine.scheduler import QueueFull
from graft.engine.sequence import FinishReason, InvalidParam, SamplingParams, TokenLogprobs
from graft.engine.tokenizer import IncrementalDetokenizer, Tokenizer, _bytes_to_unicode

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
# A token of these vocabularies spells at most a few dozen characters; a text prompt longer than
# this many characters per context token cannot fit and is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 32


class PublicLimits(PublicLimitSettings):
    """What a client of the public port may ask, and which of its claims the server believes.

    - `max_request_bytes`: larger bodies are answered 413 before they are parsed (the body is
      counted as it arrives, so a chunked upload is cut off at the limit too);
    - `request_timeout`: seconds from admission after which the engine ends a request itself
      (504, or an error event in a stream; status `timeout`): a hung patch shows as the engine's
      failures, while a client that hangs up (`abandoned`) is its own business;
    - `client_priority_band`: a body's `priority` is clamped into [-band, +band] (0: ignored), so no
      client can jump the queue by more than `band` ageing periods;
    - `priority_header`: a header a gateway sets (say `x-graft-priority`), believed in the full range
      and preferred to the body's field; off unless named, since a client could set it too where no
      gateway overwrites it;
    - `tenant_header`: the fairness key from a gateway's header; without one the key is the peer
      address of the connection, never the body's `user` (a client could take a fresh `user` per
      request and win every tie). Behind a gateway every request has the gateway's address: name
      its header.

    The fields, their defaults and checks are graft.engine.options' `PublicLimitSettings` (the flags
    of `graft serve` are made from them); this class adds how the server applies them.
    """

    @classmethod
    def of(cls, settings: PublicLimitSettings) -> "PublicLimits":
        """The limits `settings` (ServeOptions.public) describe."""
        if isinstance(settings, cls):
            return settings
        return cls(**{f.name: getattr(settings, f.name) for f in fields(PublicLimitSettings)})


    def priority(self, request: Request, asked: int) -> int:
        if self.priority_header:
            raw = request.headers.get(self.priority_header)
            if raw is not None:
                try:
                    value = int(raw.strip())
                except ValueError:
                    raise ApiError(400, f"header {self.priority_header}: must be an integer", param="priority") from None
                if not PRIORITY_MIN <= value <= PRIORITY_MAX:
                    raise ApiError(400, f"header {self.priority_header}: out of range", param="priority")
                return value
        band = self.client_priority_band
        return min(band, max(-band, asked))

    def tenant(self, request: Request) -> str:
        if self.tenant_header:
            raw = request.headers.get(self.tenant_header)
            if raw:
                return raw[:256]
        return request.client.host if request.client else ""


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before anything parses it.

    A declared Content-Length over the limit is refused at once; otherwise the body is read (at most
    `limit` bytes held) and handed on whole, and later `receive` calls (a client hang-up) pass through.
    """

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers") or []:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await self._refuse(send, 400, "the Content-Length header is not a number")
                if declared > self.limit:
                    return await self._too_large(send)
        chunks, size, tail = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                tail = message
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await self._too_large(send)
            chunks.append(body)
            if not message.get("more_body"):
                break
        first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first if tail is None else tail
            return await receive()
        await self.app(scope, replay, send)

    async def _too_large(self, send: Callable) -> None:
        await self._refuse(send, 413, f"the request body is larger than this server accepts ({self.limit} bytes)")

    @staticmethod
    async def _refuse(send: Callable, status: int, message: str) -> None:
        body = json.dumps(error_body(message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_ERRORS = {400: "the request is malformed or a field is out of range; `param` names the field",
           404: "unknown model", 413: "the request body is larger than the server accepts", 429: "too many requests are waiting; see Retry-After",
           500: "this request failed inside the engine", 503: "the server is shutting down"}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in _ERRORS.items()}

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "any"}


def _param(loc: tuple) -> str | None:
    """`messages[0].content` for pydantic's ('body', 'messages', 0, 'content'); union tags dropped."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


def _error_event(exc: ApiError) -> str:
    return _sse(exc.body())


def engine_error(message: str, code: str | None) -> ApiError:
    if code == SHUTDOWN:
        return ApiError(503, message, "server_error", code=code, headers={"Retry-After": "1"})
    return ApiError(500, message, "server_error", code=code)


class TokenSpelling:
    """How logprobs spell a token: its exact bytes, and its text (`bytes:\\xNN` when not UTF-8 alone)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "".join(f"bytes:\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, list(raw))
        return hit

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.backend.id_to_token(token_id)
        if piece is not None and all(c in self._byte_of for c in piece):  # byte-level BPE
            return bytes(self._byte_of[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


@dataclass(slots=True)
class Chunk:
    text: str
    finish_reason: str | None = None
    logprobs: list[tuple[TokenLogprobs, int]] = field(default_factory=list)  # with each token's text offset


class TextStream:
    """Token events of one request turned into text pieces, with stop strings applied.

    Text that might be the start of a stop string is held back until it is known not to be. Any
    failure here (detokenising, stop strings) ends this request alone with an ApiError.
    """

    def __init__(self, engine: LLMEngine, handle: RequestHandle, params: SamplingParams,
                 timeout: float | None = None):
        self.engine, self.handle, self.params, self.timeout = engine, handle, params, timeout
        self.detok = IncrementalDetokenizer(engine.tokenizer)
        self.completion_tokens = 0

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        # one timer per request, not a wait per token: at the deadline the engine ends the request
        # with TIMEOUT, and its last event says so
        timer = (asyncio.get_running_loop().call_later(self.timeout, self.handle.close, FinishReason.TIMEOUT)
                 if self.timeout else None)
        try:
            async for chunk in self._chunks():
                yield chunk
        except ApiError:
            raise
        except Exception:
            log.exception("turning tokens into text failed for request %d", self.handle.seq_id)
            self.handle.close(FinishReason.ERROR)
            raise ApiError(500, "internal error while detokenizing", "server_error") from None
        finally:
            if timer is not None:
                timer.cancel()
            self.handle.close()

    async def _chunks(self) -> AsyncIterator[Chunk]:
        stops = self.params.stop
        hold = max((len(s) for s in stops), default=1) - 1
        text, emitted = "", 0
        pending: list[tuple[TokenLogprobs, int]] = []
        async for ev in self.handle.events():
            if ev.error:
                raise engine_error(ev.error, ev.code)
            if ev.token_id is not None:
                self.completion_tokens += 1
                if not (ev.finish_reason is FinishReason.STOP and ev.token_id in self.engine.eos_ids):
                    if ev.logprobs is not None:
                        pending.append((ev.logprobs, len(text)))
                    text += self.detok.push(ev.token_id)
            if stops:
                cut = min((i for i in (text.find(s, max(0, emitted - hold)) for s in stops) if i >= 0),
                          default=-1)
                if cut >= 0:
                    self.handle.close(FinishReason.STOP)
                    yield Chunk(text[emitted:cut], "stop", [p for p in pending if p[1] < cut])
                    return
            if ev.finish_reason is FinishReason.TIMEOUT:
                raise ApiError(504, f"the request ran past the server's request timeout ({self.timeout:g} s)",
                               "server_error", code="request_timeout")
            if ev.finished:
                reason = ev.finish_reason.value if ev.finish_reason else "stop"
                yield Chunk(text[emitted:], reason, pending)
                return
            safe = len(text) - hold
            if safe > emitted:
                yield Chunk(text[emitted:safe], None, pending)
                emitted, pending = safe, []


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Formatter:
    """The OpenAI shapes of one response: chat or legacy completion, whole or streamed."""

    def __init__(self, chat: bool, model: str, spell: TokenSpelling):
        self.chat, self.model, self.spell = chat, model, spell
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.object = "chat.completion" if chat else "text_completion"
        self.created = now()

    def envelope(self, choices: list[dict], chunk: bool = False, **extra: Any) -> dict:
        obj = self.object + (".chunk" if self.chat and chunk else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def choice(self, text: str, finish: str | None, logprobs: list[tuple[TokenLogprobs, int]] | None,
               delta: bool) -> dict:
        lp = None if logprobs is None else (self._chat_logprobs if self.chat else self._completion_logprobs)(logprobs)
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        body = {"role": "assistant", "content": text}
        return {"index": 0, ("delta" if delta else "message"): body, "logprobs": lp, "finish_reason": finish}

    def _chat_logprobs(self, entries: list[tuple[TokenLogprobs, int]]) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            text, raw = self.spell(token_id)
            return {"token": text, "logprob": logprob, "bytes": raw}
        return {"content": [{**one(lp.token_id, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}
                            for lp, _ in entries], "refusal": None}

    def _completion_logprobs(self, entries: list[tuple[TokenLogprobs, int]]) -> dict:
        tops = []
        for lp, _ in entries:
            top = {self.spell(t)[0]: v for t, v in lp.top}
            top.setdefault(self.spell(lp.token_id)[0], lp.logprob)  # the sampled token is always listed
            tops.append(top)
        return {"tokens": [self.spell(lp.token_id)[0] for lp, _ in entries],
                "token_logprobs": [lp.logprob for lp, _ in entries],
                "top_logprobs": tops, "text_offset": [offset for _, offset in entries]}


class OpenAIServing:
    """What the generating endpoints share: the served model's name, admission into the engine,
    and the two ways of answering (an SSE stream, or one JSON body once the request is done)."""

    def __init__(self, engine: LLMEngine, model_name: str, spell: TokenSpelling, limits: PublicLimits | None = None):
        self.engine, self.model_name, self.spell = engine, model_name, spell
        self.tokenizer = engine.tokenizer
        self.limits = limits or PublicLimits()

    def check_length(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit in the context before spending time tokenizing it."""
        cap = self.engine.config.max_model_len * MAX_CHARS_PER_TOKEN
        if chars > cap:
            raise ApiError(400, f"{param}: {chars} characters cannot fit in the model's context of "
                                f"{self.engine.config.max_model_len} tokens", param=param)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           "invalid_request_error", "model", "model_not_found")

    async def tokenize(self, fn: Callable[[], list[int]], param: str) -> list[int]:
        """Run `fn` (tokenizing, templating) off the event loop; its refusals are 400s naming `param`."""
        try:
            return await asyncio.to_thread(fn)
        except (ValueError, TemplateError) as exc:
            raise ApiError(400, f"{param}: {exc}", param=param) from None

    def admit(self, request: Request, prompt_ids: list[int], req: CompletionRequest | ChatCompletionRequest
              ) -> tuple[RequestHandle, SamplingParams]:
        engine = self.engine
        priority, tenant = self.limits.priority(request, req.priority), self.limits.tenant(request)
        try:
            params = req.sampling_params(DEFAULT_MAX_TOKENS)
            return engine.submit(prompt_ids, params, priority=priority, tenant=tenant), params
        except QueueFull as exc:
            engine.metrics.requests.labels(engine.revision, "rejected").inc()
            raise ApiError(429, "the server is overloaded: too many requests are waiting", "rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        except EngineDraining as exc:
            engine.metrics.requests.labels(engine.revision, "rejected").inc()
            raise ApiError(503, str(exc), "server_error", code=SHUTDOWN, headers={"Retry-After": "1"}) from None
        except (InvalidParam, InvalidPrompt) as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

    async def respond(self, request: Request, req: CompletionRequest | ChatCompletionRequest,
                      prompt_ids: list[int], chat: bool) -> Response:
        handle, params = self.admit(request, prompt_ids, req)
        stream = TextStream(self.engine, handle, params, self.limits.request_timeout)
        fmt = Formatter(chat, self.model_name, self.spell)
        want_logprobs = params.logprobs is not None
        if req.stream:
            return _stream_response(stream, fmt, len(prompt_ids), req.include_usage, want_logprobs)
        return await _whole_response(request, stream, fmt, len(prompt_ids), want_logprobs)


class OpenAIServingCompletion(OpenAIServing):
    """`POST /v1/completions`: a prompt as text or token ids."""

    async def create_completion(self, request: Request, req: CompletionRequest) -> Response:
        self.check_model(req.model)
        vocab = self.tokenizer.vocab_size
        if isinstance(req.prompt, list):
            limit = self.engine.config.max_model_len
            if len(req.prompt) > limit:
                raise ApiError(400, f"prompt: {len(req.prompt)} tokens exceed the model's context of {limit}",
                               param="prompt")
            if any(not 0 <= t < vocab for t in req.prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = list(req.prompt)
        else:
            self.check_length(len(req.prompt), "prompt")
            prompt_ids = await self.tokenize(lambda: self.tokenizer.encode_text(req.prompt), "prompt")
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return await self.respond(request, req, prompt_ids, chat=False)


class OpenAIServingChat(OpenAIServing):
    """`POST /v1/chat/completions`: messages rendered through the model's chat template."""

    async def create_chat_completion(self, request: Request, req: ChatCompletionRequest) -> Response:
        self.check_model(req.model)
        messages = []
        for i, m in enumerate(req.messages):
            try:
                messages.append({"role": m.role, "content": m.text()})
            except ValueError as exc:
                raise ApiError(400, f"messages[{i}].content: {exc}", param=f"messages[{i}].content") from None
        self.check_length(sum(len(m["content"]) for m in messages), "messages")

        def render() -> list[int]:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        prompt_ids = await self.tokenize(render, "messages")
        return await self.respond(request, req, prompt_ids, chat=True)


class OpenAIServingModels:
    """`GET /v1/models`: the one model this server serves."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def list_models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "graft", "max_model_len": self.engine.config.max_model_len}]}


def _stream_response(stream: TextStream, fmt: Formatter, prompt_len: int, include_usage: bool,
                     want_logprobs: bool) -> StreamingResponse:
    extra = {"usage": None} if include_usage else {}

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in stream:
                lp = chunk.logprobs if want_logprobs else None
                yield _sse(fmt.envelope([fmt.choice(chunk.text, chunk.finish_reason, lp, True)],
                                        chunk=True, **extra))
            if include_usage:
                yield _sse(fmt.envelope([], chunk=True, usage=usage(prompt_len, stream.completion_tokens)))
        except ApiError as exc:
            yield _error_event(exc)
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _whole_response(request: Request, stream: TextStream, fmt: Formatter, prompt_len: int,
                          want_logprobs: bool) -> Response:
    async def collect() -> tuple[str, str, list]:
        parts, finish, logprobs = [], "stop", []
        async for chunk in stream:
            parts.append(chunk.text)
            logprobs.extend(chunk.logprobs)
            finish = chunk.finish_reason or finish
        return "".join(parts), finish, logprobs

    task = asyncio.ensure_future(collect())
    while True:  # a client that hangs up cancels its request and frees its blocks
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            break
        if await request.is_disconnected():
            task.cancel()
            stream.handle.close()
            return Response(status_code=499)
    text, finish, logprobs = task.result()
    return JSONResponse(fmt.envelope([fmt.choice(text, finish, logprobs if want_logprobs else None, False)],
                                     usage=usage(prompt_len, stream.completion_tokens)))


def _install_error_handlers(app: FastAPI) -> None:
    """Every error an OpenAI-style body; FastAPI's 422 for a malformed request becomes a 400 naming the field."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = _param(tuple(first.get("loc", ())))
        detail = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip()
            param = None
        elif first.get("type") == "extra_forbidden":
            msg = f"{param}: unknown field; this server does not implement it (remove it)"
        else:
            msg = f"{param}: {detail}" if param else detail
        return JSONResponse(error_body(msg, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "not_found_error" if exc.status_code == 404 else
                                       "invalid_request_error"), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error", exc_info=exc)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


def _openapi_saying_400(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI's schema, saying 400 where FastAPI would say 422: the server answers 400."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for item in schema.get("paths", {}).values():
                for operation in item.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema
    return openapi


def build_app(engine: LLMEngine, model_name: str, limits: PublicLimits | None = None, *,
              metrics: bool = False) -> FastAPI:
    """The inference app: /v1/*, /health, /ready (and /metrics with `metrics`, which
    `--metrics-port public` asks for). Routes only: the serving classes answer.

    Nothing here tells a client which patches the engine runs (a client that could tell canaries
    from stable pods could tilt their comparison): /health and /ready say only whether it serves;
    the revision is on the admin API and in the metrics, which `build_metrics_app` serves on a port
    of their own for Prometheus (without `metrics`, a GET of /metrics here is a 404).
    """
    limits = limits or PublicLimits()
    app = FastAPI(title="graft engine", docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=limits.max_request_bytes)
    app.openapi = _openapi_saying_400(app)
    spell = TokenSpelling(engine.tokenizer)
    completion = OpenAIServingCompletion(engine, model_name, spell, limits)
    chat = OpenAIServingChat(engine, model_name, spell, limits)
    served = OpenAIServingModels(engine, model_name)

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(request: Request, req: CompletionRequest) -> Response:
        return await completion.create_completion(request, req)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(request: Request, req: ChatCompletionRequest) -> Response:
        return await chat.create_chat_completion(request, req)

    @app.get("/v1/models")
    async def models() -> dict:
        return served.list_models()

    @app.get("/health", responses={503: ERROR_RESPONSES[503]})
    async def health() -> dict:
        why = engine.health()
        if why is not None:
            raise ApiError(503, why, "server_error")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        why = engine.health()
        if why is not None:
            return JSONResponse({"status": "unhealthy", "reason": why}, status_code=503)
        why = engine.not_ready()
        if why is not None:
            return JSONResponse({"status": "awaiting-patches"}, status_code=503)
        return JSONResponse({"status": "ready"})

    if metrics:
        @app.get("/metrics")
        async def exposition() -> Response:
            return metrics_response(engine)

    return app


METRICS_CONTENT_TYPE = "text/plain; version=0.0.4"


def metrics_response(engine: LLMEngine) -> Response:
    return PlainTextResponse(engine.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def build_metrics_app(engine: LLMEngine) -> Starlette:
    """/metrics alone, for the port Prometheus scrapes (`--metrics-port`, 9400 by default).

    Every series there carries the engine's `revision`, which tells canaries from stable pods, so
    it is kept off the public port: that port's clients are not the ones who may know. Anything
    else on this port is a 404.
    """
    async def exposition(request: Request) -> Response:
        return metrics_response(engine)

    return Starlette(routes=[Route("/metrics", exposition, methods=["GET"])])
