"""The OpenAI-compatible HTTP front of the engine (FastAPI), plus health, readiness and metrics."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from graft.engine.engine import EngineDraining, LLMEngine, RequestHandle
from graft.engine.protocol import (ChatCompletionRequest, CompletionRequest, error_body, new_id, now,
                                   usage)
from graft.engine.scheduler import QueueFull
from graft.engine.sequence import FinishReason, SamplingParams
from graft.engine.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


@dataclass(slots=True)
class Chunk:
    text: str
    finish_reason: str | None = None


class TextStream:
    """Token events of one request turned into text pieces, with stop strings applied.

    Text that might be the start of a stop string is held back until it is known not to be.
    """

    def __init__(self, engine: LLMEngine, handle: RequestHandle, params: SamplingParams):
        self.engine, self.handle, self.params = engine, handle, params
        self.detok = IncrementalDetokenizer(engine.tokenizer)
        self.completion_tokens = 0

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        stops = self.params.stop
        hold = max((len(s) for s in stops), default=1) - 1
        text, emitted = "", 0
        try:
            async for ev in self.handle.events():
                if ev.error:
                    raise ApiError(500, ev.error, "server_error")
                if ev.token_id is not None:
                    self.completion_tokens += 1
                    if not (ev.finish_reason is FinishReason.STOP and ev.token_id in self.engine.eos_ids):
                        text += self.detok.push(ev.token_id)
                if stops:
                    cut = min((i for i in (text.find(s, max(0, emitted - hold)) for s in stops) if i >= 0),
                              default=-1)
                    if cut >= 0:
                        self.handle.close(FinishReason.STOP)
                        yield Chunk(text[emitted:cut], "stop")
                        return
                if ev.finished:
                    reason = ev.finish_reason.value if ev.finish_reason else "stop"
                    yield Chunk(text[emitted:], reason)
                    return
                safe = len(text) - hold
                if safe > emitted:
                    yield Chunk(text[emitted:safe])
                    emitted = safe
        finally:
            self.handle.close()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def build_app(engine: LLMEngine, model_name: str) -> FastAPI:
    """The inference app: /v1/*, /health, /ready, /metrics."""
    app = FastAPI(title="graft engine", docs_url=None, redoc_url=None)
    tokenizer = engine.tokenizer

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip()
            loc = ""
        else:
            msg = f"{loc}: {first.get('msg', 'invalid value')}" if loc else first.get("msg", "invalid request")
        return JSONResponse(error_body(msg, param=loc or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "not_found_error" if exc.status_code == 404 else
                                       "invalid_request_error"), status_code=exc.status_code)

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{model_name}'",
                           "invalid_request_error", "model", "model_not_found")

    def admit(prompt_ids: list[int], params: SamplingParams, req) -> RequestHandle:
        try:
            return engine.submit(prompt_ids, params, priority=req.priority, tenant=req.user or "")
        except QueueFull as exc:
            engine.metrics.requests.labels(engine.revision, "rejected").inc()
            raise ApiError(429, "the server is overloaded: too many requests are waiting", "rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        except EngineDraining as exc:
            engine.metrics.requests.labels(engine.revision, "rejected").inc()
            raise ApiError(503, str(exc), "server_error", headers={"Retry-After": "1"}) from None
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt" if "prompt" in str(exc) else None) from None

    async def respond(request: Request, req, prompt_ids: list[int], chat: bool) -> Response:
        params = req.sampling_params(DEFAULT_MAX_TOKENS)
        handle = admit(prompt_ids, params, req)
        stream = TextStream(engine, handle, params)
        rid = new_id("chatcmpl" if chat else "cmpl")
        obj = "chat.completion" if chat else "text_completion"
        created = now()

        def choice(text: str, finish: str | None, delta: bool) -> dict:
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = {"role": "assistant", "content": text}
            return {"index": 0, ("delta" if delta else "message"): body, "logprobs": None,
                    "finish_reason": finish}

        if req.stream:
            async def events() -> AsyncIterator[str]:
                try:
                    async for chunk in stream:
                        yield _sse({"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                                    "model": model_name, "choices": [choice(chunk.text, chunk.finish_reason, True)]})
                    yield _sse({"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                                "model": model_name, "choices": [],
                                "usage": usage(len(prompt_ids), stream.completion_tokens)})
                except ApiError as exc:
                    yield _sse(error_body(exc.message, exc.type))
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        async def collect() -> tuple[str, str]:
            parts, finish = [], "stop"
            async for chunk in stream:
                parts.append(chunk.text)
                finish = chunk.finish_reason or finish
            return "".join(parts), finish

        task = asyncio.ensure_future(collect())
        while True:  # a client that hangs up cancels its request and frees its blocks
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                handle.close()
                return Response(status_code=499)
        text, finish = task.result()
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                             "choices": [choice(text, finish, False)],
                             "usage": usage(len(prompt_ids), stream.completion_tokens)})

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Response:
        check_model(req.model)
        if isinstance(req.prompt, list):
            if any(not 0 <= t < tokenizer.vocab_size for t in req.prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
            prompt_ids = list(req.prompt)
        else:
            prompt_ids = await asyncio.to_thread(tokenizer.encode, req.prompt)
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return await respond(request, req, prompt_ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatCompletionRequest) -> Response:
        check_model(req.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None

        def render() -> list[int]:
            return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        prompt_ids = await asyncio.to_thread(render)
        return await respond(request, req, prompt_ids, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "graft", "max_model_len": engine.config.max_model_len}]}

    @app.get("/health")
    async def health() -> dict:
        alive = engine._thread is not None and engine._thread.is_alive()
        if not alive:
            raise ApiError(503, "the step loop is not running", "server_error")
        return {"status": "ok", "revision": engine.revision}

    @app.get("/ready")
    async def ready() -> Response:
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ready", "revision": engine.revision})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
