"""The Helm chart: it lints, renders valid Kubernetes objects for every supported setup, ships the
CRDs of crds/ unchanged (graft's own as templates, so that upgrades apply them), grants the
operator exactly the API calls it makes, and locks down every pod it runs."""
from __future__ import annotations

import base64
import copy
import re
import tarfile

import helm_python as helm
import pytest
import yaml

from graft.operator.settings import OperatorSettings

from tests.deploy.manifests import (CHART, CRDS, DEPLOY, NAMESPACE, RELEASE, containers, crd_errors,
                                    env_of, k8s_errors, load_docs, load_file, notes, of_kind, one,
                                    pod_template, render, selects, validation_errors)

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
TLS_CERT_MANAGER = merged(ENGINE, {"adminTLS": {"certManager": {"enabled": True}}})
TLS_SECRET_ANY = {"adminTLS": {"existingSecret": "engine-admin-tls", "serverName": "llm-engine.llm.svc"}}
TLS_SECRET = merged(ENGINE, {"adminTLS": {"existingSecret": "engine-admin-tls"}})
GENERATED_TOKEN = {"adminToken": {"generate": True}}
SETUPS = {
    "defaults": {},
    "namespaced-rbac": NAMESPACED,
    "engine": ENGINE,
    "gateway-api": GATEWAY,
    "prometheus-operator": PROMETHEUS_OPERATOR,
    "replicas-2": REPLICAS_2,
    "admin-tls-cert-manager": TLS_CERT_MANAGER,
    "admin-tls-secret": TLS_SECRET,
    "generated-token": GENERATED_TOKEN,
    "everything": merged(NAMESPACED, GATEWAY, PROMETHEUS_OPERATOR, REPLICAS_2, {"engine": {
        "patches": "kv-align@3.2.1,sync-free@3.2.1", "model": "/models/llama.gguf",
        "modelVolume": {"persistentVolumeClaim": {"claimName": "llama"}},
        "podLabels": {"app": "llm-engine"},
        "bundles": {"trustedKeys": {"configMap": "release-keys", "keys": ["release.pem"]}}},
        "adminTLS": {"certManager": {"enabled": True, "issuerRef": {"name": "internal-ca", "kind": "ClusterIssuer"}}}}),
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
    ({"adminToken": {"value": "s3cret"}}, "value"),
    ({"adminToken": {"generate": True, "existingSecret": "fleet-token"}}, "set only one"),
    (merged(TLS_CERT_MANAGER, TLS_SECRET), "set only one"),
    ({"adminTLS": {"certManager": {"enabled": True}}}, "set engine.enabled too"),
    ({"adminTLS": {"existingSecret": "engine-admin-tls"}}, "needs adminTLS.serverName"),
    ({"adminTLS": {"certManager": {"duration": "90 days"}}}, "/adminTLS/certManager/duration"),
    (merged(ENGINE, {"engine": {"bundles": {"trustedKeys": {"configMap": "keys"}}}}), "needs both configMap and keys"),
    ({"crds": {"instal": False}}, "instal"),
], ids=["scope", "typo", "patch-format", "namespace-name", "no-replicas", "watch-cluster",
        "gateway-no-engine", "gateway-no-parent", "podmonitor-no-selector", "no-service-account",
        "token-in-values", "token-two-sources", "tls-two-sources", "tls-cert-manager-no-engine",
        "tls-secret-no-server-name", "tls-bad-duration", "trusted-keys-without-keys", "crds-typo"])
def test_bad_values_are_refused_with_a_reason(chart, values, complaint):
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as err:
        render(chart, values)
    assert complaint in str(err.value)


# CRDs: one source, crds/, shipped as it is; graft's own rendered as templates so upgrades update them

KEEP = {"helm.sh/resource-policy": "keep"}


def source_crds() -> dict[str, dict]:
    """Every CRD under crds/, by name."""
    return {crd["metadata"]["name"]: crd for path in sorted(CRDS.glob("*.yaml")) for crd in load_file(path)}


def rendered_crds(chart, values=None) -> dict[str, dict]:
    return {crd["metadata"]["name"]: crd for crd in of_kind(render(chart, values), "CustomResourceDefinition")}


def helm_crds(chart) -> dict[str, dict]:
    """The CRDs of the chart's crds/ folder, which Helm installs once and never upgrades."""
    return {crd["metadata"]["name"]: crd for f in chart.crds for crd in load_docs(f["data"])}


def without_keep(crd: dict) -> dict:
    crd = copy.deepcopy(crd)
    annotations = crd["metadata"].pop("annotations")
    assert annotations == KEEP, annotations
    return crd


