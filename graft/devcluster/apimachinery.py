"""The Kubernetes API's small print, as pure functions: URLs, selectors, patches, names, errors.

Named after ``k8s.io/apimachinery``, where kube-apiserver keeps the same rules. The emulated
API server (:mod:`graft.devcluster.apiserver`) is built from these.
"""

from __future__ import annotations

import copy
import datetime
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kmock

Predicate = Callable[[dict[str, Any]], bool]

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"
_REQUIREMENT = re.compile(r"(?P<neg>!)?\s*(?P<key>[A-Za-z0-9][-A-Za-z0-9_./]*)\s*(?:(?P<op>==|=|!=)\s*"
                          r"(?P<value>[-A-Za-z0-9_.]*)|\s+(?P<set>in|notin)\s*\((?P<values>[^()]*)\))?")


@dataclass(frozen=True, slots=True)
class FieldError:
    """One field-level complaint, worded like the API server's ``field.Error``."""

    field: str
    reason: str  # FieldValueInvalid, FieldValueRequired, FieldValueNotSupported, ...
    detail: str  # the message without the field path

    def __str__(self) -> str:
        return f"{self.field}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Target:
    """What a resource URL points at: ``/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}/{sub}``."""

    resource: kmock.resource
    namespace: str | None
    name: str | None
    subresource: str | None

    @property
    def qualified(self) -> str:
        """``plural.group`` (``plural`` for the core group), as error messages name a resource."""
        group = self.resource.group
        return f"{self.resource.plural}.{group}" if group else str(self.resource.plural)

    @property
    def api_version(self) -> str:
        return api_version(self.resource)


@dataclass(frozen=True, slots=True)
class Change:
    """One write as watchers see it; ``old`` lets a label-filtered watch tell entering from leaving."""

    rv: int
    resource: kmock.resource
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None


