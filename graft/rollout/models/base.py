"""What every Graft kind's model is built from: the base model, CEL rules, the shared value types.

A model here is the one definition of a field: its name in the manifest (the camelCase alias), its
Python type, its description (what `kubectl explain` prints), its default, its bounds and the
cross-field rules, written as CEL for the API server (`x-kubernetes-validations`) and checked the
same way in Python by `rules` validators, so the operator refuses what the CRD refuses even against
an older CRD or an API server that skips CEL rules. graft.rollout.crdgen turns these models into
crds/*.yaml; graft.rollout.spec validates manifests through them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, StringConstraints, ValidationError,
                      WithJsonSchema, model_serializer, model_validator)
from pydantic.fields import FieldInfo
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from graft.api import DIGEST_RE, NAME_RE, VERSION_RE

# -- patterns, as the API server matches them (RE2: `$` only at the very end, no lookaround) --------

DNS_LABEL_PATTERN = rf"^{NAME_RE.pattern}$"
# a DNS subdomain: an object's name (a ConfigMap, a Secret, a Service, an HTTPRoute, a template)
K8S_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
PATCH_NAME_PATTERN = DNS_LABEL_PATTERN
PATCH_VERSION_PATTERN = rf"^{VERSION_RE.pattern}$"
DIGEST_PATTERN = rf"^{DIGEST_RE.pattern}$"      # the engine checks a bundle's digest with the same pattern
METRIC_NAME_PATTERN = DNS_LABEL_PATTERN
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
# a ConfigMap or Secret data key, as the API server validates them
DATA_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY_PATTERN = rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{LABEL_NAME}$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
ARG_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_]*$"
HEADER_NAME_PATTERN = r"^[A-Za-z0-9-]+$"
URL_PATTERN = r"^https?://[^\s]+$"
# a duration has a bound length: an unbounded string of digits would parse to inf seconds
MAX_DURATION = 32
MAX_LABEL_KEY = 317        # a 253-character prefix, '/', a 63-character name


@dataclass(frozen=True, slots=True)
class Cel:
    """One `x-kubernetes-validations` rule: CEL for the API server, with `message` its refusal. The
    model that carries it checks the same in Python (`rules`, `presence` or a field validator)."""

    rule: str
    message: str


def cel(*rules: Cel) -> dict[str, Any]:
    """`json_schema_extra` carrying CEL rules."""
    return {"x-kubernetes-validations": [{"rule": r.rule, "message": r.message} for r in rules]}


def refuse(message: str, at: str | None = None) -> PydanticCustomError:
    """The error a rule's Python twin raises: `message` as the API server's CEL message, reported on
    the object (or on its property `at`)."""
    return PydanticCustomError("rule", "{message}", {"message": message, "at": at})


@dataclass(frozen=True, slots=True)
class Says:
    """Field metadata: the error text for a pydantic error type at this field, where the generic one
    would say less (e.g. {"too_long": "must be a list of at most 32 patches"})."""

    texts: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, **texts: str) -> "Says":
        return cls(tuple(texts.items()))

    def get(self, kind: str) -> str | None:
        return dict(self.texts).get(kind)


class ApiModel(BaseModel):
    """A Graft API object: manifest spelling (camelCase), strict JSON types (no "10" for 10, no true
    for 1), unknown fields refused (as kubectl's strict field validation does)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, strict=True, extra="forbid",
                              allow_inf_nan=False, frozen=True, use_attribute_docstrings=False)

    # the CEL rules of this object (x-kubernetes-validations), each checked in Python by `rules`
    cel_rules: ClassVar[tuple[Cel, ...]] = ()

    def rules(self) -> None:
        """The CEL rules' Python twins: raise `refuse(...)` for the first one broken."""

    @classmethod
    def presence(cls, data: dict[str, Any]) -> None:
        """Rules on which fields are given (CEL's has()): checked on the raw object, before its
        fields, so that such a mistake is named first, e.g. both podRatio and gatewayAPI."""

    @classmethod
    def given(cls, data: dict[str, Any], name: str) -> bool:
        """Whether raw `data` has field `name` (Python name), by its manifest name or its own."""
        return name in data or cls.model_fields[name].alias in data

    @model_validator(mode="before")
    @classmethod
    def _check_presence(cls, data: Any) -> Any:
        if isinstance(data, dict):
            # as the API server prunes them: a null field is no field (its default applies)
            names = {f.alias or n for n, f in cls.model_fields.items()} | set(cls.model_fields)
            data = {k: v for k, v in data.items() if v is not None or k not in names}
            cls.presence(data)
        return data

    @model_validator(mode="after")
    def _check_rules(self) -> "ApiModel":
        self.rules()
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):  # noqa: D105 - the CEL rules go along
        schema = handler(core_schema)
        if cls.cel_rules:
            target = handler.resolve_ref_schema(schema)
            target["x-kubernetes-validations"] = [{"rule": r.rule, "message": r.message} for r in cls.cel_rules]
        return schema


