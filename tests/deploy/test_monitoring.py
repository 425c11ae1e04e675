"""Prometheus and Grafana assets: every query parses and selects only series that exist, the alerts
cover the service levels, and the plain scrape config finds exactly the engine pods."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from graft.rollout.queries import render as render_query
from tests.deploy.manifests import CRDS, DEPLOY, EXAMPLES, load_file, pod_template
from tests.deploy.promql import (DASHBOARD, KSM_CONFIG, RULE_FILE, balanced, builtin_query_exprs, check_rule_file,
                                 dashboard_exprs, discovered_targets, engine_metric_names, known_metric_names,
                                 metric_names, promtool, promtool_errors, rule_groups)

SCRAPE_CONFIG = DEPLOY / "prometheus" / "scrape-config.yaml"


def rule_exprs() -> dict[str, str]:
    return {r.get("alert") or r["record"]: r["expr"] for g in rule_groups() for r in g["rules"]}


def example_query_exprs() -> dict[str, str]:
    """The custom checks of the example rollouts, templated the way the operator does."""
    variables = {"namespace": "llm", "canaryRevision": "kv-align@3.2.1", "stableRevision": "base",
                 "window": "1m", "patchName": "kv-align", "patchVersion": "3.2.1"}
    out = {}
    for path in sorted(EXAMPLES.glob("rollout-*.yaml")):
        for obj in load_file(path):
            for metric in obj.get("spec", {}).get("analysis", {}).get("metrics", []):
                if "query" in metric:
                    out[f'{path.stem}:{metric["name"]}'] = render_query(metric["query"], variables)
    return out


def all_exprs() -> dict[str, str]:
    exprs = {**{f"dashboard {k}": v for k, v in dashboard_exprs().items()},
             **{f"rule {k}": v for k, v in rule_exprs().items()},
             **{f"example {k}": v for k, v in example_query_exprs().items()},
             **builtin_query_exprs()}
    assert len(exprs) > 40
    return exprs


def test_metric_name_scanner_finds_series_and_skips_the_rest():
    expr = ('histogram_quantile(0.99, sum by (le, revision) (rate(graft_request_duration_seconds_bucket'
            '{namespace="a{b}", revision=~"x|y"}[5m] offset 1h))) / on (pod) group_left(le) '
            'max(up) and vector(1e3) > bool nonexistent_metric')
    assert metric_names(expr) == {"graft_request_duration_seconds_bucket", "up", "nonexistent_metric"}
    assert metric_names("graft:request_error_ratio:rate5m > (14.4 * 0.005)") == {"graft:request_error_ratio:rate5m"}


def test_known_series_come_from_the_engine_itself():
    names = engine_metric_names()
    assert {"graft_requests_total", "graft_request_duration_seconds_bucket", "graft_kv_cache_usage_ratio",
            "graft_patch_info", "graft_patch_apply_seconds_count", "process_cpu_seconds_total"} <= names


def test_every_shipped_query_selects_only_series_that_exist():
    known = known_metric_names()
    unknown = {name: sorted(metric_names(expr) - known) for name, expr in all_exprs().items()}
    assert not {k: v for k, v in unknown.items() if v}


def test_every_shipped_query_parses(tmp_path):
    exprs = all_exprs()
    assert all(balanced(e) for e in exprs.values()), [k for k, e in exprs.items() if not balanced(e)]
    assert promtool_errors(exprs, tmp_path) == ""
    assert promtool_errors({"broken": "sum(rate(graft_requests_total[5m])"}, tmp_path)


def test_every_builtin_check_query_is_among_those_checked():
    exprs = all_exprs()
    builtin = builtin_query_exprs()
    assert builtin.items() <= exprs.items()
    # the operator's checks read engine series only, by namespace
    assert all(metric_names(e) and 'namespace="llm"' in e for e in builtin.values())


def test_a_missing_promtool_fails_the_tests_that_need_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(AssertionError, match="promtool is not installed"):
        promtool()


def test_prometheus_rule_file_is_a_valid_rule_file(tmp_path):
    rule = yaml.safe_load(RULE_FILE.read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            assert ("alert" in r) != ("record" in r) and r["expr"].strip(), r
            if "alert" in r:
                assert r["labels"]["severity"] in ("critical", "warning", "info")
                assert r["annotations"]["summary"] and r["annotations"]["description"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    assert check_rule_file(path) == ""


def test_alerts_cover_the_service_levels_patches_and_rollouts():
    alerts = {r["alert"]: r for g in rule_groups() for r in g["rules"] if "alert" in r}
    assert {"GraftSuccessRateFastBurn", "GraftSuccessRateSlowBurn", "GraftLatencyP99High",
            "GraftPatchApplyFailed", "GraftPatchApplySlow", "GraftRolloutStuck"} <= set(alerts)
    assert "graft_patch_failures_total" in alerts["GraftPatchApplyFailed"]["expr"]
    assert "graft_patchrollout_step_index" in alerts["GraftRolloutStuck"]["expr"]


def test_dashboard_shows_rollouts_canary_against_stable_and_capacity():
    board = json.loads(DASHBOARD.read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    titles = {p["title"] for p in panels}
    assert {"Canary weight", "Phase", "Error rate", "p99 request latency", "Tokens per second", "KV cache",
            "Running and waiting requests", "Patch applies and reverts", "Patch failures"} <= titles
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for p in board["panels"]:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
    by_revision = [p for p in panels if p["title"] in ("Error rate", "p99 request latency")]
    assert all("by (revision" in t["expr"] for p in by_revision for t in p["targets"])
    defined = {v["name"] for v in board["templating"]["list"]}
    used = set(re.findall(r"\$\{?(\w+)\}?", json.dumps(board)))
    assert used - {"__rate_interval", "__interval", "__all", "value", "labels"} <= defined


def relabel(labels: dict[str, str], configs: list[dict]) -> dict[str, str] | None:
    """Prometheus' relabelling (keep, drop, replace); None when the target is dropped."""
    labels = dict(labels)
    for c in configs:
        value = c.get("separator", ";").join(labels.get(s, "") for s in c.get("source_labels", []))
        match = re.fullmatch(c.get("regex", "(.*)"), value)
        action = c.get("action", "replace")
        if action == "keep" and not match or action == "drop" and match:
            return None
        if action == "replace" and match:
            result = re.sub(r"\$(\d+)|\$\{(\d+)\}", lambda m: match.group(int(m.group(1) or m.group(2))) or "",
                            c.get("replacement", "$1"))
            if result:
                labels[c["target_label"]] = result
            else:
                labels.pop(c["target_label"], None)
    labels.setdefault("instance", labels["__address__"])
    return {k: v for k, v in labels.items() if not k.startswith("__meta_")}