def parse_target(path: str) -> Target | None:
    """Split a resource URL; ``None`` for anything else (discovery, ``/version``, ...)."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    # /api/v1/namespaces/{name}/status is the namespace's own subresource, not a resource in it.
    own_subresource = group == "" and len(rest) == 3 and rest[2] in ("status", "finalize")
    if rest[0] == "namespaces" and len(rest) >= 3 and not own_subresource:
        namespace, rest = rest[1], rest[2:]
    return Target(kmock.resource(group, version, rest[0]), namespace,
                  rest[1] if len(rest) > 1 else None, "/".join(rest[2:]) or None)


def verb(method: str, target: Target, params: dict[str, str]) -> str | None:
    """The Kubernetes verb of a request: list, watch, get, create, update, patch, delete, ..."""
    method = method.upper()
    if method == "GET":
        if params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if target.name else "list"
    return {"POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete" if target.name else "deletecollection"}.get(method)


def watch_event(change: Change, resource: kmock.resource, match: Predicate) -> dict[str, Any] | None:
    """The event a watcher of ``resource`` filtered by ``match`` gets for a change, if any."""
    if change.resource != resource:
        return None
    now, before = match(change.obj), change.old is not None and match(change.old)
    kind = change.type
    if kind == "MODIFIED" and now != before:
        kind = "ADDED" if now else "DELETED"  # the object entered or left the selection
    elif not now and not (kind == "DELETED" and before):
        return None
    return {"type": kind, "object": change.obj}


# selectors

def label_selector(text: str) -> Callable[[dict[str, str]], bool]:
    """A predicate over labels for a label selector (``=``, ``!=``, ``in``, ``notin``, ``k``, ``!k``)."""
    tests: list[Callable[[dict[str, str]], bool]] = []
    for term in filter(None, (t.strip() for t in re.split(r",(?![^()]*\))", text))):
        m = _REQUIREMENT.fullmatch(term)
        if m is None or (m["neg"] and (m["op"] or m["set"])):
            raise api_error(400, "BadRequest", f"unable to parse requirement: {term!r}")
        key, value = m["key"], m["value"]
        values = {v.strip() for v in (m["values"] or "").split(",")}
        if m["neg"]:
            tests.append(lambda labels, k=key: k not in labels)
        elif m["op"] in ("=", "=="):
            tests.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif m["op"] == "!=":
            tests.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif m["set"] == "in":
            tests.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
        elif m["set"] == "notin":
            tests.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        else:
            tests.append(lambda labels, k=key: k in labels)
    return lambda labels: all(test(labels) for test in tests)


def selector_text(selector: dict[str, Any]) -> str:
    """A ``LabelSelector`` (``matchLabels``, ``matchExpressions``) in the text form of ``?labelSelector=``."""
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), ",".join(sorted(expr.get("values") or ()))
        terms.append({"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})",
                      "Exists": str(key), "DoesNotExist": f"!{key}"}.get(op, f"{key} {op}"))
    return ",".join(terms)


def field_selector(text: str) -> Predicate:
    """A predicate over objects for a field selector such as ``metadata.name=x,status.phase!=Failed``."""
    tests: list[Predicate] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        m = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)", term)
        if m is None:
            raise api_error(400, "BadRequest", f"invalid field selector: {term!r}")
        path, op, value = m.groups()
        tests.append(lambda obj, p=path, v=value, eq=op != "!=": (_field(obj, p) == v) == eq)
    return lambda obj: all(test(obj) for test in tests)


def _field(obj: Any, path: str) -> str:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return "" if obj is None else json.dumps(obj) if isinstance(obj, bool) else str(obj)


# patches

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strip_directives(patch: Any) -> Any:
    """A strategic merge patch without its directives (``$patch``, ``$setElementOrder/...``)."""
    if isinstance(patch, dict):
        return {k: strip_directives(v) for k, v in patch.items() if not k.startswith("$")}
    if isinstance(patch, list):
        return [strip_directives(v) for v in patch if not (isinstance(v, dict) and "$patch" in v and len(v) == 1)]
    return patch


@dataclass(frozen=True, slots=True)
class MergeList:
    """A list that a strategic merge patch merges (``patchStrategy: merge`` in ``k8s.io/api``).

    ``key`` is its ``patchMergeKey`` (``None``: a list of scalars merged as a set); ``items`` is
    the strategic schema of its elements. Lists not declared this way are replaced whole.
    """

    key: str | None
    items: dict[str, Any] | None = None


Strategic = dict[str, "Strategic | MergeList"]

_METADATA: Strategic = {"ownerReferences": MergeList("uid"), "finalizers": MergeList(None)}
_CONTAINER: Strategic = {"env": MergeList("name"), "ports": MergeList("containerPort"),
                         "volumeMounts": MergeList("mountPath"), "volumeDevices": MergeList("devicePath")}
_POD_SPEC: Strategic = {
    "containers": MergeList("name", _CONTAINER), "initContainers": MergeList("name", _CONTAINER),
    "ephemeralContainers": MergeList("name", _CONTAINER), "volumes": MergeList("name"),
    "imagePullSecrets": MergeList("name"), "hostAliases": MergeList("ip"),
    "topologySpreadConstraints": MergeList("topologyKey")}
_CONDITIONS: Strategic = {"conditions": MergeList("type")}
_WORKLOAD: Strategic = {"metadata": _METADATA, "status": _CONDITIONS,
                        "spec": {"template": {"metadata": _METADATA, "spec": _POD_SPEC}}}
# The merging lists of the built-in kinds (their Go types' struct tags); any other kind merges
# only its metadata's lists.
STRATEGIC_SCHEMAS: dict[tuple[str, str], Strategic] = {
    ("", "pods"): {"metadata": _METADATA, "spec": _POD_SPEC,
                   "status": {"conditions": MergeList("type"), "podIPs": MergeList("ip")}},
    ("", "services"): {"metadata": _METADATA, "spec": {"ports": MergeList("port")}},
    ("", "nodes"): {"metadata": _METADATA, "status": {"conditions": MergeList("type"),
                                                      "addresses": MergeList("type")}},
    ("apps", "deployments"): _WORKLOAD, ("apps", "replicasets"): _WORKLOAD,
    ("apps", "statefulsets"): _WORKLOAD, ("apps", "daemonsets"): _WORKLOAD, ("batch", "jobs"): _WORKLOAD,
}


def strategic_schema(resource: kmock.resource) -> Strategic:
    return STRATEGIC_SCHEMAS.get((resource.group, str(resource.plural)), {"metadata": _METADATA})


def strategic_merge(target: Any, patch: Any, schema: Strategic, path: str = "") -> Any:
    """Apply a strategic merge patch: a merge patch whose declared lists merge by their key.

    The directives kubectl and kubelet send are honoured: ``$patch: replace|delete`` on a map or
    in a list, ``$setElementOrder/<list>``, ``$deleteFromPrimitiveList/<list>``, ``$retainKeys``.
    Raises ``StrategicError`` naming the field for a patch that cannot apply.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return strip_directives({k: v for k, v in patch.items() if k != "$patch"})
    if directive is not None:
        raise StrategicError(path or "<root>", f"unknown or misplaced patch directive {directive!r}")
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        sub = schema.get(key)
        where = f"{path}.{key}" if path else key
        if value is None:
            result.pop(key, None)
        elif isinstance(sub, MergeList) and isinstance(value, list):
            result[key] = _merge_list(result.get(key) if isinstance(result.get(key), list) else [], value, sub, where)
        elif isinstance(value, dict) and value.get("$patch") == "delete":
            result.pop(key, None)
        elif isinstance(value, dict):
            result[key] = strategic_merge(result.get(key), value, sub if isinstance(sub, dict) else {}, where)
        else:
            result[key] = strip_directives(value)
    for key, value in patch.items():
        name = key.partition("/")[2]
        if key.startswith("$deleteFromPrimitiveList/") and isinstance(result.get(name), list):
            result[name] = [v for v in result[name] if v not in value]
        elif key.startswith("$setElementOrder/") and isinstance(result.get(name), list):
            sub = schema.get(name)
            result[name] = _ordered(result[name], value, sub.key if isinstance(sub, MergeList) else None)
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


