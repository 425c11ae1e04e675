"""The Helm chart: it lints, renders valid Kubernetes objects for every supported setup, ships the
CRDs from crds/ unchanged, grants the operator exactly the API calls it makes, and locks down
every pod it runs."""
from __future__ import annotations

import base64
import copy
import re
import tarfile

import helm_python as helm
import pytest
import yaml

from tests.deploy.manifests import (CHART, CRDS, DEPLOY, NAMESPACE, RELEASE, containers, crd_errors,
                                    env_of, k8s_errors, load_docs, notes, of_kind, one, pod_template,
                                    render, selects, validation_errors)

GATEWAY_PARENT = {"name": "inference", "namespace": "gateway"}
WATCHED = ["llm", "llm-canary"]


def merged(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        _merge(out, copy.deepcopy(part))
    return out


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


ENGINE = {"engine": {"enabled": True}}
NAMESPACED = {"rbac": {"scope": "namespace"}, "watch": {"namespaces": WATCHED}}
GATEWAY = merged(ENGINE, {"gatewayAPI": {"enabled": True, "parentRefs": [GATEWAY_PARENT]}})
PROMETHEUS_OPERATOR = merged(ENGINE, {"monitoring": {
    "prometheusOperator": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "grafanaDashboard": {"enabled": True}}})
REPLICAS_2 = {"operator": {"replicas": 2}}
SETUPS = {
    "defaults": {},
    "namespaced-rbac": NAMESPACED,
    "engine": ENGINE,
    "gateway-api": GATEWAY,
    "prometheus-operator": PROMETHEUS_OPERATOR,
    "replicas-2": REPLICAS_2,
    "everything": merged(NAMESPACED, GATEWAY, PROMETHEUS_OPERATOR, REPLICAS_2, {"engine": {
        "patches": "kv-align@3.2.1,sync-free@3.2.1", "model": "/models/llama.gguf",
        "modelVolume": {"persistentVolumeClaim": {"claimName": "llama"}},
        "podLabels": {"app": "llm-engine"}}}),
}
setups = pytest.mark.parametrize("values", list(SETUPS.values()), ids=list(SETUPS))


# lint and schemas

@setups
def test_chart_lints_without_warnings(values):
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


@setups
def test_every_rendered_object_is_valid(chart, crds, values):
    objs = render(chart, values)
    assert objs
    errors = [e for o in objs for e in validation_errors(o, crds)]
    assert not errors, "\n".join(errors)


def test_rendered_objects_are_checked_for_real(crds):
    # the validators above must refuse what a cluster refuses
    bad_pod = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
               "spec": {"ports": [{"port": "eighty"}]}}
    assert k8s_errors(bad_pod)
    bad_peering = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "x"}, "spec": {}}
    assert crd_errors(bad_peering, crds[("kopf.dev/v1", "KopfPeering")]) == ["spec: unknown field"]
    assert validation_errors({"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "x"}}, crds)


@pytest.mark.parametrize("values, complaint", [
    ({"rbac": {"scope": "everywhere"}}, "/rbac/scope"),
    ({"engine": {"enabeld": True}}, "enabeld"),
    ({"engine": {"patches": "kv-align"}}, "/engine/patches"),
    ({"watch": {"namespaces": ["LLM"]}, "rbac": {"scope": "namespace"}}, "/watch/namespaces/0"),
    ({"operator": {"replicas": 0}}, "/operator/replicas"),
    ({"watch": {"namespaces": ["llm"]}}, "watch.namespaces applies only with rbac.scope=namespace"),
    ({"gatewayAPI": {"enabled": True, "parentRefs": [GATEWAY_PARENT]}}, "set engine.enabled too"),
    (merged(ENGINE, {"gatewayAPI": {"enabled": True}}), "needs gatewayAPI.parentRefs"),
    ({"monitoring": {"prometheusOperator": {"enabled": True}}}, "podSelector"),
    ({"serviceAccount": {"create": False}}, "serviceAccount.name is required"),
], ids=["scope", "typo", "patch-format", "namespace-name", "no-replicas", "watch-cluster",
        "gateway-no-engine", "gateway-no-parent", "podmonitor-no-selector", "no-service-account"])
def test_bad_values_are_refused_with_a_reason(chart, values, complaint):
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as err:
        render(chart, values)
    assert complaint in str(err.value)


# CRDs: one source, crds/, shipped as it is

def test_chart_ships_the_crds_of_crds_dir_byte_for_byte(chart):
    source = {p.name: p.read_text(encoding="utf-8") for p in CRDS.glob("*.yaml")}
    shipped = {c["name"].removeprefix("crds/"): c["data"] for c in chart.crds}
    assert {"patchrollout.yaml", "kopf-peering.yaml"} <= set(source)
    assert shipped == source


def test_shipped_crds_are_valid_definitions(chart):
    for crd_file in chart.crds:
        for crd in load_docs(crd_file["data"]):
            assert crd["kind"] == "CustomResourceDefinition"
            assert not k8s_errors(crd), (crd_file["name"], k8s_errors(crd))


def test_packaged_chart_carries_the_linked_files(tmp_path):
    archive = helm.package(CHART, destination=tmp_path)
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        def text(name):
            return tar.extractfile(members[name]).read().decode()
        for crd in CRDS.glob("*.yaml"):
            assert text(f"graft/crds/{crd.name}") == crd.read_text(encoding="utf-8")
        assert text("graft/files/prometheus-rule.yaml") == (DEPLOY / "prometheus" / "prometheus-rule.yaml").read_text()
        assert text("graft/files/graft-dashboard.json") == (DEPLOY / "grafana" / "graft-dashboard.json").read_text()
        assert "graft/rbac-needs.yaml" not in members
    with helm.Chart.load(archive) as packaged:
        assert one(render(packaged, PROMETHEUS_OPERATOR), "PrometheusRule")["spec"]["groups"]


def test_client_dry_run_install_accepts_the_chart(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "none",
        "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:9"}}],
        "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
        "users": [{"name": "none", "user": {"token": "none"}}]}))
    with helm.Config(kubeconfig_path=kubeconfig, namespace=NAMESPACE, storage_driver="memory") as cfg:
        release = cfg.install(CHART, RELEASE, GATEWAY, namespace=NAMESPACE, dry_run="client")
    kinds = {d["kind"] for d in load_docs(release["manifest"])}
    assert {"StatefulSet", "Deployment", "HTTPRoute", "ClusterRole"} <= kinds
    assert "httpRoute: graft-engine" in release["notes"]


