"""The PatchRollout and analysis template CRDs: valid CRDs, their schemas (and CEL rules) accept what
runs and refuse what cannot, and their defaults are the spec model's.

Objects go through what kube-apiserver does on a write (graft.devcluster.crd: pruning, structural
defaults, the schema, list types, CEL rules), with unknown fields reported as strict field
validation (kubectl's default) reports them.
"""
import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from graft.devcluster.crd import check, served_versions
from graft.rollout.spec import BUILTIN_METRICS, DEFAULTS, SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "patchrollout.yaml").read_text())
TEMPLATE_CRDS = list(yaml.safe_load_all((ROOT / "crds" / "patchanalysistemplate.yaml").read_text()))
VERSION = CRD["spec"]["versions"][0]
(ROLLOUT,) = served_versions(CRD)
TEMPLATES = {v.kind: v for crd in TEMPLATE_CRDS for v in served_versions(crd)}
DIGEST = "sha256:" + "0123456789abcdef" * 4


def manifest(**spec):
    base = {"selector": {"matchLabels": {"app": "llm-engine"}},
            "patch": {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}}}
    return {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout",
            "metadata": {"name": "kv-align-3-2-1", "namespace": "llm"}, "spec": {**base, **spec}}


def stored(obj, version=ROLLOUT):
    """What the API server would store: unknown fields pruned, defaults filled in."""
    body = copy.deepcopy(obj)
    version.prune(body)
    version.default(body)
    return body


def errors(obj, version=ROLLOUT) -> list[str]:
    """The field paths the API server names when it refuses `obj` (strict field validation)."""
    body = copy.deepcopy(obj)
    unknown = version.prune(body)
    version.default(body)
    return [f"{p} (unknown field)" for p in unknown] + [e.field for e in version.validate(body)]


@pytest.mark.parametrize("crd", [CRD, *TEMPLATE_CRDS], ids=lambda c: c["metadata"]["name"])
def test_crd_is_a_valid_apiextensions_v1_object(crd):
    kubernetes_validate.validate(crd, "1.32", strict=True)
    assert check(crd) == [], "kube-apiserver's own checks: schemas, patterns, CEL rules that compile"


