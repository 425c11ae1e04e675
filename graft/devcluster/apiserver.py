"""A local Kubernetes API server: KMock's emulator taught to behave like kube-apiserver.

kopf and kubectl talk to it as to a real cluster. What it does the way kube-apiserver does:

- discovery (``/version``, ``/api``, ``/apis`` and every group/version, with or without the
  trailing slash) for the built-in kinds KMock bundles (pods, services, configmaps, secrets,
  namespaces, events in ``v1`` and ``events.k8s.io``, leases, deployments, RBAC, Gateway API
  HTTPRoutes, ...) and for every CustomResourceDefinition created (by a POST, or from files);
- namespaces: ``default``, ``kube-system``, ``kube-public``, ``kube-node-lease`` from the start;
  a namespaced object can only be created in an existing namespace; deleting a namespace deletes
  what is in it;
- create (``generateName``, ``uid``, ``creationTimestamp``, ``generation``), get, list, watch,
  replace (PUT), merge / JSON / strategic patches, finalizer-aware delete, ``dryRun=All``; a
  strategic merge patch merges the lists the built-in kinds declare mergeable by their key (a pod's
  ``status.conditions`` by ``type``, its containers by ``name``, ...) and honours its directives;
- the ``scale`` subresource of Deployments, ReplicaSets and StatefulSets (``kubectl scale``);
- one global ``resourceVersion``, bumped by every write; a JSON patch whose ``test`` fails, and a
  stale ``resourceVersion`` in a patch or a PUT, are refused (422 / 409), as is a delete whose
  DeleteOptions ``preconditions`` (``uid``, ``resourceVersion``) the object no longer meets (409);
- lists carry ``kind``, ``apiVersion`` and ``resourceVersion`` and page with ``limit``/``continue``;
  watches resume from ``?resourceVersion=`` (410 Gone once it is too old), honour
  ``sendInitialEvents`` and ``timeoutSeconds``, and turn label changes into ADDED/DELETED events;
- label selectors (``=``, ``!=``, ``in``, ``notin``, ``key``, ``!key``) and field selectors on
  lists and watches;
- custom resources pruned, defaulted and validated against the CRD's ``openAPIV3Schema`` on
  create, replace and patch (see :mod:`graft.devcluster.crd`): patterns matched as Go's RE2,
  ``x-kubernetes-list-type`` map keys and set values kept unique, CEL rules
  (``x-kubernetes-validations``, :mod:`graft.devcluster.cel`) evaluated, transition rules against
  the old object, ``/status`` writes included; refused with 422 ``Invalid`` and the field paths.
  A CRD whose rules do not compile is itself refused. ``fieldValidation=Strict`` refuses unknown
  fields;
- the status subresource isolated, for every kind that has one: a write to the main resource
  keeps the stored ``status``, a write to ``/status`` changes nothing but ``status``. No kubelet
  runs here: whoever plays one writes a pod's ``status`` (its IP, its phase) through ``/status``;
- server-side tables for ``kubectl get`` (a CRD's printer columns, the built-in columns of pods,
  services, deployments, ..., see :mod:`graft.devcluster.tables`), for lists, gets and watches;
- OpenAPI v3 (``/openapi/v3``, see :mod:`graft.devcluster.openapi`), so ``kubectl apply``
  validates as against a cluster (unknown fields of custom resources refused by the server) and
  ``kubectl explain`` works.

What it does not do: authentication and RBAC (everyone may do everything), admission webhooks,
version conversion, validation ratcheting, CEL cost limits, ``format`` checks, strategic merge of
custom resources (applied as a merge patch; kube-apiserver refuses it), a CRD's scale subresource,
server-side apply, OpenAPI v2, schema validation of built-in kinds (unknown fields of a Pod are
kept), protobuf bodies (415: kubectl's imperative ``create namespace/configmap/...`` send protobuf,
so use ``kubectl apply -f``), controllers (nothing here creates pods for a Deployment:
:mod:`graft.devcluster.podrunner` plays the controllers and the kubelet).

Run it in a test's event loop (``async with ApiServer(crd_paths=[...]) as api``) or as a process
for kubectl in another terminal: ``python -m graft.devcluster.apiserver --port 6443 --crds crds/
--kubeconfig /tmp/graft.kubeconfig``. A request answered by a KMock reaction never reaches the
store, so a test can inject faults: ``api[kmock.method.PATCH, kmock.resource("graft.dev",
"v1alpha1", "patchrollouts")][:2] << 503`` fails the next two patches of PatchRollouts.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import functools
import json
import os
import re
import signal
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Self

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import yaml
from kmock._internal import rendering as kmock_rendering  # StreamingError, for __call__

from graft.devcluster import openapi, tables
from graft.devcluster.apimachinery import (FieldError, Predicate, StrategicError, Target, api_error, conflict, details,
                                           field_selector, invalid, label_selector, merge_patch, not_found,
                                           parse_target, selector_text, sort_key, status, strategic_merge,
                                           strategic_schema, strip_directives, verb, version_priority,
                                           watch_event)
from graft.devcluster.kubeconfig import write_kubeconfig
from graft.devcluster.podlogs import read_container_log
from graft.devcluster.store import CRDS, NAMESPACES, VERBS, ObjectStore

CORE_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
SERVER_VERSION = {"major": "1", "minor": "32", "emulationMajor": "1", "emulationMinor": "32",
                  "minCompatibilityMajor": "1", "minCompatibilityMinor": "31", "gitVersion": "v1.32.0",
                  "gitCommit": "0" * 40, "gitTreeState": "clean", "buildDate": "2024-12-11T00:00:00Z",
                  "goVersion": "go1.23.3", "compiler": "gc", "platform": "linux/amd64"}
_JSON = {"Content-Type": "application/json"}
_PATCHES = ("application/json-patch+json", "application/merge-patch+json", "application/strategic-merge-patch+json")
# A pod's log (kubectl logs), served as text from the pod runner's files.
_POD_LOG = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/log")

# Kinds whose ``/scale`` subresource is served (``kubectl scale``, autoscalers): spec.replicas, as a Scale.
_SCALABLE = {kmock.resource("apps", "v1", plural) for plural in ("deployments", "replicasets", "statefulsets")}


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """The emulated API server; ``async with`` it to serve on ``host:port`` (0: any free port).

    ``crd_paths`` are CRD manifests (files or folders of ``*.yaml``/``*.json``) created at start,
    ``namespaces`` the namespaces that exist from the start. ``history_limit`` bounds the request
    and object histories KMock keeps for assertions (a long-running server sets it).
    """

    crd_paths: Sequence[str | os.PathLike[str]] = ()
    host: str = "127.0.0.1"
    port: int = 0
    namespaces: Sequence[str] = CORE_NAMESPACES
    history_limit: int | None = None
    pod_logs_dir: Path | None = None

    _store: ObjectStore = attrs.field(init=False)
    _stopping: bool = attrs.field(default=False, init=False)
    _server: kmock.Server | None = attrs.field(default=None, init=False)
    _openapi: dict[str, tuple[int, dict[str, Any], str]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        # The stock emulator's own routes and write interception are replaced, not extended:
        # only the scaffold (discovery, the 404 fallback) is kept, with the methods overridden below.
        kmock.KubernetesScaffold.__attrs_post_init__(self)
        self.resources.load_bundled()
        self._store = ObjectStore(self._objects, self.resources, self.history_limit)
        self.fallback["get /version/"] << self._serve_server_version
        self.fallback["get /api/"] << self._serve_api
        self.fallback["get /apis/"] << self._serve_apis
        self.fallback["get", re.compile(r"/openapi/v3/?")] << self._serve_openapi_paths
        self.fallback["get", re.compile(r"/openapi/v3/apis?/.+")] << self._serve_openapi
        routes = {"list": self._serve_list, "watch": self._serve_watch, "get": self._serve_get,
                  "create": self._serve_create, "update": self._serve_update, "patch": self._serve_patch,
                  "delete": self._serve_delete, "deletecollection": self._serve_delete_collection}
        for name, serve in routes.items():
            code = 201 if name == "create" else 200
            self.fallback[functools.partial(_is_verb, name)] << code << _JSON << serve

    # lifecycle

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        if self._server is None:
            try:
                self._stopping = False
                self._bootstrap()
                server = kmock.Server(self, host=self.host, port=self.port or None)
                await server.__aenter__()
                self._server = server
            except BaseException:
                await super().__aexit__(None, None, None)
                raise
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._entered == 1 and self._server is not None:
            self._stopping = True  # ends open watch streams, so the server can close at once
            self._store.wake()
            server, self._server = self._server, None
            await server.__aexit__(exc_type, exc, tb)
        await super().__aexit__(exc_type, exc, tb)

    @property
    def url(self) -> str:  # type: ignore[override]
        """The base URL clients use, e.g. ``http://127.0.0.1:41234``."""
        if self._server is None:
            raise RuntimeError("the API server is not serving: use it as `async with ApiServer(...)`")
        return str(self._server.url).rstrip("/")

    def write_kubeconfig(self, path: str | os.PathLike[str], *, namespace: str = "default") -> Path:
        """Write a kubeconfig pointing at this server; return its path."""
        return write_kubeconfig(path, self.url, namespace=namespace)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create an object in-process, with the same admission as a POST; return it as stored."""
        api_version, kind = body.get("apiVersion", ""), body.get("kind")
        group, _, version = api_version.rpartition("/")
        for resource, info in self.resources.items():
            if (resource.group, resource.version, info.kind) == (group, version, kind):
                namespace = (body.get("metadata") or {}).get("namespace", "default") if info.namespaced else None
                return self._store.create(Target(resource, namespace, None, None), body, {})
        raise ValueError(f"no resource serves apiVersion {api_version!r} kind {kind!r}")

    def _bootstrap(self) -> None:
        for name in self.namespaces:
            if self._store.live(NAMESPACES, None, name) is None:
                self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        for path, doc in _manifests(self.crd_paths):
            if doc.get("kind") != "CustomResourceDefinition":
                raise ValueError(f"{path}: not a CustomResourceDefinition (kind: {doc.get('kind')!r})")
            if self._store.live(CRDS, None, (doc.get("metadata") or {}).get("name")) is not None:
                continue  # entered again: the CRD is still here
            try:
                self.create(doc)
            except kmock.KubernetesError as e:
                raise ValueError(f"{path}: {e.message}") from None

    # discovery

    async def _serve_server_version(self, request: kmock.Request) -> dict[str, Any]:
        return SERVER_VERSION

    async def _serve_api(self, request: kmock.Request) -> dict[str, Any]:
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{request.url.host}:{request.url.port}"}]}

    async def _serve_apis(self, request: kmock.Request) -> dict[str, Any]:
        groups = sorted({res.group for res in self.resources if res.group})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [self._group(g) for g in groups]}

    async def _serve_group(self, request: kmock.Request) -> dict[str, Any]:
        group = request.url.path.strip("/").split("/")[1]
        if not any(res.group == group for res in self.resources):
            raise kmock.KubernetesResourceNotFoundError()
        return {"kind": "APIGroup", "apiVersion": "v1", **self._group(group)}

    async def _serve_version(self, request: kmock.Request) -> dict[str, Any]:
        parts = request.url.path.strip("/").split("/")
        group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2])
        found = sorted(((res, info) for res, info in self.resources.items()
                        if (res.group, res.version) == (group, version)), key=lambda item: str(item[0].plural))
        if not found:
            raise kmock.KubernetesResourceNotFoundError()
        entries = []
        for res, info in found:
            base = {"name": res.plural, "singularName": info.singular or "", "namespaced": bool(info.namespaced),
                    "kind": info.kind, "verbs": sorted(info.verbs or VERBS)}
            entries.append(base | {"shortNames": sorted(info.shortnames), "categories": sorted(info.categories)})
            entries += [base | {"name": f"{res.plural}/{sub}", "singularName": "", "verbs": ["get", "patch", "update"]}
                        | ({"group": "autoscaling", "version": "v1", "kind": "Scale"} if sub == "scale" else {})
                        for sub in sorted(info.subresources)]
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version, "resources": entries}

    async def _serve_root(self, request: kmock.Request) -> dict[str, Any]:
        paths = {"/api", "/api/v1", "/apis", "/version", "/openapi/v3"}
        paths |= {p for res in self.resources if res.group for p in (f"/apis/{res.group}",
                                                                     f"/apis/{res.group}/{res.version}")}
        return {"paths": sorted(paths)}

    async def _serve_openapi_paths(self, request: kmock.Request) -> dict[str, Any]:
        gvs = {(res.group, str(res.version)) for res in self.resources}
        return openapi.discovery({_gv_path(g, v): self._openapi_doc(g, v)[1] for g, v in gvs})

    async def _serve_openapi(self, request: kmock.Request) -> dict[str, Any]:
        parts = request.url.path.strip("/").split("/")[2:]  # api/v1 or apis/{group}/{version}
        group, version = ("", parts[1]) if parts[0] == "api" and len(parts) == 2 else (
            (parts[1], parts[2]) if parts[0] == "apis" and len(parts) == 3 else ("", ""))
        if not any((res.group, res.version) == (group, version) for res in self.resources):
            raise kmock.KubernetesResourceNotFoundError()
        return self._openapi_doc(group, version)[0]

    def _openapi_doc(self, group: str, version: str) -> tuple[dict[str, Any], str]:
        """A group/version's OpenAPI document and its hash, rebuilt only after a CRD came or went."""
        cached = self._openapi.get(_gv_path(group, version))
        if cached is not None and cached[0] == self._store.epoch:
            return cached[1], cached[2]
        resources = [openapi.Resource(str(res.plural), str(info.kind), bool(info.namespaced),
                                      tuple(sorted(info.subresources)), self._store.crds.get(res))
                     for res, info in self.resources.items() if (res.group, res.version) == (group, version)]
        doc = openapi.document(group, version, sorted(resources, key=lambda r: r.plural))
        self._openapi[_gv_path(group, version)] = (self._store.epoch, doc, openapi.digest(doc))
        return doc, self._openapi[_gv_path(group, version)][2]

    def _group(self, group: str) -> dict[str, Any]:
        versions = sorted({str(res.version) for res in self.resources if res.group == group},
                          key=version_priority, reverse=True)
        docs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": docs, "preferredVersion": docs[0]}

    # reading

    async def _serve_get(self, request: kmock.Request) -> dict[str, Any]:
        target, _ = self._resolve(request, subresources=("status", "scale"))
        obj = self._store.existing(target)
        if target.subresource == "scale":
            return _scale_of(obj)
        version = tables.table_version(_header(request, "accept"))
        if version is not None:
            return tables.table(version, self._columns(target), [obj],
                                {"resourceVersion": obj["metadata"]["resourceVersion"]},
                                request.params.get("includeObject", "Metadata"))
        return obj

    async def _serve_list(self, request: kmock.Request) -> dict[str, Any]:
        target, info = self._resolve(request)
        match = _matcher(request, target)
        items = [obj for obj in self._store.items(target.resource, target.namespace) if match(obj)]
        meta: dict[str, Any] = {"resourceVersion": str(self._store.rv)}
        after = request.params.get("continue")
        if after:
            cursor = tuple(json.loads(base64.urlsafe_b64decode(after)))
            items = [obj for obj in items if sort_key(obj) > cursor]
        limit = int(request.params.get("limit") or 0)
        if 0 < limit < len(items):
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(sort_key(items[-1])).encode()).decode()
        version = tables.table_version(_header(request, "accept"))
        if version is not None:
            return tables.table(version, self._columns(target), items, meta,
                                request.params.get("includeObject", "Metadata"))
        return {"kind": f"{info.kind}List", "apiVersion": target.api_version, "metadata": meta, "items": items}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        store = self._store
        target, info = self._resolve(request)
        match = _matcher(request, target)
        since = request.params.get("resourceVersion") or "0"
        if not since.isdigit():
            raise api_error(400, "BadRequest", f"invalid resourceVersion: {since!r}")
        timeout = float(request.params.get("timeoutSeconds") or 0)
        deadline = asyncio.get_running_loop().time() + timeout if timeout > 0 else None
        bookmark = request.params.get("sendInitialEvents") == "true"
        initial = since == "0" or bookmark
        last = store.rv if initial else int(since)
        snapshot = [obj for obj in store.items(target.resource, target.namespace) if match(obj)] if initial else []
        as_table = self._table_events(request, target)
        yield b""  # send the headers now: a quiet watch is still a live one

        for obj in snapshot:
            yield as_table({"type": "ADDED", "object": obj})
        if bookmark:
            yield {"type": "BOOKMARK", "object": {"kind": info.kind, "apiVersion": target.api_version, "metadata": {
                "resourceVersion": str(last), "annotations": {"k8s.io/initial-events-end": "true"}}}}
        while not self._stopping:
            wakeup = store.wakeup
            if last < store.log_floor:  # this watcher fell behind what the log keeps
                yield {"type": "ERROR", "object": status(410, "Expired", f"too old resource version: {last}")}
                return
            changes = store.log[bisect.bisect_right(store.log, last, key=lambda change: change.rv):]
            for change in changes:
                last = change.rv
                event = watch_event(change, target.resource, match)
                if event is not None:
                    yield as_table(event)
            if changes:
                continue
            wait = None if deadline is None else deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(wakeup.wait(), wait)
            except TimeoutError:
                return

    # writing

    async def _serve_create(self, request: kmock.Request) -> dict[str, Any]:
        target, _ = self._resolve(request)
        return self._store.create(target, _body(request, dict), request.params)

    async def _serve_update(self, request: kmock.Request) -> dict[str, Any]:
        target, _ = self._resolve(request, subresources=("status", "scale"))
        old = self._store.existing(target)
        if target.subresource == "scale":
            return self._write_scale(target, old, _body(request, dict), request.params)
        return self._store.update(target, old, _body(request, dict), request.params)

    async def _serve_patch(self, request: kmock.Request) -> dict[str, Any]:
        target, _ = self._resolve(request, subresources=("status", "scale"))
        old = self._store.existing(target)
        if target.subresource == "scale":
            return self._write_scale(target, old, _patched(request, target, _scale_of(old), custom=False),
                                     request.params)
        patched = _patched(request, target, old, custom=target.resource in self._store.crds)
        return self._store.update(target, old, patched, request.params)

    def _write_scale(self, target: Target, old: dict[str, Any], scale: dict[str, Any],
                     params: dict[str, str]) -> dict[str, Any]:
        """Write a Scale's ``spec.replicas`` to its object (``resourceVersion``, when given, a precondition)."""
        replicas = (scale.get("spec") or {}).get("replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise invalid(target, "Scale", [FieldError("spec.replicas", "FieldValueInvalid", f"Invalid value: "
                          f"{json.dumps(replicas)}: must be greater than or equal to 0")])
        new = {**old, "spec": {**(old.get("spec") or {}), "replicas": replicas}}
        wanted = (scale.get("metadata") or {}).get("resourceVersion")
        if wanted:
            new["metadata"] = {**old["metadata"], "resourceVersion": wanted}
        main = Target(target.resource, target.namespace, target.name, None)
        return _scale_of(self._store.update(main, old, new, params))

    async def _serve_delete(self, request: kmock.Request) -> dict[str, Any]:
        target, info = self._resolve(request)
        old = self._store.existing(target)
        options = {} if request.data is None else _body(request, dict)   # DeleteOptions; curl may send none
        _check_preconditions(target, info.kind, old, options.get("preconditions"))
        return self._store.delete(target.resource, old, request.params)

    async def _serve_delete_collection(self, request: kmock.Request) -> dict[str, Any]:
        target, info = self._resolve(request)
        match = _matcher(request, target)
        deleted = [self._store.delete(target.resource, obj, request.params)
                   for obj in self._store.items(target.resource, target.namespace) if match(obj)]
        return {"kind": f"{info.kind}List", "apiVersion": target.api_version,
                "metadata": {"resourceVersion": str(self._store.rv)}, "items": deleted}

    def _columns(self, target: Target) -> tuple[list[dict[str, Any]], tables.Cells]:
        """The columns ``kubectl get`` prints for a resource: its CRD's printer columns, or the built-in ones."""
        version = self._store.crds.get(target.resource)
        if version is None:
            return tables.builtin_columns(target.resource.group, str(target.resource.plural))
        return tables.crd_columns(version.columns or [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}])

    def _table_events(self, request: kmock.Request, target: Target) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """How a watch sends its events: as they are, or as one-row Tables (column definitions only first)."""
        version = tables.table_version(_header(request, "accept"))
        if version is None:
            return lambda event: event
        columns, include, sent = self._columns(target), request.params.get("includeObject", "Metadata"), []

        def convert(event: dict[str, Any]) -> dict[str, Any]:
            obj = event["object"]
            row = tables.table(version, columns, [obj], {"resourceVersion": obj["metadata"]["resourceVersion"]},
                               include, headers=not sent)
            sent.append(True)
            return {"type": event["type"], "object": row}
        return convert

    def _resolve(self, request: kmock.Request, subresources: tuple[str, ...] = ()) -> tuple[Target, kmock.ResourceInfo]:
        target = parse_target(request.url.path)
        assert target is not None  # routed here only for resource URLs
        info = self._store.info(target)
        served = target.subresource in subresources and target.subresource in info.subresources
        if target.subresource == "scale" and target.resource not in _SCALABLE:
            served = False  # a CRD's scale subresource (its replicas paths) is not emulated
        if target.subresource is not None and not served:
            raise not_found(f"the server could not find the requested resource ({target.qualified}/"
                            f"{target.subresource} is not emulated)", target)
        return target, info

    # KMock plumbing

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # RawHandler.__call__, with two changes: a request KMock cannot parse is still served, and a
        # refused request (4xx) is the client's error, so it is not kept among the server's errors.
        raw_response: aiohttp.web.StreamResponse | None = None
        logs = _POD_LOG.fullmatch(raw_request.path) if raw_request.method == "GET" else None
        if logs is not None:
            return await self._serve_pod_log(raw_request, logs["ns"], logs["name"])
        try:
            request = await _parse_request(raw_request, len(self._requests))
            self._requests.append(request)
            if self.history_limit and len(self._requests) > 2 * self.history_limit:
                del self._requests[:-self.history_limit]
                for payload in self._payloads:
                    del payload._requests[:-self.history_limit]
            try:
                return await self._handle(request)
            except kmock_rendering.StreamingError as e:
                raw_response = e.args[0]
                raise e.__cause__ or e
        except Exception as e:
            if not self._errors:
                raise
            if not isinstance(e, kmock.KubernetesError) or e.status >= 500:
                self._errors[-1].append(e)
            if raw_response is None or not raw_response.prepared:
                return await self._render_error(e)
            await self._stream_error(e, raw_response)
            await raw_response.write_eof()
            return raw_response

    async def _serve_pod_log(self, raw: aiohttp.web.BaseRequest, namespace: str, name: str) -> aiohttp.web.StreamResponse:
        # kubectl logs: text, not JSON, so it is served beside KMock's JSON routes; the pod runner
        # writes each container's output to <pod_logs_dir>/<pod>.log.
        target = parse_target(f"/api/v1/namespaces/{namespace}/pods/{name}")
        try:
            assert target is not None
            self._store.existing(target)
            params = {key: raw.query.get(key) for key in ("tailLines", "limitBytes")}
            numbers = {}
            for key, value in params.items():
                if value is not None and not value.lstrip("-").isdigit():
                    raise ValueError(f"{key}: must be an integer, got {value!r}")
                numbers[key] = int(value) if value is not None else None
            text = b""
            if self.pod_logs_dir is not None:
                text = read_container_log(Path(self.pod_logs_dir) / f"{name}.log",
                                          tail_lines=numbers["tailLines"], limit_bytes=numbers["limitBytes"])
        except ValueError as e:
            body = status(400, "BadRequest", str(e), {})
            return aiohttp.web.json_response(body, status=400)
        except kmock.KubernetesError as e:
            return await self._render_error(e)
        return aiohttp.web.Response(body=text, content_type="text/plain")

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Skip the stock emulator's write interception: the routes above do the writes.
        return await kmock.RawHandler._handle(self, request)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if not isinstance(exc, kmock.KubernetesError) or exc.status >= 500:
            return await super()._render_error(exc)
        message = exc.message
        if type(exc) in (kmock.KubernetesEndpointNotFoundError, kmock.KubernetesResourceNotFoundError):
            message = "the server could not find the requested resource"
        reason = "NotFound" if exc.status == 404 else exc.reason
        return aiohttp.web.json_response(status(exc.status, reason, message, exc.details), status=exc.status)