# RBAC: exactly the operator's calls

def granted(rules: list[dict]) -> set[tuple]:
    """(group, resource, verb, resourceName or None) for every permission a rule list gives."""
    out = set()
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames") or [None]:
                        out.add((group, resource, verb, name))
    return out


def needed(scope: str, cluster_wide: bool, secret: str) -> set[tuple]:
    """What rbac-needs.yaml asks for, in one kind of role: the ClusterRole or a namespace's Role."""
    needs = yaml.safe_load((CHART / "rbac-needs.yaml").read_text())["needs"]
    out = set()
    for need in needs:
        if need.get("when", "always") not in ("always", scope):
            continue
        if cluster_wide != (scope == "cluster" or need.get("clusterScoped", False)):
            continue
        name = secret if need.get("resourceNames") == "adminToken" else None
        out |= {(need["group"], r, v, name) for r in need["resources"] for v in need["verbs"]}
    return out


def bound_roles(objs: list[dict], kind: str, binding_kind: str, sa: str) -> list[dict]:
    roles = {(o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in of_kind(objs, kind)}
    out = []
    for binding in of_kind(objs, binding_kind):
        ns = binding["metadata"].get("namespace")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
        assert binding["roleRef"]["kind"] == kind
        out.append(roles.pop((ns, binding["roleRef"]["name"])))
    assert not roles, f"{kind}s bound to nothing: {list(roles)}"
    return out


@pytest.mark.parametrize("values, scope, namespaces", [
    ({}, "cluster", []),
    (NAMESPACED, "namespace", WATCHED),
    ({"rbac": {"scope": "namespace"}}, "namespace", [NAMESPACE]),
    ({"adminToken": {"existingSecret": "fleet-token"}}, "cluster", []),
], ids=["cluster", "namespaces", "own-namespace", "existing-secret"])
def test_operator_rbac_grants_exactly_what_the_operator_calls(chart, values, scope, namespaces):
    objs = render(chart, values)
    sa = one(objs, "ServiceAccount")["metadata"]["name"]
    assert pod_template(one(objs, "StatefulSet"))["spec"]["serviceAccountName"] == sa
    secret = values.get("adminToken", {}).get("existingSecret") or f"{RELEASE}-admin-token"

    cluster_roles = bound_roles(objs, "ClusterRole", "ClusterRoleBinding", sa)
    assert_same_grants(granted([r for role in cluster_roles for r in role["rules"]]), needed(scope, True, secret))

    roles = bound_roles(objs, "Role", "RoleBinding", sa)
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(namespaces)
    for role in roles:
        assert_same_grants(granted(role["rules"]), needed(scope, False, secret))


def assert_same_grants(got: set[tuple], want: set[tuple]) -> None:
    beyond, missing = sorted(map(str, got - want)), sorted(map(str, want - got))
    assert not beyond and not missing, f"granted beyond the needs: {beyond}; missing: {missing}"


def test_rbac_needs_list_is_well_formed():
    needs = yaml.safe_load((CHART / "rbac-needs.yaml").read_text())["needs"]
    for need in needs:
        assert set(need) <= {"group", "resources", "verbs", "when", "clusterScoped", "resourceNames"}, need
        assert need.get("when", "always") in ("always", "cluster", "namespace")
        assert set(need["verbs"]) <= {"get", "list", "watch", "create", "update", "patch", "delete"}
    assert {"patchrollouts", "patchrollouts/status", "pods", "events", "httproutes"} <= {
        r for n in needs for r in n["resources"]}


@setups
def test_rbac_has_no_wildcards(chart, values):
    for role in of_kind(render(chart, values), "ClusterRole") + of_kind(render(chart, values), "Role"):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), (role["metadata"]["name"], rule)
            assert "nonResourceURLs" not in rule


