"""The operator's RBAC: the chart grants exactly the Kubernetes API calls the operator makes.

What the operator calls comes from the operator itself, never from a list kept by hand:
- its own calls are read from graft/operator/: every `kube.get|list|create|delete|merge_patch(path)`
  names its resource through the path helpers of graft.operator.kube, which are run to get it;
- kopf's calls depend on how it runs (peering, a list of namespaces or all of them, events). They
  are declared below with the reason for each, and a real operator, run against the API server
  emulator with the chart's peering object and admin-token Secret, has to make every one of them;
  every request it sends must be allowed by the rendered roles, evaluated the way RBAC does.
"""
from __future__ import annotations

import ast
import asyncio
import base64
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from graft.devcluster.apimachinery import parse_target, verb
from tests.deploy.manifests import NAMESPACE, RELEASE, ROOT, load_file, of_kind, one, pod_template, render

OPERATOR = ROOT / "graft" / "operator"
# `graft rollout` (cli.py) runs with the user's own credentials, not the operator's.
NOT_THE_OPERATOR = {"cli.py"}
KUBE_METHODS = {"get": "GET", "text": "GET", "list": "GET", "list_object": "GET", "watch": "WATCH", "create": "POST",
                "delete": "DELETE", "merge_patch": "PATCH"}
# resources with no namespace: the built-in ones kopf reads, and our CRDs of scope Cluster
CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces"} | {
    crd["spec"]["names"]["plural"] for path in sorted((ROOT / "crds").glob("*.yaml")) for crd in load_file(path)
    if crd["spec"]["scope"] == "Cluster"}
SECRET = f"{RELEASE}-admin-token"
SERVED = "llm"
SCOPES = {"cluster": {}, "namespace": {"rbac": {"scope": "namespace"}, "watch": {"namespaces": [SERVED]}}}
# calls made only for job checks, granted only with jobChecks.enabled
JOB_CHECKS = OPERATOR / "jobs.py"

# (group, resource, verbs, scope it applies to) for what kopf itself calls
KOPF_CALLS = [
    # watching PatchRollouts; its finalizer and the annotations where it keeps handler progress
    ("graft.dev", "patchrollouts", ("list", "watch", "patch"), None),
    # watching PatchFleets (the fleet controller), the same way
    ("graft.dev", "patchfleets", ("list", "watch"), None),
    # kopf.event(): the Events every rollout transition posts
    ("", "events", ("create",), None),
    # resource discovery, and following CRDs that come and go
    ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"), None),
    # a namespaced operator follows its namespaces being created and deleted
    ("", "namespaces", ("list", "watch"), "namespace"),
    # peering: one replica works, the others stand by
    ("kopf.dev", "clusterkopfpeerings", ("list", "watch", "patch"), "cluster"),
    ("kopf.dev", "kopfpeerings", ("list", "watch", "patch"), "namespace"),
]

Grant = tuple[str, str, str]     # (group, resource[/subresource], verb)


# the operator's own calls, read from its code

PLACEHOLDER = "placeholder"


class _Paths:
    """The URL paths a call's path argument can take: string literals, f-strings (module string
    constants filled in, anything else a placeholder name), `+`, `a if c else b`, the *_path
    helpers of graft.operator.kube (run with placeholder names), and local names assigned one of
    those in the same function. Any other form is refused, so no call goes unread."""

    def __init__(self, helpers: dict, constants: dict[str, str], local: dict[str, list[ast.expr]]):
        self.helpers, self.constants, self.local = helpers, constants, local

    def of(self, node: ast.expr) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.JoinedStr):
            out = [""]
            for part in node.values:
                options = self.of(part) if isinstance(part, ast.Constant) else [self._filled(part.value)]
                out = [a + b for a in out for b in options]
            return out
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return [a + b for a in self.of(node.left) for b in self.of(node.right)]
        if isinstance(node, ast.IfExp):
            return self.of(node.body) + self.of(node.orelse)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.helpers:
            return [self.helpers[node.func.id](*[PLACEHOLDER] * (len(node.args) + len(node.keywords)))]
        if isinstance(node, ast.Name) and node.id in self.local:
            return [path for value in self.local[node.id] for path in self.of(value)]
        raise ValueError(ast.unparse(node))

    def _filled(self, node: ast.expr) -> str:
        return self.constants.get(node.id, PLACEHOLDER) if isinstance(node, ast.Name) else PLACEHOLDER


