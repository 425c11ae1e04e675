"""The PatchRollout spec: the one config model, parsed from the manifest's `spec` dict.

`parse_spec` applies the same defaults as the CRD (crds/patchrollout.yaml) and checks everything
the CRD checks, plus what a schema cannot say (steps strictly increasing, templates known), so the
operator is safe against an older CRD or an API server that skips CEL rules. Every error names the
field path, the way the API server does (`spec.steps[2].weight: ...`).
"""
from __future__ import annotations

import os

import copy
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from graft.rollout import queries
from graft.rollout.durations import DURATION_PATTERN, parse_duration
from graft.rollout.revision import patch_ref

PATCH_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
PATCH_VERSION_PATTERN = r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}$"
DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
METRIC_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
K8S_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
NO_DATA_POLICIES = ("hold", "fail", "pass")
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")

# The defaults, spelled as in a manifest; the CRD carries the very same values (a test compares them).
BUILTIN_METRICS: dict[str, dict[str, Any]] = {
    "error-rate": {"max": 0.005, "window": "60s", "consecutive": 3},
    "latency-p99": {"max": 0.8, "window": "30s"},
    "cpu": {"max": 0.92, "window": "120s"},
    "success-rate": {"min": 0.9995, "window": "60s"},
    "error-rate-delta": {"max": 0.001, "window": "60s"},
}
DEFAULT_METRICS: list[dict[str, Any]] = [{"name": n, **v} for n, v in BUILTIN_METRICS.items()]
DEFAULT_STEPS: list[dict[str, Any]] = [
    {"weight": 1, "pause": "5m"},
    {"weight": 5, "pause": "10m"},
    {"weight": 20, "pause": "10m"},
    {"weight": 50, "pause": "10m"},
    {"weight": 100},
]
# the fleet-wide default; the operator's deployment sets it (the Helm chart's `prometheus.address`)
DEFAULT_PROMETHEUS = os.environ.get("GRAFT_PROMETHEUS_ADDRESS") or "http://prometheus.monitoring:9090"
DEFAULTS: dict[str, Any] = {
    "trafficRouting": {"podRatio": {}},
    "steps": DEFAULT_STEPS,
    "analysis": {
        "prometheus": {"address": DEFAULT_PROMETHEUS},
        "interval": "30s",
        "metrics": DEFAULT_METRICS,
        "noData": "hold",
        "minRequests": 20,
    },
    "progressDeadline": "30m",
    "paused": False,
}
DEFAULT_WINDOW = "60s"


