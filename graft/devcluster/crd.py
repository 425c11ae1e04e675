"""CustomResourceDefinitions as the API server treats them: served versions, pruning, defaults, validation.

A custom resource written to kube-apiserver goes through these steps before it is stored, and the
emulator repeats them in the same order:

1. pruning: fields the schema does not know are dropped (kept under
   ``x-kubernetes-preserve-unknown-fields``), and so are ``null`` values of non-nullable fields;
2. structural defaulting: every ``default`` of a missing property is filled in, at any depth,
   including inside array items and inside defaults that were just filled in;
3. validation against the ``openAPIV3Schema`` (with ``jsonschema``), reported field by field in
   the API server's words, e.g. ``spec.steps[2].weight: Invalid value: 150: ...``; ``pattern``
   is matched as Go's ``regexp`` does (RE2, unanchored search, ``$`` only at the very end);
4. ``x-kubernetes-list-type``: a ``set`` holds no value twice, a ``map`` no key twice (on an
   update, only when the old object obeyed this too);
5. CEL rules (``x-kubernetes-validations``, see :mod:`graft.devcluster.cel`), unless step 3 found
   an error that makes them meaningless (a wrong type, a missing required field, ...).

``format`` checks are not evaluated, nor is validation ratcheting (an update must pass every check,
even on fields it left alone). Versions are not converted: each served version keeps its own objects.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import re2

from graft.devcluster import cel
from graft.devcluster.apimachinery import FieldError

# Keys whose value is a map of property name -> schema, a list of schemas, or a single schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "definitions")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")
_SCHEMA_ONE = ("items", "additionalProperties", "not")
# OpenAPI keywords that JSON Schema draft 4 lacks or that the API server does not enforce here.
_OPENAPI_ONLY = ("nullable", "default", "format", "example", "externalDocs", "description")
_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object",
               list: "array", type(None): "null"}


# Schema errors that make CEL rules meaningless: kube-apiserver then skips them and says so.
_BLOCKING = ("FieldValueNotSupported", "FieldValueRequired", "FieldValueTooLong", "FieldValueTooMany",
             "FieldValueTypeInvalid")
_RULES_SKIPPED = FieldError("<nil>", "FieldValueInvalid",
                            'Invalid value: "null": some validation rules were not checked because the object '
                            "was invalid; correct the existing errors to complete validation")


@dataclass(slots=True)
class CrdVersion:
    """One served version of a CustomResourceDefinition: what discovery shows and what writes obey."""

    group: str
    version: str
    plural: str
    kind: str
    singular: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None
    columns: tuple[dict[str, Any], ...] = ()  # additionalPrinterColumns, for kubectl's tables
    _validator: Any = field(default=None, init=False, repr=False)

    def prune(self, obj: dict[str, Any]) -> list[str]:
        """Drop unknown fields and non-nullable nulls in place; return the dropped field paths."""
        dropped: list[str] = []
        if self.schema is not None:
            _prune(obj, self.schema, "", dropped, root=True)
        return dropped

    def default(self, obj: dict[str, Any]) -> None:
        """Fill in the schema's defaults in place, the way structural defaulting does."""
        if self.schema is not None:
            _default(obj, self.schema)

    def validate(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[FieldError]:
        """Check an (already pruned and defaulted) object, ``old`` being what it replaces on an update.

        The errors come in kube-apiserver's order: the schema's (sorted by field), the list types',
        then the CEL rules'.
        """
        if self.schema is None:
            return []
        if self._validator is None:
            self._validator = _Validator(_json_schema(self.schema))
        found = {str(e): e for err in self._validator.iter_errors(obj) for e in _field_errors(err)}
        errors = sorted(found.values(), key=lambda e: (e.field, e.detail))
        if old is None or not _list_errors(old, self.schema, ""):
            errors += _list_errors(obj, self.schema, "")
        rules = _rules(self.schema)
        if rules is not None:
            if any(e.reason in _BLOCKING for e in errors):
                errors.append(_RULES_SKIPPED)
            else:
                errors += cel.validate(rules, obj, old)
        return errors


def served_versions(crd: dict[str, Any]) -> list[CrdVersion]:
    """The served versions of a CRD body; raises ``InvalidCrd`` when the body cannot define one."""
    errors = check(crd)
    if errors:
        raise InvalidCrd(errors)
    spec = crd["spec"]
    names = spec["names"]
    result = []
    for v in spec["versions"]:
        if not v.get("served", True):
            continue
        subresources = v.get("subresources") or {}
        result.append(CrdVersion(
            group=spec["group"], version=v["name"], plural=names["plural"], kind=names["kind"],
            singular=names.get("singular") or names["kind"].lower(),
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            short_names=tuple(names.get("shortNames") or ()),
            categories=tuple(names.get("categories") or ()),
            subresources=tuple(sorted(subresources)),
            schema=(v.get("schema") or {}).get("openAPIV3Schema"),
            columns=tuple(v.get("additionalPrinterColumns") or ()),
        ))
    return result


class Admission:
    """What kube-apiserver does with a custom resource of these CRDs written with strict field
    validation (kubectl's default): the object it would store, or every reason it refuses it.
    `graft rollout lint` asks it, so that lint refuses what the API server would."""

    def __init__(self, crds: Iterable[dict[str, Any]]) -> None:
        self.versions = {(f"{v.group}/{v.version}", v.kind): v for crd in crds for v in served_versions(crd)}

    @classmethod
    def load(cls, folder: str | Path) -> "Admission":
        """The CRDs of every YAML file in `folder` (other documents there are left alone)."""
        import yaml

        docs = [d for path in sorted(Path(folder).glob("*.yaml"))
                for d in yaml.safe_load_all(path.read_text(encoding="utf-8"))
                if isinstance(d, dict) and d.get("kind") == "CustomResourceDefinition"]
        return cls(docs)

    def review(self, obj: dict[str, Any]) -> tuple[list[str], dict[str, Any]] | None:
        """(the refusals as `field: detail`, the object as stored); None when no CRD here serves the
        object's apiVersion and kind."""
        version = self.versions.get((obj.get("apiVersion"), obj.get("kind")))
        if version is None:
            return None
        body = copy.deepcopy(obj)
        unknown = version.prune(body)
        version.default(body)
        errors = [f"{path}: unknown field (strict decoding error)" for path in unknown]
        return errors + [str(e) for e in version.validate(body)], body


def check(crd: dict[str, Any]) -> list[FieldError]:
    """The API server's checks of a CRD: names, group, scope, versions, their schemas and CEL rules."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    versions = spec.get("versions")
    errors = [FieldError(f"spec.{path}", "FieldValueRequired", "Required value")
              for path, value in (("group", spec.get("group")), ("names.plural", names.get("plural")),
                                  ("names.kind", names.get("kind")), ("versions", versions))
              if not value]
    for i, version in enumerate(versions if isinstance(versions, list) else []):
        if not isinstance(version, dict) or not version.get("name"):
            errors.append(FieldError(f"spec.versions[{i}].name", "FieldValueRequired", "Required value"))
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        path = f"spec.versions[{i}].schema.openAPIV3Schema"
        try:
            if schema is not None:
                jsonschema.Draft4Validator.check_schema(_json_schema(schema))
        except (jsonschema.SchemaError, AttributeError, TypeError) as e:
            errors.append(FieldError(path, "FieldValueInvalid", f"Invalid value: {getattr(e, 'message', e)}"))
            continue
        if schema is not None:
            errors += _schema_errors(schema, path)
            errors += cel.compile_schema(schema, path)[1]
        for j, column in enumerate(version.get("additionalPrinterColumns") or ()):
            for key in ("name", "type", "jsonPath"):
                if not isinstance(column, dict) or not column.get(key):
                    errors.append(FieldError(f"spec.versions[{i}].additionalPrinterColumns[{j}].{key}",
                                             "FieldValueRequired", "Required value"))
    if spec.get("scope", "Namespaced") not in ("Namespaced", "Cluster"):
        errors.append(FieldError("spec.scope", "FieldValueNotSupported",
                                 f'Unsupported value: {json.dumps(spec.get("scope"))}: '
                                 'supported values: "Cluster", "Namespaced"'))
    if not errors:
        expected = f'{names["plural"]}.{spec["group"]}'
        name = (crd.get("metadata") or {}).get("name")
        if name != expected:
            errors.append(FieldError("metadata.name", "FieldValueInvalid",
                                     f'Invalid value: {json.dumps(name)}: must be spec.names.plural+"."+spec.group'))
        storage = [v.get("name") for v in spec["versions"] if v.get("storage")]
        if len(storage) != 1:
            errors.append(FieldError("spec.versions", "FieldValueInvalid",
                                     "Invalid value: must have exactly one version marked as storage version"))
    return errors


def _schema_errors(schema: dict[str, Any], path: str) -> list[FieldError]:
    """What kube-apiserver refuses in a structural schema beyond its shape: bad patterns, bad list types."""
    errors = []
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        try:
            _regex(pattern)
        except re2.error as e:
            errors.append(FieldError(f"{path}.pattern", "FieldValueInvalid", f"Invalid value: {json.dumps(pattern)}: "
                                     f"must be a valid regular expression, but isn't: {e}"))
    list_type = schema.get("x-kubernetes-list-type")
    if list_type is not None and list_type not in ("atomic", "set", "map"):
        errors.append(FieldError(f"{path}.x-kubernetes-list-type", "FieldValueNotSupported", f"Unsupported value: "
                                 f'{json.dumps(list_type)}: supported values: "atomic", "set", "map"'))
    keys = schema.get("x-kubernetes-list-map-keys") or []
    if list_type == "map":
        known = (schema.get("items") or {}).get("properties") or {}
        if not keys:
            errors.append(FieldError(f"{path}.x-kubernetes-list-map-keys", "FieldValueRequired",
                                     "Required value: must not be empty if x-kubernetes-list-type is map"))
        errors += [FieldError(f"{path}.x-kubernetes-list-map-keys", "FieldValueInvalid",
                              f"Invalid value: {json.dumps(keys)}: entries must all be names of item properties")
                   for key in keys if key not in known][:1]
    for key, sub in _children(schema, path):
        errors += _schema_errors(sub, key)
    return errors


def _children(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            if isinstance(sub, dict):
                yield f"{path}.{key}[{name}]", sub
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or ()):
            if isinstance(sub, dict):
                yield f"{path}.{key}[{i}]", sub
    for key in _SCHEMA_ONE:
        if isinstance(schema.get(key), dict):
            yield f"{path}.{key}", schema[key]


@functools.lru_cache(maxsize=64)
def _compiled_rules(text: str) -> cel.Node | None:
    return cel.compile_schema(json.loads(text), "")[0]


def _rules(schema: dict[str, Any]) -> cel.Node | None:
    """The schema's compiled CEL rules, compiled once per distinct schema."""
    return _compiled_rules(json.dumps(schema, sort_keys=True))


class InvalidCrd(ValueError):
    """A CustomResourceDefinition the API server would refuse."""

    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__("; ".join(map(str, errors)))
        self.errors = errors


# pruning

def _prune(value: Any, schema: dict[str, Any], path: str, dropped: list[str], *, root: bool = False) -> None:
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                _prune(item, items, f"{path}[{i}]", dropped)
        return
    if not isinstance(value, dict):
        return
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
    envelope = root or schema.get("x-kubernetes-embedded-resource")
    for key in list(value):
        if envelope and key in ("apiVersion", "kind", "metadata"):
            continue
        sub = props.get(key, extra if isinstance(extra, dict) else None)
        if sub is None:
            if not keep_unknown:
                dropped.append(_join(path, key))
                del value[key]
        elif value[key] is None and not sub.get("nullable"):
            del value[key]
        else:
            _prune(value[key], sub, _join(path, key), dropped)


# defaulting

def _default(value: Any, schema: dict[str, Any]) -> None:
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for item in value:
                _default(item, items)
        return
    if not isinstance(value, dict):
        return
    props = schema.get("properties") or {}
    for key, sub in props.items():
        if "default" in sub and (key not in value or (value[key] is None and not sub.get("nullable"))):
            value[key] = copy.deepcopy(sub["default"])
    extra = schema.get("additionalProperties")
    for key, item in value.items():
        sub = props.get(key, extra if isinstance(extra, dict) else None)
        if sub is not None:
            _default(item, sub)


# validation

@functools.lru_cache(maxsize=512)
def _regex(pattern: str) -> Any:
    """A pattern compiled as Go's ``regexp`` would: RE2 syntax, where ``$`` is the end of the text."""
    return re2.compile(pattern)


def _pattern(validator: Any, pattern: str, instance: Any,
             schema: dict[str, Any]) -> Iterator[jsonschema.ValidationError]:
    # kube-openapi's check is regexp.MatchString: a search, anchored only where the pattern says so.
    if isinstance(instance, str) and _regex(pattern).search(instance) is None:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"pattern": _pattern})


