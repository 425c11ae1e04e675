"""CEL validation rules (``x-kubernetes-validations``) as kube-apiserver compiles and evaluates them.

A CRD's rules are compiled when the CRD is registered: a rule that does not parse, calls a
function the Kubernetes CEL environment lacks, names a field its schema does not have, or uses
``oldSelf`` where no old value can be correlated, makes the CRD itself invalid (422), as on a
real API server. Each write of a custom resource then evaluates every rule of every schema node
that holds a value, with ``self`` bound to that value (typed by the schema: ``number`` fields are
doubles even when written as ``2``). Transition rules (those naming ``oldSelf``) run only on an
update, and only where an old value correlates: through object properties, map values and
``x-kubernetes-list-type: map`` items (by their keys); never through plain or set lists.

Failures are reported as kube-apiserver words them: ``spec.steps: Invalid value: "array": the
last step must have weight 100``, with ``message``, ``messageExpression``, ``fieldPath`` and
``reason`` honoured. Evaluation is by ``cel-python`` (``celpy``); the functions Kubernetes adds to
CEL (the lists, strings and regex libraries) are provided here. Rules are not costed: a rule a real
API server would refuse as too expensive is accepted here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import celpy
import lark
import re2
from celpy import celtypes

from graft.devcluster.apimachinery import FieldError

_MACROS = frozenset({"has", "all", "exists", "exists_one", "map", "filter"})
_REASONS = {"FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired", "FieldValueDuplicate"}
_FIELD_PATH = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\['((?:[^'\\]|\\.)*)'\]")
_ENV = celpy.Environment()


# The Kubernetes additions to CEL: k8s.io/apiserver/pkg/cel/library (lists, regex) and cel-go's
# strings extension. celpy calls a method as a function of its target: ``x.f(a)`` is ``f(x, a)``.

def _is_sorted(items: celtypes.ListType) -> celtypes.BoolType:
    return celtypes.BoolType(all(a <= b for a, b in zip(items, items[1:])))


def _sum(items: celtypes.ListType) -> Any:
    if not items:
        return celtypes.IntType(0)
    total = items[0]
    for item in items[1:]:
        total = total + item
    return total


def _least(items: celtypes.ListType) -> Any:
    if not items:
        raise ValueError("min called on empty list")
    return min(items)


def _greatest(items: celtypes.ListType) -> Any:
    if not items:
        raise ValueError("max called on empty list")
    return max(items)


def _index_of(target: Any, needle: Any, offset: int = 0) -> celtypes.IntType:
    if isinstance(target, str):
        return celtypes.IntType(str(target).find(needle, int(offset)))
    return celtypes.IntType(next((i for i, item in enumerate(target) if item == needle), -1))


def _last_index_of(target: Any, needle: Any, offset: int | None = None) -> celtypes.IntType:
    if isinstance(target, str):
        end = len(target) if offset is None else int(offset) + len(needle)
        return celtypes.IntType(str(target).rfind(needle, 0, end))
    return celtypes.IntType(next((i for i in reversed(range(len(target))) if target[i] == needle), -1))


def _char_at(text: str, index: int) -> celtypes.StringType:
    if not 0 <= index <= len(text):
        raise ValueError(f"index out of range: {index}")
    return celtypes.StringType(text[index:index + 1])


def _substring(text: str, start: int, end: int | None = None) -> celtypes.StringType:
    end = len(text) if end is None else end
    if not 0 <= start <= end <= len(text):
        raise ValueError(f"index out of range: {start}, {end}")
    return celtypes.StringType(text[start:end])


def _replace(text: str, old: str, new: str, count: int = -1) -> celtypes.StringType:
    return celtypes.StringType(text.replace(old, new, int(count)))


def _split(text: str, separator: str, limit: int = -1) -> celtypes.ListType:
    if limit == 0:
        return celtypes.ListType()
    parts = list(text) if separator == "" else text.split(separator, int(limit) - 1 if limit > 0 else -1)
    return celtypes.ListType(celtypes.StringType(p) for p in parts)


def _join(items: celtypes.ListType, separator: str = "") -> celtypes.StringType:
    return celtypes.StringType(separator.join(items))


def _find(text: str, pattern: str) -> celtypes.StringType:
    m = re2.search(pattern, text)
    return celtypes.StringType(m.group(0) if m else "")


def _find_all(text: str, pattern: str, limit: int = -1) -> celtypes.ListType:
    found = [m.group(0) for m in re2.finditer(pattern, text)]
    return celtypes.ListType(celtypes.StringType(f) for f in (found if limit < 0 else found[:limit]))


LIBRARY: dict[str, Callable[..., Any]] = {
    "isSorted": _is_sorted, "sum": _sum, "min": _least, "max": _greatest,
    "indexOf": _index_of, "lastIndexOf": _last_index_of,
    "charAt": _char_at, "substring": _substring, "replace": _replace, "split": _split, "join": _join,
    "lowerAscii": lambda s: celtypes.StringType(s.lower()), "upperAscii": lambda s: celtypes.StringType(s.upper()),
    "trim": lambda s: celtypes.StringType(s.strip()), "reverse": lambda s: celtypes.StringType(s[::-1]),
    "find": _find, "findAll": _find_all,
}
_KNOWN = frozenset(celpy.base_functions) | _MACROS | frozenset(LIBRARY)


# compiling

@dataclass(frozen=True, slots=True)
class Rule:
    """One entry of ``x-kubernetes-validations``, compiled."""

    rule: str
    program: celpy.Runner
    message: str
    message_program: celpy.Runner | None
    field_path: tuple[str, ...]
    reason: str
    transition: bool  # it names oldSelf: evaluated only on an update with a correlated old value


@dataclass(slots=True)
class Node:
    """A schema node that holds rules, or has descendants that do."""

    schema: dict[str, Any]
    rules: list[Rule] = field(default_factory=list)
    properties: dict[str, Node] = field(default_factory=dict)
    additional: Node | None = None
    items: Node | None = None

    @property
    def type(self) -> str:
        return str(self.schema.get("type") or "")


def compile_schema(schema: dict[str, Any], crd_path: str) -> tuple[Node | None, list[FieldError]]:
    """Compile every rule of an ``openAPIV3Schema``; ``crd_path`` names the schema in errors.

    Returns the tree of nodes that carry rules (``None`` when there are none) and the CRD's errors.
    """
    errors: list[FieldError] = []
    node = _compile(schema, crd_path, errors, correlatable=True, root=True)
    return node, errors


def _compile(schema: dict[str, Any], path: str, errors: list[FieldError], *, correlatable: bool,
             root: bool = False) -> Node | None:
    node = Node(schema)
    for i, entry in enumerate(schema.get("x-kubernetes-validations") or ()):
        rule = _compile_rule(entry, schema, f"{path}.x-kubernetes-validations[{i}]", errors, root=root)
        if rule is None:
            continue
        if rule.transition and not correlatable:
            errors.append(FieldError(f"{path}.x-kubernetes-validations[{i}].rule", "FieldValueInvalid",
                                     f"Invalid value: {json.dumps(rule.rule)}: oldSelf cannot be used on the "
                                     "uncorrelatable portion of the schema"))
            continue
        node.rules.append(rule)
    for name, sub in (schema.get("properties") or {}).items():
        child = _compile(sub, f"{path}.properties[{name}]", errors, correlatable=correlatable)
        if child is not None:
            node.properties[name] = child
    if isinstance(schema.get("additionalProperties"), dict):
        node.additional = _compile(schema["additionalProperties"], f"{path}.additionalProperties", errors,
                                   correlatable=correlatable)
    if isinstance(schema.get("items"), dict):
        keyed = schema.get("x-kubernetes-list-type") == "map"
        node.items = _compile(schema["items"], f"{path}.items", errors, correlatable=correlatable and keyed)
    if node.rules or node.properties or node.additional or node.items:
        return node
    return None


def _compile_rule(entry: Any, schema: dict[str, Any], path: str, errors: list[FieldError], *,
                  root: bool) -> Rule | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("rule"), str) or not entry["rule"].strip():
        errors.append(FieldError(f"{path}.rule", "FieldValueRequired", "Required value"))
        return None
    text = entry["rule"]
    reason = entry.get("reason") or "FieldValueInvalid"
    if reason not in _REASONS:
        supported = ", ".join(json.dumps(r) for r in sorted(_REASONS))
        errors.append(FieldError(f"{path}.reason", "FieldValueNotSupported",
                                 f"Unsupported value: {json.dumps(reason)}: supported values: {supported}"))
        return None
    field_path = _parse_field_path(entry.get("fieldPath") or "", schema)
    if field_path is None:
        errors.append(FieldError(f"{path}.fieldPath", "FieldValueInvalid",
                                 f"Invalid value: {json.dumps(entry.get('fieldPath'))}: fieldPath must be a valid "
                                 "path to a field of the schema, such as .a.b or .a['b']"))
        return None
    try:
        program, transition = _program(text, schema, root=root)
        message_program = None
        if entry.get("messageExpression"):
            message_program, _ = _program(entry["messageExpression"], schema, root=root)
    except CompileError as e:
        which = "messageExpression" if str(e).startswith("messageExpression") else "rule"
        errors.append(FieldError(f"{path}.{which}", "FieldValueInvalid",
                                 f"Invalid value: {json.dumps(text)}: compilation failed: {e}"))
        return None
    message = (entry.get("message") or "").strip() or f"failed rule: {text.strip()}"
    return Rule(text, program, message, message_program, field_path, reason, transition)


class CompileError(ValueError):
    """A rule the Kubernetes CEL environment would not compile."""


def _program(text: str, schema: dict[str, Any], *, root: bool) -> tuple[celpy.Runner, bool]:
    try:
        ast = _ENV.compile(text)
    except celpy.CELParseError as e:
        raise CompileError(f"ERROR: <input>: Syntax error: {str(e).splitlines()[0]}") from None
    names = set(_identifiers(ast))
    for name in _calls(ast):
        if name not in _KNOWN:
            raise CompileError(f"ERROR: <input>: undeclared reference to '{name}' (in container '')")
    for variable in ("self", "oldSelf"):
        for chain in _field_chains(ast, variable):
            missing = _undefined_field(chain, schema, root=root)
            if missing:
                raise CompileError(f"ERROR: <input>: undefined field '{missing}'")
    return _ENV.program(ast, functions=LIBRARY), "oldSelf" in names


def _identifiers(tree: lark.Tree) -> Iterator[str]:
    for sub in tree.iter_subtrees():
        if sub.data == "ident":
            yield str(sub.children[0])


def _calls(tree: lark.Tree) -> Iterator[str]:
    for sub in tree.iter_subtrees():
        if sub.data == "ident_arg":
            yield str(sub.children[0])
        elif sub.data == "member_dot_arg":
            yield str(sub.children[1])


def _field_chains(tree: lark.Tree, variable: str) -> Iterator[list[str]]:
    """The plain field selections ``variable.a.b`` of a rule, longest first, as ``["a", "b"]``."""
    for sub in tree.iter_subtrees():
        if sub.data != "member_dot":
            continue
        chain: list[str] = []
        node: Any = sub
        while isinstance(node, lark.Tree) and node.data == "member_dot":
            chain.insert(0, str(node.children[1]))
            node = node.children[0].children[0] if node.children[0].children else None
        if (isinstance(node, lark.Tree) and node.data == "primary" and node.children
                and isinstance(node.children[0], lark.Tree) and node.children[0].data == "ident"
                and str(node.children[0].children[0]) == variable):
            yield chain


def _undefined_field(chain: list[str], schema: dict[str, Any], *, root: bool) -> str | None:
    for depth, name in enumerate(chain):
        if root and depth == 0 and name in ("apiVersion", "kind", "metadata"):
            return None
        props = schema.get("properties")
        if (not props or schema.get("x-kubernetes-preserve-unknown-fields")
                or schema.get("additionalProperties") not in (None, False)):
            return None  # a map, or an object whose fields are not all known
        if name not in props:
            return name
        schema = props[name]
    return None


def _parse_field_path(text: str, schema: dict[str, Any]) -> tuple[str, ...] | None:
    parts, at = [], 0
    while at < len(text):
        m = _FIELD_PATH.match(text, at)
        if m is None:
            return None
        parts.append(m[1] if m[1] is not None else re.sub(r"\\(.)", r"\1", m[2]))
        at = m.end()
    for part in parts:
        props = schema.get("properties") or {}
        if part in props:
            schema = props[part]
        elif isinstance(schema.get("additionalProperties"), dict):
            schema = schema["additionalProperties"]
        else:
            return None
    return tuple(parts)


# evaluating

def validate(node: Node, value: Any, old: Any = None, path: str = "", *, root: bool = True) -> list[FieldError]:
    """Evaluate the rules of ``node`` and its descendants on ``value`` (``old``: the value before an update)."""
    if value is None:
        return []  # rules see only values that are there: a parent's rule judges absence
    errors: list[FieldError] = []
    if node.rules:
        self = to_cel(value, node.schema, root=root)
        old_self = to_cel(old, node.schema, root=root) if old is not None else None
        for rule in node.rules:
            if rule.transition and old_self is None:
                continue
            error = _evaluate(rule, node, self, old_self, path)
            if error is not None:
                errors.append(error)
    if isinstance(value, dict):
        old_map = old if isinstance(old, dict) else {}
        for key in sorted(value):
            child = node.properties.get(key)
            if child is not None:
                errors += validate(child, value[key], old_map.get(key), _join(path, key), root=False)
            elif node.additional is not None and key not in (node.schema.get("properties") or {}):
                errors += validate(node.additional, value[key], old_map.get(key), f"{path}[{key}]", root=False)
    elif isinstance(value, list) and node.items is not None:
        keys = node.schema.get("x-kubernetes-list-map-keys") or ()
        old_items = _by_keys(old, keys) if node.schema.get("x-kubernetes-list-type") == "map" else {}
        for i, item in enumerate(value):
            old_item = old_items.get(_key_of(item, keys)) if isinstance(item, dict) else None
            errors += validate(node.items, item, old_item, f"{path}[{i}]", root=False)
    return errors


def _evaluate(rule: Rule, node: Node, self: Any, old_self: Any, path: str) -> FieldError | None:
    activation = {"self": self} if old_self is None else {"self": self, "oldSelf": old_self}
    shown = json.dumps(node.type)
    try:
        result = rule.program.evaluate(activation)
    except celpy.CELEvalError as e:
        return FieldError(path or "<nil>", "FieldValueInvalid",
                          f"Invalid value: {shown}: {_eval_error(e)} evaluating rule: {_rule_name(rule)}")
    if not isinstance(result, (bool, celtypes.BoolType)):
        return FieldError(path or "<nil>", "FieldValueInvalid",
                          f"Invalid value: {shown}: rule did not evaluate to a bool: {_rule_name(rule)}")
    if result:
        return None
    at = path
    for part in rule.field_path:
        at = _join(at, part) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", part) else f"{at}[{part}]"
    at = at or "<nil>"  # kube-apiserver's name for the root of the object
    detail = _message(rule, activation)
    match rule.reason:
        case "FieldValueForbidden":
            return FieldError(at, rule.reason, f"Forbidden: {detail}")
        case "FieldValueRequired":
            return FieldError(at, rule.reason, f"Required value: {detail}")
        case "FieldValueDuplicate":
            return FieldError(at, rule.reason, f"Duplicate value: {shown}")
    return FieldError(at, rule.reason, f"Invalid value: {shown}: {detail}")


def _message(rule: Rule, activation: dict[str, Any]) -> str:
    """The rule's ``messageExpression`` when it yields a one-line string, else its ``message``."""
    if rule.message_program is not None:
        try:
            text = rule.message_program.evaluate(activation)
        except celpy.CELEvalError:
            text = None
        if isinstance(text, str) and text.strip() and "\n" not in text:
            return str(text).strip()
    return rule.message


