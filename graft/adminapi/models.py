"""The admin API's bodies: `POST /admin/patches`' request, and the answers of every call.

Each request field's rule is written once, in its description, and a body that breaks it is
refused with `field: rule` (`request_error`), as the engine answers it in a 400. Answers keep
fields they do not declare (`extra="allow"`): an engine newer than its client may say more.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from graft.api import NAME_RE, VERSION_RE

SOURCE_RULE = ("exactly one of {\"builtin\": true} or "
               "{\"module\": ..., \"digest\": \"sha256:...\", \"signature\": ...}")


class ApplyRequest(BaseModel):
    """`POST /admin/patches`: apply `name@version` from `source`, configured by `config`."""

    # fields other than these are ignored, as before (a client may pad a body)
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str = Field(pattern=NAME_RE.pattern, description="required, a DNS label (a-z, 0-9, '-')")
    version: str = Field(pattern=VERSION_RE.pattern, description="required, a version string")
    source: dict[str, Any] = Field(description=SOURCE_RULE)
    config: dict[str, Any] | None = Field(default=None, description="must be an object")
    replace: bool = Field(default=False, description="must be true or false")

    @field_validator("name", "version", mode="after")
    @classmethod
    def _whole(cls, value: str, info) -> str:
        # pydantic's pattern searches; the rule is the whole string
        rule = NAME_RE if info.field_name == "name" else VERSION_RE
        if not rule.fullmatch(value):
            raise ValueError("does not match")
        return value

    @field_validator("source", mode="after")
    @classmethod
    def _one_source(cls, source: dict[str, Any]) -> dict[str, Any]:
        if len(source.keys() & {"builtin", "module"}) != 1:
            raise ValueError(SOURCE_RULE)
        if "builtin" in source and source["builtin"] is not True:
            raise BuiltinNotTrue(source["builtin"])
        return source

    @property
    def settings(self) -> dict[str, Any]:
        """The patch's config (an absent or null one: no settings)."""
        return self.config or {}

    def body(self) -> dict[str, Any]:
        """The JSON body a client sends: `config` and `replace` only when set."""
        return self.model_dump(exclude_defaults=True)


class BuiltinNotTrue(ValueError):
    def __init__(self, given: object):
        super().__init__(f"must be true (a JSON boolean), not {json.dumps(given)[:40]}")


def request_error(exc: ValidationError, model: type[BaseModel] = ApplyRequest) -> str:
    """The first broken rule of a request, as `field: rule` (the engine's 400 message)."""
    error = exc.errors()[0]
    field = str(error["loc"][0]) if error["loc"] else "body"
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, BuiltinNotTrue):
        return f"{field}.builtin: {cause}"
    info = model.model_fields.get(field)
    return f"{field}: {info.description if info is not None and info.description else error['msg']}"


class Answer(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class AppliedPatch(Answer):
    """One entry of `applied` in `GET /admin/patches`."""

    name: str
    version: str
    digest: str | None = None                               # "builtin", or the bundle's sha256
    config_digest: str | None = Field(default=None, alias="configDigest")
    applied_at: str | None = Field(default=None, alias="appliedAt")      # ISO 8601, UTC
    apply_ms: float | None = Field(default=None, alias="applyMs")
    verify_ms: float | None = Field(default=None, alias="verifyMs")
    self_check: dict[str, Any] = Field(default_factory=dict, alias="selfCheck")


class PatchesAnswer(Answer):
    """`GET /admin/patches`: the engine's revision and what makes it."""

    revision: str
    applied: list[AppliedPatch] = Field(default_factory=list)
    available: list[dict[str, Any]] = Field(default_factory=list)
    shadow: dict[str, Any] = Field(default_factory=dict)
    faults: list[Any] = Field(default_factory=list)
    awaiting: list[str] = Field(default_factory=list)       # start-up entries (GRAFT_PATCHES) not applied again yet


class ApplyAnswer(Answer):
    """`POST /admin/patches`: the new revision, and the apply's own timings."""

    revision: str
    changed: bool = True
    apply_ms: float = Field(default=0.0, alias="applyMs")
    verify_ms: float | None = Field(default=None, alias="verifyMs")
    self_check: dict[str, Any] | None = Field(default=None, alias="selfCheck")


class RevertAnswer(ApplyAnswer):
    """`DELETE /admin/patches/{name}`: the revision after the revert."""


class ErrorBody(BaseModel):
    """Every refusal: `{"error": {"code", "message"}}`."""

    code: int
    message: str


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": ErrorBody(code=status, message=message).model_dump()}
