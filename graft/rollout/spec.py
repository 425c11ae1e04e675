"""The PatchRollout spec: the one config model, parsed from the manifest's `spec` dict.

`parse_spec` applies the same defaults as the CRD (crds/patchrollout.yaml) and checks everything
the CRD checks, plus what a schema cannot say (steps strictly increasing, templates known), so the
operator is safe against an older CRD or an API server that skips CEL rules. Every error names the
field path, the way the API server does (`spec.steps[2].weight: ...`).
"""
from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from graft.rollout import queries
from graft.rollout.durations import DURATION_PATTERN, parse_duration
from graft.api import patch_ref

PATCH_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
PATCH_VERSION_PATTERN = r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}$"
DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
METRIC_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
K8S_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
NO_DATA_POLICIES = ("hold", "fail", "pass")
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
# A selector names its fleet by an equality or an `In` term: `NotIn`, `Exists` and `DoesNotExist`
# alone reach pods nobody meant (a database of the namespace), and the operator relabels and calls
# what it selects. The CRDs' CEL rule says the same.
SELECTOR_MUST_NAME = ("must name the fleet: a matchLabels entry or an In expression "
                      "(NotIn, Exists and DoesNotExist alone reach pods outside it)")
# label keys and values as the API server validates them (an optional DNS-subdomain prefix, a name)
LABEL_NAME_PATTERN = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY_PATTERN = rf"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{LABEL_NAME_PATTERN}"
LABEL_VALUE_PATTERN = rf"({LABEL_NAME_PATTERN})?"
MAX_STEPS = 20
MAX_CHECKS = 20
MAX_QUERY = 8192
MAX_SELECTOR_TERMS = 16
BREAKER, GATE = "breaker", "gate"
APPLY, REVERT = "apply", "revert"
STEP_WINDOW = "step"          # the traffic since the step was in place
ROLLOUT_WINDOW = "rollout"    # the traffic since the rollout started
CUMULATIVE_WINDOWS = (STEP_WINDOW, ROLLOUT_WINDOW)

# The built-in checks: what each measures and its defaults, spelled as in a manifest.
#   rate:        canary errors / requests (output-divergence: divergent / compared requests) against an
#                absolute limit, judged on counts with bounds
#   difference:  canary error rate minus stable error rate, judged on counts with bounds
#   quantile:    a latency quantile from a histogram, absolute (max) or relative to stable (maxRatio)
#   utilisation: CPU seconds per second over the engine's CPU quota
BUILTIN_METRICS: dict[str, dict[str, Any]] = {
    "error-rate": {"kind": "rate", "window": "60s"},
    "success-rate": {"kind": "rate", "window": "60s"},
    "error-rate-delta": {"kind": "difference", "window": STEP_WINDOW},
    "latency-p99": {"kind": "quantile", "window": "60s"},
    "ttft-p99": {"kind": "quantile", "window": "60s"},
    "tpot-p99": {"kind": "quantile", "window": "60s"},
    "cpu": {"kind": "utilisation", "window": "120s"},
    # the canary engines' own shadow comparisons (each compares a share of its finished requests with
    # the table it ran before the patch): judged on the canary alone, over the rollout so far (every
    # step runs the same patch, and a canary compares a few requests a minute: a window that began
    # again at every step would throw its evidence away)
    "output-divergence": {"kind": "rate", "window": ROLLOUT_WINDOW},
}
# The default analysis for a rollout that names no checks and no template. Absolute latency depends
# on hardware, model and prompts, so latency is judged against stable; errors both ways.
DEFAULT_BREAKERS: list[dict[str, Any]] = [
    {"name": "error-rate", "max": 0.005, "window": "60s", "consecutive": 3},
    {"name": "ttft-p99", "maxRatio": 1.5, "window": "30s", "consecutive": 3},
    {"name": "tpot-p99", "maxRatio": 1.3, "window": "30s", "consecutive": 3},
    {"name": "cpu", "max": 0.92, "window": "120s", "consecutive": 3},
    # window: step. One breach rolls back: the window is cumulative, so consecutive breaches would
    # count the same evidence again; rollbackConfidence 0.999 already guards against the repeated
    # looks. 3 divergent of 3 compared requests (lower bound 10%) roll back, 1 or 2 of 2 do not.
    {"name": "output-divergence", "max": 0.05, "consecutive": 1},
]
DEFAULT_GATES: list[dict[str, Any]] = [
    {"name": "error-rate-delta", "max": 0.001},
    {"name": "tpot-p99", "maxRatio": 1.2, "window": "60s"},
]
DEFAULT_STEPS: list[dict[str, Any]] = [
    {"weight": 1, "pause": "5m"},
    {"weight": 5, "pause": "10m"},
    {"weight": 20, "pause": "10m"},
    {"weight": 50, "pause": "10m"},
    {"weight": 100},
]
DEFAULT_CONFIDENCE = 0.95
DEFAULT_ROLLBACK_CONFIDENCE = 0.999
DEFAULT_INCONCLUSIVE_LIMIT = 20
DEFAULT_ERROR_LIMIT = 4
DEFAULT_OUTAGE_LIMIT = "10m"
DEFAULT_MEASUREMENT_RETENTION = 10   # analysis runs kept in status.analysisHistory
MAX_MEASUREMENT_RETENTION = 100
DEFAULT_REVISION_HISTORY_LIMIT = 10   # finished PatchRollouts a PatchFleet keeps (its CRD default)
# What the CRD defaults (the API server stores these); the checks themselves default in parse_spec,
# because a rollout that names a template must not also get the default list.
DEFAULTS: dict[str, Any] = {
    "trafficRouting": {"podRatio": {}},
    "steps": DEFAULT_STEPS,
    "analysis": {
        "interval": "30s",
        "noData": "hold",
        "confidence": DEFAULT_CONFIDENCE,
        "rollbackConfidence": DEFAULT_ROLLBACK_CONFIDENCE,
        "inconclusiveLimit": DEFAULT_INCONCLUSIVE_LIMIT,
        "errorLimit": DEFAULT_ERROR_LIMIT,
        "outageLimit": DEFAULT_OUTAGE_LIMIT,
        "measurementRetention": DEFAULT_MEASUREMENT_RETENTION,
    },
    "progressDeadline": "30m",
    "paused": False,
    "action": "apply",
}


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
        """The selector as the API server's `labelSelector` parameter; one spelling per meaning
        (labels, expressions and their values sorted), so it also tells two selectors apart."""
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        for key, op, values in sorted({(k, o, tuple(sorted(set(v)))) for k, o, v in self.match_expressions}):
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
    # a manual gate: once the step's analysis passes it holds until a person approves (the annotation
    # graft.dev/promote, `graft rollout promote`); spelt `untilApproved: true` or, as Argo Rollouts
    # does, `pause: {}`
    until_approved: bool = False


