"""OpenAPI v3 documents, as kube-apiserver publishes them under ``/openapi/v3``.

kubectl needs them: ``kubectl apply`` (``--validate=strict``, its default) reads the document of
the object's group/version to learn that the server validates fields itself (the ``fieldValidation``
parameter of the kind's PATCH operation), then sends ``fieldValidation=Strict``, so an unknown
field is refused by the server; without a document it refuses to apply at all. ``kubectl explain``
prints a kind's schema from the same document.

A custom resource's schema is its CRD version's ``openAPIV3Schema`` with the envelope kube-apiserver
adds (``apiVersion``, ``kind``, ``metadata`` as ObjectMeta, ``x-kubernetes-group-version-kind``).
The built-in kinds take Kubernetes 1.32's own schemas from the ``kubernetes-validate`` package when
it is installed; a kind without a known schema (KMock's HTTPRoute, say) is published as an object
that keeps any field.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.resources
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from graft.devcluster.crd import CrdVersion

KUBE_SCHEMAS = "v1.32.0-local"  # the kubernetes-validate folder matching the emulated server version
_META = "io.k8s.apimachinery.pkg.apis.meta.v1"
_REF = "#/components/schemas/"
_API_VERSION = ("APIVersion defines the versioned schema of this representation of an object. Servers should "
                "convert recognized schemas to the latest internal value, and may reject unrecognized values.")
_KIND = ("Kind is a string value representing the REST resource this object represents. Servers may infer "
         "this from the endpoint the client submits requests to. Cannot be updated. In CamelCase.")
_FALLBACK_META = {
    f"{_META}.ObjectMeta": {"description": "ObjectMeta is metadata that all persisted resources must have.",
                            "type": "object", "x-kubernetes-preserve-unknown-fields": True,
                            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                           "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                           "annotations": {"type": "object",
                                                           "additionalProperties": {"type": "string"}}}},
    f"{_META}.ListMeta": {"description": "ListMeta describes metadata that synthetic resources must have.",
                          "type": "object", "x-kubernetes-preserve-unknown-fields": True},
}


@dataclass(frozen=True, slots=True)
class Resource:
    """What a group/version document says of one resource."""

    plural: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...]
    crd: CrdVersion | None  # None: a built-in kind


def document(group: str, version: str, resources: Iterable[Resource]) -> dict[str, Any]:
    """The OpenAPI v3 document of one group/version: its paths and the schemas of its kinds."""
    kube = _kube_schemas()
    schemas: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for res in resources:
        gvk = {"group": group, "version": version, "kind": res.kind}
        name, list_name = _schema_names(group, version, res.kind)
        if res.crd is not None:
            schemas[name] = _crd_schema(res.crd.schema or {"type": "object"}, gvk)
        elif name in kube:
            schemas[name] = kube[name]
        else:
            loose = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
            schemas[name] = {**loose, "x-kubernetes-group-version-kind": [gvk], "properties": {
                **_envelope(f"{_META}.ObjectMeta"), "spec": loose, "status": loose}}
        schemas[list_name] = (kube.get(list_name) if res.crd is None else None) or _list_schema(
            name, group, version, res.kind)
        paths.update(_paths(group, version, res, gvk, name, list_name))
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"}, "paths": paths,
            "components": {"schemas": _closure(schemas, kube)}}


def digest(doc: dict[str, Any]) -> str:
    """The ``hash`` a client caches a document by: it changes whenever the document does."""
    return hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest().upper()


def discovery(hashes: dict[str, str]) -> dict[str, Any]:
    """``/openapi/v3``: each group/version's document URL (``api/v1``, ``apis/g/v``) with its hash."""
    return {"paths": {path: {"serverRelativeURL": f"/openapi/v3/{path}?hash={h}"}
                      for path, h in sorted(hashes.items())}}


def _schema_names(group: str, version: str, kind: str) -> tuple[str, str]:
    """The component names of a kind and its list: Kubernetes' own, or ``dev.graft.v1alpha1.PatchRollout``."""
    name = _kube_kinds().get((group, version, kind))
    if name is None:
        prefix = ".".join(reversed(group.split("."))) if group else "io.k8s.api.core"
        name = f"{prefix}.{version}.{kind}"
    return name, f"{name}List"


@functools.cache
def _kube_kinds() -> dict[tuple[str, str, str], str]:
    return {(gvk["group"], gvk["version"], gvk["kind"]): name for name, schema in _kube_schemas().items()
            for gvk in schema.get("x-kubernetes-group-version-kind", ())}


def _envelope(meta_ref: str) -> dict[str, Any]:
    return {"apiVersion": {"type": "string", "description": _API_VERSION},
            "kind": {"type": "string", "description": _KIND},
            "metadata": {"allOf": [{"$ref": _REF + meta_ref}], "description": "Standard object's metadata."}}


def _crd_schema(schema: dict[str, Any], gvk: dict[str, str]) -> dict[str, Any]:
    out = copy.deepcopy(schema)
    out.setdefault("type", "object")
    out["properties"] = {**out.get("properties", {}), **_envelope(f"{_META}.ObjectMeta")}
    out["x-kubernetes-group-version-kind"] = [gvk]
    return out