def test_rbac_can_be_left_to_the_cluster_admin(chart):
    objs = render(chart, {"rbac": {"create": False}})
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding")]


# the operator

@pytest.mark.parametrize("values, peering_kind, namespaces", [
    (REPLICAS_2, "ClusterKopfPeering", None),
    (merged(REPLICAS_2, NAMESPACED), "KopfPeering", WATCHED),
], ids=["cluster", "namespaces"])
def test_operator_replicas_meet_in_one_peering_with_distinct_priorities(chart, values, peering_kind, namespaces):
    objs = render(chart, values)
    sts = one(objs, "StatefulSet")
    assert sts["spec"]["replicas"] == 2
    (operator,) = containers(sts)
    args = operator["args"]
    peering = next(a.split("=", 1)[1] for a in args if a.startswith("--peering="))
    peerings = of_kind(objs, peering_kind)
    assert {p["metadata"]["name"] for p in peerings} == {peering}
    assert [p["metadata"].get("namespace") for p in peerings] == (namespaces or [None])
    # equal kopf priorities pause every replica: each takes its StatefulSet ordinal instead
    priority = next(a.split("=", 1)[1] for a in args if a.startswith("--priority="))
    var = re.fullmatch(r"\$\((\w+)\)", priority).group(1)
    field = env_of(operator)[var]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env_of(operator)["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert one(objs, "Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("values, expected", [
    ({}, ["--all-namespaces"]),
    (NAMESPACED, [f"--namespace={n}" for n in WATCHED]),
], ids=["cluster", "namespaces"])
def test_operator_serves_the_namespaces_its_rbac_covers(chart, values, expected):
    (operator,) = containers(one(render(chart, values), "StatefulSet"))
    scope_args = [a for a in operator["args"] if a.startswith(("--namespace", "--all-namespaces"))]
    assert scope_args == expected
    assert operator["args"][0] == "operator"


def test_operator_gets_prometheus_address_and_admin_token_secret(chart):
    values = {"prometheus": {"address": "http://prom.obs:9090"},
              "adminToken": {"existingSecret": "fleet-token", "key": "bearer"}}
    (operator,) = containers(one(render(chart, values), "StatefulSet"))
    env = env_of(operator)
    assert env["GRAFT_PROMETHEUS_ADDRESS"]["value"] == "http://prom.obs:9090"
    assert env["GRAFT_ADMIN_TOKEN_SECRET"]["value"] == f"{NAMESPACE}/fleet-token"
    assert env["GRAFT_ADMIN_TOKEN_SECRET_KEY"]["value"] == "bearer"
    port = next(p["containerPort"] for p in operator["ports"] if p["name"] == "health")
    assert f"--liveness=http://0.0.0.0:{port}/healthz" in operator["args"]
    assert operator["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


# security

@setups
def test_every_pod_runs_locked_down(chart, values):
    workloads = [o for o in render(chart, values) if o["kind"] in ("Deployment", "StatefulSet")]
    assert workloads
    for workload in workloads:
        spec = pod_template(workload)["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
        for c in containers(workload):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True and not sc.get("privileged")
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
            # a read-only root still needs somewhere to write
            assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}


@pytest.mark.parametrize("values", [ENGINE, GATEWAY, SETUPS["everything"]], ids=["engine", "gateway-api", "everything"])
def test_engine_services_never_expose_the_admin_port(chart, values):
    objs = render(chart, values)
    (engine,) = containers(one(objs, "Deployment"))
    admin = {p["containerPort"]: p["name"] for p in engine["ports"]}
    assert admin[8081] == "admin"
    services = of_kind(objs, "Service")
    assert len(services) >= 2
    for svc in services:
        for port in svc["spec"]["ports"]:
            assert port["port"] != 8081 and port["targetPort"] not in (8081, "admin"), svc["metadata"]["name"]


def test_only_the_operator_may_reach_the_engine_admin_port(chart):
    objs = render(chart, ENGINE)
    policy = one(objs, "NetworkPolicy")
    engine_labels = pod_template(one(objs, "Deployment"))["metadata"]["labels"]
    operator_labels = pod_template(one(objs, "StatefulSet"))["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], engine_labels)
    by_port = {p["port"]: rule for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert "from" not in by_port["http"]
    (source,) = by_port["admin"]["from"]
    assert selects(source["podSelector"]["matchLabels"], operator_labels)
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}


# the engine fleet

def test_engine_pods_read_their_patches_and_admin_token(chart):
    objs = render(chart, merged(ENGINE, {"engine": {"patches": "kv-align@3.2.1"}}))
    deployment = one(objs, "Deployment")
    template = pod_template(deployment)
    (engine,) = containers(deployment)
    env = env_of(engine)
    assert env["GRAFT_PATCHES"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['graft.dev/patches']"
    assert template["metadata"]["annotations"]["graft.dev/patches"] == "kv-align@3.2.1"
    token_file = env["GRAFT_ADMIN_TOKEN_FILE"]["value"]
    mount = next(m for m in engine["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"] is True
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    secret = one(objs, "Secret")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    key = token_file.rsplit("/", 1)[1]
    assert key in secret["data"] and volume["secret"]["items"] == [{"key": key, "path": key}]
    assert template["spec"]["automountServiceAccountToken"] is False


def test_engine_pods_serve_on_8000_with_a_gpu_and_health_probes(chart):
    objs = render(chart, merged(ENGINE, {"engine": {"model": "/models/llama.gguf",
                                                    "modelVolume": {"persistentVolumeClaim": {"claimName": "llama"}}}}))
    deployment = one(objs, "Deployment")
    (engine,) = containers(deployment)
    assert engine["args"][:4] == ["serve", "--host=0.0.0.0", "--port=8000", "--admin-port=8081"]
    assert "--model=/models/llama.gguf" in engine["args"]
    assert "/models" in {m["mountPath"] for m in engine["volumeMounts"]}
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert ports == {"http": 8000, "admin": 8081}
    assert engine["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert engine["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"
    annotations = pod_template(deployment)["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["http"]) and annotations["prometheus.io/path"] == "/metrics"
    assert deployment["spec"]["replicas"] == 3
    service = one(objs, "Service", "graft-engine")
    assert selects(service["spec"]["selector"], pod_template(deployment)["metadata"]["labels"])


def test_engine_selector_in_notes_picks_the_engine_pods(chart):
    objs = render(chart, ENGINE)
    labels = pod_template(one(objs, "Deployment"))["metadata"]["labels"]
    text = notes(chart, ENGINE)
    block = text.split("matchLabels:", 1)[1].split("\n\n", 1)[0]
    selector = yaml.safe_load(block)
    assert selector and selects(selector, labels)


def test_gateway_api_sends_all_traffic_to_stable_until_a_rollout_moves_it(chart):
    objs = render(chart, GATEWAY)
    pod_labels = pod_template(one(objs, "Deployment"))["metadata"]["labels"]
    route = one(objs, "HTTPRoute")
    assert route["spec"]["parentRefs"] == [GATEWAY_PARENT]
    (rule,) = route["spec"]["rules"]
    weights = {ref["name"]: ref["weight"] for ref in rule["backendRefs"]}
    assert weights == {"graft-engine-stable": 100, "graft-engine-canary": 0}
    for name, track in (("graft-engine-stable", "stable"), ("graft-engine-canary", "canary")):
        selector = one(objs, "Service", name)["spec"]["selector"]
        assert selector["graft.dev/track"] == track
        assert selects({k: v for k, v in selector.items() if k != "graft.dev/track"}, pod_labels)
    # a fresh pod is stable, so the stable Service has endpoints before any rollout
    assert pod_labels["graft.dev/track"] == "stable"
    notes_text = notes(chart, GATEWAY)
    for key, name in (("httpRoute", "graft-engine"), ("stableService", "graft-engine-stable"),
                      ("canaryService", "graft-engine-canary")):
        assert f"{key}: {name}" in notes_text


def test_admin_token_secret_is_created_or_taken_as_given(chart):
    created = one(render(chart, {"adminToken": {"value": "s3cret"}}), "Secret")
    assert base64.b64decode(created["data"]["token"]).decode() == "s3cret"
    generated = one(render(chart, {}), "Secret")
    assert len(base64.b64decode(generated["data"]["token"])) == 48
    objs = render(chart, merged(ENGINE, {"adminToken": {"existingSecret": "fleet-token"}}))
    assert not of_kind(objs, "Secret")
    volumes = pod_template(one(objs, "Deployment"))["spec"]["volumes"]
    assert {v["secret"]["secretName"] for v in volumes if "secret" in v} == {"fleet-token"}


# monitoring

def test_pod_monitor_scrapes_the_engines_metrics_port(chart):
    objs = render(chart, PROMETHEUS_OPERATOR)
    monitor = one(objs, "PodMonitor")
    deployment = one(objs, "Deployment")
    assert selects(monitor["spec"]["selector"]["matchLabels"], pod_template(deployment)["metadata"]["labels"])
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in containers(deployment)[0]["ports"]}
    assert ports[endpoint["port"]] == 8000 and endpoint["path"] == "/metrics"


def test_pod_monitor_can_scrape_engines_the_chart_does_not_run(chart):
    selector = {"matchLabels": {"app": "llm-engine"}}
    monitor = one(render(chart, {"monitoring": {"prometheusOperator": {"enabled": True, "podSelector": selector}}}),
                  "PodMonitor")
    assert monitor["spec"]["selector"] == selector and monitor["spec"]["namespaceSelector"] == {"any": True}


def test_prometheus_rule_and_dashboard_are_the_deploy_files(chart):
    objs = render(chart, PROMETHEUS_OPERATOR)
    rule_file = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-rule.yaml").read_text())
    rule = one(objs, "PrometheusRule")
    assert rule["spec"] == rule_file["spec"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    dashboard = one(objs, "ConfigMap", f"{RELEASE}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["graft-dashboard.json"] == (DEPLOY / "grafana" / "graft-dashboard.json").read_text()


def test_notes_warn_when_the_operator_would_not_serve_the_chart_engines(chart):
    away = merged(ENGINE, NAMESPACED)
    assert f"the engines run in {NAMESPACE}, which the operator does not serve" in notes(chart, away)
    assert "does not serve" not in notes(chart, merged(ENGINE, {"rbac": {"scope": "namespace"}}))
    assert "does not serve" not in notes(chart, ENGINE)