@dataclass(slots=True, frozen=True)
class Check:
    """One check of the analysis: a breaker (rolls back) or a gate (must hold to promote a step)."""

    name: str
    role: str                          # breaker | gate
    metric: str                        # a key of BUILTIN_METRICS, or "custom"
    max: float | None = None
    min: float | None = None
    max_ratio: float | None = None     # quantiles: canary <= max_ratio x stable
    window: float | None = 60.0        # seconds; None: since the step was in place
    window_text: str = "60s"
    consecutive: int = 1               # breakers: breaches in a row that roll back
    query: str | None = None           # custom checks: PromQL giving one number
    dry_run: bool = False
    min_samples: int | None = None     # the traffic floor; None: derived from the threshold

    @property
    def kind(self) -> str:
        return "custom" if self.metric == "custom" else BUILTIN_METRICS[self.metric]["kind"]

    @property
    def threshold(self) -> str:
        parts = []
        if self.max_ratio is not None:
            parts.append(f"<= {self.max_ratio:g} x stable")
        if self.min is not None:
            parts.append(f">= {self.min:g}")
        if self.max is not None:
            parts.append(f"<= {self.max:g}")
        return " and ".join(parts)

    @property
    def comparison(self) -> bool:
        """True when the check compares canary with stable (meaningless once no stable pod is left)."""
        if self.metric == "custom":
            return queries.is_comparison(self.query or "")
        return self.kind == "difference" or self.max_ratio is not None

    @property
    def key(self) -> str:
        """Unique across the analysis: a breaker and a gate may share a name."""
        return f"{self.role}/{self.name}"

    def breached(self, value: float) -> bool:
        limit_max = self.max_ratio if self.max_ratio is not None else self.max
        return (limit_max is not None and value > limit_max) or (self.min is not None and value < self.min)