def _list_errors(value: Any, schema: dict[str, Any], path: str) -> list[FieldError]:
    """``x-kubernetes-list-type`` checks: no value twice in a ``set``, no key twice in a ``map``."""
    errors: list[FieldError] = []
    if isinstance(value, list):
        list_type = schema.get("x-kubernetes-list-type")
        keys = schema.get("x-kubernetes-list-map-keys") or ()
        seen: set[str] = set()
        for i, item in enumerate(value):
            if list_type == "set":
                key, shown = json.dumps(item, sort_keys=True), _go_value(item)
            elif list_type == "map" and isinstance(item, dict):
                key_fields = {k: item[k] for k in keys if k in item}
                key, shown = json.dumps(key_fields, sort_keys=True), _go_value(key_fields)
            else:
                continue
            if key in seen:
                errors.append(FieldError(f"{path}[{i}]", "FieldValueDuplicate", f"Duplicate value: {shown}"))
            seen.add(key)
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                errors += _list_errors(item, items, f"{path}[{i}]")
    elif isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                errors += _list_errors(item, sub, _join(path, key))
    return errors


def _go_value(value: Any) -> str:
    """A value as Go's ``%#v`` prints the decoded JSON in field errors (``map[string]interface {}{...}``)."""
    if isinstance(value, dict):
        inner = ", ".join(f"{json.dumps(k)}:{_go_value(v)}" for k, v in sorted(value.items()))
        return f"map[string]interface {{}}{{{inner}}}"
    if isinstance(value, list):
        return f"[]interface {{}}{{{', '.join(_go_value(v) for v in value)}}}"
    return json.dumps(value)


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Translate an OpenAPI v3 structural schema into a JSON Schema (draft 4) one."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _json_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_json_schema(sub) for sub in value]
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            out[key] = _json_schema(value)
        elif key not in _OPENAPI_ONLY and not key.startswith("x-"):
            out[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if schema.get("nullable"):
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def _field_errors(err: jsonschema.ValidationError) -> Iterator[FieldError]:
    path = _path(err.absolute_path)
    here = path or "<root>"
    value, limit = err.instance, err.validator_value
    match err.validator:
        case "required":
            for name in limit:
                if isinstance(value, dict) and name not in value:
                    yield FieldError(_join(path, name), "FieldValueRequired", "Required value")
        case "enum":
            supported = ", ".join(json.dumps(v) for v in limit)
            yield FieldError(here, "FieldValueNotSupported",
                             f"Unsupported value: {_show(value)}: supported values: {supported}")
        case "type":
            expected = ",".join(limit) if isinstance(limit, list) else limit
            actual = json.dumps(_TYPE_NAMES.get(type(value), type(value).__name__))
            yield FieldError(here, "FieldValueTypeInvalid",
                             f"Invalid value: {actual}: {here} in body must be of type {expected}: {actual}")
        case "maximum":
            op = "less than" if err.schema.get("exclusiveMaximum") else "less than or equal to"
            yield _invalid(here, _show(value), f"{here} in body should be {op} {limit}")
        case "minimum":
            op = "greater than" if err.schema.get("exclusiveMinimum") else "greater than or equal to"
            yield _invalid(here, _show(value), f"{here} in body should be {op} {limit}")
        case "maxLength":
            yield FieldError(here, "FieldValueTooLong", f"Too long: may not be longer than {limit}")
        case "minLength":
            yield _invalid(here, _show(value), f"{here} in body should be at least {limit} chars long")
        case "pattern":
            yield _invalid(here, _show(value), f"{here} in body should match '{limit}'")
        case "maxItems" | "maxProperties":
            yield FieldError(here, "FieldValueTooMany", f"Too many: {len(value)}: must have at most {limit} items")
        case "minItems":
            yield _invalid(here, _show(value), f"{here} in body should have at least {limit} items")
        case "uniqueItems":
            yield FieldError(here, "FieldValueDuplicate", f"Duplicate value: {_show(value)}")
        case "oneOf":
            found = "Found none valid" if err.context else "Found more than one valid alternative"
            yield _invalid(here, _show(value), f"must validate one and only one schema (oneOf). {found}")
        case "anyOf":
            yield _invalid(here, _show(value), "must validate at least one schema (anyOf)")
        case "not":
            yield _invalid(here, _show(value), "must not validate the schema (not)")
        case _:
            yield _invalid(here, _show(value), err.message)


def _invalid(field_path: str, shown: str, detail: str) -> FieldError:
    return FieldError(field_path, "FieldValueInvalid", f"Invalid value: {shown}: {detail}")


def _show(value: Any) -> str:
    # The API server prints scalars as they are and containers by their type name.
    if isinstance(value, (dict, list)):
        return json.dumps(_TYPE_NAMES[type(value)])
    return json.dumps(value)


def _path(parts: Any) -> str:
    path = ""
    for part in parts:
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path, part)
    return path


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key