class StrategicError(ValueError):
    """A strategic merge patch that cannot apply; ``field`` is where."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field}: {detail}")
        self.field = field


def _merge_list(target: list[Any], patch: list[Any], spec: MergeList, path: str) -> list[Any]:
    if any(isinstance(v, dict) and v.get("$patch") == "replace" for v in patch):
        return strip_directives([v for v in patch if not (isinstance(v, dict) and "$patch" in v)])
    if spec.key is None:
        return list(target) + [strip_directives(v) for v in patch if v not in target]
    result = list(target)
    for i, item in enumerate(patch):
        where = f"{path}[{i}]"
        if not isinstance(item, dict) or spec.key not in item:
            raise StrategicError(where, f"does not contain declared merge key: {spec.key}")
        at = next((j for j, old in enumerate(result) if isinstance(old, dict)
                   and old.get(spec.key) == item[spec.key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del result[at]
        elif at is None:
            result.append(strategic_merge(None, item, spec.items or {}, where))
        else:
            result[at] = strategic_merge(result[at], item, spec.items or {}, where)
    return result


def _ordered(items: list[Any], order: list[Any], key: str | None) -> list[Any]:
    """``items`` with those named in ``order`` first, in that order; the rest after, as they were."""
    def identity(item: Any) -> Any:
        return item.get(key) if key is not None and isinstance(item, dict) else item
    wanted = [identity(o) for o in order]
    rank = {json.dumps(w, sort_keys=True): i for i, w in enumerate(wanted)}
    return sorted(items, key=lambda item: rank.get(json.dumps(identity(item), sort_keys=True), len(rank)))


# names and versions

def name_error(resource: kmock.resource, name: Any) -> FieldError | None:
    """Why ``name`` cannot name an object of ``resource``, or ``None`` if it can."""
    if not name:
        return FieldError("metadata.name", "FieldValueRequired", "Required value: name or generateName is required")
    if not isinstance(name, str):
        return FieldError("metadata.name", "FieldValueInvalid", f"Invalid value: {json.dumps(name)}")
    if resource.group == "rbac.authorization.k8s.io":  # role names may hold colons: path segments
        ok = name not in (".", "..") and not {"/", "%"} & set(name)
        rule = 'may not contain "/" or "%" or be "." or ".."'
    elif resource == kmock.resource("", "v1", "namespaces"):
        ok = len(name) <= 63 and re.fullmatch(_DNS_LABEL, name) is not None
        rule = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
                "and must start and end with an alphanumeric character")
    else:
        ok = len(name) <= 253 and re.fullmatch(_DNS_SUBDOMAIN, name) is not None
        rule = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                "and must start and end with an alphanumeric character")
    return None if ok else FieldError("metadata.name", "FieldValueInvalid", f'Invalid value: "{name}": {rule}')


def api_version(resource: kmock.resource) -> str:
    return f"{resource.group}/{resource.version}" if resource.group else str(resource.version)


def version_priority(version: str) -> tuple[int, int, int]:
    """Sort key for API versions: v2 > v1 > v1beta2 > v1beta1 > v1alpha1 > anything else."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if m is None:
        return (-1, 0, 0)
    stage = {"alpha": 0, "beta": 1, None: 2}[m[2]]
    return stage, int(m[1]), int(m[3] or 0)


def sort_key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# errors, as Status objects

def api_error(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> kmock.KubernetesError:
    """An error the API server answers with a ``Status`` body."""
    return kmock.KubernetesError(code, reason, message, details)


def not_found(message: str, target: Target) -> kmock.KubernetesError:
    return api_error(404, "NotFound", message, details(target))


def conflict(target: Target) -> kmock.KubernetesError:
    return api_error(409, "Conflict", f'Operation cannot be fulfilled on {target.qualified} "{target.name}": the '
                     "object has been modified; please apply your changes to the latest version and try again",
                     details(target))


def invalid(target: Target, kind: str, errors: list[FieldError]) -> kmock.KubernetesError:
    """422 Invalid, worded like ``Widget.example.com "w1" is invalid: spec.size: Invalid value: ...``."""
    qualified_kind = f"{kind}.{target.resource.group}" if target.resource.group else kind
    summary = str(errors[0]) if len(errors) == 1 else f"[{', '.join(map(str, errors))}]"
    causes = [{"reason": e.reason, "message": e.detail, "field": e.field} for e in errors]
    return api_error(422, "Invalid", f'{qualified_kind} "{target.name}" is invalid: {summary}',
                     details(target) | {"kind": kind, "causes": causes})


def details(target: Target) -> dict[str, Any]:
    return {"name": target.name, "group": target.resource.group, "kind": target.resource.plural}


def status(code: int, reason: str | None, message: str | None, detail: Any = None) -> dict[str, Any]:
    """A failure ``Status`` object, as error bodies and watch ERROR events carry it."""
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}
    return body | ({"details": detail} if detail else {})