@dataclass(slots=True, frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(ValueError):
    """A PatchRollout spec that cannot run; `errors` name each bad field."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))

    @property
    def paths(self) -> list[str]:
        return [e.path for e in self.errors]


@dataclass(slots=True, frozen=True)
class LabelSelector:
    match_labels: dict[str, str] = field(default_factory=dict)
    match_expressions: tuple[tuple[str, str, tuple[str, ...]], ...] = ()

    def to_query(self) -> str:
        """The selector as the API server's `labelSelector` parameter."""
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        for key, op, values in self.match_expressions:
            parts.append({"In": f"{key} in ({','.join(values)})",
                          "NotIn": f"{key} notin ({','.join(values)})",
                          "Exists": key, "DoesNotExist": f"!{key}"}[op])
        return ",".join(parts)

    def matches(self, labels: Mapping[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for key, op, values in self.match_expressions:
            ok = {"In": lambda: labels.get(key) in values,
                  "NotIn": lambda: labels.get(key) not in values,
                  "Exists": lambda: key in labels,
                  "DoesNotExist": lambda: key not in labels}[op]()
            if not ok:
                return False
        return True


@dataclass(slots=True, frozen=True)
class PatchSource:
    builtin: bool
    config_map: str | None = None     # ConfigMap name, in the rollout's namespace
    key: str | None = None            # its data key holding the bundle's Python source
    digest: str | None = None         # sha256:<hex> pinned for the bundle


@dataclass(slots=True, frozen=True)
class PatchSpec:
    name: str
    version: str
    source: PatchSource
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return patch_ref(self.name, self.version)


@dataclass(slots=True, frozen=True)
class TrafficRouting:
    kind: str                          # podRatio | gatewayAPI
    http_route: str | None = None
    stable_service: str | None = None
    canary_service: str | None = None


@dataclass(slots=True, frozen=True)
class Step:
    weight: int
    pause: float = 0.0
    pause_text: str | None = None


@dataclass(slots=True, frozen=True)
class MetricCheck:
    name: str
    max: float | None
    min: float | None
    window: float
    window_text: str
    consecutive: int = 1
    query: str | None = None
    dry_run: bool = False

    @property
    def threshold(self) -> str:
        parts = []
        if self.min is not None:
            parts.append(f">= {self.min:g}")
        if self.max is not None:
            parts.append(f"<= {self.max:g}")
        return " and ".join(parts)

    @property
    def comparison(self) -> bool:
        """True when the check compares canary with stable (needs stable traffic)."""
        return queries.is_comparison(self.query or queries.BUILTIN_QUERIES.get(self.name, ""))

    def breached(self, value: float) -> bool:
        return (self.max is not None and value > self.max) or (self.min is not None and value < self.min)


@dataclass(slots=True, frozen=True)
class Analysis:
    prometheus: str
    interval: float
    metrics: tuple[MetricCheck, ...]
    no_data: str = "hold"
    min_requests: int = 20


@dataclass(slots=True, frozen=True)
class RolloutSpec:
    selector: LabelSelector
    patch: PatchSpec
    traffic_routing: TrafficRouting
    steps: tuple[Step, ...]
    analysis: Analysis
    progress_deadline: float
    paused: bool = False

    def step(self, index: int) -> Step:
        return self.steps[min(index, len(self.steps) - 1)]


def with_defaults(spec: Mapping[str, Any]) -> dict[str, Any]:
    """`spec` with the CRD's defaults filled in (what the API server stores)."""
    out = copy.deepcopy(dict(spec))
    for key, value in DEFAULTS.items():
        if key not in out:
            out[key] = copy.deepcopy(value)
        elif key == "analysis" and isinstance(out[key], dict):
            for k, v in value.items():
                out[key].setdefault(k, copy.deepcopy(v))
            if isinstance(out[key].get("prometheus"), dict):
                out[key]["prometheus"].setdefault("address", DEFAULT_PROMETHEUS)
    return out


def parse_spec(spec: Mapping[str, Any]) -> RolloutSpec:
    """Parse and validate a PatchRollout `spec`; raises SpecError naming every bad field."""
    r = _Reader()
    if not isinstance(spec, Mapping):
        raise SpecError([FieldError("spec", "must be an object")])
    spec = with_defaults(spec)
    r.known(spec, "spec", ("selector", "patch", "trafficRouting", "steps", "analysis",
                           "progressDeadline", "paused"))
    selector = _selector(r, spec.get("selector"), "spec.selector")
    patch = _patch(r, spec.get("patch"), "spec.patch")
    routing = _routing(r, spec.get("trafficRouting"), "spec.trafficRouting")
    steps = _steps(r, spec.get("steps"), "spec.steps")
    analysis = _analysis(r, spec.get("analysis"), "spec.analysis")
    deadline = r.duration(spec, "progressDeadline", "spec")
    paused = r.boolean(spec, "paused", "spec")
    if r.errors:
        raise SpecError(r.errors)
    return RolloutSpec(selector, patch, routing, steps, analysis, deadline, paused)


class _Reader:
    """Typed field access that records an error per bad field instead of stopping at the first."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def obj(self, value: Any, path: str, required: bool = True) -> dict | None:
        if value is None:
            if required:
                self.fail(path, "required")
            return None
        if not isinstance(value, dict):
            self.fail(path, "must be an object")
            return None
        return value

    def known(self, d: dict, path: str, allowed: tuple[str, ...]) -> None:
        for key in d:
            if key not in allowed:
                self.fail(f"{path}.{key}", f"unknown field (allowed: {', '.join(allowed)})")

    def string(self, d: dict, key: str, path: str, pattern: str | None = None,
               required: bool = True) -> str | None:
        value = d.get(key)
        where = f"{path}.{key}"
        if value is None:
            if required:
                self.fail(where, "required")
            return None
        if not isinstance(value, str) or not value:
            self.fail(where, "must be a non-empty string")
            return None
        if pattern and not re.fullmatch(pattern, value):
            self.fail(where, f"{value!r} does not match {pattern}")
            return None
        return value

    def number(self, d: dict, key: str, path: str) -> float | None:
        value = d.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            self.fail(f"{path}.{key}", "must be a finite number")
            return None
        return float(value)

    def integer(self, d: dict, key: str, path: str, lo: int, hi: int | None = None) -> int | None:
        value = d.get(key)
        where = f"{path}.{key}"
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(where, "must be an integer")
            return None
        if value < lo or (hi is not None and value > hi):
            self.fail(where, f"must be between {lo} and {hi}" if hi is not None else f"must be at least {lo}")
            return None
        return value

    def boolean(self, d: dict, key: str, path: str) -> bool:
        value = d.get(key, False)
        if not isinstance(value, bool):
            self.fail(f"{path}.{key}", "must be true or false")
            return False
        return value

    def duration(self, d: dict, key: str, path: str) -> float:
        text = self.string(d, key, path, pattern=DURATION_PATTERN)
        return parse_duration(text) if text else 0.0


def _selector(r: _Reader, value: Any, path: str) -> LabelSelector:
    d = r.obj(value, path)
    if d is None:
        return LabelSelector()
    r.known(d, path, ("matchLabels", "matchExpressions"))
    labels = d.get("matchLabels") or {}
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        r.fail(f"{path}.matchLabels", "must map label names to string values")
        labels = {}
    errors_before = len(r.errors)
    exprs = []
    for i, e in enumerate(d.get("matchExpressions") or []):
        where = f"{path}.matchExpressions[{i}]"
        if r.obj(e, where) is None:
            continue
        key = r.string(e, "key", where)
        op = r.string(e, "operator", where)
        values = e.get("values") or []
        if op is not None and op not in SELECTOR_OPERATORS:
            r.fail(f"{where}.operator", f"must be one of {', '.join(SELECTOR_OPERATORS)}")
        elif op in ("In", "NotIn") and not values:
            r.fail(f"{where}.values", f"required for operator {op}")
        elif op in ("Exists", "DoesNotExist") and values:
            r.fail(f"{where}.values", f"must be empty for operator {op}")
        if key and op in SELECTOR_OPERATORS:
            exprs.append((key, op, tuple(str(v) for v in values)))
    if not labels and not exprs and len(r.errors) == errors_before:
        r.fail(path, "must select something: an empty selector would match every pod in the namespace")
    return LabelSelector(dict(labels), tuple(exprs))


def _patch(r: _Reader, value: Any, path: str) -> PatchSpec:
    d = r.obj(value, path) or {}
    if d:
        r.known(d, path, ("name", "version", "source", "config"))
    name = r.string(d, "name", path, PATCH_NAME_PATTERN) if d else None
    version = r.string(d, "version", path, PATCH_VERSION_PATTERN) if d else None
    config = d.get("config") or {}
    if not isinstance(config, dict):
        r.fail(f"{path}.config", "must be an object")
        config = {}
    source = _source(r, d.get("source"), f"{path}.source") if d else PatchSource(builtin=True)
    return PatchSpec(name or "", version or "", source, config)


def _source(r: _Reader, value: Any, path: str) -> PatchSource:
    d = r.obj(value, path, required=False)
    if d is None:
        return PatchSource(builtin=True)
    r.known(d, path, ("builtin", "configMap", "digest"))
    kinds = [k for k in ("builtin", "configMap") if k in d]
    if len(kinds) != 1:
        r.fail(path, "exactly one of builtin or configMap is required")
        return PatchSource(builtin=True)
    if kinds == ["builtin"]:
        if r.obj(d["builtin"] if d["builtin"] is not None else {}, f"{path}.builtin") is None:
            return PatchSource(builtin=True)
        if "digest" in d:
            r.fail(f"{path}.digest", "only a configMap source is pinned by digest")
        return PatchSource(builtin=True)
    where = f"{path}.configMap"
    cm = r.obj(d["configMap"], where) or {}
    if cm:
        r.known(cm, where, ("name", "key"))
    name = r.string(cm, "name", where, K8S_NAME_PATTERN) if cm else None
    key = r.string(cm, "key", where) if cm else None
    digest = r.string(d, "digest", path, DIGEST_PATTERN)
    return PatchSource(builtin=False, config_map=name, key=key, digest=digest)


def _routing(r: _Reader, value: Any, path: str) -> TrafficRouting:
    d = r.obj(value, path)
    if d is None:
        return TrafficRouting("podRatio")
    r.known(d, path, ("podRatio", "gatewayAPI"))
    kinds = [k for k in ("podRatio", "gatewayAPI") if k in d]
    if len(kinds) != 1:
        r.fail(path, "exactly one of podRatio or gatewayAPI is required")
        return TrafficRouting("podRatio")
    if kinds == ["podRatio"]:
        return TrafficRouting("podRatio")
    where = f"{path}.gatewayAPI"
    g = r.obj(d["gatewayAPI"], where) or {}
    if g:
        r.known(g, where, ("httpRoute", "stableService", "canaryService"))
    names = [r.string(g, k, where, K8S_NAME_PATTERN) for k in ("httpRoute", "stableService", "canaryService")]
    if names[1] and names[1] == names[2]:
        r.fail(f"{where}.canaryService", "must differ from stableService")
    return TrafficRouting("gatewayAPI", *names)


def _steps(r: _Reader, value: Any, path: str) -> tuple[Step, ...]:
    if not isinstance(value, list) or not value:
        r.fail(path, "must be a non-empty list")
        return ()
    steps: list[Step] = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        d = r.obj(item, where)
        if d is None:
            continue
        r.known(d, where, ("weight", "pause"))
        if "weight" not in d:
            r.fail(f"{where}.weight", "required")
            continue
        weight = r.integer(d, "weight", where, 1, 100)
        pause_text = r.string(d, "pause", where, DURATION_PATTERN, required=False)
        if weight is None:
            continue
        if steps and weight <= steps[-1].weight:
            r.fail(f"{where}.weight", f"must be greater than the previous step's weight ({steps[-1].weight})")
        steps.append(Step(weight, parse_duration(pause_text) if pause_text else 0.0, pause_text))
    last = value[-1]
    if steps and isinstance(last, dict) and last.get("weight") != 100:
        r.fail(f"{path}[{len(value) - 1}].weight", "the last step must have weight 100")
    return tuple(steps)


def _analysis(r: _Reader, value: Any, path: str) -> Analysis:
    d = r.obj(value, path) or {}
    r.known(d, path, ("prometheus", "interval", "metrics", "noData", "minRequests"))
    prom = r.obj(d.get("prometheus"), f"{path}.prometheus") or {}
    r.known(prom, f"{path}.prometheus", ("address",))
    address = r.string(prom, "address", f"{path}.prometheus", r"^https?://.+") or ""
    interval = r.duration(d, "interval", path)
    if interval and interval < 0.1:
        r.fail(f"{path}.interval", "must be at least 100ms")
    no_data = d.get("noData", "hold")
    if no_data not in NO_DATA_POLICIES:
        r.fail(f"{path}.noData", f"must be one of {', '.join(NO_DATA_POLICIES)}")
    min_requests = r.integer(d, "minRequests", path, 0)
    metrics = d.get("metrics")
    checks: list[MetricCheck] = []
    if not isinstance(metrics, list) or not metrics:
        r.fail(f"{path}.metrics", "must be a non-empty list")
    else:
        seen: set[str] = set()
        for i, item in enumerate(metrics):
            check = _metric(r, item, f"{path}.metrics[{i}]")
            if check is None:
                continue
            if check.name in seen:
                r.fail(f"{path}.metrics[{i}].name", f"duplicate metric {check.name!r}")
            seen.add(check.name)
            checks.append(check)
    return Analysis(address, interval, tuple(checks), no_data if no_data in NO_DATA_POLICIES else "hold",
                    20 if min_requests is None else min_requests)


def _metric(r: _Reader, value: Any, path: str) -> MetricCheck | None:
    d = r.obj(value, path)
    if d is None:
        return None
    r.known(d, path, ("name", "max", "min", "window", "consecutive", "query", "dryRun"))
    name = r.string(d, "name", path, METRIC_NAME_PATTERN)
    if name is None:
        return None
    query = r.string(d, "query", path, required=False)
    builtin = BUILTIN_METRICS.get(name)
    if builtin is None and query is None:
        r.fail(f"{path}.query", f"required: {name!r} is not a built-in metric "
                                f"({', '.join(BUILTIN_METRICS)})")
        return None
    if query is not None:
        unknown = queries.unknown_vars(query)
        if unknown:
            r.fail(f"{path}.query", f"unknown template variable(s) {', '.join(unknown)} "
                                    f"(known: {', '.join(queries.TEMPLATE_VARS)})")
    given = {k: d[k] for k in ("max", "min", "window", "consecutive") if k in d}
    base = dict(builtin or {})
    if "max" in given or "min" in given:
        base.pop("max", None)
        base.pop("min", None)
    merged = {**base, **given}
    lo, hi = r.number(merged, "min", path), r.number(merged, "max", path)
    if lo is None and hi is None and not [e for e in r.errors if e.path.startswith(path)]:
        r.fail(path, "needs a threshold: max, min or both")
    if lo is not None and hi is not None and lo > hi:
        r.fail(f"{path}.min", f"must not exceed max ({hi:g})")
    window_text = merged.get("window", DEFAULT_WINDOW)
    window = r.duration({"window": window_text}, "window", path)
    if window_text and window == 0 and re.fullmatch(DURATION_PATTERN, str(window_text)):
        r.fail(f"{path}.window", "must be longer than zero")
    consecutive = r.integer(merged, "consecutive", path, 1)
    dry_run = r.boolean(d, "dryRun", path)
    return MetricCheck(name, hi, lo, window, str(window_text), consecutive or 1, query, dry_run)