def test_chart_renders_every_crd_of_crds_dir_with_the_keep_policy(chart):
    source, rendered, by_helm = source_crds(), rendered_crds(chart), helm_crds(chart)
    assert {"patchrollouts.graft.dev", "patchfleets.graft.dev", "patchanalysistemplates.graft.dev",
            "clusterkopfpeerings.kopf.dev"} <= set(source)
    # each CRD of crds/ comes one way only: rendered, or kopf's peering CRDs from the chart's crds/
    assert not set(rendered) & set(by_helm)
    assert {name: without_keep(crd) for name, crd in rendered.items()} | by_helm == source
    assert {crd["spec"]["group"] for crd in rendered.values()} == {"graft.dev"}
    assert {crd["spec"]["group"] for crd in by_helm.values()} == {"kopf.dev"}


def test_the_chart_crds_folder_holds_only_kopfs_peering_crds_byte_for_byte(chart):
    # the chart renders its own peering objects: Helm must know their kinds before it builds the
    # release's manifest, which only the crds/ folder gives; kopf's definitions never change
    assert {c["name"]: c["data"] for c in chart.crds} == {
        "crds/kopf-peering.yaml": (CRDS / "kopf-peering.yaml").read_text(encoding="utf-8")}


@pytest.mark.parametrize("values", [{"crds": {"install": False}}, {"crds": {"install": False, "keep": False}}],
                         ids=["install-off", "install-and-keep-off"])
def test_crds_install_false_renders_no_crd(chart, values):
    assert rendered_crds(chart, values) == {}
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2]


def test_crds_keep_false_renders_the_crds_as_they_are(chart):
    ours = {name: crd for name, crd in source_crds().items() if crd["spec"]["group"] == "graft.dev"}
    assert ours and rendered_crds(chart, {"crds": {"keep": False}}) == ours


def test_shipped_crds_are_valid_definitions(chart):
    for name, crd in (helm_crds(chart) | rendered_crds(chart)).items():
        assert crd["kind"] == "CustomResourceDefinition"
        assert not k8s_errors(crd), (name, k8s_errors(crd))


def test_packaged_chart_carries_the_linked_files(chart, tmp_path):
    archive = helm.package(CHART, destination=tmp_path)
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        def text(name):
            return tar.extractfile(members[name]).read().decode()
        for crd in CRDS.glob("*.yaml"):
            assert text(f"graft/files/crds/{crd.name}") == crd.read_text(encoding="utf-8")
        assert {m for m in members if m.startswith("graft/crds/")} == {"graft/crds/kopf-peering.yaml"}
        assert text("graft/crds/kopf-peering.yaml") == (CRDS / "kopf-peering.yaml").read_text(encoding="utf-8")
        assert text("graft/files/prometheus-rule.yaml") == (DEPLOY / "prometheus" / "prometheus-rule.yaml").read_text()
        assert text("graft/files/graft-dashboard.json") == (DEPLOY / "grafana" / "graft-dashboard.json").read_text()
    with helm.Chart.load(archive) as packaged:
        assert one(render(packaged, PROMETHEUS_OPERATOR), "PrometheusRule")["spec"]["groups"]
        assert rendered_crds(packaged) == rendered_crds(chart)


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
    assert "GRAFT_PROMETHEUS_ALLOWED" not in env, "by default rollouts may name no other Prometheus"


def test_operator_gets_the_prometheus_addresses_rollouts_may_name(chart):
    values = {"prometheus": {"address": "http://prom.obs:9090",
                             "allowedAddresses": ["https://thanos.obs:10902", "http://prom.team:9090/org"]}}
    (operator,) = containers(one(render(chart, values), "StatefulSet"))
    value = env_of(operator)["GRAFT_PROMETHEUS_ALLOWED"]["value"]
    assert value == "https://thanos.obs:10902,http://prom.team:9090/org"
    # the operator starts with the environment the chart gives it
    settings = OperatorSettings.from_env({k: e["value"] for k, e in env_of(operator).items() if "value" in e})
    assert settings.prometheus_prefixes == ["http://prom.obs:9090", "https://thanos.obs:10902",
                                            "http://prom.team:9090/org"]
    with pytest.raises(Exception, match="allowedAddresses"):
        render(chart, {"prometheus": {"address": "http://prom.obs:9090", "allowedAddresses": ["prom:9090"]}})


