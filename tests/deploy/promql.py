"""The PromQL the project ships (dashboard, alerts, example checks): which metrics it names, and
whether Prometheus' own parser (promtool) accepts it."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.deploy.manifests import DEPLOY

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# a name not preceded by a digit (1e3, 5m) and not followed by "(" (a function)
_NAME = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on",
             "ignoring", "group_left", "group_right", "atan2"}
# Grafana's variables, as a Prometheus query would see them
_GRAFANA_VARS = [(re.compile(r"\$__(rate_)?interval\b"), "5m"), (re.compile(r"\$__range\b"), "1h"),
                 (re.compile(r"\$\{?\w+\}?"), ".*")]

KSM_CONFIG = DEPLOY / "prometheus" / "kube-state-metrics-patchrollout.yaml"
RULE_FILE = DEPLOY / "prometheus" / "prometheus-rule.yaml"
DASHBOARD = DEPLOY / "grafana" / "graft-dashboard.json"


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label names, functions, keywords left out)."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {m for m in _NAME.findall(text) if m.lower() not in _KEYWORDS}


def engine_metric_names() -> set[str]:
    """Every series name the engine exports, read from its own metrics registry."""
    from graft.engine.metrics import EngineMetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                "summary": ("_count", "_sum", ""), "gauge": ("",), "info": ("_info",)}
    names: set[str] = set()
    for family in EngineMetrics().registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def operator_metric_names() -> set[str]:
    """Every series name the operator exports about its rollouts, read from its own registry."""
    from graft.operator.metrics import OperatorMetrics

    suffixes = {"counter": ("_total",), "gauge": ("",)}
    return {family.name + s for family in OperatorMetrics().registry.collect()
            for s in suffixes.get(family.type, ("",))}


def kube_state_metric_names() -> set[str]:
    """The graft_patchrollout_* series kube-state-metrics makes with our config."""
    config = yaml.safe_load(KSM_CONFIG.read_text(encoding="utf-8"))
    return {f'{r["metricNamePrefix"]}_{m["name"]}'
            for r in config["spec"]["resources"] for m in r["metrics"]}


def rule_groups() -> list[dict]:
    return yaml.safe_load(RULE_FILE.read_text(encoding="utf-8"))["spec"]["groups"]


def recorded_names() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def known_metric_names() -> set[str]:
    return engine_metric_names() | operator_metric_names() | kube_state_metric_names() | recorded_names()


def dashboard_exprs() -> dict[str, str]:
    """'panel title [refId]' -> the Prometheus query, Grafana variables filled in."""
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = {}
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            exprs[f'{panel["title"]} [{target["refId"]}]'] = grafana_to_promql(target["expr"])
    for annotation in board.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            exprs[f'annotation {annotation["name"]}'] = grafana_to_promql(annotation["expr"])
    return exprs


def grafana_to_promql(expr: str) -> str:
    for pattern, value in _GRAFANA_VARS:
        expr = pattern.sub(value, expr)
    return expr


def promtool() -> str:
    """The promtool binary; a missing one fails the test (make test installs Debian's prometheus)."""
    tool = shutil.which("promtool")
    assert tool, "promtool is not installed: apt-get install prometheus (make test does)"
    return tool


def promtool_errors(exprs: dict[str, str], workdir: Path) -> str:
    """Run every expression through `promtool check rules` as a recording rule; '' when all parse."""
    rules = [{"record": f"check:expr_{i}", "expr": e} for i, e in enumerate(exprs.values())]
    path = workdir / "exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "shipped", "rules": rules}]}), encoding="utf-8")
    return check_rule_file(path)


def check_rule_file(path: Path) -> str:
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    return "" if done.returncode == 0 else done.stdout + done.stderr


def builtin_query_exprs() -> dict[str, str]:
    """The PromQL of every built-in check the operator can run (each one graft.rollout.spec
    knows), as graft.rollout.queries plans it for a rollout; quantiles both absolute and against
    stable, so every query of every kind is there."""
    from graft.rollout import queries, spec

    ctx = queries.Context(namespace="llm", canary="kv-align@3.2.1", stable="base",
                          patch_name="kv-align", patch_version="3.2.1")
    exprs = {}
    for name, builtin in spec.BUILTIN_METRICS.items():
        ratio = 1.5 if builtin["kind"] == "quantile" else None
        check = spec.Check(name=name, role="gate", metric=name, max=0.5, max_ratio=ratio)
        for series in queries.plan(check, ctx, 60.0):
            exprs[f"builtin {name} {series.key}"] = series.promql
    assert exprs, "no built-in checks found"
    return exprs


def balanced(expr: str) -> bool:
    """Brackets pair up and quotes close: the least any PromQL parser asks."""
    text = _STRINGS.sub('""', expr)
    if any(q in text.replace('""', "") for q in "\"'`"):
        return False
    stack: list[str] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack


def discovered_targets(pod: dict, namespace: str, name: str, ip: str, phase: str = "Running") -> list[dict]:
    """What kubernetes_sd (role: pod) makes of a pod: one target per container port."""
    def clean(key: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", key)
    meta = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": name,
            "__meta_kubernetes_pod_phase": phase, "__metrics_path__": "/metrics"}
    meta |= {f"__meta_kubernetes_pod_label_{clean(k)}": v for k, v in pod["metadata"].get("labels", {}).items()}
    meta |= {f"__meta_kubernetes_pod_annotation_{clean(k)}": v
             for k, v in pod["metadata"].get("annotations", {}).items()}
    ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
    return [meta | {"__address__": f"{ip}:{port}", "__meta_kubernetes_pod_container_port_number": str(port)}
            for port in ports]