def _list_schema(item: str, group: str, version: str, kind: str) -> dict[str, Any]:
    return {"description": f"{kind}List is a list of {kind}", "type": "object", "required": ["items"],
            "properties": {**_envelope(f"{_META}.ListMeta"),
                           "items": {"type": "array", "items": {"$ref": _REF + item}}},
            "x-kubernetes-group-version-kind": [{"group": group, "version": version, "kind": f"{kind}List"}]}


def _paths(group: str, version: str, res: Resource, gvk: dict[str, str], name: str,
           list_name: str) -> dict[str, Any]:
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    scope = f"{base}/namespaces/{{namespace}}/{res.plural}" if res.namespaced else f"{base}/{res.plural}"
    params = [_param("namespace", "path")] if res.namespaced else []
    writes = [_param("dryRun"), _param("fieldManager"), _param("fieldValidation")]
    one = _schema_ref(name)

    def op(action: str, reply: dict[str, Any], extra: list[dict[str, Any]] = (), body: bool = False) -> dict[str, Any]:
        entry = {"operationId": f"{action}{res.kind}", "x-kubernetes-action": action,
                 "x-kubernetes-group-version-kind": gvk, "parameters": list(extra),
                 "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": reply}}}}}
        if body:
            media = ("application/json-patch+json", "application/merge-patch+json",
                     "application/strategic-merge-patch+json") if action == "patch" else ("application/json",)
            schema = {"type": "object"} if action == "patch" else one
            entry["requestBody"] = {"content": {m: {"schema": schema} for m in media}, "required": True}
        return entry

    item = {"parameters": [*params, _param("name", "path")],
            "get": op("get", one), "put": op("put", one, writes, body=True),
            "patch": op("patch", one, [*writes, _param("force")], body=True),
            "delete": op("delete", {"type": "object"}, [_param("dryRun")])}
    paths = {scope: {"parameters": params, "get": op("list", _schema_ref(list_name), [_param("labelSelector")]),
                     "post": op("post", one, writes, body=True)},
             f"{scope}/{{name}}": item}
    for sub in res.subresources:
        paths[f"{scope}/{{name}}/{sub}"] = {"parameters": item["parameters"], "get": op("get", one),
                                            "put": op("put", one, writes, body=True),
                                            "patch": op("patch", one, [*writes, _param("force")], body=True)}
    return paths


def _param(name: str, where: str = "query") -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "schema": {"type": "string"},
            "description": {"fieldValidation": "Strict, Warn or Ignore: what the server does with unknown fields"}
            .get(name, name)}


def _schema_ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF + name}


def _closure(schemas: dict[str, Any], kube: dict[str, Any]) -> dict[str, Any]:
    """The schemas plus every Kubernetes schema they refer to, however deeply."""
    out = dict(schemas)
    todo = list(schemas.values())
    while todo:
        for ref in _refs(todo.pop()):
            if ref not in out:
                out[ref] = kube.get(ref) or _FALLBACK_META.get(ref) or {"type": "object"}
                todo.append(out[ref])
    return out


def _refs(value: Any) -> Iterable[str]:
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith(_REF):
            yield ref[len(_REF):]
        for item in value.values():
            yield from _refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)


@functools.cache
def _kube_schemas() -> dict[str, Any]:
    """Kubernetes' own schemas (``io.k8s.api.core.v1.Pod``, ...) as OpenAPI v3 components, if available."""
    try:
        root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema" / KUBE_SCHEMAS
        defs = json.loads((root / "_definitions.json").read_text())["$defs"]
    except (ModuleNotFoundError, FileNotFoundError, KeyError, json.JSONDecodeError):
        return {}
    return {name: _openapi(schema) for name, schema in defs.items()}


def _openapi(schema: dict[str, Any]) -> dict[str, Any]:
    """kubernetes-validate's JSON Schema (2020-12) back into the OpenAPI v3 kube-apiserver publishes."""
    if "$ref" in schema:
        ref = {"$ref": _REF + schema["$ref"].rsplit("/", 1)[-1]}
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        return {"allOf": [ref], **siblings} if siblings else ref
    alternatives = schema.get("oneOf") or ()
    if alternatives and all("type" in alt for alt in alternatives):  # IntOrString, Quantity
        types = {t for alt in alternatives for t in _types(alt["type"])}
        kept = {k: v for k, v in schema.items() if k != "oneOf"}
        return {**kept, "type": "string", **({"x-kubernetes-int-or-string": True} if "integer" in types else {})}
    out = dict(schema)
    if "type" in out:
        out["type"] = (_types(out["type"]) or ["object"])[0]
    if isinstance(out.get("properties"), dict):
        # kubernetes-validate pins apiVersion and kind with an enum; the API server publishes none
        out["properties"] = {name: _openapi({k: v for k, v in sub.items() if not (k == "enum" and name in (
            "apiVersion", "kind"))}) for name, sub in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _openapi(out[key])
    return out


def _types(value: Any) -> list[str]:
    return [t for t in ([value] if isinstance(value, str) else value) if t != "null"]