def test_operator_gets_the_services_web_checks_may_ask(chart):
    (operator,) = containers(one(render(chart, {}), "StatefulSet"))
    assert "GRAFT_WEB_ALLOWED" not in env_of(operator), "by default a web check may ask nothing"
    values = {"webChecks": {"allowedAddresses": ["http://evals.ml.svc:8080", "https://scores.obs/api"]}}
    (operator,) = containers(one(render(chart, values), "StatefulSet"))
    settings = OperatorSettings.from_env({k: e["value"] for k, e in env_of(operator).items() if "value" in e})
    assert settings.web_allowed == ["http://evals.ml.svc:8080", "https://scores.obs/api"]
    with pytest.raises(Exception, match="allowedAddresses"):
        render(chart, {"webChecks": {"allowedAddresses": ["evals:8080"]}})


def test_job_checks_are_off_until_the_chart_turns_them_on_with_their_service_accounts(chart):
    (operator,) = containers(one(render(chart, {}), "StatefulSet"))
    settings = OperatorSettings.from_env({k: e["value"] for k, e in env_of(operator).items() if "value" in e})
    assert not settings.job_checks, "by default no rollout makes a Job"
    values = {"jobChecks": {"enabled": True, "serviceAccounts": ["default", "llm-evals"]}}
    (operator,) = containers(one(render(chart, values), "StatefulSet"))
    settings = OperatorSettings.from_env({k: e["value"] for k, e in env_of(operator).items() if "value" in e})
    assert (settings.job_checks, settings.job_service_accounts) == (True, ["default", "llm-evals"])
    with pytest.raises(Exception, match="serviceAccounts"):
        render(chart, {"jobChecks": {"enabled": True, "serviceAccounts": ["Not A Name"]}})


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


@pytest.mark.parametrize("values", [ENGINE, TLS_CERT_MANAGER, SETUPS["everything"]],
                         ids=["engine", "admin-tls", "everything"])
def test_only_the_operator_may_reach_the_engine_admin_port(chart, values):
    # on by default whenever the chart runs engines
    objs = render(chart, values)
    policy = one(objs, "NetworkPolicy")
    deployment = one(objs, "Deployment")
    (engine,) = containers(deployment)
    engine_labels = pod_template(deployment)["metadata"]["labels"]
    operator_labels = pod_template(one(objs, "StatefulSet"))["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], engine_labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    by_port = {p["port"]: rule for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert set(by_port) == {"http", "metrics", "admin"}
    # the serving port stays open to everyone
    assert "from" not in by_port["http"]
    (source,) = by_port["admin"]["from"]
    assert selects(source["podSelector"]["matchLabels"], operator_labels)
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}
    # the named port is the one the admin API listens on
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert f"--admin-port={ports['admin']}" in engine["args"]
    assert f"--port={ports['http']}" in engine["args"]


def test_network_policy_is_only_left_out_when_asked(chart):
    assert not of_kind(render(chart, {}), "NetworkPolicy")
    off = merged(ENGINE, {"engine": {"networkPolicy": {"enabled": False}}})
    assert not of_kind(render(chart, off), "NetworkPolicy")


# the engine fleet

