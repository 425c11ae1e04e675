"""Spec parsing that deliberate breaks of graft/rollout/spec.py showed unpinned: the PatchFleet spec,
label values, unknown fields in nested objects, the query length limit, routing defaults. Every bad
field is refused by name, and nothing bad crashes the parser."""
import pytest

from graft.rollout.spec import MAX_QUERY, SpecError, parse_fleet_spec, parse_spec

MINIMAL = {"selector": {"matchLabels": {"app": "llm-engine"}},
           "patch": {"name": "kv-align", "version": "3.2.1"}}
FLEET = {"selector": {"matchLabels": {"app": "llm-engine"}}}


def errors(parse, spec) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse(spec)
    return {e.path: e.message for e in info.value.errors}


def patch(name, version="3.2.1"):
    return {"name": name, "version": version, "source": {"builtin": {}}}


def test_a_fleet_spec_lists_its_patches_by_name():
    fleet = parse_fleet_spec({**FLEET, "patches": [patch("sync-free"), patch("kv-align")]})
    assert [p.ref for p in fleet.patches] == ["kv-align@3.2.1", "sync-free@3.2.1"]
    assert fleet.selector.match_labels == {"app": "llm-engine"}
    assert parse_fleet_spec(FLEET).patches == ()


def test_a_fleet_runs_one_version_of_each_patch():
    got = errors(parse_fleet_spec, {**FLEET, "patches": [patch("kv-align"), patch("kv-align", "3.2.2")]})
    assert got == {"spec.patches[1].name": "duplicate patch 'kv-align': a fleet runs one version of each"}


@pytest.mark.parametrize("patches", ["kv-align", [patch(f"p{i}") for i in range(33)]])
def test_a_fleet_holds_a_list_of_at_most_32_patches(patches):
    assert errors(parse_fleet_spec, {**FLEET, "patches": patches}) == {
        "spec.patches": "must be a list of at most 32 patches"}


def test_a_fleet_spec_names_unknown_and_bad_fields():
    got = errors(parse_fleet_spec, {**FLEET, "replicas": 3, "patches": [{**patch("kv-align"), "config": "x"}]})
    assert set(got) == {"spec.replicas", "spec.patches[0].config"}
    assert got["spec.patches[0].config"] == "must be an object"


def test_a_bad_label_value_is_refused_by_its_path():
    got = errors(parse_spec, {**MINIMAL, "selector": {"matchLabels": {"app": "no spaces"}}})
    assert list(got) == ["spec.selector.matchLabels.app"] and "not a valid label value" in got[
        "spec.selector.matchLabels.app"]


def test_match_labels_must_be_a_map():
    got = errors(parse_spec, {**MINIMAL, "selector": {"matchLabels": ["app=llm"]}})
    assert got["spec.selector.matchLabels"] == "must map label names to string values"


def test_unknown_fields_of_nested_objects_are_refused():
    spec = {**MINIMAL,
            "selector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["llm"], "value": "x"}]},
            "steps": [{"weight": 50, "pasue": "1m"}, {"weight": 100}]}
    got = errors(parse_spec, spec)
    assert set(got) == {"spec.selector.matchExpressions[0].value", "spec.steps[0].pasue"}
    assert all(m.startswith("unknown field (allowed: ") for m in got.values())


def test_a_patch_config_must_be_an_object():
    assert errors(parse_spec, {**MINIMAL, "patch": {**MINIMAL["patch"], "config": [1]}}) == {
        "spec.patch.config": "must be an object"}
    assert parse_spec({**MINIMAL, "patch": {**MINIMAL["patch"], "config": {"errorRate": 0.5}}}).patch.config == {
        "errorRate": 0.5}


def test_a_query_may_be_as_long_as_the_limit_and_no_longer():
    def with_query(n):
        q = 'sum(up{namespace="{{namespace}}"})'
        q += " " * (n - len(q))
        return {**MINIMAL, "analysis": {"breakers": [{"name": "custom", "max": 1, "query": q}]}}
    assert parse_spec(with_query(MAX_QUERY)).analysis.breakers[0].query.startswith("sum(up{")
    assert errors(parse_spec, with_query(MAX_QUERY + 1)) == {
        "spec.analysis.breakers[0].query": f"must be at most {MAX_QUERY} characters"}
    assert MAX_QUERY == 8192


def test_routing_is_pod_ratio_unless_it_says_otherwise():
    assert parse_spec(MINIMAL).traffic_routing.kind == "podRatio"
    assert parse_spec({**MINIMAL, "trafficRouting": {"podRatio": {}}}).traffic_routing.kind == "podRatio"


def test_a_boolean_is_no_integer():
    got = errors(parse_spec, {**MINIMAL, "steps": [{"weight": True}, {"weight": 100}]})
    assert list(got) == ["spec.steps[0].weight"]


def test_a_rollout_may_have_twenty_checks_of_a_role_and_no_more():
    def with_breakers(n):
        return {**MINIMAL, "analysis": {"breakers": [{"name": f"c{i}", "max": 1, "query": 'max(up{namespace="{{namespace}}"})'} for i in range(n)]}}
    assert len(parse_spec(with_breakers(20)).analysis.breakers) == 20
    assert errors(parse_spec, with_breakers(21)) == {"spec.analysis.breakers": "must have at most 20 items"}


def test_headers_that_are_not_objects_are_refused_by_index():
    spec = {**MINIMAL, "analysis": {"prometheus": {"address": "http://p:9090", "headers": ["X-Org: llm"]}}}
    got = errors(parse_spec, spec)
    assert "spec.analysis.prometheus.headers[0]" in got
    assert set(got) <= {"spec.analysis.prometheus.headers[0]", "spec.analysis.prometheus.headers[0].name",
                        "spec.analysis.prometheus.headers[0].value"}


def test_at_most_eight_templates():
    refs = [{"name": f"t{i}"} for i in range(9)]
    got = errors(parse_spec, {**MINIMAL, "analysis": {"templates": refs}})
    assert got["spec.analysis.templates"] == "must be a list of at most 8 template references"


def test_only_a_custom_check_may_have_a_negative_maximum():
    custom = {**MINIMAL, "analysis": {"breakers": [{"name": "drift", "max": -1, "query": 'min(up{namespace="{{namespace}}"}) - 2'}]}}
    assert parse_spec(custom).analysis.breakers[0].max == -1
    built_in = {**MINIMAL, "analysis": {"breakers": [{"name": "error-rate", "max": -1}]}}
    assert errors(parse_spec, built_in) == {"spec.analysis.breakers[0].max": "must be at least 0"}


@pytest.mark.parametrize("name,needs", [("ttft-p99", "max, min or maxRatio"), ("error-rate", "max, min")])
def test_a_check_without_a_threshold_says_which_it_may_have(name, needs):
    got = errors(parse_spec, {**MINIMAL, "analysis": {"breakers": [{"name": name}]}})
    assert got == {"spec.analysis.breakers[0]": f"needs a threshold: {needs}"}