def test_names_scope_columns_and_status_subresource():
    names = CRD["spec"]["names"]
    assert CRD["metadata"]["name"] == "patchrollouts.graft.dev" and CRD["spec"]["scope"] == "Namespaced"
    assert names["kind"] == "PatchRollout" and names["shortNames"] == ["prl"]
    assert VERSION["name"] == "v1alpha1" and VERSION["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    # the step is counted from 1, as in Events and the CLI; the real traffic share shows with -o wide
    assert columns == {"Phase": ".status.phase", "Step": ".status.step", "Weight": ".status.weight",
                       "Share": ".status.trafficShare",
                       "Canary": ".status.canaryRevision", "Stable": ".status.stableRevision",
                       "Age": ".metadata.creationTimestamp"}


def test_template_crds_one_namespaced_one_cluster_wide():
    ns, cluster = TEMPLATES["PatchAnalysisTemplate"], TEMPLATES["ClusterPatchAnalysisTemplate"]
    assert (ns.group, ns.version, ns.plural, ns.namespaced) == (
        "graft.dev", "v1alpha1", "patchanalysistemplates", True)
    assert (cluster.plural, cluster.namespaced) == ("clusterpatchanalysistemplates", False)
    # the paths the operator reads them from (graft.operator.reconcile.load_templates)
    from graft.operator.kube import cluster_template_path, template_path
    assert template_path("llm", "slo") == f"/apis/{ns.group}/{ns.version}/namespaces/llm/{ns.plural}/slo"
    assert cluster_template_path("slo") == f"/apis/{cluster.group}/{cluster.version}/{cluster.plural}/slo"


def test_crd_defaults_equal_the_spec_model_defaults():
    defaulted = stored(manifest())["spec"]
    expected = copy.deepcopy(DEFAULTS)
    # the Prometheus address is left to the operator's fleet-wide setting (GRAFT_PROMETHEUS_ADDRESS)
    expected["analysis"]["prometheus"] = {}
    for key, value in expected.items():
        assert defaulted[key] == value, key
    assert "breakers" not in defaulted["analysis"] and "gates" not in defaulted["analysis"], \
        "the default checks come from parse_spec, so a rollout naming a template gets none of them"
    assert parse_spec(defaulted).analysis.prometheus.address == ""
    minimal = manifest()["spec"]
    del minimal["patch"]["source"]
    assert stored({**manifest(), "spec": minimal})["spec"]["patch"]["source"] == {"builtin": {}}
    assert parse_spec(defaulted) == parse_spec(minimal)


def test_partial_analysis_gets_the_remaining_defaults_in_both():
    m = manifest(analysis={"interval": "10s", "gates": [{"name": "error-rate-delta", "max": 0.002}]})
    a = stored(m)["spec"]["analysis"]
    assert (a["interval"], a["noData"], a["confidence"], a["rollbackConfidence"]) == ("10s", "hold", 0.95, 0.999)
    assert (a["inconclusiveLimit"], a["errorLimit"], a["outageLimit"]) == (20, 4, "10m")
    assert parse_spec(stored(m)["spec"]) == parse_spec(m["spec"])


QUERY = 'histogram_quantile(0.9, rate(x{namespace="{{namespace}}",revision="{{canaryRevision}}"}[{{window}}]))'
VALID = [
    manifest(),
    manifest(patch={"name": "kv-align", "version": "3.2.1",
                    "source": {"configMap": {"name": "kv-align-bundle", "key": "patch.py"}, "digest": DIGEST}}),
    manifest(trafficRouting={"gatewayAPI": {"httpRoute": "llm", "stableService": "llm-stable",
                                            "canaryService": "llm-canary"}}),
    manifest(steps=[{"weight": 10, "pause": {}}, {"weight": 50, "untilApproved": True},
                    {"weight": 100, "pause": "1m", "untilApproved": False}]),
    manifest(steps=[{"weight": 10, "pause": "1h30m"}, {"weight": 100, "pause": "250ms"}],
             analysis={"prometheus": {"address": "https://prom:9090",
                                      "bearerTokenSecret": {"name": "prom", "key": "token"},
                                      "caSecret": {"name": "prom-ca", "key": "ca.crt"},
                                      "headers": [{"name": "X-Scope-OrgID", "value": "llm"}]},
                       "interval": "5s", "noData": "fail", "confidence": 0.9, "rollbackConfidence": 0.99,
                       "inconclusiveLimit": 0, "errorLimit": 10, "outageLimit": "0s",
                       "breakers": [{"name": "ttft-p90", "max": 2, "query": QUERY, "consecutive": 2},
                                    {"name": "cpu", "max": 0.9, "dryRun": True},
                                    {"name": "tpot-p99", "maxRatio": 1.3, "max": 0.2, "window": "30s"}],
                       "gates": [{"name": "tpot-p99", "maxRatio": 1.2, "minSamples": 400},
                                 {"name": "errors", "metric": "error-rate", "max": 0.01, "window": "step"},
                                 {"name": "success-rate", "min": 0.999}]},
             progressDeadline="1h", paused=True),
    manifest(analysis={"breakers": [{"name": "output-divergence", "max": 0.05, "consecutive": 1}],
                       "gates": [{"name": "output-divergence", "max": 0.01, "window": "10m"},
                                 {"name": "divergence-trial", "metric": "output-divergence", "max": 0.001,
                                  "dryRun": True}]}),
]


@pytest.mark.parametrize("obj", VALID)
def test_valid_manifests_pass_the_api_server_and_the_spec_model(obj):
    assert errors(obj) == []
    parse_spec(stored(obj)["spec"])


def br(*checks):
    return {"analysis": {"breakers": list(checks)}}


INVALID = [
    ("no selector", {"selector": None}, "spec.selector"),
    ("empty selector", {"selector": {}}, "spec.selector"),
    ("patch name", {"patch": {"name": "Kv_Align", "version": "1"}}, "spec.patch.name"),
    ("both sources", {"patch": {"name": "p", "version": "1", "source": {
        "builtin": {}, "configMap": {"name": "c", "key": "k"}, "digest": DIGEST}}}, "spec.patch.source"),
    ("no digest", {"patch": {"name": "p", "version": "1", "source": {"configMap": {"name": "c", "key": "k"}}}},
     "spec.patch.source"),
    ("bad digest", {"patch": {"name": "p", "version": "1", "source": {
        "configMap": {"name": "c", "key": "k"}, "digest": "sha256:ABC"}}}, "spec.patch.source.digest"),
    ("two routings", {"trafficRouting": {"podRatio": {}, "gatewayAPI": {
        "httpRoute": "r", "stableService": "a", "canaryService": "b"}}}, "spec.trafficRouting"),
    ("route without services", {"trafficRouting": {"gatewayAPI": {"httpRoute": "r"}}},
     "spec.trafficRouting.gatewayAPI.stableService"),
    ("weight 0", {"steps": [{"weight": 0}, {"weight": 100}]}, "spec.steps[0].weight"),
    ("weight 101", {"steps": [{"weight": 101}]}, "spec.steps[0].weight"),
    ("no steps", {"steps": []}, "spec.steps"),
    ("steps out of order", {"steps": [{"weight": 50}, {"weight": 20}, {"weight": 100}]}, "spec.steps"),
    ("last step below 100", {"steps": [{"weight": 20}, {"weight": 50}]}, "spec.steps"),
    ("pause spelling", {"steps": [{"weight": 100, "pause": "ten minutes"}]}, "spec.steps[0].pause"),
    ("pause object with fields", {"steps": [{"weight": 100, "pause": {"duration": "1m"}}]}, "spec.steps[0].pause"),
    ("untilApproved spelling", {"steps": [{"weight": 100, "untilApproved": "yes"}]}, "spec.steps[0].untilApproved"),
    ("deadline spelling", {"progressDeadline": "30 min"}, "spec.progressDeadline"),
    ("noData", {"analysis": {"noData": "ignore"}}, "spec.analysis.noData"),
    ("old minRequests", {"analysis": {"minRequests": 20}}, "spec.analysis.minRequests (unknown field)"),
    ("old metrics list", {"analysis": {"metrics": [{"name": "cpu", "max": 0.9}]}},
     "spec.analysis.metrics (unknown field)"),
    ("interval spelling", {"analysis": {"interval": "often"}}, "spec.analysis.interval"),
    ("confidence", {"analysis": {"confidence": 0.3}}, "spec.analysis.confidence"),
    ("errorLimit", {"analysis": {"errorLimit": -1}}, "spec.analysis.errorLimit"),
    ("outageLimit", {"analysis": {"outageLimit": "a while"}}, "spec.analysis.outageLimit"),
    ("address", {"analysis": {"prometheus": {"address": "prometheus:9090"}}}, "spec.analysis.prometheus.address"),
    ("token secret key", {"analysis": {"prometheus": {"bearerTokenSecret": {"name": "t"}}}},
     "spec.analysis.prometheus.bearerTokenSecret.key"),
    ("unknown metric", br({"name": "x", "metric": "gpu-temp", "max": 1}), "spec.analysis.breakers[0].metric"),
    ("custom without query", br({"name": "gpu-temp", "max": 80}), "spec.analysis.breakers[0]"),
    ("metric and query", br({"name": "x", "metric": "cpu", "query": "up", "max": 1}), "spec.analysis.breakers[0]"),
    ("no threshold", br({"name": "cpu"}), "spec.analysis.breakers[0]"),
    ("min above max", br({"name": "cpu", "min": 0.9, "max": 0.5}), "spec.analysis.breakers[0]"),
    ("maxRatio 0", br({"name": "tpot-p99", "maxRatio": 0}), "spec.analysis.breakers[0].maxRatio"),
    ("consecutive", br({"name": "cpu", "max": 0.9, "consecutive": 0}), "spec.analysis.breakers[0].consecutive"),
    ("threshold type", br({"name": "cpu", "max": "lots"}), "spec.analysis.breakers[0].max"),
    ("window spelling", br({"name": "cpu", "max": 0.9, "window": "soon"}), "spec.analysis.breakers[0].window"),
    ("two breakers of a name", br({"name": "cpu", "max": 0.9}, {"name": "cpu", "max": 0.5}),
     "spec.analysis.breakers[1]"),
    ("a gate counting breaches", {"analysis": {"gates": [{"name": "error-rate-delta", "max": 0.001,
                                                          "consecutive": 3}]}}, "spec.analysis.gates"),
]


@pytest.mark.parametrize("what,spec,path", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_manifests_are_refused_by_the_api_server_and_the_spec_model(what, spec, path):
    obj = manifest(**spec)
    if spec.get("selector", True) is None:
        del obj["spec"]["selector"]
    assert path in errors(obj), (what, errors(obj))
    with pytest.raises(SpecError):
        parse_spec(obj["spec"])


@pytest.mark.parametrize("what,analysis,path", [
    ("an error rate above 1", {"breakers": [{"name": "error-rate", "max": 5}]}, "spec.analysis.breakers[0]"),
    ("a divergent share above 1", {"gates": [{"name": "output-divergence", "max": 1.5}]}, "spec.analysis.gates[0]"),
    ("a divergent share with a min", {"breakers": [{"name": "output-divergence", "min": 0.01}]},
     "spec.analysis.breakers[0].min"),
    ("cpu against stable", {"breakers": [{"name": "cpu", "maxRatio": 1.2}]}, "spec.analysis.breakers[0].maxRatio"),
    ("window 'step' on a quantile", {"breakers": [{"name": "tpot-p99", "maxRatio": 1.2, "window": "step"}]},
     "spec.analysis.breakers[0].window"),
    ("an interval under a second", {"interval": "500ms"}, "spec.analysis.interval"),
    ("no checks at all", {"breakers": [], "gates": []}, "spec.analysis"),
    ("a template that is not there", {"templates": [{"name": "missing"}]}, "spec.analysis.templates"),
])
def test_what_only_the_operator_can_refuse(what, analysis, path):
    """Rules the CRD does not state (or cannot: a template's existence): the spec model refuses them
    by field, so the operator marks the rollout InvalidSpec instead of running it."""
    obj = manifest(analysis=analysis)
    assert errors(obj) == [], what
    with pytest.raises(SpecError) as info:
        parse_spec(stored(obj)["spec"])
    assert path in info.value.paths, (what, info.value.paths)


def template(kind="PatchAnalysisTemplate", **spec):
    meta = {"name": "gpu-checks"} | ({"namespace": "llm"} if kind == "PatchAnalysisTemplate" else {})
    return {"apiVersion": "graft.dev/v1alpha1", "kind": kind, "metadata": meta, "spec": spec}


TEMPLATE_SPEC = {
    "args": [{"name": "tenant"}, {"name": "job", "value": "engine"}],
    "breakers": [{"name": "ttft-p99", "max": 0.8, "window": "30s", "consecutive": 1},
                 {"name": "kv", "max": 0.25, "query": 'max(x{namespace="{{namespace}}",job="{{args.job}}",t="{{args.tenant}}"})'}],
    "gates": [{"name": "success-rate", "min": 0.9995, "window": "60s"}],
}


def check_schemas():
    """Every check schema the CRDs hold: a rollout's breakers and gates, each template kind's."""
    rollout = VERSION["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["analysis"]["properties"]
    out = {f"PatchRollout {k}": rollout[k]["items"] for k in ("breakers", "gates")}
    for crd in TEMPLATE_CRDS:
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        out |= {f"{crd['spec']['names']['kind']} {k}": spec[k]["items"] for k in ("breakers", "gates")}
    return out


@pytest.mark.parametrize("where", list(check_schemas()))
def test_every_check_schema_names_and_describes_every_builtin_metric(where):
    """The enum, the CEL rule that lets a built-in name stand without a query, and the descriptions
    `kubectl explain` prints all know each built-in metric the spec model knows."""
    schema = check_schemas()[where]
    metric = schema["properties"]["metric"]
    assert metric["enum"] == list(BUILTIN_METRICS)
    for name in BUILTIN_METRICS:
        assert name in metric["description"], name
    (builtin_rule,) = [r["rule"] for r in schema["x-kubernetes-validations"] if "self.name in" in r["rule"]]
    assert builtin_rule.endswith("[" + ", ".join(f"'{n}'" for n in BUILTIN_METRICS) + "]")
    for field in ("max", "window"):
        assert "output-divergence" in schema["properties"][field]["description"], field


@pytest.mark.parametrize("kind", ["PatchAnalysisTemplate", "ClusterPatchAnalysisTemplate"])
def test_a_template_may_carry_output_divergence(kind):
    obj = template(kind, breakers=[{"name": "output-divergence", "max": 0.05, "consecutive": 1}],
                   gates=[{"name": "output-divergence", "max": 0.02}])
    assert errors(obj, TEMPLATES[kind]) == []
    cluster = kind.startswith("Cluster")
    rollout = manifest(analysis={"templates": [{"name": "gpu-checks", "clusterScope": cluster}]})
    spec = parse_spec(stored(rollout)["spec"], {("gpu-checks", cluster): stored(obj, TEMPLATES[kind])["spec"]})
    assert [(c.key, c.max, c.window) for c in spec.analysis.checks] == [
        ("breaker/output-divergence", 0.05, None), ("gate/output-divergence", 0.02, None)]


@pytest.mark.parametrize("kind", ["PatchAnalysisTemplate", "ClusterPatchAnalysisTemplate"])
def test_templates_are_accepted_and_their_checks_run(kind):
    obj = template(kind, **TEMPLATE_SPEC)
    assert errors(obj, TEMPLATES[kind]) == []
    cluster = kind.startswith("Cluster")
    rollout = manifest(analysis={"templates": [{"name": "gpu-checks", "clusterScope": cluster}],
                                 "args": [{"name": "tenant", "value": "acme"}]})
    assert errors(rollout) == []
    spec = parse_spec(stored(rollout)["spec"], {("gpu-checks", cluster): stored(obj, TEMPLATES[kind])["spec"]})
    assert [c.key for c in spec.analysis.checks] == ["breaker/ttft-p99", "breaker/kv", "gate/success-rate"]
    assert spec.analysis.breakers[1].query == 'max(x{namespace="{{namespace}}",job="engine",t="acme"})'


@pytest.mark.parametrize("spec,path", [
    ({"breakers": [{"name": "cpu"}]}, "spec.breakers[0]"),
    ({"gates": [{"name": "x", "metric": "gpu", "max": 1}]}, "spec.gates[0].metric"),
    ({"args": [{"name": "1st"}]}, "spec.args[0].name"),
    ({"metrics": []}, "spec.metrics (unknown field)"),
])
def test_templates_are_refused_naming_the_field(spec, path):
    assert path in errors(template(**spec), TEMPLATES["PatchAnalysisTemplate"])
