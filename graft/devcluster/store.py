"""The emulated cluster's objects and the rules every write obeys, as kube-apiserver applies them.

One global ``resourceVersion`` stamps every write; the change log behind it feeds the watches.
Create fills the server-side metadata, update keeps it, delete honours finalizers. Custom
resources are pruned, defaulted and validated against their CRD; the status subresource is
isolated; a namespace or a CRD that goes takes its objects with it. Nothing here speaks HTTP:
:mod:`graft.devcluster.apiserver` does, and both share KMock's object and resource tables.
"""

from __future__ import annotations

import asyncio
import copy
import secrets
import uuid
from typing import Any

import kmock

from graft.devcluster import crd as crds
from graft.devcluster import services
from graft.devcluster.apimachinery import Change, Target, api_error, conflict, details, invalid, name_error, \
    not_found, now, sort_key

NAMESPACES = kmock.resource("", "v1", "namespaces")
SERVICES = kmock.resource("", "v1", "services")
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
_SERVER_MANAGED = ("uid", "creationTimestamp", "resourceVersion", "generation", "deletionTimestamp",
                   "deletionGracePeriodSeconds", "managedFields", "selfLink")
_LOG_LIMIT = 20_000  # changes kept for watches to resume from; older resourceVersions are expired
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"


class ObjectStore:
    """Objects keyed by (resource, namespace, name) in KMock's ``objects``, with their history.

    ``resources`` is the discovery table: what can be stored, and where CRDs register their kinds.
    ``history_limit`` bounds how many versions of each object are kept (``None``: all of them).
    """

    def __init__(self, objects: kmock.ObjectsArray, resources: kmock.ResourcesArray,
                 history_limit: int | None = None) -> None:
        self.objects = objects
        self.resources = resources
        self.history_limit = history_limit
        self.rv = 0
        self.log: list[Change] = []
        self.log_floor = 0  # every change after this resourceVersion is still in the log
        self.wakeup = asyncio.Event()  # set, then replaced, on every change
        self.crds: dict[kmock.resource, crds.CrdVersion] = {}
        self.epoch = 0  # bumped whenever a CRD registers or goes: what the OpenAPI documents are built from

    # reading

    def info(self, target: Target) -> kmock.ResourceInfo:
        if target.resource not in self.resources:
            raise not_found("the server could not find the requested resource", target)
        info = self.resources[target.resource]
        if not info.namespaced and target.namespace is not None:
            raise not_found("the server could not find the requested resource", target)
        return info

    def live(self, resource: kmock.resource, namespace: str | None, name: str | None) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key].raw
        return None

    def existing(self, target: Target) -> dict[str, Any]:
        obj = self.live(target.resource, target.namespace, target.name)
        if obj is None:
            raise not_found(f'{target.qualified} "{target.name}" not found', target)
        return obj

    def items(self, resource: kmock.resource, namespace: str | None) -> list[dict[str, Any]]:
        """The live objects of a resource (in one namespace, or all), sorted by namespace and name."""
        found = [obj.raw for (res, ns, _), obj in self.objects.items()
                 if res == resource and (namespace is None or ns == namespace) and not obj.deleted]
        return sorted(found, key=sort_key)

    def wake(self) -> None:
        self.wakeup.set()
        self.wakeup = asyncio.Event()

    # writing

    def create(self, target: Target, body: dict[str, Any], params: dict[str, str]) -> dict[str, Any]:
        info = self.info(target)
        if target.name is not None:
            raise api_error(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        if info.namespaced and target.namespace is None:
            raise api_error(405, "MethodNotAllowed", f"create {target.qualified} needs a namespace in the URL")
        obj = copy.deepcopy(body)
        meta = _metadata(obj)
        self._check_type(obj, target)
        for key in _SERVER_MANAGED:
            meta.pop(key, None)
        if info.namespaced:
            if meta.get("namespace", target.namespace) != target.namespace:
                raise api_error(400, "BadRequest", "the namespace of the provided object does not match "
                                                   "the namespace sent on the request")
            if self.live(NAMESPACES, None, target.namespace) is None:
                raise not_found(f'namespaces "{target.namespace}" not found',
                                Target(NAMESPACES, None, target.namespace, None))
            meta["namespace"] = target.namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = self._generate_name(target, str(meta["generateName"]))
        target = Target(target.resource, target.namespace, meta.get("name"), None)
        error = name_error(target.resource, target.name)
        if error is not None:
            raise self._invalid(target, [error])
        if self.live(target.resource, target.namespace, target.name) is not None:
            raise api_error(409, "AlreadyExists", f'{target.qualified} "{target.name}" already exists',
                            details(target))
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
        if "status" in info.subresources:
            obj.pop("status", None)
        self._admit(target, obj, None, params)
        self._fill_server_side(target, obj, None)
        return obj if params.get("dryRun") == "All" else self._commit(target.resource, obj, None)

    def update(self, target: Target, old: dict[str, Any], body: Any, params: dict[str, str]) -> dict[str, Any]:
        """Replace ``old`` with ``body`` (a PUT, or a patch already applied), keeping what the server owns."""
        info = self.info(target)
        new = copy.deepcopy(body)
        meta = _metadata(new)
        self._check_type(new, target)
        if meta.get("name", target.name) != target.name:
            raise api_error(400, "BadRequest", f"the name of the object ({meta.get('name')}) does not match "
                                               f"the name on the URL ({target.name})")
        if meta.get("resourceVersion") and meta["resourceVersion"] != old["metadata"]["resourceVersion"]:
            raise conflict(target)
        if target.subresource == "status":
            written = new.get("status")
            new = copy.deepcopy(old)
            new.pop("status", None)
            if written is not None:
                new["status"] = written
            meta = new["metadata"]
        elif "status" in info.subresources:
            new.pop("status", None)
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
        for key in ("namespace", *_SERVER_MANAGED):
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
            else:
                meta.pop(key, None)
        if old["metadata"].get("deletionTimestamp"):
            if set(meta.get("finalizers") or ()) - set(old["metadata"].get("finalizers") or ()):
                raise self._invalid(target, [crds.FieldError("metadata.finalizers", "FieldValueForbidden",
                                    "Forbidden: no new finalizers can be added if the object is being deleted")])
        self._admit(target, new, old, params)
        self._fill_server_side(target, new, old)
        if _desired_state(new, info) != _desired_state(old, info):
            meta["generation"] = int(old["metadata"].get("generation") or 0) + 1
        if new == old or params.get("dryRun") == "All":
            return new
        return self._commit(target.resource, new, old)

    def delete(self, resource: kmock.resource, old: dict[str, Any], params: dict[str, str]) -> dict[str, Any]:
        """Delete now, or, while finalizers remain, mark for deletion and wait for them to go."""
        meta = old["metadata"]
        if meta.get("deletionTimestamp") or params.get("dryRun") == "All":
            return old
        if meta.get("finalizers"):
            new = copy.deepcopy(old)
            new["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0)
            return self._commit(resource, new, old)
        return self._commit(resource, None, old)

    def _commit(self, resource: kmock.resource, new: dict[str, Any] | None,
                old: dict[str, Any] | None) -> dict[str, Any]:
        """Store a new state (``None``: gone) under a fresh resourceVersion and tell the watchers."""
        self.rv += 1
        obj = new if new is not None else copy.deepcopy(old)
        assert obj is not None
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self.rv)
        key = (resource, meta.get("namespace"), meta["name"])
        gone = new is None or bool(meta.get("deletionTimestamp") and not meta.get("finalizers"))
        if gone:
            self.objects[key].delete()
        elif key not in self.objects:
            self.objects[key] = obj
        elif self.objects[key].deleted:
            self.objects[key].create(obj)
        else:
            self.objects[key].history.append(obj)
        if self.history_limit and len(self.objects[key].history) > self.history_limit:
            del self.objects[key].history[:-self.history_limit]
        self.log.append(Change(self.rv, resource, "DELETED" if gone else "ADDED" if old is None else "MODIFIED",
                               obj, old))
        if len(self.log) > _LOG_LIMIT:
            cut = len(self.log) // 2
            self.log_floor = self.log[cut - 1].rv
            del self.log[:cut]
        self.wake()
        self._cascade(resource, obj, gone)
        return obj

    def _cascade(self, resource: kmock.resource, obj: dict[str, Any], gone: bool) -> None:
        if resource == CRDS:
            served = self._unregister(obj)
            if gone:
                for res in served:
                    for item in self.items(res, None):
                        self._commit(res, None, item)
            else:
                self._register(obj)
        elif resource == NAMESPACES and gone:
            namespace = obj["metadata"]["name"]
            for (res, ns, _), item in list(self.objects.items()):
                if ns == namespace and not item.deleted:
                    self.delete(res, item.raw, {})

    def _admit(self, target: Target, obj: dict[str, Any], old: dict[str, Any] | None,
               params: dict[str, str]) -> None:
        """Prune, default and validate a custom resource against its CRD (``old``: what an update replaces)."""
        version = self.crds.get(target.resource)
        if version is None:
            return
        dropped = version.prune(obj)
        if dropped and params.get("fieldValidation") == "Strict":
            raise api_error(400, "BadRequest", f'{version.kind} in version "{version.version}" cannot be handled as a '
                            f"{version.kind}: strict decoding error: "
                            + ", ".join(f'unknown field "{path}"' for path in dropped))
        version.default(obj)
        errors = version.validate(obj, old)
        if errors:
            raise self._invalid(target, errors)

    def _fill_server_side(self, target: Target, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        """What the API server itself writes into a namespace, a Service (its address) or a CRD."""
        if target.resource == SERVICES and target.subresource is None:
            taken = {(svc.get("spec") or {}).get("clusterIP") for svc in self.items(SERVICES, None)}
            try:
                services.fill_service(obj, old, {ip for ip in taken if ip})
            except services.ImmutableClusterIP as e:
                raise self._invalid(target, [crds.FieldError("spec.clusterIP", "FieldValueInvalid", str(e))]) from None
        elif target.resource == NAMESPACES:
            name = obj["metadata"]["name"]
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = name
            obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
            obj["status"] = {"phase": "Terminating" if obj["metadata"].get("deletionTimestamp") else "Active"}
        elif target.resource == CRDS:
            try:
                crds.served_versions(obj)
            except crds.InvalidCrd as e:
                raise self._invalid(target, e.errors) from None
            spec = obj["spec"]
            accepted = (("NamesAccepted", "NoConflicts", "no conflicts found"),
                        ("Established", "InitialNamesAccepted", "the initial names have been accepted"))
            conditions = [{"type": t, "status": "True", "reason": r, "message": m,
                           "lastTransitionTime": obj["metadata"]["creationTimestamp"]} for t, r, m in accepted]
            obj["status"] = {"conditions": conditions, "acceptedNames": spec["names"],
                             "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")]}

    def _register(self, crd: dict[str, Any]) -> None:
        self.epoch += 1
        for version in crds.served_versions(crd):
            resource = kmock.resource(version.group, version.version, version.plural)
            self.resources[resource] = kmock.ResourceInfo(
                kind=version.kind, singular=version.singular, namespaced=version.namespaced, verbs=VERBS,
                shortnames=version.short_names, categories=version.categories, subresources=version.subresources)
            self.crds[resource] = version

    def _unregister(self, crd: dict[str, Any]) -> list[kmock.resource]:
        spec = crd.get("spec") or {}
        plural = (spec.get("names") or {}).get("plural")
        served = [res for res in self.crds if (res.group, res.plural) == (spec.get("group"), plural)]
        self.epoch += 1
        for res in served:
            del self.crds[res]
            del self.resources[res]
        return served

    def _check_type(self, obj: dict[str, Any], target: Target) -> None:
        expected, kind = target.api_version, self.info(target).kind
        if obj.get("apiVersion", expected) != expected or obj.get("kind", kind) != kind:
            raise api_error(400, "BadRequest", f"the object ({obj.get('apiVersion')}, {obj.get('kind')}) does not "
                                               f"match the resource ({expected}, {kind})")
        obj["apiVersion"], obj["kind"] = expected, kind

    def _generate_name(self, target: Target, prefix: str) -> str:
        while True:
            name = prefix + "".join(secrets.choice(_NAME_CHARS) for _ in range(5))
            if self.live(target.resource, target.namespace, name) is None:
                return name

    def _invalid(self, target: Target, errors: list[crds.FieldError]) -> kmock.KubernetesError:
        return invalid(target, str(self.info(target).kind), errors)


def _desired_state(obj: dict[str, Any], info: kmock.ResourceInfo) -> dict[str, Any]:
    # generation counts changes of what is asked for: not metadata, not a subresource's status.
    skip = {"metadata", "status"} if "status" in info.subresources else {"metadata"}
    return {k: v for k, v in obj.items() if k not in skip}


def _metadata(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.setdefault("metadata", {})
    if not isinstance(meta, dict):
        raise api_error(400, "BadRequest", "metadata must be an object")
    return meta
