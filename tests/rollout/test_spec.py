"""The spec model: defaults, breakers and gates, templates, and errors that name the field."""
import copy

import pytest
from hypothesis import assume, given, settings, strategies as st

from graft.rollout.durations import format_duration, parse_duration, promql_duration
from graft.api import has_patch, patches_of, revision_of, with_patch, without_patch
from graft.rollout.spec import (parse_selector, DEFAULT_BREAKERS, DEFAULT_GATES, DEFAULT_STEPS, PrometheusSource, SpecError,
                                parse_spec, template_refs, with_defaults)

MINIMAL = {"selector": {"matchLabels": {"app": "llm-engine"}},
           "patch": {"name": "kv-align", "version": "3.2.1"}}


def errors_of(spec, templates=None) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(spec, templates)
    return {e.path: e.message for e in info.value.errors}


def analysis(**fields):
    return parse_spec({**MINIMAL, "analysis": fields}).analysis


def by_key(a) -> dict:
    return {c.key: c for c in a.checks}


def test_minimal_spec_gets_the_documented_defaults():
    s = parse_spec(MINIMAL)
    assert [(st.weight, st.pause) for st in s.steps] == [(1, 300), (5, 600), (20, 600), (50, 600), (100, 0)]
    assert s.traffic_routing.kind == "podRatio" and s.patch.source.builtin
    a = s.analysis
    assert (a.interval, a.no_data, a.confidence, a.rollback_confidence) == (30, "hold", 0.95, 0.999)
    assert (a.inconclusive_limit, a.error_limit, a.outage_limit, a.templates) == (20, 4, 600, ())
    # no address: the operator's GRAFT_PROMETHEUS_ADDRESS is used
    assert a.prometheus == PrometheusSource(address="", bearer_token_secret=None, ca_secret=None, headers=())
    assert s.progress_deadline == 1800 and s.paused is False
    # the documented default analysis (docs/analysis.md): absolute error limits, latency against stable
    got = {(c.role, c.name): (c.metric, c.max, c.min, c.max_ratio, c.window, c.consecutive) for c in a.checks}
    assert got == {
        ("breaker", "error-rate"): ("error-rate", 0.005, None, None, 60, 3),
        ("breaker", "ttft-p99"): ("ttft-p99", None, None, 1.5, 30, 3),
        ("breaker", "tpot-p99"): ("tpot-p99", None, None, 1.3, 30, 3),
        ("breaker", "cpu"): ("cpu", 0.92, None, None, 120, 3),
        ("breaker", "output-divergence"): ("output-divergence", 0.05, None, None, None, 1),
        ("gate", "error-rate-delta"): ("error-rate-delta", 0.001, None, None, None, 1),
        ("gate", "tpot-p99"): ("tpot-p99", None, None, 1.2, 60, 1),
    }
    assert [c.key for c in a.breakers] == ["breaker/error-rate", "breaker/ttft-p99", "breaker/tpot-p99", "breaker/cpu",
                                           "breaker/output-divergence"]
    assert [c.key for c in a.gates] == ["gate/error-rate-delta", "gate/tpot-p99"]
    delta = by_key(a)["gate/error-rate-delta"]
    assert delta.window_text == "step" and delta.kind == "difference" and delta.comparison
    assert not by_key(a)["breaker/error-rate"].comparison and by_key(a)["breaker/ttft-p99"].comparison
    divergence = by_key(a)["breaker/output-divergence"]
    assert (divergence.kind, divergence.window_text, divergence.threshold) == ("rate", "rollout", "<= 0.05")
    assert not divergence.comparison, "judged on the canary alone: never skipped once no stable pod is left"


def test_builtin_check_takes_its_kind_and_window_from_its_name():
    a = analysis(breakers=[{"name": "latency-p99", "max": 0.8}, {"name": "error-rate", "max": 0.01}],
                 gates=[{"name": "success-rate", "min": 0.999}, {"name": "error-rate-delta", "max": 0.002}])
    lat, err = a.breakers
    assert (lat.metric, lat.kind, lat.max, lat.window, lat.window_text) == ("latency-p99", "quantile", 0.8, 60, "60s")
    assert (err.kind, err.max, err.window, err.consecutive) == ("rate", 0.01, 60, 1)
    ok, delta = a.gates
    assert (ok.kind, ok.min, ok.max, ok.threshold) == ("rate", 0.999, None, ">= 0.999")
    assert (delta.kind, delta.window) == ("difference", None), "error-rate-delta looks at the whole step"