def test_scrape_config_finds_each_engine_pod_once_on_its_metrics_port():
    (job,) = yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    engine = pod_template(next(o for o in load_file(EXAMPLES / "engine-deployment.yaml") if o["kind"] == "Deployment"))
    other = {"metadata": {"labels": {"app": "db"}}, "spec": {"containers": [{"ports": [{"containerPort": 5432}]}]}}
    discovered = (discovered_targets(engine, "llm", "llm-engine-a", "192.0.2.10")
                  + discovered_targets(engine, "llm", "llm-engine-b", "192.0.2.11", phase="Pending")
                  + discovered_targets(other, "llm", "postgres-0", "192.0.2.12"))
    targets = [t for t in (relabel(d, job["relabel_configs"]) for d in discovered) if t is not None]
    # one pod, three container ports: the same target, on the metrics port, three times (Prometheus merges them)
    metrics = next(p["containerPort"] for c in engine["spec"]["containers"] for p in c["ports"] if p["name"] == "metrics")
    assert metrics != 8000 and len(targets) == 3
    assert {json.dumps(t, sort_keys=True) for t in targets} == {json.dumps({
        "__address__": f"192.0.2.10:{metrics}", "__metrics_path__": "/metrics", "instance": f"192.0.2.10:{metrics}",
        "namespace": "llm", "pod": "llm-engine-a", "track": "stable"}, sort_keys=True)}


def test_kube_state_metrics_reads_only_fields_the_crd_defines():
    config = yaml.safe_load(KSM_CONFIG.read_text())
    (resource,) = config["spec"]["resources"]
    paths = {tuple(p) for m in resource["metrics"] for p in _paths(m["each"])}
    assert {("status", "phase"), ("status", "weight"), ("status", "stepIndex")} <= paths
    crd = load_file(CRDS / "patchrollout.yaml")[0]
    assert crd["spec"]["group"] == resource["groupVersionKind"]["group"]
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == resource["groupVersionKind"]["version"]]
    for path in paths - {("metadata", "name"), ("metadata", "namespace")}:
        schema = version["schema"]["openAPIV3Schema"]
        for part in path:
            assert part in schema.get("properties", {}), f"the CRD has no {'.'.join(path)}"
            schema = schema["properties"][part]
    phases = next(m for m in resource["metrics"] if m["name"] == "phase")["each"]["stateSet"]["list"]
    assert phases == version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["phase"]["enum"]


def _paths(each: dict) -> list[list[str]]:
    body = each[each["type"][0].lower() + each["type"][1:]]
    found = [body["path"]] if "path" in body else []
    return found + list(body.get("labelsFromPath", {}).values())
