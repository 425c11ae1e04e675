"""What the API server refuses beyond the schema's shape: CEL rules, list types, RE2 patterns.

Each refusal is checked against kube-apiserver's wording: 422 ``Invalid`` with one cause per field.
"""

import copy
import json
from pathlib import Path

import aiohttp
import pytest
import yaml

from graft.devcluster import cel
from graft.devcluster.apiserver import ApiServer
from graft.rollout.spec import SELECTOR_MUST_NAME

ROOT = Path(__file__).resolve().parents[2]
PATCHROLLOUT_CRD = yaml.safe_load((ROOT / "crds" / "patchrollout.yaml").read_text())
ROLLOUTS = "/apis/graft.dev/v1alpha1/namespaces/default/patchrollouts"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
DIGEST = "sha256:" + "0123456789abcdef" * 4
GROUP = "admission.graft.dev"
GIZMOS = f"/apis/{GROUP}/v1/namespaces/default/gizmos"


def gizmo_crd(spec_rules=(), **spec_properties) -> dict:
    """A CRD with a rule at every level: the root, spec, map values, list-map items, status."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"gizmos.{GROUP}"},
        "spec": {"group": GROUP, "scope": "Namespaced",
                 "names": {"plural": "gizmos", "singular": "gizmo", "kind": "Gizmo"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                               "schema": {"openAPIV3Schema": {
                                   "type": "object",
                                   "x-kubernetes-validations": [{"rule": "self.metadata.name.startsWith('g')",
                                                                 "message": "name must start with g"}],
                                   "properties": {
                                       "spec": {"type": "object", "x-kubernetes-validations": [
                                           {"rule": "!has(self.replicas) || self.replicas <= self.max",
                                            "messageExpression": "'replicas ' + string(self.replicas) + "
                                                                 "' exceed max ' + string(self.max)",
                                            "fieldPath": ".replicas", "reason": "FieldValueForbidden"},
                                           {"rule": "!has(self.ratio) || self.ratio + 0.5 < 2.0"},
                                           *spec_rules],
                                           "properties": {
                                               "replicas": {"type": "integer"}, "max": {"type": "integer", "default": 3},
                                               "ratio": {"type": "number"},
                                               "labels": {"type": "object", "additionalProperties": {
                                                   "type": "string", "x-kubernetes-validations": [
                                                       {"rule": "size(self) <= 5", "message": "label too long"}]}},
                                               "ports": {"type": "array", "x-kubernetes-list-type": "map",
                                                         "x-kubernetes-list-map-keys": ["name"],
                                                         "items": {"type": "object", "required": ["name"], "properties": {
                                                             "name": {"type": "string"},
                                                             "port": {"type": "integer", "x-kubernetes-validations": [
                                                                 {"rule": "self >= oldSelf",
                                                                  "message": "ports only grow"}]}}}},
                                               "tags": {"type": "array", "x-kubernetes-list-type": "set",
                                                        "items": {"type": "string"}},
                                               "code": {"type": "string", "pattern": "^[a-z]+$"},
                                               "loose": {"type": "string", "pattern": "[a-z]+"},
                                               **spec_properties}},
                                       "status": {"type": "object", "properties": {"ready": {"type": "integer"}},
                                                  "x-kubernetes-validations": [{"rule": "self.ready >= 0",
                                                                                "message": "ready cannot be negative"}]},
                                   }}}}]}}


def gizmo(name: str = "g1", **spec) -> dict:
    return {"apiVersion": f"{GROUP}/v1", "kind": "Gizmo", "metadata": {"name": name}, "spec": spec}


def rollout(name: str = "r1", **spec) -> dict:
    base = {"selector": {"matchLabels": {"app": "llm-engine"}},
            "patch": {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}}}
    return {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout", "metadata": {"name": name},
            "spec": {**base, **spec}}


@pytest.fixture
async def api(tmp_path):
    (tmp_path / "gizmos.yaml").write_text(yaml.safe_dump(gizmo_crd()))
    async with ApiServer(crd_paths=[ROOT / "crds", tmp_path / "gizmos.yaml"]) as server:
        yield server
        assert not server.errors, f"the emulator failed on its own: {server.errors}"


@pytest.fixture
async def http(api):
    async with aiohttp.ClientSession(api.url, connector=aiohttp.TCPConnector(force_close=True)) as session:
        yield session


async def call(http, method: str, path: str, body=None):
    headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
    async with http.request(method, path, json=body, headers=headers) as reply:
        return reply.status, json.loads(await reply.text())


def causes(refused: dict) -> set[tuple[str, str]]:
    return {(c["field"], c["message"]) for c in refused["details"]["causes"]}


# every CEL rule of crds/patchrollout.yaml, both ways: (rule message, field, passing spec, breaking spec)
SOURCE_MAP = {"configMap": {"name": "bundle", "key": "patch.py"}, "digest": DIGEST}
PATCH = {"name": "kv-align", "version": "3.2.1"}
RULE_CASES = [
    ("label keys are an optional DNS-subdomain prefix and '/', then at most 63 letters, digits, '-', '_' or "
     "'.', starting and ending alphanumeric", "spec.selector.matchLabels",
     {"selector": {"matchLabels": {"app.kubernetes.io/name": "llm"}}},
     {"selector": {"matchLabels": {"zzz!": "q"}}}),
    (SELECTOR_MUST_NAME, "spec.selector",
     {"selector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["llm"]},
                                        {"key": "legacy", "operator": "DoesNotExist"}]}},
     {"selector": {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["db"]}]}}),
    ("In and NotIn need values; Exists and DoesNotExist take none", "spec.selector.matchExpressions[0]",
     {"selector": {"matchLabels": {"app": "llm"}, "matchExpressions": [{"key": "tier", "operator": "Exists"}]}},
     {"selector": {"matchLabels": {"app": "llm"},
                   "matchExpressions": [{"key": "tier", "operator": "Exists", "values": ["gpu"]}]}}),
    ("only a configMap source is pinned by digest", "spec.patch.source",
     {"patch": {**PATCH, "source": {"builtin": {}}}},
     {"patch": {**PATCH, "source": {"builtin": {}, "digest": DIGEST}}}),
    ("exactly one of podRatio or gatewayAPI is required", "spec.trafficRouting",
     {"trafficRouting": {"podRatio": {}}},
     {"trafficRouting": {"podRatio": {}, "gatewayAPI": {"httpRoute": "llm", "stableService": "a",
                                                         "canaryService": "b"}}}),
    ("exactly one of builtin or configMap is required", "spec.patch.source",
     {"patch": {**PATCH, "source": SOURCE_MAP}},
     {"patch": {**PATCH, "source": {"builtin": {}, **SOURCE_MAP}}}),
    ("a configMap source needs its pinned sha256 digest", "spec.patch.source",
     {"patch": {**PATCH, "source": SOURCE_MAP}},
     {"patch": {**PATCH, "source": {"configMap": SOURCE_MAP["configMap"]}}}),
    ("canaryService must differ from stableService", "spec.trafficRouting.gatewayAPI",
     {"trafficRouting": {"gatewayAPI": {"httpRoute": "llm", "stableService": "a", "canaryService": "b"}}},
     {"trafficRouting": {"gatewayAPI": {"httpRoute": "llm", "stableService": "a", "canaryService": "a"}}}),
    ("the last step must have weight 100", "spec.steps",
     {"steps": [{"weight": 10}, {"weight": 100}]}, {"steps": [{"weight": 10}, {"weight": 50}]}),
    ("step weights must strictly increase", "spec.steps",
     {"steps": [{"weight": 20}, {"weight": 50}, {"weight": 100}]},
     {"steps": [{"weight": 50}, {"weight": 20}, {"weight": 100}]}),
    ("a check that is not built in needs its query, web or job", "spec.analysis.breakers[0]",
     {"analysis": {"breakers": [{"name": "ttft", "query": "up", "max": 1}]}},
     {"analysis": {"breakers": [{"name": "ttft", "max": 1}]}}),
    ("a check has one source: a built-in metric, a query, web or job", "spec.analysis.gates[0]",
     {"analysis": {"gates": [{"name": "busy", "metric": "cpu", "max": 0.9}]}},
     {"analysis": {"gates": [{"name": "busy", "metric": "cpu", "query": "up", "max": 0.9}]}}),
    ("only a POST has a body", "spec.analysis.gates[0].web",
     {"analysis": {"gates": [{"name": "q", "min": 0.5, "web": {"url": "http://e/q", "jsonPath": "$.q",
                                                                "method": "POST", "body": "{}"}}]}},
     {"analysis": {"gates": [{"name": "q", "min": 0.5, "web": {"url": "http://e/q", "jsonPath": "$.q",
                                                                "body": "{}"}}]}}),
    ("a header has a value or a valueFrom", "spec.analysis.gates[0].web.headers[0]",
     {"analysis": {"gates": [{"name": "q", "min": 0.5, "web": {"url": "http://e/q", "jsonPath": "$.q",
                                                                "headers": [{"name": "A", "value": "v"}]}}]}},
     {"analysis": {"gates": [{"name": "q", "min": 0.5, "web": {"url": "http://e/q", "jsonPath": "$.q",
                                                                "headers": [{"name": "A"}]}}]}}),
    ("at most one of bearerTokenSecret, basicAuth and oauth2", "spec.analysis.prometheus",
     {"analysis": {"prometheus": {"basicAuth": {"username": "g", "passwordSecret": {"name": "p", "key": "k"}}}}},
     {"analysis": {"prometheus": {"bearerTokenSecret": {"name": "t", "key": "k"},
                                  "basicAuth": {"username": "g", "passwordSecret": {"name": "p", "key": "k"}}}}}),
    ("a check needs a threshold: max, min or maxRatio", "spec.analysis.gates[0]",
     {"analysis": {"gates": [{"name": "latency-p99", "maxRatio": 1.2}]}},
     {"analysis": {"gates": [{"name": "latency-p99"}]}}),
    ("gates take no consecutive: a failing gate holds the step until it passes", "spec.analysis.gates",
     {"analysis": {"breakers": [{"name": "cpu", "max": 1, "consecutive": 2}], "gates": [{"name": "cpu", "max": 1}]}},
     {"analysis": {"gates": [{"name": "cpu", "max": 1, "consecutive": 2}]}}),
    ("min must not exceed max", "spec.analysis.breakers[1]",
     {"analysis": {"breakers": [{"name": "cpu", "max": 1}, {"name": "ratio", "query": "up", "min": 0.5, "max": 1}]}},
     {"analysis": {"breakers": [{"name": "cpu", "max": 1}, {"name": "ratio", "query": "up", "min": 2, "max": 1}]}}),
]
# transition rules: (rule message, field, the change an update makes)
TRANSITION_CASES = [
    ("is immutable: create a new PatchRollout for another patch", "spec.patch.name",
     {"patch": {"name": "prefill-fusion"}}),
    ("is immutable: create a new PatchRollout for another version", "spec.patch.version",
     {"patch": {"version": "3.2.2"}}),
    ("is immutable: create a new PatchRollout for another patch", "spec.patch.source",
     {"patch": {"source": {"builtin": None, **SOURCE_MAP}}}),
    ("is immutable: create a new PatchRollout to undo a patch", "spec.action", {"action": "revert"}),
    # a config edited mid-rollout would reach only the pods patched after it, under the same revision
    ("is immutable (its config too): create a new PatchRollout for another patch or config", "spec.patch",
     {"patch": {"config": {"errorRate": 0.5}}}),
    ("is immutable: the pods a rollout acts on are chosen when it is created; create a new PatchRollout",
     "spec.selector", {"selector": {"matchLabels": {"app": "other"}}}),
]


def test_every_cel_rule_of_the_patchrollout_crd_has_a_case():
    def rules(schema):
        yield from ((r.get("message") or r["rule"]) for r in schema.get("x-kubernetes-validations") or ())
        extra = schema.get("additionalProperties")
        for sub in [*(schema.get("properties") or {}).values(), schema.get("items"), extra]:
            if isinstance(sub, dict):
                yield from rules(sub)

    schema = PATCHROLLOUT_CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    covered = {case[0] for case in RULE_CASES + TRANSITION_CASES}
    assert set(rules(schema)) <= covered, f"rules without a test case: {set(rules(schema)) - covered}"


@pytest.mark.parametrize("message, field, good, bad", RULE_CASES, ids=[c[0][:40] for c in RULE_CASES])
async def test_a_patchrollout_cel_rule_accepts_what_obeys_it_and_refuses_what_breaks_it(http, message, field, good,
                                                                                         bad):
    status, created = await call(http, "POST", ROLLOUTS, rollout("good", **good))
    assert status == 201, created["message"]
    status, refused = await call(http, "POST", ROLLOUTS, rollout("bad", **bad))
    assert status == 422 and refused["reason"] == "Invalid" and refused["status"] == "Failure"
    kind = "array" if field in ("spec.steps", "spec.analysis.gates") else "object"
    assert (field, f'Invalid value: "{kind}": {message}') in causes(refused), refused["details"]["causes"]
    assert f'PatchRollout.graft.dev "bad" is invalid: ' in refused["message"] and message in refused["message"]
    assert (await call(http, "GET", f"{ROLLOUTS}/bad"))[0] == 404


@pytest.mark.parametrize("message, field, change", TRANSITION_CASES, ids=[c[1] for c in TRANSITION_CASES])
async def test_patchrollout_transition_rules_compare_with_the_old_object(http, message, field, change):
    assert (await call(http, "POST", ROLLOUTS, rollout()))[0] == 201
    status, refused = await call(http, "PATCH", f"{ROLLOUTS}/r1", {"spec": change})
    assert status == 422
    kind = "object" if field.rpartition(".")[2] in ("source", "patch", "selector") else "string"
    assert (field, f'Invalid value: "{kind}": {message}') in causes(refused)
    status, paused = await call(http, "PATCH", f"{ROLLOUTS}/r1", {"spec": {"paused": True}})  # old == new: passes
    assert status == 200 and paused["spec"]["paused"] is True
    status, replaced = await call(http, "PUT", f"{ROLLOUTS}/r1", {**paused, "spec": {**paused["spec"], "paused": False}})
    assert status == 200, replaced
    assert (await call(http, "POST", ROLLOUTS, rollout("r2", patch={"name": "other", "version": "1"})))[0] == 201


async def test_status_writes_are_checked_by_the_rules_too(http):
    assert (await call(http, "POST", GIZMOS, gizmo()))[0] == 201
    status, refused = await call(http, "PATCH", f"{GIZMOS}/g1/status", {"status": {"ready": -1}})
    assert status == 422
    assert causes(refused) == {("status", 'Invalid value: "object": ready cannot be negative')}
    assert (await call(http, "PATCH", f"{GIZMOS}/g1/status", {"status": {"ready": 2}}))[0] == 200
    # the main resource ignores status, so a rule of status cannot refuse it
    assert (await call(http, "PATCH", f"{GIZMOS}/g1", {"status": {"ready": -1}, "spec": {"replicas": 1}}))[0] == 200


async def test_rules_at_every_level_with_message_expression_field_path_and_reason(http):
    status, refused = await call(http, "POST", GIZMOS, gizmo("x1", replicas=5, labels={"a": "fine", "b": "toolong"}))
    assert status == 422
    assert refused["details"]["causes"] == [
        {"reason": "FieldValueInvalid", "field": "<nil>", "message": 'Invalid value: "object": name must start with g'},
        {"reason": "FieldValueForbidden", "field": "spec.replicas", "message": "Forbidden: replicas 5 exceed max 3"},
        {"reason": "FieldValueInvalid", "field": "spec.labels[b]", "message": 'Invalid value: "string": label too long'},
    ]
    # a number field is a double to CEL even when written as 1: `self.ratio + 0.5` needs no conversion
    assert (await call(http, "POST", GIZMOS, gizmo("g1", replicas=2, ratio=1)))[0] == 201
    status, refused = await call(http, "POST", GIZMOS, gizmo("g2", ratio=2))
    assert status == 422 and causes(refused) == {
        ("spec", 'Invalid value: "object": failed rule: !has(self.ratio) || self.ratio + 0.5 < 2.0')}


async def test_schema_errors_that_make_rules_meaningless_skip_them_as_kube_apiserver_does(http):
    status, refused = await call(http, "POST", GIZMOS, gizmo("x1", replicas="five"))
    assert status == 422
    assert [(c["reason"], c["field"]) for c in refused["details"]["causes"]] == [
        ("FieldValueTypeInvalid", "spec.replicas"), ("FieldValueInvalid", "<nil>")]
    assert refused["message"].endswith('<nil>: Invalid value: "null": some validation rules were not checked because '
                                       "the object was invalid; correct the existing errors to complete validation]")


async def test_transition_rules_follow_list_map_items_by_key(http):
    assert (await call(http, "POST", GIZMOS, gizmo(ports=[{"name": "http", "port": 80}])))[0] == 201
    status, refused = await call(http, "PATCH", f"{GIZMOS}/g1", {"spec": {"ports": [{"name": "http", "port": 70}]}})
    assert status == 422 and causes(refused) == {("spec.ports[0].port", 'Invalid value: "integer": ports only grow')}
    # reordered, grown, and a new item without an old value: accepted
    grown = [{"name": "admin", "port": 1}, {"name": "http", "port": 81}]
    assert (await call(http, "PATCH", f"{GIZMOS}/g1", {"spec": {"ports": grown}}))[0] == 200


async def test_list_map_keys_and_set_values_may_not_repeat(http):
    status, refused = await call(http, "POST", GIZMOS, gizmo(ports=[{"name": "a", "port": 1}, {"name": "b"},
                                                                   {"name": "a", "port": 2}]))
    assert status == 422
    assert causes(refused) == {("spec.ports[2]", 'Duplicate value: map[string]interface {}{"name":"a"}')}
    assert refused["details"]["causes"][0]["reason"] == "FieldValueDuplicate"
    status, refused = await call(http, "POST", GIZMOS, gizmo(tags=["x", "y", "x"]))
    assert status == 422 and causes(refused) == {("spec.tags[2]", 'Duplicate value: "x"')}
    assert (await call(http, "POST", GIZMOS, gizmo(tags=["x", "y"], ports=[{"name": "a"}, {"name": "b"}])))[0] == 201

    twice = [{"name": "cpu", "max": 0.9}, {"name": "cpu", "max": 0.8}]
    status, refused = await call(http, "POST", ROLLOUTS, rollout(analysis={"breakers": twice}))
    assert status == 422
    assert causes(refused) == {("spec.analysis.breakers[1]", 'Duplicate value: map[string]interface {}{"name":"cpu"}')}


@pytest.mark.parametrize("field, value, accepted", [
    ("code", "abc", True),
    ("code", "abc\n", False),      # Go's $ is the end of the text, not the end of a line
    ("code", "\nabc", False),
    ("loose", "ABCdef", True),     # an unanchored pattern is a search, as regexp.MatchString
    ("loose", "ABC", False),
])
async def test_patterns_match_as_go_regexp_does(http, field, value, accepted):
    status, reply = await call(http, "POST", GIZMOS, gizmo(**{field: value}))
    assert (status == 201) == accepted, reply
    if not accepted:
        pattern = {"code": "^[a-z]+$", "loose": "[a-z]+"}[field]
        assert causes(reply) == {(f"spec.{field}", f"Invalid value: {json.dumps(value)}: spec.{field} in body should "
                                                   f"match '{pattern}'")}


async def test_a_trailing_newline_does_not_pass_the_patchrollout_name_patterns(http):
    status, refused = await call(http, "POST", ROLLOUTS, rollout(patch={"name": "kv-align\n", "version": "3.2.1\n"}))
    assert status == 422
    assert {c["field"] for c in refused["details"]["causes"]} >= {"spec.patch.name", "spec.patch.version"}


@pytest.mark.parametrize("rule, field, complaint", [
    ("self.replicas >", "rule", "Syntax error"),
    ("self.replicas.isSortd()", "rule", "undeclared reference to 'isSortd'"),
    ("self.replcas > 0", "rule", "undefined field 'replcas'"),
])
async def test_a_rule_that_does_not_compile_makes_the_crd_invalid(http, rule, field, complaint):
    crd = gizmo_crd([{"rule": rule}])
    crd["metadata"]["name"] = crd["metadata"]["name"].replace("gizmos", "widgets")
    crd["spec"]["names"] = {"plural": "widgets", "singular": "widget", "kind": "Widget"}
    status, refused = await call(http, "POST", CRDS, crd)
    assert status == 422
    [cause] = refused["details"]["causes"]
    assert cause["field"] == ("spec.versions[0].schema.openAPIV3Schema.properties[spec]"
                              f".x-kubernetes-validations[2].{field}")
    assert "compilation failed" in cause["message"] and complaint in cause["message"]
    assert (await call(http, "GET", f"/apis/{GROUP}/v1/namespaces/default/widgets"))[0] == 404


async def test_old_self_where_nothing_correlates_makes_the_crd_invalid(http):
    crd = gizmo_crd(steps={"type": "array", "items": {"type": "object", "properties": {"w": {"type": "integer"}},
                                                      "x-kubernetes-validations": [{"rule": "self.w >= oldSelf.w"}]}})
    crd["metadata"]["name"] = f"others.{GROUP}"
    crd["spec"]["names"] = {"plural": "others", "kind": "Other"}
    status, refused = await call(http, "POST", CRDS, crd)
    assert status == 422 and "oldSelf cannot be used on the uncorrelatable portion" in refused["message"]


async def test_a_crd_file_with_a_broken_rule_stops_the_server_from_starting(tmp_path):
    crd = copy.deepcopy(PATCHROLLOUT_CRD)
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["steps"][
        "x-kubernetes-validations"][0]["rule"] = "self.last().weight == 100"
    (tmp_path / "crd.yaml").write_text(yaml.safe_dump(crd))

    with pytest.raises(ValueError, match="undeclared reference to 'last'"):
        async with ApiServer(crd_paths=[tmp_path / "crd.yaml"]):
            pass


@pytest.mark.parametrize("rule, value", [
    ("self.isSorted() && ![3, 2].isSorted()", [1, 2, 3]),
    ("self.sum() == 6 && self.min() == 1 && self.max() == 3", [1, 2, 3]),
    ("self.indexOf(2) == 1 && self.lastIndexOf(5) == -1", [1, 2, 3]),
    ("self.map(x, x * 2).all(x, x % 2 == 0) && self.exists_one(x, x == 2) && self.filter(x, x > 1).size() == 2",
     [1, 2, 3]),
    ("self.split(',').size() == 3 && self.indexOf('b') == 2 && self.upperAscii() == 'A,B,C'", "a,b,c"),
    ("self.replace(',', '') == 'abc' && self.substring(2, 3) == 'b' && self.charAt(0) == 'a'", "a,b,c"),
    ("self.matches('^[a-z,]+$') && self.find('[b-c]+') == 'b' && self.findAll('[a-z]').size() == 3", "a,b,c"),
    ("['x', 'y'].join('-') == 'x-y' && ' a '.trim() == 'a' && 'ABC'.lowerAscii() == 'abc'", "s"),
])
def test_kubernetes_cel_library_functions(rule, value):
    schema = {"type": "array", "items": {"type": "integer"}} if isinstance(value, list) else {"type": "string"}
    node, errors = cel.compile_schema({**schema, "x-kubernetes-validations": [{"rule": rule}]}, "schema")
    assert errors == [] and node is not None
    assert cel.validate(node, value) == []