def test_a_check_may_name_its_metric_and_window_step():
    a = analysis(breakers=[{"name": "ttft-slo", "metric": "ttft-p99", "max": 0.5, "window": "2m"},
                           {"name": "errors-so-far", "metric": "error-rate", "max": 0.01, "window": "step"}])
    slo, so_far = a.breakers
    assert (slo.name, slo.metric, slo.kind, slo.max, slo.window) == ("ttft-slo", "ttft-p99", "quantile", 0.5, 120)
    assert (so_far.metric, so_far.window, so_far.window_text) == ("error-rate", None, "step")


def test_output_divergence_is_a_canary_share_in_either_role():
    """A counts check on the canary's shadow comparisons: a breaker or a gate, by its name or as the
    metric of a check named otherwise, dry run or not; over the rollout so far unless it says."""
    a = analysis(breakers=[{"name": "output-divergence", "max": 0.05, "consecutive": 1},
                           {"name": "divergence-trial", "metric": "output-divergence", "max": 0.01,
                            "window": "5m", "dryRun": True}],
                 gates=[{"name": "output-divergence", "max": 0.02}])
    breaker, trial = a.breakers
    (gate,) = a.gates
    assert (breaker.metric, breaker.kind, breaker.window, breaker.window_text, breaker.consecutive) == \
        ("output-divergence", "rate", None, "rollout", 1)
    assert (trial.metric, trial.max, trial.window, trial.dry_run) == ("output-divergence", 0.01, 300, True)
    assert (gate.key, gate.max, gate.window, gate.comparison) == ("gate/output-divergence", 0.02, None, False)
    # the edges of a share are limits it may have: 0 (no divergence at all) and 1 (never acts)
    edges = analysis(breakers=[{"name": "output-divergence", "max": 0}], gates=[{"name": "output-divergence", "max": 1}])
    assert [c.max for c in edges.checks] == [0, 1]


def test_a_breaker_and_a_gate_may_share_a_name():
    a = analysis(breakers=[{"name": "tpot-p99", "maxRatio": 1.5, "consecutive": 2}],
                 gates=[{"name": "tpot-p99", "maxRatio": 1.1}])
    assert [(c.key, c.max_ratio, c.consecutive) for c in a.checks] == [
        ("breaker/tpot-p99", 1.5, 2), ("gate/tpot-p99", 1.1, 1)]


def test_naming_any_check_replaces_the_whole_default_analysis():
    only_gates = analysis(gates=[{"name": "error-rate-delta", "max": 0.01}])
    assert only_gates.breakers == () and [c.key for c in only_gates.gates] == ["gate/error-rate-delta"]
    only_breakers = analysis(breakers=[{"name": "cpu", "max": 0.5}])
    assert only_breakers.gates == () and [c.key for c in only_breakers.breakers] == ["breaker/cpu"]


def test_custom_query_check():
    a = analysis(breakers=[{"name": "kv-fragmentation", "max": 0.25, "consecutive": 2, "window": "5m",
                            "query": 'max(x{namespace="{{namespace}}"})'}],
                 gates=[{"name": "itl-ratio", "max": 1.05, "minSamples": 500,
                         "query": 'a{namespace="{{namespace}}",r="{{canaryRevision}}"} / a{namespace="{{namespace}}",r="{{stableRevision}}"}'}])
    frag, ratio = a.checks
    assert (frag.metric, frag.kind, frag.window, frag.consecutive, frag.comparison) == ("custom", "custom", 300, 2, False)
    assert (ratio.min_samples, ratio.comparison) == (500, True), "a query naming stableRevision compares"
    (own,) = analysis(breakers=[{"name": "error-rate", "max": 0.01, "query": 'sum(up{namespace="{{namespace}}"})'}]).breakers
    assert (own.metric, own.query) == ("custom", 'sum(up{namespace="{{namespace}}"})'), "a query makes even a built-in name custom"