@dataclass(slots=True, frozen=True)
class PrometheusSource:
    """Where the analysis asks: an address ('' means the operator's default) and how to log in."""

    address: str = ""
    bearer_token_secret: tuple[str, str] | None = None    # (Secret name, key) in the rollout's namespace
    ca_secret: tuple[str, str] | None = None              # a PEM CA bundle to verify TLS with
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True, frozen=True)
class Analysis:
    prometheus: PrometheusSource
    interval: float
    breakers: tuple[Check, ...]
    gates: tuple[Check, ...]
    no_data: str = "hold"
    confidence: float = DEFAULT_CONFIDENCE
    rollback_confidence: float = DEFAULT_ROLLBACK_CONFIDENCE
    inconclusive_limit: int = DEFAULT_INCONCLUSIVE_LIMIT
    error_limit: int = DEFAULT_ERROR_LIMIT
    outage_limit: float = parse_duration(DEFAULT_OUTAGE_LIMIT)   # seconds; 0: hold for ever
    templates: tuple[tuple[str, bool], ...] = ()          # (name, cluster-scoped) as referenced
    measurement_retention: int = DEFAULT_MEASUREMENT_RETENTION   # runs kept in status.analysisHistory

    @property
    def checks(self) -> tuple[Check, ...]:
        return self.breakers + self.gates


@dataclass(slots=True, frozen=True)
class RolloutSpec:
    selector: LabelSelector
    patch: PatchSpec
    traffic_routing: TrafficRouting
    steps: tuple[Step, ...]
    analysis: Analysis
    progress_deadline: float
    paused: bool = False
    action: str = APPLY                # apply the patch, or revert it, step by step
    ttl_seconds_after_finished: int | None = None   # deleted this long after it finished (None: kept)

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
    return out


Templates = Mapping[tuple[str, bool], Mapping[str, Any]]


