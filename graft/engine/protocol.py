"""OpenAI request and response shapes (the subset Graft serves), with their validation.

Validation happens here, at the edge, so nothing that reaches the step loop can fail there. Types
are strict (JSON `"yes"` is not a boolean, `true` is not a token id, `1.5` is not an integer) and
every number the engine turns into a tensor or a seed is bounded. Fields of the OpenAI API that
Graft does not implement are declared so that a request using them is refused with a 400 naming
the field instead of being answered as if they had been honoured; their neutral values (null,
false, empty) are accepted because clients send them by default.

A field the API does not have is refused with a 400 naming it, except these, which common clients
send by default and which change nothing here: `store`, `metadata`, `service_tier`,
`parallel_tool_calls`, `prediction` (null only), `modalities` (null or ["text"]) and `user`. `user`
is accepted but decides nothing: the fairness key comes from the connection or a gateway's header
(`graft.engine.server.PublicLimits`). So does `priority` beyond a small band. Stop strings are at
most MAX_STOP_LENGTH characters each (a stop string's length is text held back from a stream).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      ValidationInfo, field_validator)

from graft.engine.sequence import MAX_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams

MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 128
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


def _utf8(value: str) -> str:
    """JSON may escape a lone UTF-16 surrogate (`"\\ud800"`); such a string has no UTF-8 form."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it contains a lone surrogate)") from None
    return value


Text = Annotated[StrictStr, AfterValidator(_utf8)]
StopText = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
TokenId = Annotated[StrictInt, Field(ge=0)]


def _unsupported(*neutral: Any) -> AfterValidator:
    """Accept only null or a neutral value for a field Graft does not implement."""
    def check(value: Any) -> Any:
        if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
            raise ValueError("not supported by this server (omit it or send null)")
        return value
    return AfterValidator(check)


def _unsupported_field(*neutral: Any) -> Any:
    allowed = " or ".join(["null", *(json.dumps(n) for n in neutral)])
    return Field(default=None, json_schema_extra={
        "description": f"Not supported by this server: only {allowed} is accepted.",
        "anyOf": [{"type": "null"}, *([{"enum": list(neutral)}] if neutral else [])]})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: StrictBool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: Text
    max_tokens: StrictInt | None = Field(default=None, ge=1, description=(
        "At most the model's context length; beyond what the prompt leaves, the completion is cut there."))
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0, description="0 means off; at most the vocabulary size.")
    n: StrictInt = Field(default=1, ge=1, le=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    user: Text | None = Field(default=None, description="Accepted; fairness does not depend on it.")
    priority: StrictInt = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX, description=(
        "Lower is more urgent. Clamped to the server's band (--client-priority-band, 1 by default) "
        "unless a trusted gateway header sets it."))
    ignore_eos: StrictBool = False
    # OpenAI fields Graft does not implement
    logit_bias: Annotated[Any, _unsupported({})] = _unsupported_field({})
    response_format: Annotated[Any, _unsupported({"type": "text"})] = _unsupported_field({"type": "text"})
    tools: Annotated[Any, _unsupported([])] = _unsupported_field([])
    tool_choice: Annotated[Any, _unsupported("none")] = _unsupported_field("none")
    functions: Annotated[Any, _unsupported([])] = _unsupported_field([])
    function_call: Annotated[Any, _unsupported("none")] = _unsupported_field("none")
    presence_penalty: Annotated[Any, _unsupported(0, 0.0)] = _unsupported_field(0)
    frequency_penalty: Annotated[Any, _unsupported(0, 0.0)] = _unsupported_field(0)
    # harmless client defaults: accepted, and nothing depends on them
    store: StrictBool | None = None
    metadata: dict[str, Text] | None = None
    service_tier: Text | None = None
    parallel_tool_calls: StrictBool | None = None
    prediction: Annotated[Any, _unsupported()] = _unsupported_field()
    modalities: Annotated[Any, _unsupported(["text"])] = _unsupported_field(["text"])

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        return [v] if isinstance(v, str) else list(v or [])

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_logprobs(self) -> int | None:
        """How many alternatives to report per token; None: no logprobs at all."""
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens,
                              temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, stop=list(self.stop or []), ignore_eos=self.ignore_eos,
                              logprobs=self.num_logprobs)


class CompletionRequest(_Request):
    prompt: Text | list[TokenId] | list[Text]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Annotated[Any, _unsupported(False)] = _unsupported_field(False)
    suffix: Annotated[Any, _unsupported("")] = _unsupported_field("")
    best_of: Annotated[Any, _unsupported(1)] = _unsupported_field(1)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            return v[0]
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.type != "text":
                    raise ValueError(f"unsupported content part type {part.type!r}: only text")
                parts.append(part.text or "")
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs set to true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        params = super().sampling_params(default_max_tokens)
        if self.max_completion_tokens is not None and self.max_tokens is None:
            params.max_tokens = self.max_completion_tokens
        return params


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
