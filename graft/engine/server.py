"""The OpenAI-compatible HTTP front of the engine (FastAPI), plus health, readiness and metrics.

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
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2.exceptions import TemplateError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from graft.engine.engine import SHUTDOWN, EngineDraining, InvalidPrompt, LLMEngine, RequestHandle
from graft.engine.protocol import (ChatCompletionRequest, CompletionRequest, error_body, new_id, now,
                                   usage)
from graft.engine.scheduler import QueueFull
from graft.engine.sequence import FinishReason, InvalidParam, SamplingParams, TokenLogprobs
from graft.engine.tokenizer import IncrementalDetokenizer, Tokenizer, _bytes_to_unicode

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


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
           404: "unknown model", 429: "too many requests are waiting; see Retry-After",
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

    def __init__(self, engine: LLMEngine, handle: RequestHandle, params: SamplingParams):
        self.engine, self.handle, self.params = engine, handle, params
        self.detok = IncrementalDetokenizer(engine.tokenizer)
        self.completion_tokens = 0

    async def __aiter__(self) -> AsyncIterator[Chunk]:
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

    def __init__(self, engine: LLMEngine, model_name: str, spell: TokenSpelling):
        self.engine, self.model_name, self.spell = engine, model_name, spell
        self.tokenizer = engine.tokenizer

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

    def admit(self, prompt_ids: list[int], req: CompletionRequest | ChatCompletionRequest
              ) -> tuple[RequestHandle, SamplingParams]:
        engine = self.engine
        try:
            params = req.sampling_params(DEFAULT_MAX_TOKENS)
            return engine.submit(prompt_ids, params, priority=req.priority, tenant=req.user or ""), params
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
        handle, params = self.admit(prompt_ids, req)
        stream = TextStream(self.engine, handle, params)
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
            if any(not 0 <= t < vocab for t in req.prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = list(req.prompt)
        else:
            prompt_ids = await self.tokenize(lambda: self.tokenizer.encode(req.prompt), "prompt")
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

        def render() -> list[int]:
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
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


def build_app(engine: LLMEngine, model_name: str) -> FastAPI:
    """The inference app: /v1/*, /health, /ready, /metrics. Routes only: the serving classes answer."""
    app = FastAPI(title="graft engine", docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    app.openapi = _openapi_saying_400(app)
    spell = TokenSpelling(engine.tokenizer)
    completion = OpenAIServingCompletion(engine, model_name, spell)
    chat = OpenAIServingChat(engine, model_name, spell)
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
        return {"status": "ok", "revision": engine.revision}

    @app.get("/ready")
    async def ready() -> Response:
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        why = engine.health()
        if why is not None:
            return JSONResponse({"status": "unhealthy", "reason": why}, status_code=503)
        why = engine.not_ready()
        if why is not None:
            return JSONResponse({"status": "awaiting-patches", "reason": why, "revision": engine.revision,
                                 "awaiting": list(engine.awaiting)}, status_code=503)
        return JSONResponse({"status": "ready", "revision": engine.revision})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