async def _parse_request(raw_request: aiohttp.web.BaseRequest, id: int) -> kmock.Request:
    try:
        return await kmock.Request._parse(raw_request, id=id)
    except ValueError:
        # KMock's URL parser fails on bare collection URLs such as /api/v1/namespaces; the routes
        # parse URLs themselves, so a request without KMock's Kubernetes fields serves as well.
        try:
            data = await raw_request.json()
        except ValueError:
            data = None
        return kmock.Request(id=id, raw_request=raw_request, url=raw_request.url, method=raw_request.method,
                             params=dict(raw_request.query), headers=dict(raw_request.headers),
                             cookies=dict(raw_request.cookies), body=await raw_request.read(),
                             text=await raw_request.text(), data=data)


def _is_verb(name: str, request: kmock.Request) -> bool:
    target = parse_target(request.url.path)
    return target is not None and verb(str(request.method.value), target, request.params) == name


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _header(request: kmock.Request, name: str) -> str:
    return next((v for k, v in request.headers.items() if k.lower() == name), "")


def _content_type(request: kmock.Request) -> str:
    return _header(request, "content-type").split(";")[0].strip().lower()


def _matcher(request: kmock.Request, target: Target) -> Predicate:
    labels = label_selector(request.params.get("labelSelector", ""))
    fields = field_selector(request.params.get("fieldSelector", ""))

    def match(obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        return ((target.namespace is None or meta.get("namespace") == target.namespace)
                and (target.name is None or meta.get("name") == target.name)
                and labels(meta.get("labels") or {}) and fields(obj))
    return match


def _patched(request: kmock.Request, target: Target, old: dict[str, Any], *, custom: bool) -> dict[str, Any]:
    """``old`` with the request's patch applied (JSON, merge or strategic merge, by its content type).

    A strategic merge patch merges the lists a built-in kind declares mergeable by their key (a
    pod's ``status.conditions`` by ``type``). Custom resources have no such declarations: for them
    it is applied as a merge patch.
    """
    content_type = _content_type(request)
    if content_type == "application/json-patch+json":
        try:
            return jsonpatch.apply_patch(old, _body(request, list))
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
            raise api_error(422, "Invalid", f"the server rejected our request due to an error in our request: {e}")
    if content_type not in _PATCHES:
        raise api_error(415, "UnsupportedMediaType", "the body of the request was in an unknown format: "
                        f"{content_type or 'none'}; accepted media types include: {', '.join(_PATCHES)}")
    patch = _body(request, dict)
    wanted = (patch.get("metadata") or {}).get("resourceVersion")
    if wanted and wanted != old["metadata"]["resourceVersion"]:
        raise conflict(target)
    if content_type == "application/merge-patch+json":
        return merge_patch(old, patch)
    if custom:
        return merge_patch(old, strip_directives(patch))
    try:
        return strategic_merge(old, patch, strategic_schema(target.resource))
    except StrategicError as e:
        raise api_error(400, "BadRequest", f"the strategic merge patch does not apply: {e}") from None


def _scale_of(obj: dict[str, Any]) -> dict[str, Any]:
    """The ``autoscaling/v1`` Scale of a Deployment, ReplicaSet or StatefulSet."""
    meta, spec = obj["metadata"], obj.get("spec") or {}
    return {"kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                         if k in meta},
            "spec": {"replicas": int(spec.get("replicas", 1))},
            "status": {"replicas": int((obj.get("status") or {}).get("replicas", 0)),
                       "selector": selector_text(spec.get("selector") or {})}}


def _check_preconditions(target: Target, kind: str, obj: dict[str, Any], preconditions: Any) -> None:
    """Refuse a delete whose DeleteOptions ``preconditions`` name another ``uid`` or ``resourceVersion``
    than the object has now (it was recreated, or changed, since the client read it): 409 Conflict,
    worded as kube-apiserver's ``rest.BeforeDelete`` words it, which names the kind, not the plural."""
    if preconditions is None:
        return
    if not isinstance(preconditions, dict):
        raise api_error(400, "BadRequest", "preconditions: the DeleteOptions field must be a JSON object")
    meta = obj["metadata"]
    for field, label, why in (("uid", "UID", "deleted and then recreated"),
                              ("resourceVersion", "ResourceVersion", "modified")):
        wanted = preconditions.get(field)
        if wanted is not None and wanted != meta.get(field):
            qualified = f"{kind}.{target.resource.group}" if target.resource.group else kind
            raise api_error(409, "Conflict", f'Operation cannot be fulfilled on {qualified} "{target.name}": the '
                            f"{label} in the precondition ({wanted}) does not match the {label} in record "
                            f"({meta.get(field)}). The object might have been {why}",
                            details(target) | {"kind": kind})


def _body(request: kmock.Request, kind: type) -> Any:
    content_type = _content_type(request)
    if content_type and content_type != "application/json" and not content_type.endswith("+json"):
        raise api_error(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: "
                        f"{content_type}; only JSON is emulated")
    if not isinstance(request.data, kind):
        raise api_error(400, "BadRequest", f"the request body must be a JSON {'object' if kind is dict else 'array'}")
    return request.data


def _manifests(paths: Sequence[str | os.PathLike[str]]) -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"no such manifest file or folder: {path}")
        files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json")) if path.is_dir() else [path]
        for file in files:
            for doc in yaml.safe_load_all(file.read_text()):
                if doc:
                    yield file, doc


# standalone process

async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGINT/SIGTERM; print the URL once listening, write the kubeconfig if asked."""
    api = ApiServer(crd_paths=args.crds, host=args.host, port=args.port,
                    namespaces=[*CORE_NAMESPACES, *args.namespace], history_limit=1000)
    async with api:
        if args.kubeconfig:
            api.write_kubeconfig(args.kubeconfig)
        print(f"Kubernetes API emulator serving {api.url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m graft.devcluster.apiserver``: the emulator as a process for kubectl and operators."""
    parser = argparse.ArgumentParser(prog="python -m graft.devcluster.apiserver", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed at start)")
    parser.add_argument("--crds", action="append", default=[], metavar="PATH",
                        help="a CRD manifest or a folder of them (repeatable)")
    parser.add_argument("--namespace", action="append", default=[], metavar="NAME",
                        help="an extra namespace to create at start (repeatable)")
    parser.add_argument("--kubeconfig", metavar="PATH", help="write a kubeconfig for this server here")
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args))
    except (ValueError, OSError) as e:  # a bad manifest, a port in use: say so without a traceback
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