def test_prometheus_source_with_credentials():
    a = analysis(prometheus={"address": "https://prom.example:9090",
                             "bearerTokenSecret": {"name": "prom-token", "key": "token"},
                             "caSecret": {"name": "prom-ca", "key": "ca.crt"},
                             "headers": [{"name": "X-Scope-OrgID", "value": "llm"}]})
    assert a.prometheus == PrometheusSource("https://prom.example:9090", ("prom-token", "token"),
                                            ("prom-ca", "ca.crt"), (("X-Scope-OrgID", "llm"),))


TEMPLATE = {
    "args": [{"name": "job", "value": "engine"}, {"name": "tenant"}],
    "breakers": [{"name": "error-rate", "max": 0.01, "window": "30s", "consecutive": 2},
                 {"name": "kv", "max": 0.25, "query": 'max(x{namespace="{{namespace}}",job="{{args.job}}",t="{{args.tenant}}"})'}],
    "gates": [{"name": "error-rate-delta", "max": 0.002}],
}


def test_template_checks_come_first_and_the_rollouts_own_replace_them_by_name_and_role():
    s = parse_spec({**MINIMAL, "analysis": {
        "templates": [{"name": "fleet-checks", "clusterScope": True}],
        "args": [{"name": "tenant", "value": "acme"}],
        "breakers": [{"name": "error-rate", "max": 0.02}],
        "gates": [{"name": "success-rate", "min": 0.99}]}}, {("fleet-checks", True): TEMPLATE})
    a = s.analysis
    assert [c.key for c in a.checks] == ["breaker/kv", "breaker/error-rate", "gate/error-rate-delta",
                                         "gate/success-rate"]
    kv, err = a.breakers
    assert kv.query == 'max(x{namespace="{{namespace}}",job="engine",t="acme"})', "a template's default and the rollout's value fill args"
    assert (err.max, err.window, err.consecutive) == (0.02, 60, 1), "replaced whole, not merged"
    assert a.gates[0].max == 0.002 and a.templates == (("fleet-checks", True),)


def test_a_template_alone_brings_no_default_checks():
    s = parse_spec({**MINIMAL, "analysis": {"templates": [{"name": "t"}], "args": [{"name": "tenant", "value": "x"}]}},
                   {("t", False): TEMPLATE})
    assert [c.key for c in s.analysis.checks] == ["breaker/error-rate", "breaker/kv", "gate/error-rate-delta"]


def test_template_problems_name_the_template_and_the_field():
    refs = {"analysis": {"templates": [{"name": "t"}]}}
    assert "not found" in errors_of({**MINIMAL, **refs})["spec.analysis.templates"]
    errors = errors_of({**MINIMAL, **refs}, {("t", False): TEMPLATE})
    assert "argument 'tenant' has no value" in errors["PatchAnalysisTemplate t: spec.breakers[1].query"]
    cluster = {"analysis": {"templates": [{"name": "t", "clusterScope": True}]}}
    assert "cluster analysis template 't' was not found" in errors_of({**MINIMAL, **cluster},
                                                                      {("t", False): TEMPLATE})["spec.analysis.templates"]


def test_template_refs_are_read_from_any_spec():
    assert template_refs({"analysis": {"templates": [{"name": "a"}, {"name": "b", "clusterScope": True}]}}) == [
        ("a", False), ("b", True)]
    assert template_refs({}) == [] and template_refs({"analysis": {"templates": "x"}}) == []


def test_config_map_source_with_digest():
    digest = "sha256:" + "ab" * 32
    s = parse_spec({**MINIMAL, "patch": {"name": "p", "version": "1", "source": {
        "configMap": {"name": "bundle", "key": "patch.py"}, "digest": digest}}})
    assert (s.patch.source.builtin, s.patch.source.config_map, s.patch.source.key, s.patch.source.digest) == (
        False, "bundle", "patch.py", digest)