def _assignments(scope: ast.AST) -> dict[str, list[ast.expr]]:
    out: dict[str, list[ast.expr]] = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out.setdefault(node.targets[0].id, []).append(node.value)
    return out


def _is_kube_call(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in KUBE_METHODS and node.args):
        return False
    owner = node.func.value
    return (isinstance(owner, ast.Name) and owner.id == "kube"
            or isinstance(owner, ast.Attribute) and owner.attr == "kube")


def kube_calls(source: str, helpers: dict) -> Iterator[tuple[int, str, str]]:
    """(line, HTTP method, path) of every call through a `Kube` client (`kube.x(...)`, `self.kube.x(...)`)."""
    module = ast.parse(source)
    constants = {name: value.value for name, values in _assignments(module).items() for value in values
                 if isinstance(value, ast.Constant) and isinstance(value.value, str)}
    scopes = [n for n in ast.walk(module) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        paths = _Paths(helpers, constants, _assignments(scope))
        # calls in this function's own body, not in functions nested in it (they are scopes too)
        body = [n for n in ast.walk(scope) if _is_kube_call(n)
                and not any(inner is not scope and n in set(ast.walk(inner)) for inner in scopes)]
        for node in body:
            try:
                found = paths.of(node.args[0])
            except ValueError as e:
                raise AssertionError(f"line {node.lineno}: cannot tell which resource `{e}` is; build the path "
                                     "with a graft.operator.kube *_path helper") from None
            method = "GET" if node.func.attr == "get" else KUBE_METHODS[node.func.attr]
            for path in found:
                yield node.lineno, method, path


def grant_of(method: str, path: str, params: dict | None = None) -> Grant:
    target = parse_target(path)
    assert target is not None, f"not a resource URL: {path}"
    resource = target.resource.plural + (f"/{target.subresource}" if target.subresource else "")
    return target.resource.group, resource, verb(method, target, params or {})


def operator_calls() -> dict[Grant, list[str]]:
    """Every API call graft/operator/ makes through its Kube client, with where it is made."""
    from graft.operator import kube

    helpers = {name: getattr(kube, name) for name in dir(kube) if name.endswith("_path")}
    calls: dict[Grant, list[str]] = {}
    for path in sorted(OPERATOR.rglob("*.py")):
        if path.name in NOT_THE_OPERATOR or path == Path(kube.__file__):
            continue
        for line, method, url in kube_calls(path.read_text(encoding="utf-8"), helpers):
            # a watch is a GET with ?watch=true: the verb is the parameter's
            call = grant_of("GET", url, {"watch": "true"}) if method == "WATCH" else grant_of(method, url)
            calls.setdefault(call, []).append(f"{path.relative_to(ROOT)}:{line}")
    return calls


def kopf_calls(scope: str) -> set[Grant]:
    return {(g, r, v) for g, r, verbs, when in KOPF_CALLS if when in (None, scope) for v in verbs}


def test_the_code_scan_finds_the_operator_calls():
    calls = operator_calls()
    # the scan must see the calls everyone knows about, or it sees nothing
    assert {("", "pods", "list"), ("", "pods", "patch"), ("", "secrets", "get"), ("", "configmaps", "get"),
            ("graft.dev", "patchrollouts/status", "patch")} <= set(calls)
    assert all(where for where in calls.values())


def test_the_code_scan_refuses_a_path_it_cannot_read():
    with pytest.raises(AssertionError, match="cannot tell which resource"):
        list(kube_calls("async def f(kube, url):\n    await kube.get(url)\n", {}))
    source = "async def f(self):\n    await self.rt.kube.merge_patch(pods_path('a', 'b') + '/status', {})\n"
    found = list(kube_calls(source, {"pods_path": lambda ns, name: f"/api/v1/namespaces/{ns}/pods/{name}"}))
    assert [grant_of(m, p) for _, m, p in found] == [("", "pods/status", "patch")]
    source = ('GROUP = "/apis/graft.dev/v1alpha1"\n'
              "async def f(rt, name, ns, cluster):\n"
              '    path = f"{GROUP}/things/{name}" if cluster else f"{GROUP}/namespaces/{ns}/widgets/{name}"\n'
              "    await rt.kube.get(path)\n")
    found = [grant_of(m, p) for _, m, p in kube_calls(source, {})]
    assert found == [("graft.dev", "things", "get"), ("graft.dev", "widgets", "get")]


# the rendered roles, evaluated as RBAC does

def bound_rules(objs: list[dict], sa: str) -> list[tuple[str | None, list[dict]]]:
    """(namespace the rules hold in, or None for every namespace and the cluster, rules) per binding."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
             for o in of_kind(objs, "Role") + of_kind(objs, "ClusterRole")}
    out, used = [], set()
    for binding in of_kind(objs, "RoleBinding") + of_kind(objs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
        ns = binding["metadata"].get("namespace")
        ref = binding["roleRef"]
        key = (ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])
        used.add(key)
        out.append((ns, roles[key]["rules"]))
    assert used == set(roles), f"roles bound to nothing: {set(roles) - used}"
    return out


def allowed(bindings, group: str, resource: str, verb_: str, namespace: str | None, name: str | None) -> bool:
    for ns, rules in bindings:
        if ns is not None and ns != namespace:
            continue
        for rule in rules:
            if (group in rule["apiGroups"] and resource in rule["resources"] and verb_ in rule["verbs"]
                    and (not rule.get("resourceNames") or name in rule["resourceNames"])):
                return True
    return False


def granted(bindings) -> set[Grant]:
    return {(g, r, v) for _, rules in bindings for rule in rules
            for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def job_check_calls() -> set[Grant]:
    """The calls only job checks make: those made nowhere but graft/operator/jobs.py."""
    where = str(JOB_CHECKS.relative_to(ROOT))
    return {call for call, places in operator_calls().items() if all(p.startswith(where + ":") for p in places)}


def test_job_checks_make_jobs_and_read_logs_and_nothing_else():
    assert job_check_calls() == {("batch", "jobs", "get"), ("batch", "jobs", "create"), ("", "pods/log", "get")}


@pytest.mark.parametrize("jobs", [False, True], ids=["no-job-checks", "job-checks"])
@pytest.mark.parametrize("scope", list(SCOPES))
def test_chart_grants_exactly_the_calls_of_the_operator_and_kopf(chart, scope, jobs):
    objs = render(chart, {**SCOPES[scope], **({"jobChecks": {"enabled": True}} if jobs else {})})
    sa = one(objs, "ServiceAccount")["metadata"]["name"]
    assert pod_template(one(objs, "StatefulSet"))["spec"]["serviceAccountName"] == sa
    bindings = bound_rules(objs, sa)
    needed = set(operator_calls()) | kopf_calls(scope)
    if not jobs:
        needed -= job_check_calls()
    beyond, missing = sorted(granted(bindings) - needed), sorted(needed - granted(bindings))
    assert not beyond and not missing, f"granted beyond the calls: {beyond}; missing: {missing}"

    served = [SERVED] if scope == "namespace" else [SERVED, "any-namespace"]
    for g, r, v in needed - {("", "secrets", "get")}:
        if r.split("/")[0] in CLUSTER_SCOPED:
            assert allowed(bindings, g, r, v, None, None), (g, r, v)
        else:
            for ns in served:
                assert allowed(bindings, g, r, v, ns, "any"), (g, r, v, ns)
    if scope == "namespace":
        assert not allowed(bindings, "", "pods", "list", "kube-system", None)


@pytest.mark.parametrize("values", [{}, SCOPES["namespace"], {"adminToken": {"existingSecret": "fleet-token"}}],
                         ids=["cluster", "namespace", "existing-secret"])
def test_admin_token_is_readable_by_name_in_the_release_namespace_only(chart, values):
    objs = render(chart, values)
    bindings = bound_rules(objs, one(objs, "ServiceAccount")["metadata"]["name"])
    secret = values.get("adminToken", {}).get("existingSecret", SECRET)
    assert allowed(bindings, "", "secrets", "get", NAMESPACE, secret)
    assert not allowed(bindings, "", "secrets", "get", NAMESPACE, "another-secret")
    assert not allowed(bindings, "", "secrets", "get", SERVED, secret)
    assert not allowed(bindings, "", "secrets", "list", NAMESPACE, None)


def secret_rules(objs: list[dict], kind: str) -> list[dict]:
    return [rule for o in of_kind(objs, kind) for rule in o["rules"] if "secrets" in rule["resources"]]


@pytest.mark.parametrize("scope", list(SCOPES))
def test_by_default_no_secret_is_readable_beyond_the_admin_token(chart, scope):
    objs = render(chart, SCOPES[scope])
    assert secret_rules(objs, "ClusterRole") == []
    assert [r for r in secret_rules(objs, "Role") if not r.get("resourceNames")] == []
    bindings = bound_rules(objs, one(objs, "ServiceAccount")["metadata"]["name"])
    assert not allowed(bindings, "", "secrets", "get", SERVED, "prometheus-token")
    assert allowed(bindings, "", "secrets", "get", NAMESPACE, SECRET)
    env = {e["name"]: e.get("value") for e in pod_template(one(objs, "StatefulSet"))["spec"]["containers"][0]["env"]}
    assert "GRAFT_PROMETHEUS_SECRET_NAMESPACES" not in env


@pytest.mark.parametrize("scope", list(SCOPES))
def test_prometheus_secrets_are_granted_by_namespaced_roles_only(chart, scope):
    granted_in = [SERVED] if scope == "namespace" else [SERVED, "obs"]
    rbac = {**SCOPES[scope].get("rbac", {}), "prometheusSecrets": True}
    if scope == "cluster":
        rbac["prometheusSecretNamespaces"] = granted_in
    objs = render(chart, {**SCOPES[scope], "rbac": rbac})
    assert secret_rules(objs, "ClusterRole") == []
    roles = [o for o in of_kind(objs, "Role") if any("secrets" in r["resources"] and not r.get("resourceNames")
                                                     for r in o["rules"])]
    assert sorted(o["metadata"]["namespace"] for o in roles) == sorted(granted_in)
    bindings = bound_rules(objs, one(objs, "ServiceAccount")["metadata"]["name"])
    for ns in granted_in:
        assert allowed(bindings, "", "secrets", "get", ns, "prometheus-token")
        assert not allowed(bindings, "", "secrets", "list", ns, None)
        assert not allowed(bindings, "", "secrets", "watch", ns, None)
    assert not allowed(bindings, "", "secrets", "get", "kube-system", "prometheus-token")
    env = {e["name"]: e.get("value") for e in pod_template(one(objs, "StatefulSet"))["spec"]["containers"][0]["env"]}
    assert env["GRAFT_PROMETHEUS_SECRET_NAMESPACES"] == ",".join(granted_in)


def test_prometheus_secrets_in_cluster_scope_need_a_list_of_namespaces(chart):
    with pytest.raises(Exception, match="rbac.prometheusSecretNamespaces"):
        render(chart, {"rbac": {"prometheusSecrets": True}})


def test_prometheus_secret_namespaces_must_be_served_in_namespace_scope(chart):
    with pytest.raises(Exception, match="kube-system is not one of watch.namespaces"):
        render(chart, {**SCOPES["namespace"], "rbac": {"scope": "namespace", "prometheusSecrets": True,
                                                       "prometheusSecretNamespaces": ["kube-system"]}})


@pytest.mark.parametrize("scope", list(SCOPES))
def test_rbac_has_no_wildcards(chart, scope):
    for role in of_kind(render(chart, SCOPES[scope]), "ClusterRole") + of_kind(render(chart, SCOPES[scope]), "Role"):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), (role["metadata"]["name"], rule)
            assert "nonResourceURLs" not in rule


def test_rbac_can_be_left_to_the_cluster_admin(chart):
    objs = render(chart, {"rbac": {"create": False}})
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding")]


# a running operator

class RunningOperator:
    """The operator in a thread with its own event loop (kopf cancels the tasks of the loop it runs in)."""

    def __init__(self, settings):
        from graft.operator.main import run

        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.error: BaseException | None = None

        def main() -> None:
            try:
                asyncio.run(run(settings, stop_flag=self.stop_flag, ready_flag=self.ready_flag, priority=1))
            except BaseException as e:
                self.error = e

        self.thread = threading.Thread(target=main, name="graft-operator", daemon=True)

    async def __aenter__(self) -> "RunningOperator":
        self.thread.start()
        assert await asyncio.to_thread(self.ready_flag.wait, 20), f"the operator did not start: {self.error}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop_flag.set()
        await asyncio.to_thread(self.thread.join, 20)
        assert not self.thread.is_alive() and self.error is None, self.error


async def until(probe, what: str, timeout: float = 15.0):
    for _ in range(int(timeout / 0.1)):
        if found := await probe():
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


TEST_CLIENT = "graft-rbac-test"     # the test's own requests, told apart from the operator's


@pytest.mark.parametrize("scope", list(SCOPES))
async def test_a_running_operator_makes_only_calls_the_chart_allows(chart, scope):
    """Start, peer, pick up a Gateway API rollout, report it waiting for pods, and finalize it on
    deletion (the route set back to stable): each request checked against the rendered roles."""
    from graft.devcluster.apiserver import ApiServer
    from graft.operator.kube import Kube, httproute_path, rollout_path
    from graft.operator.settings import OperatorSettings

    objs = render(chart, SCOPES[scope])
    bindings = bound_rules(objs, one(objs, "ServiceAccount")["metadata"]["name"])
    async with ApiServer(crd_paths=[ROOT / "crds"], namespaces=("default", NAMESPACE, SERVED)) as api:
        for peering in of_kind(objs, "ClusterKopfPeering") + of_kind(objs, "KopfPeering"):
            api.create(peering)
        api.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": NAMESPACE},
                    "data": {"token": base64.b64encode(b"admin-token").decode()}})
        api.create({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                    "metadata": {"name": "llm", "namespace": SERVED},
                    "spec": {"rules": [{"backendRefs": [{"name": "llm-stable", "port": 8000, "weight": 90},
                                                        {"name": "llm-canary", "port": 8000, "weight": 10}]}]}})
        (operator_container,) = pod_template(one(objs, "StatefulSet"))["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in operator_container["env"]}
        peering = next(a.split("=", 1)[1] for a in operator_container["args"] if a.startswith("--peering="))
        settings = OperatorSettings(namespaces=[SERVED] if scope == "namespace" else [], tick=0.2,
                                    kube_server=api.url, peering=peering, admin_scheme="http", admin_plain_http=True,
                                    admin_token_secret=env["GRAFT_ADMIN_TOKEN_SECRET"],
                                    admin_token_key=env["GRAFT_ADMIN_TOKEN_SECRET_KEY"])
        kube = Kube(api.url, headers={"User-Agent": TEST_CLIENT})
        try:
            async with RunningOperator(settings):
                await kube.create(rollout_path(SERVED, "")[:-1], {
                    "apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout", "metadata": {"name": "kv-align"},
                    "spec": {"selector": {"matchLabels": {"app": "no-such-engine"}},
                             "patch": {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}},
                             "trafficRouting": {"gatewayAPI": {"httpRoute": "llm", "stableService": "llm-stable",
                                                               "canaryService": "llm-canary"}}}})

                async def waiting():
                    status = (await kube.get(rollout_path(SERVED, "kv-align")) or {}).get("status") or {}
                    return status.get("reason") == "NoPods"

                async def events_posted():
                    return await kube.list(f"/api/v1/namespaces/{SERVED}/events")

                async def gone():
                    return await kube.get(rollout_path(SERVED, "kv-align")) is None

                await until(waiting, "the rollout to wait for pods")
                await until(events_posted, "an Event")
                await kube.delete(rollout_path(SERVED, "kv-align"))
                await until(gone, "the finalizer to let the rollout go")
            route = await kube.get(httproute_path(SERVED, "llm"))
        finally:
            await kube.aclose()
        requests = [r for r in list(api) if r.headers.get("User-Agent") != TEST_CLIENT]

    assert [ref["weight"] for ref in route["spec"]["rules"][0]["backendRefs"]] == [100, 0]
    seen: set[Grant] = set()
    refused = []
    for request in requests:
        target = parse_target(request.url.path)
        if target is None:
            continue    # discovery (/api, /apis/...): every authenticated client may read it
        call = grant_of(str(request.method.value), request.url.path, dict(request.params))
        seen.add(call)
        if not allowed(bindings, *call, target.namespace, target.name):
            refused.append(f"{request.method.value} {request.url.path}")
    assert not refused, f"the chart's RBAC would refuse: {sorted(set(refused))}"
    assert kopf_calls(scope) <= seen, f"kopf never made these granted calls: {kopf_calls(scope) - seen}"
    assert seen - kopf_calls(scope) <= set(operator_calls()), "calls the code scan missed"