def mounted_file(workload: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret or ConfigMap name, key) of the file at `path` in a container, mounted read-only
    without subPath (a subPath mount never sees the Secret change)."""
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    assert mount.get("readOnly") is True and "subPath" not in mount, mount
    volume = next(v for v in pod_template(workload)["spec"]["volumes"] if v["name"] == mount["name"])
    source = volume.get("secret") or volume["configMap"]
    relative = path[len(mount["mountPath"].rstrip("/")) + 1:]
    (key,) = [i["key"] for i in source.get("items") or [{"key": relative, "path": relative}] if i["path"] == relative]
    return source.get("secretName") or source["name"], key


def test_engine_pods_read_their_patches_from_the_pod_annotation(chart):
    objs = render(chart, merged(ENGINE, {"engine": {"patches": "kv-align@3.2.1"}}))
    deployment = one(objs, "Deployment")
    template = pod_template(deployment)
    (engine,) = containers(deployment)
    env = env_of(engine)
    assert env["GRAFT_PATCHES"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['graft.dev/patches']"
    assert template["metadata"]["annotations"]["graft.dev/patches"] == "kv-align@3.2.1"
    assert template["spec"]["automountServiceAccountToken"] is False
    # the shadow comparison's rate, from the pod annotation (an absent one is empty: the default)
    assert env["GRAFT_SHADOW_RATE"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['graft.dev/shadow-rate']"


def test_engine_admin_api_listens_on_the_pod_ip(chart):
    # the engine binds its admin API to loopback unless told otherwise; the operator calls the pod IP
    (engine,) = containers(one(render(chart, ENGINE), "Deployment"))
    assert "--admin-host=$(POD_IP)" in engine["args"]
    assert env_of(engine)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "--host=0.0.0.0" in engine["args"]


@pytest.mark.parametrize("values", [ENGINE, SETUPS["everything"]], ids=["engine", "everything"])
def test_engine_pods_wait_for_the_patched_readiness_gate_when_asked(chart, values):
    on = pod_template(one(render(chart, merged(values, {"engine": {"readinessGate": True}})), "Deployment"))
    assert on["spec"]["readinessGates"] == [{"conditionType": "graft.dev/patched"}]
    # off by default: nothing sets the condition yet, and a gated pod would never be Ready
    default = pod_template(one(render(chart, values), "Deployment"))
    assert "readinessGates" not in default["spec"]


UNSIGNED = merged(ENGINE, {"engine": {"bundles": {"allowUnsigned": True}}})


@pytest.mark.parametrize("values", [ENGINE, TLS_CERT_MANAGER, TLS_SECRET, UNSIGNED, SETUPS["everything"]],
                         ids=["engine", "admin-tls-cert-manager", "admin-tls-secret", "unsigned-bundles", "everything"])
def test_engine_args_are_flags_graft_serve_accepts(chart, values):
    from graft.cli import build_parser

    (engine,) = containers(one(render(chart, values), "Deployment"))
    # $(VAR) expanded from the container's env, as the kubelet does
    defined = {e["name"] for e in engine["env"]}
    args = [re.sub(r"\$\((\w+)\)", lambda m: "10.1.2.3" if m.group(1) in defined else m.group(0), a)
            for a in engine["args"]]
    parsed, unknown = build_parser().parse_known_args(args)
    assert not unknown, f"graft serve does not know {unknown}"
    assert parsed.command == "serve" and parsed.admin_host == "10.1.2.3"


def test_engines_accept_only_bundles_signed_by_a_trusted_key(chart):
    (engine,) = containers(one(render(chart, ENGINE), "Deployment"))
    assert not [a for a in engine["args"] if a.startswith(("--trusted-key", "--allow-unsigned-bundles"))]
    values = merged(ENGINE, {"engine": {"bundles": {"trustedKeys": {"configMap": "release-keys",
                                                                    "keys": ["release.pem", "backup.pem"]}}}})
    deployment = one(render(chart, values), "Deployment")
    (engine,) = containers(deployment)
    keys = [a.split("=", 1)[1] for a in engine["args"] if a.startswith("--trusted-key=")]
    assert [mounted_file(deployment, engine, k) for k in keys] == [("release-keys", "release.pem"),
                                                                   ("release-keys", "backup.pem")]
    assert "--allow-unsigned-bundles" not in engine["args"]
    (engine,) = containers(one(render(chart, UNSIGNED), "Deployment"))
    assert "--allow-unsigned-bundles" in engine["args"]


def test_engines_probe_patches_with_the_prompts_of_a_configmap(chart):
    from graft.cli import build_parser

    (engine,) = containers(one(render(chart, ENGINE), "Deployment"))
    assert not [a for a in engine["args"] if a.startswith("--probe-prompts")]
    for probe, key in (({"configMap": "fleet-probes"}, "probe-prompts.jsonl"),
                       ({"configMap": "fleet-probes", "key": "traffic.jsonl"}, "traffic.jsonl")):
        values = merged(ENGINE, {"engine": {"probePrompts": probe}})
        report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
        assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
        deployment = one(render(chart, values), "Deployment")
        (engine,) = containers(deployment)
        (path,) = [a.split("=", 1)[1] for a in engine["args"] if a.startswith("--probe-prompts=")]
        assert mounted_file(deployment, engine, path) == ("fleet-probes", key)
        assert build_parser().parse_known_args(engine["args"])[0].probe_prompts == path
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as err:
        render(chart, merged(ENGINE, {"engine": {"probePrompts": {"configMap": "Fleet Probes"}}}))
    assert "/engine/probePrompts/configMap" in str(err.value)


# the admin token: one Secret in the release's namespace, the same whoever renders the chart

# helm template and GitOps renders: certificates from a Secret the user manages (or cert-manager)
DETERMINISTIC = {k: v if "adminTLS" in v else merged(v, TLS_SECRET_ANY)
                 for k, v in SETUPS.items() if k != "generated-token"}
GENERATED_TLS = {k: v for k, v in SETUPS.items() if "adminTLS" not in v and k != "generated-token"}


@pytest.mark.parametrize("values", list(DETERMINISTIC.values()), ids=list(DETERMINISTIC))
def test_rendering_twice_gives_the_same_objects(chart, values):
    # helm template and GitOps tools (Argo CD) render without the cluster, on every sync: a token
    # drawn at render time would change each time, and the engines and the operator would disagree
    assert render(chart, values) == render(chart, values)


@pytest.mark.parametrize("values", list(GENERATED_TLS.values()), ids=list(GENERATED_TLS))
def test_rendering_twice_changes_only_a_generated_admin_certificate_which_is_immutable(chart, values):
    """By default the chart generates the admin API's certificate at render time, so a renderer
    without the cluster draws a new one each time; the Secret is immutable and kept, so that render
    is refused by the API server instead of parting the engines' certificate from the operator's CA."""
    one_render, other = render(chart, values), render(chart, values)
    name = f"{RELEASE}-engine-admin-tls"

    def generated(objs):
        return [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == name]

    (first,), (second,) = generated(one_render), generated(other)
    assert first["data"]["tls.key"] != second["data"]["tls.key"]
    assert first["immutable"] is True and first["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert [o for o in one_render if o not in generated(one_render)] == [o for o in other if o not in generated(other)]


def test_by_default_the_admin_token_is_a_secret_the_user_makes(chart):
    objs = render(chart, ENGINE)
    assert [s["metadata"]["name"] for s in of_kind(objs, "Secret")] == [f"{RELEASE}-engine-admin-tls"]
    (operator,) = containers(one(objs, "StatefulSet"))
    assert env_of(operator)["GRAFT_ADMIN_TOKEN_SECRET"]["value"] == f"{NAMESPACE}/{RELEASE}-admin-token"
    deployment = one(objs, "Deployment")
    (engine,) = containers(deployment)
    assert mounted_file(deployment, engine, env_of(engine)["GRAFT_ADMIN_TOKEN_FILE"]["value"]) == (
        f"{RELEASE}-admin-token", "token")

    objs = render(chart, merged(TLS_SECRET, {"adminToken": {"existingSecret": "fleet-token", "key": "bearer"}}))
    assert not of_kind(objs, "Secret")
    (operator,) = containers(one(objs, "StatefulSet"))
    assert env_of(operator)["GRAFT_ADMIN_TOKEN_SECRET"]["value"] == f"{NAMESPACE}/fleet-token"
    assert env_of(operator)["GRAFT_ADMIN_TOKEN_SECRET_KEY"]["value"] == "bearer"
    deployment = one(objs, "Deployment")
    (engine,) = containers(deployment)
    token_file = env_of(engine)["GRAFT_ADMIN_TOKEN_FILE"]["value"]
    assert mounted_file(deployment, engine, token_file) == ("fleet-token", "bearer")


def test_a_generated_admin_token_is_made_once_and_kept(chart):
    objs = render(chart, merged(TLS_SECRET, GENERATED_TOKEN))
    secret = one(objs, "Secret")
    assert (secret["metadata"]["name"], secret["metadata"]["namespace"]) == (f"{RELEASE}-admin-token", NAMESPACE)
    # kept through upgrades and uninstalls, and never overwritten by a render that cannot see it
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert secret["immutable"] is True
    assert len(base64.b64decode(secret["data"]["token"])) == 48
    deployment = one(objs, "Deployment")
    (engine,) = containers(deployment)
    assert mounted_file(deployment, engine, env_of(engine)["GRAFT_ADMIN_TOKEN_FILE"]["value"]) == (
        secret["metadata"]["name"], "token")
    # an upgrade takes the token it finds rather than drawing a new one
    template = (CHART / "templates" / "admin-token-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template


@pytest.mark.parametrize("values", [ENGINE, SETUPS["everything"]], ids=["engine", "everything"])
def test_engines_read_the_admin_token_from_a_file_that_follows_rotation(chart, values):
    deployment = one(render(chart, values), "Deployment")
    for c in containers(deployment):
        assert not c.get("envFrom")
        assert not [e for e in c.get("env", []) if "secretKeyRef" in (e.get("valueFrom") or {})], c["name"]
        assert "GRAFT_ADMIN_TOKEN" not in env_of(c)
    (engine,) = containers(deployment)
    token_file = env_of(engine)["GRAFT_ADMIN_TOKEN_FILE"]["value"]
    assert mounted_file(deployment, engine, token_file)[1] == "token"


def test_docs_say_where_the_admin_token_lives_and_when_it_is_read(chart):
    text = notes(chart, ENGINE)
    assert f'Secret "{RELEASE}-admin-token" in namespace {NAMESPACE}' in text
    assert "at start-up" in text
    assert f"kubectl -n {NAMESPACE} create secret generic {RELEASE}-admin-token" in text
    assert "create secret" not in notes(chart, merged(ENGINE, GENERATED_TOKEN))
    for doc in ("README.md", "values.yaml"):
        text = " ".join((CHART / doc).read_text().split())
        assert "in the release's namespace" in text and "at start-up" in text, doc


# admin API TLS

@pytest.mark.parametrize("values, secret", [(merged(ENGINE, {"adminTLS": {"plainHTTP": True}}), None),
                                            (ENGINE, "graft-engine-admin-tls"),
                                            (TLS_CERT_MANAGER, "graft-engine-admin-tls"),
                                            (TLS_SECRET, "engine-admin-tls")],
                         ids=["plain-http", "generated", "cert-manager", "existing-secret"])
def test_admin_tls_gives_engines_a_certificate_and_the_operator_its_ca(chart, values, secret):
    objs = render(chart, values)
    deployment, sts = one(objs, "Deployment"), one(objs, "StatefulSet")
    (engine,), (operator,) = containers(deployment), containers(sts)
    flags = dict(a.split("=", 1) for a in engine["args"] if a.startswith("--admin-tls"))
    env = env_of(operator)
    if secret is None:
        assert not flags and not {"GRAFT_ADMIN_CA_FILE", "GRAFT_ADMIN_TLS_SERVER_NAME"} & set(env)
        assert not of_kind(objs, "Certificate") and not of_kind(objs, "Issuer") and not of_kind(objs, "Secret")
        assert env["GRAFT_ADMIN_PLAIN_HTTP"]["value"] == "true"     # opted out, said to the operator
        return
    assert "GRAFT_ADMIN_PLAIN_HTTP" not in env
    assert mounted_file(deployment, engine, flags["--admin-tls-cert"]) == (secret, "tls.crt")
    assert mounted_file(deployment, engine, flags["--admin-tls-key"]) == (secret, "tls.key")
    assert mounted_file(sts, operator, env["GRAFT_ADMIN_CA_FILE"]["value"]) == (secret, "ca.crt")
    assert env["GRAFT_ADMIN_TLS_SERVER_NAME"]["value"] == f"{RELEASE}-engine.{NAMESPACE}.svc"
    # the operator gets the CA and nothing else of that Secret: never the engines' private key
    volumes = [v["secret"] for v in pod_template(sts)["spec"]["volumes"] if "secret" in v]
    assert volumes == [{"secretName": secret, "items": [{"key": "ca.crt", "path": "ca.crt"}]}]


CERT_MANAGER_FIELDS = {"secretName", "duration", "renewBefore", "dnsNames", "usages", "privateKey", "issuerRef",
                       "isCA", "commonName"}


def test_cert_manager_issues_the_engine_certificate_for_the_service_name(chart):
    objs = render(chart, TLS_CERT_MANAGER)
    certs = {c["spec"]["secretName"]: c for c in of_kind(objs, "Certificate")}
    issuers = {i["metadata"]["name"]: i for i in of_kind(objs, "Issuer")}
    for obj in of_kind(objs, "Certificate") + of_kind(objs, "Issuer"):
        assert obj["metadata"]["namespace"] == NAMESPACE
    assert all(set(c["spec"]) <= CERT_MANAGER_FIELDS for c in certs.values())
    leaf = certs[f"{RELEASE}-engine-admin-tls"]
    (operator,) = containers(one(objs, "StatefulSet"))
    server_name = env_of(operator)["GRAFT_ADMIN_TLS_SERVER_NAME"]["value"]
    service = one(objs, "Service", f"{RELEASE}-engine")
    assert server_name == f'{service["metadata"]["name"]}.{service["metadata"]["namespace"]}.svc'
    assert server_name in leaf["spec"]["dnsNames"] and "server auth" in leaf["spec"]["usages"]
    # the chain the chart brings: engine certificate <- CA Issuer <- CA certificate <- self-signed Issuer
    assert leaf["spec"]["issuerRef"]["kind"] == "Issuer"
    ca_issuer = issuers[leaf["spec"]["issuerRef"]["name"]]
    ca = certs[ca_issuer["spec"]["ca"]["secretName"]]
    assert ca["spec"]["isCA"] is True and ca["spec"]["issuerRef"]["kind"] == "Issuer"
    assert issuers[ca["spec"]["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}

    own = render(chart, merged(TLS_CERT_MANAGER, {"adminTLS": {"certManager": {
        "issuerRef": {"name": "internal-ca", "kind": "ClusterIssuer"}}}}))
    assert not of_kind(own, "Issuer")
    (leaf,) = of_kind(own, "Certificate")
    assert leaf["spec"]["issuerRef"] == {"name": "internal-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}


def test_engine_pods_serve_on_8000_with_a_gpu_and_health_probes(chart):
    objs = render(chart, merged(ENGINE, {"engine": {"model": "/models/llama.gguf",
                                                    "modelVolume": {"persistentVolumeClaim": {"claimName": "llama"}}}}))
    deployment = one(objs, "Deployment")
    (engine,) = containers(deployment)
    assert engine["args"][:3] == ["serve", "--host=0.0.0.0", "--port=8000"]
    assert "--admin-port=8081" in engine["args"]
    assert "--model=/models/llama.gguf" in engine["args"]
    assert "/models" in {m["mountPath"] for m in engine["volumeMounts"]}
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert ports == {"http": 8000, "metrics": 9400, "admin": 8081}
    assert engine["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert engine["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"
    annotations = pod_template(deployment)["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"]) and annotations["prometheus.io/path"] == "/metrics"
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


# monitoring

def monitor_of(objs, component):
    (monitor,) = [o for o in of_kind(objs, "PodMonitor")
                  if o["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return monitor


def test_pod_monitor_scrapes_the_engines_metrics_port(chart):
    objs = render(chart, PROMETHEUS_OPERATOR)
    monitor = monitor_of(objs, "engine")
    deployment = one(objs, "Deployment")
    assert selects(monitor["spec"]["selector"]["matchLabels"], pod_template(deployment)["metadata"]["labels"])
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in containers(deployment)[0]["ports"]}
    assert endpoint["port"] == "metrics" and ports["metrics"] == 9400 and endpoint["path"] == "/metrics"


METRICS_FROM = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


@pytest.mark.parametrize("values", [PROMETHEUS_OPERATOR, SETUPS["everything"]], ids=["prometheus-operator", "everything"])
def test_engine_pods_serve_metrics_on_a_port_of_their_own_which_the_monitoring_scrapes(chart, values):
    """/metrics is labelled by revision, which tells canaries apart: the engine serves it on its
    container port named `metrics`, apart from the public port; the PodMonitor and the scrape
    annotations go there, and no Service (what clients reach) exposes it."""
    from graft.cli import build_parser

    objs = render(chart, values)
    deployment = one(objs, "Deployment")
    (engine,) = containers(deployment)
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    args = build_parser().parse_known_args(engine["args"])[0]
    assert args.metrics_port == ports["metrics"] and args.port == ports["http"] != ports["metrics"]
    assert args.metrics_host is None and args.host == "0.0.0.0"    # on the pod IP, where Prometheus scrapes
    annotations = pod_template(deployment)["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(ports["metrics"])
    (endpoint,) = monitor_of(objs, "engine")["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    engine_services = [svc for svc in of_kind(objs, "Service")
                       if svc["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"]
    assert len(engine_services) >= 1
    for svc in engine_services:
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"], svc["metadata"]["name"]


def test_the_metrics_port_is_open_to_the_peers_named_and_to_anyone_by_default(chart):
    def metrics_rule(values):
        policy = one(render(chart, values), "NetworkPolicy")
        (rule,) = [r for r in policy["spec"]["ingress"] if {"port": "metrics", "protocol": "TCP"} in r["ports"]]
        assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
        return rule
    assert "from" not in metrics_rule(ENGINE)
    assert metrics_rule(merged(ENGINE, {"engine": {"networkPolicy": {"metricsFrom": METRICS_FROM}}}))["from"] == METRICS_FROM


def test_pod_monitor_scrapes_the_operators_own_metrics(chart):
    objs = render(chart, PROMETHEUS_OPERATOR)
    monitor = monitor_of(objs, "operator")
    operator = one(objs, "StatefulSet")
    assert selects(monitor["spec"]["selector"]["matchLabels"], pod_template(operator)["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (container,) = containers(operator)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[endpoint["port"]] == 9090 and env_of(container)["GRAFT_METRICS_PORT"]["value"] == "9090"


def test_pod_monitor_can_scrape_engines_the_chart_does_not_run(chart):
    selector = {"matchLabels": {"app": "llm-engine"}}
    monitor = monitor_of(render(chart, {"monitoring": {"prometheusOperator": {"enabled": True,
                                                                          "podSelector": selector}}}), "engine")
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


def test_a_generated_admin_certificate_names_the_engine_service_and_is_signed_by_the_ca_the_operator_gets(chart):
    from cryptography import x509

    objs = render(chart, ENGINE)
    secret = one(objs, "Secret")
    assert secret["type"] == "kubernetes.io/tls" and secret["immutable"] is True
    cert, ca = (x509.load_pem_x509_certificate(base64.b64decode(secret["data"][k])) for k in ("tls.crt", "ca.crt"))
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    (operator,) = containers(one(objs, "StatefulSet"))
    assert env_of(operator)["GRAFT_ADMIN_TLS_SERVER_NAME"]["value"] in names
    # an upgrade reuses the certificate it finds rather than drawing a new one
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in (CHART / "templates" / "admin-tls-secret.yaml").read_text()


@pytest.mark.parametrize("values, words", [
    ({"adminTLS": {"generate": False}}, "or set adminTLS.plainHTTP to opt out"),
    ({"adminTLS": {"plainHTTP": True, "existingSecret": "engine-admin-tls"}}, "set only one"),
])
def test_the_chart_refuses_an_admin_api_without_tls_unless_opted_out(chart, values, words):
    with pytest.raises(Exception, match=words):
        render(chart, values)


def test_notification_receivers_reach_the_operator_with_urls_from_their_secrets(chart):
    """The operator reads what the chart renders (graft.operator.notify.receivers_from_env), and no
    URL is ever written into the rendered objects."""
    from graft.operator.notify import receivers_from_env

    values = {"notifications": {"receivers": [
        {"name": "deploys", "type": "slack", "secret": {"name": "graft-notifications", "key": "slack-url"}},
        {"name": "audit", "type": "webhook", "secret": {"name": "audit", "key": "url"},
         "moments": ["started", "promoted"]}]}}
    (operator,) = containers(one(render(chart, values), "StatefulSet"))
    env = env_of(operator)
    assert env["GRAFT_NOTIFY_URL_0"]["valueFrom"]["secretKeyRef"] == {"name": "graft-notifications", "key": "slack-url"}
    assert env["GRAFT_NOTIFY_URL_1"]["valueFrom"]["secretKeyRef"] == {"name": "audit", "key": "url"}
    # what the pod would see once Kubernetes filled the variables from the Secrets
    seen = {"GRAFT_NOTIFICATIONS": env["GRAFT_NOTIFICATIONS"]["value"],
            "GRAFT_NOTIFY_URL_0": "https://hooks.slack.example/T/B/x", "GRAFT_NOTIFY_URL_1": "http://audit.local/in"}
    deploys, audit = receivers_from_env(seen)
    assert (deploys.name, deploys.kind, deploys.url) == ("deploys", "slack", "https://hooks.slack.example/T/B/x")
    assert [m.value for m in audit.moments] == ["started", "promoted"]
    assert "GRAFT_NOTIFICATIONS" not in env_of(containers(one(render(chart, {}), "StatefulSet"))[0])


@pytest.mark.parametrize("receiver", [
    {"name": "deploys", "type": "teams", "secret": {"name": "s", "key": "k"}},
    {"name": "deploys", "type": "slack", "url": "https://hooks.slack.example/T/B/x"},
    {"name": "deploys", "type": "slack", "secret": {"name": "s", "key": "k"}, "moments": ["finished"]},
])
def test_a_notification_receiver_without_a_secret_or_of_an_unknown_kind_is_refused(chart, receiver):
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as err:
        render(chart, {"notifications": {"receivers": [receiver]}})
    assert "/notifications/receivers/0" in str(err.value)


def test_operator_gets_the_fleet_settings_from_values(chart):
    values = {"operator": {"fleet": {"resyncSeconds": 600, "adminConcurrency": 4, "podWatchSeconds": 120}}}
    (operator,) = containers(one(render(chart, values), "StatefulSet"))
    env = env_of(operator)
    assert env["GRAFT_FLEET_RESYNC_SECONDS"]["value"] == "600"
    assert env["GRAFT_FLEET_ADMIN_CONCURRENCY"]["value"] == "4"
    assert env["GRAFT_POD_WATCH_SECONDS"]["value"] == "120"
    # the operator starts with the environment the chart gives it
    settings = OperatorSettings.from_env({k: e["value"] for k, e in env_of(operator).items() if "value" in e})
    assert (settings.fleet_resync, settings.fleet_admin_concurrency, settings.pod_watch_seconds) == (600.0, 4, 120)
    defaults = OperatorSettings.from_env({k: e["value"] for k, e in env_of(one_operator(chart)).items()
                                          if "value" in e})
    assert (defaults.fleet_resync, defaults.fleet_admin_concurrency, defaults.pod_watch_seconds) == (300.0, 8, 300)
    with pytest.raises(Exception, match="adminConcurrency"):
        render(chart, {"operator": {"fleet": {"resyncSeconds": 300, "adminConcurrency": 0, "podWatchSeconds": 300}}})


def one_operator(chart):
    (operator,) = containers(one(render(chart, {}), "StatefulSet"))
    return operator