def _rule_name(rule: Rule) -> str:
    return rule.message if not rule.message.startswith("failed rule: ") else rule.rule.strip()


def _eval_error(error: celpy.CELEvalError) -> str:
    text = str(error.args[0]) if error.args else str(error)
    m = re.match(r"no such member in mapping: '(.*)'", text)
    return f"no such key: {m[1]}" if m else text


def to_cel(value: Any, schema: dict[str, Any], *, root: bool = False) -> Any:
    """A JSON value as CEL sees it under ``schema``: numbers are doubles, metadata is name only."""
    if value is None:
        return None
    kind = schema.get("type")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out = celtypes.MapType()
        for key, item in value.items():
            if root and key == "metadata":
                item = {k: v for k, v in (item or {}).items() if k in ("name", "generateName")}
            sub = props.get(key, extra if isinstance(extra, dict) else {})
            out[celtypes.StringType(key)] = to_cel(item, sub)
        return out
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return celtypes.ListType(to_cel(item, items) for item in value)
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if kind == "number" and isinstance(value, (int, float)):
        return celtypes.DoubleType(value)
    return celpy.json_to_cel(value)


def _by_keys(items: Any, keys: Any) -> dict[tuple[str, ...], Any]:
    if not isinstance(items, list):
        return {}
    return {_key_of(item, keys): item for item in items if isinstance(item, dict)}


def _key_of(item: dict[str, Any], keys: Any) -> tuple[str, ...]:
    return tuple(json.dumps(item.get(k), sort_keys=True) for k in keys)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