def template_refs(spec: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """The analysis templates a spec names, as (name, cluster-scoped); [] when none or malformed."""
    analysis = spec.get("analysis") if isinstance(spec, Mapping) else None
    refs = analysis.get("templates") if isinstance(analysis, Mapping) else None
    if not isinstance(refs, list):
        return []
    return [(t["name"], bool(t.get("clusterScope", False))) for t in refs
            if isinstance(t, Mapping) and isinstance(t.get("name"), str)]


def parse_spec(spec: Mapping[str, Any], templates: Templates | None = None) -> RolloutSpec:
    """Parse and validate a PatchRollout `spec`; raises SpecError naming every bad field.

    `templates` maps each (name, cluster-scoped) the spec references to that template's `spec`; the
    operator reads them from the API server. A template's checks come first, the rollout's own
    checks replace those of the same name and role.
    """
    r = _Reader()
    if not isinstance(spec, Mapping):
        raise SpecError([FieldError("spec", "must be an object")])
    spec = with_defaults(spec)
    r.known(spec, "spec", ("selector", "patch", "trafficRouting", "steps", "analysis",
                           "progressDeadline", "paused", "action", "ttlSecondsAfterFinished"))
    action = spec.get("action", APPLY)
    if action not in (APPLY, REVERT):
        r.fail("spec.action", f"must be {APPLY} or {REVERT}")
    selector = _selector(r, spec.get("selector"), "spec.selector")
    patch = _patch(r, spec.get("patch"), "spec.patch")
    routing = _routing(r, spec.get("trafficRouting"), "spec.trafficRouting")
    steps = _steps(r, spec.get("steps"), "spec.steps")
    analysis = _analysis(r, spec.get("analysis"), "spec.analysis", templates or {})
    deadline = r.duration(spec, "progressDeadline", "spec")
    if "progressDeadline" in spec and deadline <= 0 and not r.errors_at("spec.progressDeadline"):
        r.fail("spec.progressDeadline", "must be longer than zero")
    paused = r.boolean(spec, "paused", "spec")
    ttl = r.integer(spec, "ttlSecondsAfterFinished", "spec", 0)
    if r.errors:
        raise SpecError(r.errors)
    return RolloutSpec(selector, patch, routing, steps, analysis, deadline, paused, action, ttl)


def parse_ttl(spec: Mapping[str, Any]) -> int | None:
    """`spec.ttlSecondsAfterFinished` alone (None when unset); raises SpecError naming the field.

    What deletes a finished rollout reads this field only: the rest of its spec may no longer parse
    (an analysis template deleted since), and that must not keep it forever.
    """
    r = _Reader()
    ttl = r.integer(dict(spec), "ttlSecondsAfterFinished", "spec", 0) if isinstance(spec, Mapping) else None
    if r.errors:
        raise SpecError(r.errors)
    return ttl


class _Reader:
    """Typed field access that records an error per bad field instead of stopping at the first."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def errors_at(self, path: str) -> bool:
        return any(e.path == path or e.path.startswith(path + ".") or e.path.startswith(path + "[")
                   for e in self.errors)

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

    def number(self, d: dict, key: str, path: str, lo: float | None = None,
               hi: float | None = None, open_lo: bool = False) -> float | None:
        value = d.get(key)
        if value is None:
            return None
        where = f"{path}.{key}"
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            self.fail(where, "must be a finite number")
            return None
        if lo is not None and (value < lo or (open_lo and value == lo)):
            self.fail(where, f"must be {'greater than' if open_lo else 'at least'} {lo:g}")
            return None
        if hi is not None and value > hi:
            self.fail(where, f"must be at most {hi:g}")
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


def _label_key(r: _Reader, key: Any, where: str) -> bool:
    if not isinstance(key, str) or len(key) > 317 or not re.fullmatch(LABEL_KEY_PATTERN, key) \
            or len(key.rpartition("/")[2]) > 63 or len(key.rpartition("/")[0]) > 253:
        r.fail(where, f"{key!r} is not a valid label key (an optional DNS-subdomain prefix and '/', "
                      "then at most 63 letters, digits, '-', '_' or '.', starting and ending alphanumeric)")
        return False
    return True


def _label_value(r: _Reader, value: Any, where: str) -> bool:
    if not isinstance(value, str) or len(value) > 63 or not re.fullmatch(LABEL_VALUE_PATTERN, value):
        r.fail(where, f"{value!r} is not a valid label value (at most 63 letters, digits, '-', '_' or '.', "
                      "starting and ending alphanumeric)")
        return False
    return True


def _selector(r: _Reader, value: Any, path: str) -> LabelSelector:
    d = r.obj(value, path)
    if d is None:
        return LabelSelector()
    r.known(d, path, ("matchLabels", "matchExpressions"))
    errors_before = len(r.errors)
    labels = d.get("matchLabels") or {}
    if not isinstance(labels, dict):
        r.fail(f"{path}.matchLabels", "must map label names to string values")
        labels = {}
    labels = {k: v for k, v in labels.items()
              if _label_key(r, k, f"{path}.matchLabels") and _label_value(r, v, f"{path}.matchLabels.{k}")}
    raw = d.get("matchExpressions") or []
    if not isinstance(raw, list):
        r.fail(f"{path}.matchExpressions", "must be a list")
        raw = []
    elif len(raw) > MAX_SELECTOR_TERMS:
        r.fail(f"{path}.matchExpressions", f"must have at most {MAX_SELECTOR_TERMS} items")
    exprs = []
    for i, e in enumerate(raw[:MAX_SELECTOR_TERMS]):
        where = f"{path}.matchExpressions[{i}]"
        if r.obj(e, where) is None:
            continue
        r.known(e, where, ("key", "operator", "values"))
        key = r.string(e, "key", where)
        op = r.string(e, "operator", where)
        values = e.get("values") or []
        if key is not None and not _label_key(r, key, f"{where}.key"):
            key = None
        if not isinstance(values, list):
            r.fail(f"{where}.values", "must be a list")
            values = []
        values = [v for j, v in enumerate(values) if _label_value(r, v, f"{where}.values[{j}]")]
        if op is not None and op not in SELECTOR_OPERATORS:
            r.fail(f"{where}.operator", f"must be one of {', '.join(SELECTOR_OPERATORS)}")
        elif op in ("In", "NotIn") and not values:
            r.fail(f"{where}.values", f"required for operator {op}")
        elif op in ("Exists", "DoesNotExist") and values:
            r.fail(f"{where}.values", f"must be empty for operator {op}")
        if key and op in SELECTOR_OPERATORS:
            exprs.append((key, op, tuple(values)))
    if len(r.errors) == errors_before and not labels and not any(op == "In" for _, op, _ in exprs):
        r.fail(path, SELECTOR_MUST_NAME)
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
    if len(value) > MAX_STEPS:
        r.fail(path, f"must have at most {MAX_STEPS} items")
        return ()
    steps: list[Step] = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        d = r.obj(item, where)
        if d is None:
            continue
        r.known(d, where, ("weight", "pause", "untilApproved"))
        if "weight" not in d:
            r.fail(f"{where}.weight", "required")
            continue
        weight = r.integer(d, "weight", where, 1, 100)
        pause_text, until_approved = _pause(r, d, where)
        if weight is None:
            continue
        if steps and weight <= steps[-1].weight:
            r.fail(f"{where}.weight", f"must be greater than the previous step's weight ({steps[-1].weight})")
        steps.append(Step(weight, parse_duration(pause_text) if pause_text else 0.0, pause_text, until_approved))
    last = value[-1]
    if steps and isinstance(last, dict) and last.get("weight") != 100:
        r.fail(f"{path}[{len(value) - 1}].weight", "the last step must have weight 100")
    return tuple(steps)


def _pause(r: _Reader, d: dict, where: str) -> tuple[str | None, bool]:
    """A step's pause: (the duration as written, or None; whether it waits for approval).

    `pause` is a duration ("10m") or `{}` (Argo Rollouts' spelling of a pause until promoted);
    `untilApproved: true` is the canonical spelling of the latter. A step waits for its duration or
    for a person, never both: the two are refused together, and so is `pause: {}` with
    `untilApproved: false`."""
    until = d.get("untilApproved")
    if until is not None and not isinstance(until, bool):
        r.fail(f"{where}.untilApproved", "must be true or false")
        until = None
    pause = d.get("pause")
    if pause is None or isinstance(pause, str):
        text = r.string(d, "pause", where, DURATION_PATTERN, required=False)
        if text is not None and until:
            r.fail(where, f"a step waits for a duration (pause: {text}) or for approval (untilApproved: true), "
                          "not both; drop one")
        return text, bool(until)
    if isinstance(pause, dict):
        if pause:
            hint = (f"; a duration is written pause: {pause['duration']}"
                    if set(pause) == {"duration"} and isinstance(pause["duration"], str) else "")
            r.fail(f"{where}.pause", f"must be a duration (\"10m\") or {{}} (wait for approval); "
                                     f"{{}} takes no fields, not {', '.join(map(str, pause))}{hint}")
            return None, bool(until)
        if until is False:
            r.fail(where, "pause: {} waits for approval, untilApproved: false says not to; drop one")
            return None, False
        return None, True
    r.fail(f"{where}.pause", f"must be a duration (\"10m\") or {{}} (wait for approval), not {pause!r:.40}")
    return None, bool(until)


def _analysis(r: _Reader, value: Any, path: str, templates: Templates) -> Analysis:
    d = r.obj(value, path) or {}
    r.known(d, path, ("prometheus", "interval", "breakers", "gates", "templates", "args", "noData",
                      "confidence", "rollbackConfidence", "inconclusiveLimit", "errorLimit",
                      "outageLimit", "measurementRetention"))
    source = _prometheus(r, d.get("prometheus"), f"{path}.prometheus")
    interval = r.duration(d, "interval", path)
    if not r.errors_at(f"{path}.interval") and interval < 1:
        r.fail(f"{path}.interval", "must be at least 1s (Prometheus needs two scrapes in a window)")
    no_data = d.get("noData", "hold")
    if no_data not in NO_DATA_POLICIES:
        r.fail(f"{path}.noData", f"must be one of {', '.join(NO_DATA_POLICIES)}")
    confidence = r.number(d, "confidence", path, 0.5, 0.9999)
    rollback_confidence = r.number(d, "rollbackConfidence", path, 0.5, 0.9999)
    inconclusive_limit = r.integer(d, "inconclusiveLimit", path, 0, 1000)
    error_limit = r.integer(d, "errorLimit", path, 0, 1000)
    outage_limit = r.duration(d, "outageLimit", path) if "outageLimit" in d else parse_duration(DEFAULT_OUTAGE_LIMIT)
    retention = r.integer(d, "measurementRetention", path, 0, MAX_MEASUREMENT_RETENTION)
    refs = _template_refs(r, d.get("templates"), f"{path}.templates")
    args = _args(r, d.get("args"), f"{path}.args")

    lists: dict[str, list[tuple[dict, str]]] = {"breakers": [], "gates": []}
    trusted: set[str] = set()      # a ClusterPatchAnalysisTemplate's checks: the cluster administrator's queries
    for name, cluster in refs:
        template = templates.get((name, cluster))
        if template is None:
            r.fail(f"{path}.templates", f"{'cluster' if cluster else 'namespaced'} analysis template "
                                        f"{name!r} was not found")
            continue
        where = f"{'ClusterPatchAnalysisTemplate' if cluster else 'PatchAnalysisTemplate'} {name}"
        targs = {**_args(r, template.get("args"), f"{where}: spec.args", need_values=False), **args}
        for key in ("breakers", "gates"):
            items = template.get(key) or []
            if not isinstance(items, list):
                r.fail(f"{where}: spec.{key}", "must be a list")
                continue
            for i, item in enumerate(items):
                lists[key].append((_with_args(r, item, targs, f"{where}: spec.{key}[{i}]"),
                                   f"{where}: spec.{key}[{i}]"))
                if cluster:
                    trusted.add(f"{where}: spec.{key}[{i}]")
    own_given = any(k in d for k in ("breakers", "gates"))
    for key in ("breakers", "gates"):
        items = d.get(key)
        if items is None:
            if not refs and not own_given:
                items = DEFAULT_BREAKERS if key == "breakers" else DEFAULT_GATES
            else:
                items = []
        if not isinstance(items, list):
            r.fail(f"{path}.{key}", "must be a list")
            continue
        if len(items) > MAX_CHECKS:
            r.fail(f"{path}.{key}", f"must have at most {MAX_CHECKS} items")
        names = [i.get("name") for i in items if isinstance(i, dict)]
        lists[key] = [(t, w) for t, w in lists[key] if t.get("name") not in names]
        lists[key] += [(_with_args(r, item, args, f"{path}.{key}[{i}]"), f"{path}.{key}[{i}]")
                       for i, item in enumerate(items)]
    parsed: dict[str, list[Check]] = {"breakers": [], "gates": []}
    for key, role in (("breakers", BREAKER), ("gates", GATE)):
        seen: set[str] = set()
        for item, where in lists[key]:
            check = _check(r, item, where, role)
            if check is None:
                continue
            if check.query is not None and where not in trusted and not r.errors_at(f"{where}.query"):
                _scoped(r, check.query, f"{where}.query")
            if check.name in seen:
                r.fail(f"{where}.name", f"duplicate {role} {check.name!r}")
            seen.add(check.name)
            parsed[key].append(check)
    if not parsed["breakers"] and not parsed["gates"] and not r.errors_at(path):
        r.fail(path, "needs at least one breaker or gate")
    return Analysis(source, interval, tuple(parsed["breakers"]), tuple(parsed["gates"]),
                    no_data if no_data in NO_DATA_POLICIES else "hold",
                    DEFAULT_CONFIDENCE if confidence is None else confidence,
                    DEFAULT_ROLLBACK_CONFIDENCE if rollback_confidence is None else rollback_confidence,
                    DEFAULT_INCONCLUSIVE_LIMIT if inconclusive_limit is None else inconclusive_limit,
                    DEFAULT_ERROR_LIMIT if error_limit is None else error_limit, outage_limit, tuple(refs),
                    DEFAULT_MEASUREMENT_RETENTION if retention is None else retention)


def _prometheus(r: _Reader, value: Any, path: str) -> PrometheusSource:
    d = r.obj(value, path, required=False) or {}
    r.known(d, path, ("address", "bearerTokenSecret", "caSecret", "headers"))
    address = r.string(d, "address", path, r"https?://[^\s]+", required=False) or ""
    secrets = []
    for key in ("bearerTokenSecret", "caSecret"):
        ref = r.obj(d.get(key), f"{path}.{key}", required=False)
        if ref is None:
            secrets.append(None)
            continue
        r.known(ref, f"{path}.{key}", ("name", "key"))
        name = r.string(ref, "name", f"{path}.{key}", K8S_NAME_PATTERN)
        item = r.string(ref, "key", f"{path}.{key}", r"[-._a-zA-Z0-9]{1,253}")
        secrets.append((name, item) if name and item else None)
    headers = []
    raw = d.get("headers") or []
    if not isinstance(raw, list):
        r.fail(f"{path}.headers", "must be a list")
        raw = []
    for i, h in enumerate(raw[:16]):
        where = f"{path}.headers[{i}]"
        h = r.obj(h, where) or {}
        r.known(h, where, ("name", "value"))
        name = r.string(h, "name", where, r"[A-Za-z0-9-]{1,64}")
        text = r.string(h, "value", where, r"[^\r\n]{1,4096}")
        if name and text:
            headers.append((name, text))
    return PrometheusSource(address, secrets[0], secrets[1], tuple(headers))


def _template_refs(r: _Reader, value: Any, path: str) -> list[tuple[str, bool]]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > 8:
        r.fail(path, "must be a list of at most 8 template references")
        return []
    refs = []
    for i, item in enumerate(value):
        d = r.obj(item, f"{path}[{i}]") or {}
        r.known(d, f"{path}[{i}]", ("name", "clusterScope"))
        name = r.string(d, "name", f"{path}[{i}]", K8S_NAME_PATTERN)
        cluster = r.boolean(d, "clusterScope", f"{path}[{i}]")
        if name:
            refs.append((name, cluster))
    return refs


def _args(r: _Reader, value: Any, path: str, need_values: bool = True) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, list) or len(value) > 32:
        r.fail(path, "must be a list of at most 32 arguments")
        return {}
    out = {}
    for i, item in enumerate(value):
        d = r.obj(item, f"{path}[{i}]") or {}
        r.known(d, f"{path}[{i}]", ("name", "value"))
        name = r.string(d, "name", f"{path}[{i}]", r"[A-Za-z][A-Za-z0-9_]{0,62}")
        text = r.string(d, "value", f"{path}[{i}]", required=need_values)
        problem = queries.arg_problem(text) if text is not None else None
        if problem is not None:
            r.fail(f"{path}[{i}].value", problem)
            text = None
        if name and text is not None:
            out[name] = text
    return out


def _with_args(r: _Reader, item: Any, args: dict[str, str], where: str) -> Any:
    """A check with `{{args.NAME}}` in its query filled from the arguments."""
    if not isinstance(item, dict) or not isinstance(item.get("query"), str):
        return item
    try:
        return {**item, "query": queries.fill_args(item["query"], args)}
    except (KeyError, ValueError) as e:
        r.fail(f"{where}.query", str(e.args[0]))
        return item


def _scoped(r: _Reader, query: str, path: str) -> None:
    """A query written in the rollout's namespace reads that namespace only: every vector selector
    carries namespace="{{namespace}}" (Prometheus would answer it about every namespace)."""
    try:
        unscoped = queries.unscoped_selectors(query)
    except queries.QueryError as e:
        r.fail(path, f"{e}; a custom query must be PromQL whose every vector selector carries "
                     'namespace="{{namespace}}"')
        return
    if unscoped:
        r.fail(path, f"every vector selector must carry namespace=\"{{{{namespace}}}}\" (the rollout's own "
                     f"namespace); missing in: {', '.join(unscoped[:5])}"
                     + ("" if len(unscoped) <= 5 else f" and {len(unscoped) - 5} more")
                     + ". Only a ClusterPatchAnalysisTemplate's queries may read other namespaces")


def _check(r: _Reader, value: Any, path: str, role: str) -> Check | None:
    d = r.obj(value, path)
    if d is None:
        return None
    r.known(d, path, ("name", "metric", "max", "min", "maxRatio", "window", "consecutive", "query",
                      "dryRun", "minSamples"))
    name = r.string(d, "name", path, METRIC_NAME_PATTERN)
    if name is None:
        return None
    query = r.string(d, "query", path, required=False)
    if query is not None and len(query) > MAX_QUERY:
        r.fail(f"{path}.query", f"must be at most {MAX_QUERY} characters")
    metric = r.string(d, "metric", path, required=False)
    if metric is None:
        metric = "custom" if query is not None or name not in BUILTIN_METRICS else name
    if metric != "custom" and metric not in BUILTIN_METRICS:
        r.fail(f"{path}.metric", f"{metric!r} is not a built-in metric ({', '.join(BUILTIN_METRICS)})")
        return None
    if metric == "custom" and query is None:
        r.fail(f"{path}.query", f"required: {name!r} is not a built-in metric ({', '.join(BUILTIN_METRICS)})")
        return None
    if metric != "custom" and query is not None:
        r.fail(f"{path}.query", f"a built-in metric ({metric}) takes no query; give the check another name")
    if query is not None:
        unknown = queries.unknown_vars(query)
        if unknown:
            r.fail(f"{path}.query", f"unknown template variable(s) {', '.join(unknown)} "
                                    f"(known: {', '.join(queries.TEMPLATE_VARS)})")
    kind = "custom" if metric == "custom" else BUILTIN_METRICS[metric]["kind"]
    hi = r.number(d, "max", path, 0 if kind != "custom" else None)
    lo = r.number(d, "min", path, 0 if kind != "custom" else None)
    ratio = r.number(d, "maxRatio", path, 0, open_lo=True)
    if kind in ("rate", "difference") and (hi is not None and hi > 1 or lo is not None and lo > 1):
        r.fail(path, f"{metric} is a fraction: its limits lie between 0 and 1")
    if ratio is not None and kind != "quantile":
        r.fail(f"{path}.maxRatio", "only latency quantiles (latency-p99, ttft-p99, tpot-p99) compare with "
                                   "stable by ratio")
    if kind == "difference" and (lo is not None or hi is None):
        r.fail(f"{path}.max", f"required: {metric} allows the canary at most this much more error than stable")
    if metric == "error-rate" and lo is not None:
        r.fail(f"{path}.min", "error-rate takes max; success-rate takes min")
    if metric == "success-rate" and hi is not None:
        r.fail(f"{path}.max", "success-rate takes min; error-rate takes max")
    if metric == "output-divergence" and lo is not None:
        r.fail(f"{path}.min", "output-divergence takes max: the share of compared requests that may diverge")
    if hi is None and lo is None and ratio is None and not r.errors_at(path):
        r.fail(path, "needs a threshold: max, min" + (" or maxRatio" if kind == "quantile" else ""))
    if lo is not None and hi is not None and lo > hi:
        r.fail(f"{path}.min", f"must not exceed max ({hi:g})")
    window_text = d.get("window", BUILTIN_METRICS.get(metric, {}).get("window", "60s"))
    window: float | None = None
    if window_text in CUMULATIVE_WINDOWS and kind in ("rate", "difference"):
        window = None
    else:
        window = r.duration({"window": window_text}, "window", path)
        if not r.errors_at(f"{path}.window") and window < 1:
            r.fail(f"{path}.window", "must be at least 1s (a rate needs two scrapes in its window)"
                   + ("; or 'step' (the traffic since the step was in place) or 'rollout' (since the "
                      "rollout started)" if kind in ("rate", "difference") else ""))
    consecutive = r.integer(d, "consecutive", path, 1, 100)
    if role == GATE and consecutive is not None:
        r.fail(f"{path}.consecutive", "gates take no consecutive: a failing gate holds the step until it passes")
    min_samples = r.integer(d, "minSamples", path, 1, 10_000_000)
    dry_run = r.boolean(d, "dryRun", path)
    return Check(name, role, metric, hi, lo, ratio, window, str(window_text), consecutive or 1, query,
                 dry_run, min_samples)


@dataclass(slots=True, frozen=True)
class FleetSpec:
    """A PatchFleet's `spec`: the pods it covers and the patches they all run (its stable revision)."""

    selector: LabelSelector
    patches: tuple[PatchSpec, ...]
    revision_history_limit: int = DEFAULT_REVISION_HISTORY_LIMIT   # finished rollouts kept


def parse_fleet_spec(spec: Mapping[str, Any]) -> FleetSpec:
    """Parse and validate a PatchFleet `spec`; raises SpecError naming every bad field."""
    r = _Reader()
    if not isinstance(spec, Mapping):
        raise SpecError([FieldError("spec", "must be an object")])
    r.known(dict(spec), "spec", ("selector", "patches", "revisionHistoryLimit"))
    selector = _selector(r, spec.get("selector"), "spec.selector")
    raw = spec.get("patches") or []
    if not isinstance(raw, list) or len(raw) > 32:
        r.fail("spec.patches", "must be a list of at most 32 patches")
        raw = []
    patches, names = [], set()
    for i, item in enumerate(raw):
        p = _patch(r, item, f"spec.patches[{i}]")
        if p.name in names:
            r.fail(f"spec.patches[{i}].name", f"duplicate patch {p.name!r}: a fleet runs one version of each")
        names.add(p.name)
        patches.append(p)
    limit = r.integer(dict(spec), "revisionHistoryLimit", "spec", 0)
    if r.errors:
        raise SpecError(r.errors)
    return FleetSpec(selector, tuple(sorted(patches, key=lambda p: p.name)),
                     DEFAULT_REVISION_HISTORY_LIMIT if limit is None else limit)


def patch_to_dict(patch: PatchSpec) -> dict[str, Any]:
    """A PatchSpec as a manifest spells it (what a PatchFleet records on promotion)."""
    src = patch.source
    source: dict[str, Any] = ({"builtin": {}} if src.builtin else
                              {"configMap": {"name": src.config_map, "key": src.key}, "digest": src.digest})
    out: dict[str, Any] = {"name": patch.name, "version": patch.version, "source": source}
    if patch.config:
        out["config"] = copy.deepcopy(patch.config)
    return out


def parse_selector(value: Any, path: str = "spec.selector") -> LabelSelector:
    """A label selector alone (a rollout's or a fleet's); raises SpecError naming every bad field."""
    r = _Reader()
    selector = _selector(r, value, path)
    if r.errors:
        raise SpecError(r.errors)
    return selector
