"""The PatchRollout CRD: a valid CRD, its schema accepts what runs and refuses what cannot, and its
defaults are the spec model's."""
import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from graft.rollout.spec import DEFAULT_PROMETHEUS, DEFAULTS, SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "patchrollout.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)
DIGEST = "sha256:" + "0123456789abcdef" * 4


def manifest(**spec):
    base = {"selector": {"matchLabels": {"app": "llm-engine"}},
            "patch": {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}}}
    return {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout",
            "metadata": {"name": "kv-align-3-2-1", "namespace": "llm"}, "spec": {**base, **spec}}


def apply_defaults(schema: dict, value):
    """Structural defaulting as the API server does it: a missing field with a default gets it."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_defaults(schema["items"], item)
    return value


def schema_errors(obj) -> list[str]:
    return ["/".join(str(p) for p in e.absolute_path) or e.message for e in VALIDATOR.iter_errors(obj)]


def test_crd_is_a_valid_apiextensions_v1_object():
    kubernetes_validate.validate(CRD, "1.32", strict=True)
    jsonschema.Draft7Validator.check_schema(SCHEMA)


def test_names_scope_columns_and_status_subresource():
    names = CRD["spec"]["names"]
    assert CRD["metadata"]["name"] == "patchrollouts.graft.dev" and CRD["spec"]["scope"] == "Namespaced"
    assert names["kind"] == "PatchRollout" and names["shortNames"] == ["prl"]
    assert VERSION["name"] == "v1alpha1" and VERSION["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    assert columns == {"Phase": ".status.phase", "Step": ".status.stepIndex", "Weight": ".status.weight",
                       "Canary": ".status.canaryRevision", "Stable": ".status.stableRevision",
                       "Age": ".metadata.creationTimestamp"}


def test_crd_defaults_equal_the_spec_model_defaults():
    defaulted = apply_defaults(SCHEMA, manifest())["spec"]
    expected = copy.deepcopy(DEFAULTS)
    # the Prometheus address is left to the operator's fleet-wide setting (GRAFT_PROMETHEUS_ADDRESS)
    expected["analysis"]["prometheus"] = {}
    for key, value in expected.items():
        assert defaulted[key] == value, key
    assert parse_spec(defaulted).analysis.prometheus == DEFAULT_PROMETHEUS
    minimal = manifest()["spec"]
    del minimal["patch"]["source"]
    assert apply_defaults(SCHEMA["properties"]["spec"], copy.deepcopy(minimal))["patch"]["source"] == {"builtin": {}}
    assert parse_spec(defaulted) == parse_spec(minimal)


def test_partial_analysis_gets_the_remaining_defaults_in_both():
    m = manifest(analysis={"interval": "10s"})
    defaulted = apply_defaults(SCHEMA, copy.deepcopy(m))["spec"]
    assert defaulted["analysis"]["noData"] == "hold" and defaulted["analysis"]["minRequests"] == 20
    assert parse_spec(defaulted) == parse_spec(m["spec"])


VALID = [
    manifest(),
    manifest(patch={"name": "kv-align", "version": "3.2.1",
                    "source": {"configMap": {"name": "kv-align-bundle", "key": "patch.py"}, "digest": DIGEST}}),
    manifest(trafficRouting={"gatewayAPI": {"httpRoute": "llm", "stableService": "llm-stable",
                                            "canaryService": "llm-canary"}}),
    manifest(steps=[{"weight": 10, "pause": "1h30m"}, {"weight": 100, "pause": "250ms"}],
             analysis={"prometheus": {"address": "https://prom:9090"}, "interval": "5s", "noData": "fail",
                       "minRequests": 0,
                       "metrics": [{"name": "ttft-p90", "max": 2,
                                    "query": "histogram_quantile(0.9, rate(x{revision="
                                             "\"{{canaryRevision}}\"}[{{window}}]))"},
                                   {"name": "cpu", "dryRun": True}]},
             progressDeadline="1h", paused=True),
]


@pytest.mark.parametrize("obj", VALID)
def test_valid_manifests_pass_the_schema_and_the_spec_model(obj):
    assert schema_errors(apply_defaults(SCHEMA, copy.deepcopy(obj))) == []
    parse_spec(obj["spec"])


INVALID = [
    ("no selector", {"selector": None}, "spec"),
    ("patch name", {"patch": {"name": "Kv_Align", "version": "1"}}, "spec/patch/name"),
    ("both sources", {"patch": {"name": "p", "version": "1", "source": {
        "builtin": {}, "configMap": {"name": "c", "key": "k"}, "digest": DIGEST}}}, "spec/patch/source"),
    ("no digest", {"patch": {"name": "p", "version": "1", "source": {"configMap": {"name": "c", "key": "k"}}}},
     "spec/patch/source"),
    ("bad digest", {"patch": {"name": "p", "version": "1", "source": {
        "configMap": {"name": "c", "key": "k"}, "digest": "sha256:ABC"}}}, "spec/patch/source/digest"),
    ("two routings", {"trafficRouting": {"podRatio": {}, "gatewayAPI": {
        "httpRoute": "r", "stableService": "a", "canaryService": "b"}}}, "spec/trafficRouting"),
    ("route without services", {"trafficRouting": {"gatewayAPI": {"httpRoute": "r"}}},
     "spec/trafficRouting/gatewayAPI"),
    ("weight 0", {"steps": [{"weight": 0}, {"weight": 100}]}, "spec/steps/0/weight"),
    ("weight 101", {"steps": [{"weight": 101}]}, "spec/steps/0/weight"),
    ("no steps", {"steps": []}, "spec/steps"),
    ("pause spelling", {"steps": [{"weight": 100, "pause": "ten minutes"}]}, "spec/steps/0/pause"),
    ("deadline spelling", {"progressDeadline": "30 min"}, "spec/progressDeadline"),
    ("noData", {"analysis": {"noData": "ignore"}}, "spec/analysis/noData"),
    ("minRequests", {"analysis": {"minRequests": -5}}, "spec/analysis/minRequests"),
    ("consecutive", {"analysis": {"metrics": [{"name": "cpu", "consecutive": 0}]}},
     "spec/analysis/metrics/0/consecutive"),
    ("threshold type", {"analysis": {"metrics": [{"name": "cpu", "max": "lots"}]}}, "spec/analysis/metrics/0/max"),
]


@pytest.mark.parametrize("what,spec,path", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_manifests_are_refused_by_the_schema_and_the_spec_model(what, spec, path):
    obj = manifest(**spec)
    if spec.get("selector", True) is None:
        del obj["spec"]["selector"]
    assert path in schema_errors(apply_defaults(SCHEMA, obj)), what
    with pytest.raises(SpecError):
        parse_spec(obj["spec"])


def test_rules_a_schema_cannot_express_are_cel_and_in_the_spec_model():
    """Ordering of steps and their last weight: CEL on a real API server, the spec model everywhere."""
    steps_schema = SCHEMA["properties"]["spec"]["properties"]["steps"]
    rules = " ".join(r["rule"] for r in steps_schema["x-kubernetes-validations"])
    assert "isSorted" in rules and "== 100" in rules
    for steps, path in (([{"weight": 50}, {"weight": 20}, {"weight": 100}], "spec.steps[1].weight"),
                        ([{"weight": 20}, {"weight": 50}], "spec.steps[1].weight")):
        assert schema_errors(manifest(steps=steps)) == []
        with pytest.raises(SpecError) as info:
            parse_spec(manifest(steps=steps)["spec"])
        assert path in info.value.paths