class StatusModel(BaseModel):
    """A status object: the operator writes it and reads it back (graft.rollout.status), so it is read
    leniently (fields it does not know are ignored, "3" is 3). A `compact` object leaves out its
    fields without a value, but those in `always` (written as null, which a merge patch clears)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore",
                              from_attributes=True)
    compact: ClassVar[bool] = False
    always: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _compacted(self, handler: Any) -> Any:
        out = handler(self)
        if not self.compact or not isinstance(out, dict):
            return out
        keep = {self.model_fields[n].alias or n for n in self.always}
        return {k: v for k, v in out.items() if v is not None or k in keep}


def to_time(t: float | None) -> str | None:
    """Epoch seconds as the status writes them: RFC 3339, UTC, milliseconds."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def from_time(text: str | None) -> float | None:
    """An RFC 3339 time as epoch seconds (None for none)."""
    if not text:
        return None
    if isinstance(text, (int, float)):
        return float(text)
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# a status time: epoch seconds in memory, RFC 3339 in the object
Time = Annotated[float | None, BeforeValidator(from_time), PlainSerializer(to_time),
                 WithJsonSchema({"type": "string"})]
# a field written as null (so a merge patch clears it) when it is empty: "", [], 0 stay out of the object
OrNone = PlainSerializer(lambda v: v or None)


# -- shared value types ----------------------------------------------------------------------------

