"""The spec model: defaults, and errors that name the field."""
import pytest

from graft.rollout.durations import format_duration, parse_duration, promql_duration
from graft.rollout.revision import has_patch, majority_stable, patches_of, revision_of, with_patch, without_patch
from graft.rollout.spec import DEFAULT_METRICS, DEFAULT_STEPS, SpecError, parse_spec, with_defaults

MINIMAL = {"selector": {"matchLabels": {"app": "llm-engine"}},
           "patch": {"name": "kv-align", "version": "3.2.1"}}


def errors_of(spec) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    return {e.path: e.message for e in info.value.errors}


def test_minimal_spec_gets_the_documented_defaults():
    s = parse_spec(MINIMAL)
    assert [(st.weight, st.pause) for st in s.steps] == [(1, 300), (5, 600), (20, 600), (50, 600), (100, 0)]
    assert s.traffic_routing.kind == "podRatio" and s.patch.source.builtin
    assert s.analysis.interval == 30 and s.analysis.no_data == "hold" and s.analysis.min_requests == 20
    assert s.analysis.prometheus == "http://prometheus.monitoring:9090"
    assert s.progress_deadline == 1800 and s.paused is False
    m = {c.name: c for c in s.analysis.metrics}
    assert (m["error-rate"].max, m["error-rate"].window, m["error-rate"].consecutive) == (0.005, 60, 3)
    assert (m["latency-p99"].max, m["latency-p99"].window) == (0.8, 30)
    assert (m["cpu"].max, m["cpu"].window) == (0.92, 120)
    assert (m["success-rate"].min, m["success-rate"].max, m["success-rate"].window) == (0.9995, None, 60)
    assert (m["error-rate-delta"].max, m["error-rate-delta"].window) == (0.001, 60)
    assert m["error-rate-delta"].comparison and not m["error-rate"].comparison


def test_builtin_metric_named_alone_takes_its_builtin_threshold_and_window():
    s = parse_spec({**MINIMAL, "analysis": {"metrics": [{"name": "latency-p99"}, {"name": "error-rate", "max": 0.01}]}})
    lat, err = s.analysis.metrics
    assert (lat.max, lat.window) == (0.8, 30)
    assert (err.max, err.window, err.consecutive) == (0.01, 60, 3)


def test_giving_min_replaces_a_builtin_max():
    (check,) = parse_spec({**MINIMAL, "analysis": {"metrics": [{"name": "cpu", "min": 0.1}]}}).analysis.metrics
    assert (check.min, check.max, check.threshold) == (0.1, None, ">= 0.1")


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


@pytest.mark.parametrize("change,path,words", [
    ({"steps": [{"weight": 5}, {"weight": 5}, {"weight": 100}]}, "spec.steps[1].weight", "greater than"),
    ({"steps": [{"weight": 5}, {"weight": 50}]}, "spec.steps[1].weight", "last step must have weight 100"),
    ({"steps": [{"weight": 0}, {"weight": 100}]}, "spec.steps[0].weight", "between 1 and 100"),
    ({"steps": [{"weight": 101}]}, "spec.steps[0].weight", "between 1 and 100"),
    ({"steps": [{"weight": 1, "pause": "5 minutes"}, {"weight": 100}]}, "spec.steps[0].pause", "does not match"),
    ({"steps": []}, "spec.steps", "non-empty"),
    ({"progressDeadline": "soon"}, "spec.progressDeadline", "does not match"),
    ({"paused": "yes"}, "spec.paused", "true or false"),
    ({"selector": {}}, "spec.selector", "must select something"),
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
    ({"analysis": {"minRequests": -1}}, "spec.analysis.minRequests", "at least 0"),
    ({"analysis": {"interval": "10ms"}}, "spec.analysis.interval", "at least 100ms"),
    ({"analysis": {"prometheus": {"address": "prometheus:9090"}}}, "spec.analysis.prometheus.address",
     "does not match"),
    ({"analysis": {"metrics": [{"name": "gpu-temp", "max": 80}]}}, "spec.analysis.metrics[0].query", "not a built-in"),
    ({"analysis": {"metrics": [{"name": "q", "query": "up{x='{{pod}}'}", "max": 1}]}},
     "spec.analysis.metrics[0].query", "unknown template variable"),
    ({"analysis": {"metrics": [{"name": "q", "query": "up"}]}}, "spec.analysis.metrics[0]", "needs a threshold"),
    ({"analysis": {"metrics": [{"name": "cpu", "min": 2, "max": 1}]}}, "spec.analysis.metrics[0].min", "exceed"),
    ({"analysis": {"metrics": [{"name": "cpu", "consecutive": 0}]}}, "spec.analysis.metrics[0].consecutive",
     "at least 1"),
    ({"analysis": {"metrics": [{"name": "cpu", "max": "high"}]}}, "spec.analysis.metrics[0].max", "finite number"),
    ({"analysis": {"metrics": [{"name": "cpu"}, {"name": "cpu"}]}}, "spec.analysis.metrics[1].name", "duplicate"),
    ({"analysis": {"metrics": [{"name": "cpu", "window": "0s"}]}}, "spec.analysis.metrics[0].window", "longer"),
    ({"stepz": []}, "spec.stepz", "unknown field"),
])
def test_bad_field_is_named(change, path, words):
    errors = errors_of({**MINIMAL, **change})
    assert path in errors, errors
    assert words in errors[path]


def test_every_bad_field_is_reported_at_once():
    errors = errors_of({"selector": {"matchLabels": {"a": "b"}}, "patch": {"name": "X"},
                        "steps": [{"weight": 500}], "analysis": {"noData": "x"}})
    assert {"spec.patch.name", "spec.patch.version", "spec.steps[0].weight", "spec.analysis.noData"} <= set(errors)


def test_selector_query_and_matching():
    s = parse_spec({**MINIMAL, "selector": {"matchLabels": {"app": "llm"}, "matchExpressions": [
        {"key": "tier", "operator": "In", "values": ["gpu", "cpu"]}, {"key": "legacy", "operator": "DoesNotExist"}]}})
    assert s.selector.to_query() == "app=llm,tier in (gpu,cpu),!legacy"
    assert s.selector.matches({"app": "llm", "tier": "gpu"})
    assert not s.selector.matches({"app": "llm", "tier": "tpu"})
    assert not s.selector.matches({"app": "llm", "tier": "gpu", "legacy": "1"})


def test_defaults_are_copied_not_shared():
    filled = with_defaults(MINIMAL)
    filled["steps"][0]["weight"] = 99
    filled["analysis"]["metrics"][0]["max"] = 1
    assert DEFAULT_STEPS[0] == {"weight": 1, "pause": "5m"} and DEFAULT_METRICS[0]["max"] == 0.005


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
    assert majority_stable(["base", "kv@1", "z@1"], "kv@1") == "base"