def test_gateway_routing_fields():
    s = parse_spec({**MINIMAL, "trafficRouting": {"gatewayAPI": {
        "httpRoute": "llm", "stableService": "llm-stable", "canaryService": "llm-canary"}}})
    assert (s.traffic_routing.kind, s.traffic_routing.http_route, s.traffic_routing.canary_service) == (
        "gatewayAPI", "llm", "llm-canary")


def br(**check):
    return {"analysis": {"breakers": [check]}}


def gt(**check):
    return {"analysis": {"gates": [check]}}


@pytest.mark.parametrize("change,path,words", [
    ({"steps": [{"weight": 5}, {"weight": 5}, {"weight": 100}]}, "spec.steps[1].weight", "greater than"),
    ({"steps": [{"weight": 5}, {"weight": 50}]}, "spec.steps[1].weight", "last step must have weight 100"),
    ({"steps": [{"weight": 0}, {"weight": 100}]}, "spec.steps[0].weight", "between 1 and 100"),
    ({"steps": [{"weight": 101}]}, "spec.steps[0].weight", "between 1 and 100"),
    ({"steps": [{"weight": 1, "pause": "5 minutes"}, {"weight": 100}]}, "spec.steps[0].pause", "does not match"),
    ({"steps": []}, "spec.steps", "non-empty"),
    ({"progressDeadline": "soon"}, "spec.progressDeadline", "does not match"),
    ({"paused": "yes"}, "spec.paused", "true or false"),
    ({"selector": {}}, "spec.selector", "must name the fleet"),
    ({"selector": {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["db"]}]}},
     "spec.selector", "must name the fleet"),
    ({"selector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]}}, "spec.selector", "must name the fleet"),
    ({"selector": {"matchExpressions": [{"key": "db", "operator": "DoesNotExist"}]}},
     "spec.selector", "must name the fleet"),
    ({"selector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}},
     "spec.selector.matchExpressions[0].operator", "one of"),
    ({"patch": {"name": "KV", "version": "1"}}, "spec.patch.name", "does not match"),
    ({"patch": {"name": "kv"}}, "spec.patch.version", "required"),
    ({"patch": {"name": "kv", "version": "1", "source": {"builtin": {}, "configMap": {"name": "c", "key": "k"}}}},
     "spec.patch.source", "exactly one"),
    ({"patch": {"name": "kv", "version": "1", "source": {"configMap": {"name": "c", "key": "k"}}}},
     "spec.patch.source.digest", "required"),
    ({"patch": {"name": "kv", "version": "1", "source": {"configMap": {"name": "c", "key": "k"},
                                                          "digest": "sha256:xyz"}}},
     "spec.patch.source.digest", "does not match"),
    ({"patch": {"name": "kv", "version": "1", "source": {"builtin": {}, "digest": "sha256:" + "0" * 64}}},
     "spec.patch.source.digest", "only a configMap"),
    ({"trafficRouting": {"podRatio": {}, "gatewayAPI": {}}}, "spec.trafficRouting", "exactly one"),
    ({"trafficRouting": {"gatewayAPI": {"httpRoute": "r", "stableService": "s"}}},
     "spec.trafficRouting.gatewayAPI.canaryService", "required"),
    ({"trafficRouting": {"gatewayAPI": {"httpRoute": "r", "stableService": "s", "canaryService": "s"}}},
     "spec.trafficRouting.gatewayAPI.canaryService", "differ"),
    ({"analysis": {"noData": "maybe"}}, "spec.analysis.noData", "hold, fail, pass"),
    # the old model's fields are refused by name, not silently ignored
    ({"analysis": {"minRequests": 20}}, "spec.analysis.minRequests", "unknown field"),
    ({"analysis": {"metrics": [{"name": "cpu", "max": 0.9}]}}, "spec.analysis.metrics", "unknown field"),
    ({"analysis": {"interval": "500ms"}}, "spec.analysis.interval", "at least 1s"),
    ({"analysis": {"confidence": 0.3}}, "spec.analysis.confidence", "at least 0.5"),
    ({"analysis": {"rollbackConfidence": 1}}, "spec.analysis.rollbackConfidence", "0.9999"),
    ({"analysis": {"errorLimit": -1}}, "spec.analysis.errorLimit", "between 0 and 1000"),
    ({"analysis": {"outageLimit": 600}}, "spec.analysis.outageLimit", "must be a non-empty string"),
    ({"analysis": {"inconclusiveLimit": 1001}}, "spec.analysis.inconclusiveLimit", "between 0 and 1000"),
    ({"analysis": {"breakers": [], "gates": []}}, "spec.analysis", "at least one breaker or gate"),
    ({"analysis": {"prometheus": {"address": "prometheus:9090"}}}, "spec.analysis.prometheus.address",
     "does not match"),
    ({"analysis": {"prometheus": {"bearerTokenSecret": {"name": "t"}}}},
     "spec.analysis.prometheus.bearerTokenSecret.key", "required"),
    (br(name="gpu-temp", max=80), "spec.analysis.breakers[0].query", "not a built-in"),
    (br(name="q", metric="gpu-temp", max=80), "spec.analysis.breakers[0].metric", "not a built-in metric"),
    (br(name="q", query="up{x='{{pod}}'}", max=1), "spec.analysis.breakers[0].query", "unknown template variable"),
    (br(name="q", query="up"), "spec.analysis.breakers[0]", "needs a threshold"),
    (br(name="latency-p99"), "spec.analysis.breakers[0]", "needs a threshold"),
    (br(name="errors", metric="error-rate", max=0.01, query="up"), "spec.analysis.breakers[0].query", "takes no query"),
    (br(name="cpu", min=0.9, max=0.5), "spec.analysis.breakers[0].min", "exceed"),
    (br(name="cpu", max=0.9, consecutive=0), "spec.analysis.breakers[0].consecutive", "between 1 and 100"),
    (br(name="cpu", max="high"), "spec.analysis.breakers[0].max", "finite number"),
    (br(name="error-rate", max=5), "spec.analysis.breakers[0]", "between 0 and 1"),
    (br(name="error-rate", min=0.1), "spec.analysis.breakers[0].min", "error-rate takes max"),
    (br(name="success-rate", max=0.1), "spec.analysis.breakers[0].max", "success-rate takes min"),
    (br(name="cpu", maxRatio=1.2), "spec.analysis.breakers[0].maxRatio", "only latency quantiles"),
    (br(name="output-divergence", max=1.5), "spec.analysis.breakers[0]", "between 0 and 1"),
    (gt(name="output-divergence", max=-0.1), "spec.analysis.gates[0].max", "at least 0"),
    (br(name="output-divergence", min=0.01, max=0.05), "spec.analysis.breakers[0].min",
     "output-divergence takes max"),
    (gt(name="output-divergence"), "spec.analysis.gates[0]", "needs a threshold"),
    (br(name="output-divergence", maxRatio=1.1), "spec.analysis.breakers[0].maxRatio", "only latency quantiles"),
    (br(name="shadow", metric="output-divergence", max=0.05, query="up"), "spec.analysis.breakers[0].query",
     "takes no query"),
    (br(name="tpot-p99", maxRatio=0), "spec.analysis.breakers[0].maxRatio", "greater than 0"),
    (br(name="error-rate-delta", min=0.001), "spec.analysis.breakers[0].max", "required"),
    (br(name="cpu", max=0.9, window="0s"), "spec.analysis.breakers[0].window", "at least 1s"),
    (br(name="cpu", max=0.9, window="step"), "spec.analysis.breakers[0].window", "does not match"),
    (br(name="cpu", max=0.9, minSamples=0), "spec.analysis.breakers[0].minSamples", "between 1 and"),
    (br(name="cpu", max=0.9, dryRun="no"), "spec.analysis.breakers[0].dryRun", "true or false"),
    (br(name="cpu", max=0.9, threshold=1), "spec.analysis.breakers[0].threshold", "unknown field"),
    (gt(name="error-rate-delta", max=0.001, consecutive=2), "spec.analysis.gates[0].consecutive",
     "gates take no consecutive"),
    ({"analysis": {"breakers": [{"name": "cpu", "max": 0.9}, {"name": "cpu", "max": 0.5}]}},
     "spec.analysis.breakers[1].name", "duplicate breaker"),
    ({"analysis": {"args": [{"name": "1x", "value": "v"}]}}, "spec.analysis.args[0].name", "does not match"),
    ({"analysis": {"templates": [{"name": "Bad_Name"}]}}, "spec.analysis.templates[0].name", "does not match"),
    ({"stepz": []}, "spec.stepz", "unknown field"),
])
def test_bad_field_is_named(change, path, words):
    errors = errors_of({**MINIMAL, **change})
    assert path in errors, errors
    assert words in errors[path]


def manual(step: dict) -> dict:
    """A spec whose first step is `step` (weight 20), then 100%."""
    return {**MINIMAL, "steps": [{"weight": 20, **step}, {"weight": 100}]}


@pytest.mark.parametrize("step", [{"untilApproved": True}, {"pause": {}}, {"pause": {}, "untilApproved": True}],
                         ids=["untilApproved", "argo-pause-empty-object", "both-spellings"])
def test_a_manual_step_has_two_spellings(step):
    first = parse_spec(manual(step)).steps[0]
    assert (first.weight, first.until_approved, first.pause, first.pause_text) == (20, True, 0.0, None)


def test_an_ordinary_step_waits_for_no_one():
    steps = parse_spec(manual({"pause": "5m", "untilApproved": False})).steps
    assert [(s.until_approved, s.pause) for s in steps] == [(False, 300.0), (False, 0.0)]
    assert not any(s.until_approved for s in parse_spec(MINIMAL).steps), "the default steps need no person"


@pytest.mark.parametrize("step,path,words", [
    ({"pause": {"x": 1}}, "spec.steps[0].pause", "{} takes no fields, not x"),
    ({"pause": {"duration": "10m"}}, "spec.steps[0].pause", "a duration is written pause: 10m"),
    ({"pause": 600}, "spec.steps[0].pause", 'must be a duration ("10m") or {} (wait for approval), not 600'),
    ({"pause": ["10m"]}, "spec.steps[0].pause", "not ['10m']"),
    ({"pause": True}, "spec.steps[0].pause", "not True"),
    ({"pause": ""}, "spec.steps[0].pause", "non-empty string"),
    ({"pause": "10m", "untilApproved": True}, "spec.steps[0]", "not both"),
    ({"pause": "0s", "untilApproved": True}, "spec.steps[0]", "not both"),
    ({"pause": {}, "untilApproved": False}, "spec.steps[0]", "drop one"),
    ({"untilApproved": "yes"}, "spec.steps[0].untilApproved", "true or false"),
    ({"untilApproved": 1}, "spec.steps[0].untilApproved", "true or false"),
    ({"approval": True}, "spec.steps[0].approval", "unknown field (allowed: weight, pause, untilApproved)"),
])
def test_a_manual_step_badly_written_is_refused_by_field(step, path, words):
    errors = errors_of(manual(step))
    assert path in errors, errors
    assert words in errors[path], errors[path]


def test_every_bad_field_is_reported_at_once():
    errors = errors_of({"selector": {"matchLabels": {"a": "b"}}, "patch": {"name": "X"},
                        "steps": [{"weight": 500}], "analysis": {"noData": "x", "gates": [
                            {"name": "error-rate-delta", "max": 0.001, "consecutive": 3}]}})
    assert {"spec.patch.name", "spec.patch.version", "spec.steps[0].weight", "spec.analysis.noData",
            "spec.analysis.gates[0].consecutive"} <= set(errors)


def test_selector_query_and_matching():
    s = parse_spec({**MINIMAL, "selector": {"matchLabels": {"app": "llm"}, "matchExpressions": [
        {"key": "tier", "operator": "In", "values": ["gpu", "cpu"]}, {"key": "legacy", "operator": "DoesNotExist"}]}})
    assert s.selector.to_query() == "app=llm,!legacy,tier in (cpu,gpu)"   # one spelling: keys and values sorted
    assert s.selector.matches({"app": "llm", "tier": "gpu"})
    assert not s.selector.matches({"app": "llm", "tier": "tpu"})
    assert not s.selector.matches({"app": "llm", "tier": "gpu", "legacy": "1"})


def test_defaults_are_copied_not_shared():
    before = copy.deepcopy((DEFAULT_STEPS, DEFAULT_BREAKERS, DEFAULT_GATES))
    filled = with_defaults(MINIMAL)
    filled["steps"][0]["weight"] = 99
    filled["analysis"]["interval"] = "1h"
    assert "breakers" not in filled["analysis"], "the checks default in parse_spec, not in the stored spec"
    parse_spec(MINIMAL).analysis.breakers[0]          # parsing hands out checks, never the lists
    assert (DEFAULT_STEPS, DEFAULT_BREAKERS, DEFAULT_GATES) == before
    assert with_defaults(MINIMAL)["analysis"]["interval"] == "30s"


@pytest.mark.parametrize("text,seconds", [("30s", 30), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("1.5s", 1.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_duration_spelling_round_trips():
    for seconds in (0.25, 1, 59, 60, 90, 300, 3600, 5400):
        assert parse_duration(format_duration(seconds)) == seconds
    assert format_duration(300) == "5m" and format_duration(90) == "1m30s"
    assert promql_duration(1.5) == "1500ms" and promql_duration(60) == "60s"
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("5 m")


def test_revisions():
    assert revision_of([]) == "base" and revision_of(["b@1", "a@2"]) == "a@2,b@1"
    assert patches_of("base") == [] and patches_of("a@2,b@1") == ["a@2", "b@1"]
    assert has_patch("a@2,kv-align@3.2.1", "kv-align@3.2.1") and not has_patch("kv-align@3.2.0", "kv-align@3.2.1")
    assert with_patch("base", "kv@1") == "kv@1" and with_patch("kv@0,z@1", "kv@1") == "kv@1,z@1"
    assert without_patch("kv@1,z@1", "kv@1") == "z@1" and without_patch("kv@1", "kv@1") == "base"


_KEYS = st.sampled_from(["app", "zone", "tier", "graft.dev/track"])
_VALUES = st.lists(st.sampled_from(["a", "b", "llm", "gpu-1"]), min_size=1, max_size=3)
_EXPRESSIONS = st.lists(st.one_of(
    st.builds(lambda k, v: {"key": k, "operator": "In", "values": v}, _KEYS, _VALUES),
    st.builds(lambda k, v: {"key": k, "operator": "NotIn", "values": v}, _KEYS, _VALUES),
    st.builds(lambda k: {"key": k, "operator": "Exists"}, _KEYS),
    st.builds(lambda k: {"key": k, "operator": "DoesNotExist"}, _KEYS)), max_size=4)


@settings(max_examples=200, deadline=None)
@given(labels=st.dictionaries(_KEYS, st.sampled_from(["a", "llm"]), max_size=2), expressions=_EXPRESSIONS,
       pod=st.dictionaries(_KEYS, st.sampled_from(["a", "b", "llm", "gpu-1"]), max_size=4), data=st.data())
def test_a_selector_has_one_spelling_whatever_the_order_of_its_expressions_and_values(labels, expressions, pod,
                                                                                      data):
    """Fleets are told apart by their selector's query: the same selector written in another order
    is the same fleet, and the query picks the pods the selector matches."""
    assume(labels or any(e["operator"] == "In" for e in expressions))   # others do not name a fleet
    shuffled = [{**e, **({"values": data.draw(st.permutations(e["values"]))} if "values" in e else {})}
                for e in data.draw(st.permutations(expressions))]
    one = parse_selector({"matchLabels": labels, "matchExpressions": expressions})
    other = parse_selector({"matchLabels": dict(reversed(list(labels.items()))), "matchExpressions": shuffled})
    assert one.to_query() == other.to_query()
    assert one.matches(pod) == other.matches(pod)