Duration = Annotated[str, StringConstraints(max_length=MAX_DURATION, pattern=DURATION_PATTERN)]
K8sName = Annotated[str, StringConstraints(max_length=253, pattern=K8S_NAME_PATTERN)]
DataKey = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DATA_KEY_PATTERN)]
LabelKey = Annotated[str, StringConstraints(max_length=MAX_LABEL_KEY, pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[str, StringConstraints(max_length=63, pattern=LABEL_VALUE_PATTERN)]
PatchName = Annotated[str, StringConstraints(max_length=63, pattern=PATCH_NAME_PATTERN)]
PatchVersion = Annotated[str, StringConstraints(max_length=64, pattern=PATCH_VERSION_PATTERN)]
Digest = Annotated[str, StringConstraints(max_length=71, pattern=DIGEST_PATTERN)]


def label_key_ok(key: str) -> bool:
    """A label key as the API server takes it (a prefix of at most 253, a name of at most 63)."""
    prefix, _, name = key.rpartition("/")
    return (len(key) <= MAX_LABEL_KEY and re.fullmatch(LABEL_KEY_PATTERN[1:-1], key) is not None
            and len(name) <= 63 and len(prefix) <= 253)


def described(description: str, **kwargs: Any) -> Any:
    """A Field with its description (every field has one: `kubectl explain` prints it)."""
    return Field(description=description, **kwargs)




@dataclass(frozen=True, slots=True)
class Column:
    """An additional printer column (`kubectl get`)."""

    name: str
    type: str
    json_path: str
    priority: int = 0
    description: str = ""


@dataclass(frozen=True, slots=True)
class Kind:
    """One custom resource kind: its names, what `kubectl explain` says of it, its spec and status
    models, its printer columns. graft.rollout.crdgen writes its CustomResourceDefinition from this."""

    kind: str
    plural: str
    short_names: tuple[str, ...]
    description: str
    spec: type[BaseModel]
    spec_description: str
    status: type[BaseModel] | None = None
    status_description: str = ""
    namespaced: bool = True
    columns: tuple[Column, ...] = ()

    @property
    def singular(self) -> str:
        return self.kind.lower()


# -- validation errors in the API server's words and paths -----------------------------------------


@dataclass(slots=True, frozen=True)
class FieldError:
    """One bad field: its path as the API server writes it (`spec.steps[2].weight`) and why."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def validate(model: type[BaseModel], data: Any, root: str) -> tuple[BaseModel | None, list[FieldError]]:
    """`data` validated through `model`: (the object, []) or (None, every bad field under `root`)."""
    try:
        return model.model_validate(data), []
    except ValidationError as e:
        return None, [_field_error(model, err, root) for err in e.errors(include_url=False)]


def _field_error(model: type[BaseModel], err: Any, root: str) -> FieldError:
    path, node, info, parent = root, model, None, None
    key_error = value_of_dict = False
    owner = root                           # the path of the object the last part is a key of
    for part in err["loc"]:
        if part == "[key]":                # a map's key is bad: the API server names the map
            key_error = True
            continue
        kind, args = _unwrap(node)
        owner = path
        if isinstance(part, int):
            path += f"[{part}]"
            node = args[0] if args else Any
            continue
        path += f".{part}"
        if _is_model(kind):
            parent = kind
            field = next((f for n, f in kind.model_fields.items() if (f.alias or n) == part or n == part), None)
            if field is None:
                node = Any
                continue
            node, info, value_of_dict = field.annotation, field, False
            # the field's metadata (its bounds, its Says) rides along for the error's wording
            node = Annotated[(node, *field.metadata)] if field.metadata else node
        elif kind is dict:
            node, value_of_dict = (args[1] if len(args) == 2 else Any), True
    says = _says(info)
    kind_name, ctx, given = err["type"], err.get("ctx") or {}, err.get("input")
    if kind_name == "rule":
        at = ctx.get("at")
        return FieldError(path + ("" if not at else at if at.startswith("[") else f".{at}"), ctx["message"])
    if key_error:
        text = says.get("key") if says else None
        return FieldError(owner, f"{given!r} {text}" if text else _generic(err, info, parent))
    if value_of_dict and says and says.get("value"):
        return FieldError(path, f"{given!r} {says.get('value')}")
    if says and says.get(kind_name):
        return FieldError(path, says.get(kind_name).format(input=repr(given)))
    return FieldError(path, _generic(err, info, parent))


def _generic(err: Any, info: Any, parent: Any) -> str:
    kind, ctx, given = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "missing" or (given is None and kind.endswith("_type")):
        return "required"
    if kind == "extra_forbidden" and parent is not None:
        return f"unknown field (allowed: {', '.join(f.alias or n for n, f in parent.model_fields.items())})"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "must be an object"
    if kind == "list_type":
        return "must be a list"
    if kind == "string_type" or (kind == "string_too_short" and ctx.get("min_length") == 1):
        return "must be a non-empty string"
    if kind == "string_too_short":
        return f"must be at least {ctx['min_length']} characters"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters"
    if kind == "string_pattern_mismatch":
        return f"{given!r} does not match {ctx['pattern']}"
    if kind in ("int_type", "int_from_float", "int_parsing"):
        return "must be an integer"
    if kind in ("float_type", "float_parsing", "finite_number"):
        return "must be a finite number"
    if kind == "bool_type":
        return "must be true or false"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        lo, hi = _bounds(info)
        if isinstance(given, int) and lo is not None and hi is not None:
            return f"must be between {lo:g} and {hi:g}"
        bound = next(iter(ctx.values()))
        return {"greater_than_equal": f"must be at least {bound:g}", "less_than_equal": f"must be at most {bound:g}",
                "greater_than": f"must be greater than {bound:g}", "less_than": f"must be less than {bound:g}"}[kind]
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} items"
    if kind == "too_short":
        return "must be a non-empty list" if ctx.get("min_length") == 1 else f"must have at least {ctx['min_length']} items"
    if kind == "literal_error":
        return f"must be one of {', '.join(_choices(info))}"
    return str(err["msg"])


def _bounds(info: Any) -> tuple[float | None, float | None]:
    lo = hi = None
    for item in _metadata(info):
        lo = getattr(item, "ge", None) if getattr(item, "ge", None) is not None else lo
        hi = getattr(item, "le", None) if getattr(item, "le", None) is not None else hi
    return lo, hi


def _choices(info: Any) -> list[str]:
    node = info.annotation if info is not None else None
    while node is not None:
        origin = get_origin(node)
        if origin is Literal:
            return [str(a) for a in get_args(node)]
        args = [a for a in get_args(node) if a is not type(None)]
        node = args[0] if args else None
    return []


def _metadata(info: Any) -> list[Any]:
    out = list(getattr(info, "metadata", None) or [])
    node = getattr(info, "annotation", None)
    while node is not None:
        if get_origin(node) is Annotated:
            for item in node.__metadata__:     # a Field(...) inside Annotated carries its bounds as metadata
                out += [item, *(item.metadata if isinstance(item, FieldInfo) else ())]
            node = get_args(node)[0]
            continue
        args = [a for a in get_args(node) if a is not type(None)] if get_origin(node) in (Union, UnionType) else []
        node = args[0] if len(args) == 1 else None
    return out


def _says(info: Any) -> Says | None:
    return next((m for m in _metadata(info) if isinstance(m, Says)), None)


def _unwrap(node: Any) -> tuple[Any, tuple[Any, ...]]:
    """A type without Annotated and Optional: (its origin or class, its arguments)."""
    while True:
        origin = get_origin(node)
        if origin is Annotated:
            node = get_args(node)[0]
        elif origin in (Union, UnionType):
            args = [a for a in get_args(node) if a is not type(None)]
            if len(args) != 1:
                return Any, ()
            node = args[0]
        elif origin is not None:
            return origin, get_args(node)
        else:
            return node, ()


def _is_model(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, BaseModel)
