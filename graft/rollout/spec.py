"""The PatchRollout spec as the operator runs it, read from the manifest's `spec` dict.

The schema is graft.rollout.models: `parse_spec` validates through PatchRolloutSpec first (the CRD's
defaults, bounds, patterns and CEL rules, the same model crds/patchrollout.yaml is generated from),
so the operator refuses what the API server refuses even against an older CRD or one that skips CEL
rules. What no schema can say stays here, as plain code run after the model, the way Argo's
VerifyRolloutSpec runs after decoding:

- templates: each referenced template's checks come first, the rollout's own replace those of the
  same name and role; `{{args.NAME}}` filled from the template's and the rollout's arguments (an
  argument must be one label value's worth);
- the default analysis, only when the rollout names no checks and no template;
- what each built-in metric takes (a rate's limits are fractions, maxRatio only for quantiles,
  error-rate-delta needs max, ...) and its default window; a window or interval of at least 1s;
- a custom query's template variables, and that every vector selector of a query written in the
  rollout's namespace carries namespace="{{namespace}}";
- names unique across the merged lists; gates take no `consecutive`.

Every error names the field path, the way the API server does (`spec.steps[2].weight: ...`).
"""
from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, create_model

from graft.api import patch_ref
from graft.rollout import queries
from graft.rollout.durations import parse_duration
from graft.rollout.hooks import Hook, HookType
from graft.rollout.models import analysistemplate as template_model
from graft.rollout.models import common, patchfleet, patchrollout as model
from graft.rollout.models.base import (DIGEST_PATTERN, DURATION_PATTERN, K8S_NAME_PATTERN, METRIC_NAME_PATTERN,
                                       PATCH_NAME_PATTERN, PATCH_VERSION_PATTERN, ApiModel, FieldError,
                                       validate)
from graft.rollout.models.common import MAX_CHECKS, MAX_QUERY, MAX_SELECTOR_TERMS, SELECTOR_MUST_NAME, SELECTOR_OPERATORS
from graft.rollout.models.patchfleet import DEFAULT_REVISION_HISTORY_LIMIT
from graft.rollout.models.patchrollout import (DEFAULT_CONFIDENCE, DEFAULT_ERROR_LIMIT, DEFAULT_INCONCLUSIVE_LIMIT,
                                               DEFAULT_MEASUREMENT_RETENTION, DEFAULT_OUTAGE_LIMIT,
                                               DEFAULT_ROLLBACK_CONFIDENCE, DEFAULT_STEPS, MAX_MEASUREMENT_RETENTION,
                                               MAX_STEPS)

__all__ = ["DEFAULT_STEPS", "DIGEST_PATTERN", "DURATION_PATTERN", "K8S_NAME_PATTERN", "METRIC_NAME_PATTERN", "PATCH_NAME_PATTERN",
           "PATCH_VERSION_PATTERN", "MAX_CHECKS", "MAX_QUERY", "MAX_SELECTOR_TERMS", "MAX_STEPS",
           "SELECTOR_MUST_NAME", "SELECTOR_OPERATORS", "DEFAULT_REVISION_HISTORY_LIMIT", "MAX_MEASUREMENT_RETENTION",
           "FieldError", "SpecError", "parse_spec", "parse_fleet_spec", "parse_selector", "parse_ttl"]

NO_DATA_POLICIES = ("hold", "fail", "pass")
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
# the model's enum and CEL rule name the same metrics (tests/rollout/test_crd.py holds them equal)
assert tuple(BUILTIN_METRICS) == common.BUILTIN_METRIC_NAMES
assert {m for m, b in BUILTIN_METRICS.items() if b["kind"] == "quantile"} == set(common.QUANTILE_METRICS)
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


def _model_defaults(cls: type[BaseModel]) -> dict[str, Any]:
    """The defaults the CRD (generated from `cls`) fills in, as a manifest spells them."""
    out = {}
    for name, info in cls.model_fields.items():
        if info.is_required() or info.default is None:
            continue
        value = info.default
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json", by_alias=True, exclude_none=True)
        elif isinstance(value, list):
            value = [v.model_dump(mode="json", by_alias=True, exclude_none=True) if isinstance(v, BaseModel) else v
                     for v in value]
        out[info.alias or name] = value
    return out


# What the CRD defaults (the API server stores these), read off the model; the checks themselves
# default in parse_spec, because a rollout that names a template must not also get the default list.
DEFAULTS: dict[str, Any] = {k: v for k, v in _model_defaults(model.PatchRolloutSpec).items() if k != "patch"}


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
class WebSpec:
    """A web check's request: where, how, and where the number is in the JSON answer."""

    url: str
    method: str = "GET"
    body: str | None = None
    # (name, value) or (name, None) with the value's (Secret name, key)
    headers: tuple[tuple[str, str | None, tuple[str, str] | None], ...] = ()
    json_path: str = "$"
    timeout: float = 10.0

    @property
    def comparison(self) -> bool:
        return queries.is_comparison(self.url + (self.body or ""))


MAX_JOB_TIMEOUT = 3600.0


@dataclass(slots=True, frozen=True)
class JobSpec:
    """A job check's Job: its batch/v1 JobSpec (as JSON, so the spec stays hashable), labels and
    annotations, where the number is in its log (None: its exit code), and how long it may run."""

    spec_json: str
    labels: tuple[tuple[str, str], ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    json_path: str | None = None
    timeout: float = 600.0

    @property
    def spec(self) -> dict[str, Any]:
        return json.loads(self.spec_json)

    @property
    def comparison(self) -> bool:
        return queries.is_comparison(self.spec_json)


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
    web: WebSpec | None = None         # custom checks: a number from an HTTP service instead of PromQL
    job: JobSpec | None = None         # custom checks: a number from a Kubernetes Job

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
            source = self.web or self.job
            return source.comparison if source is not None else queries.is_comparison(self.query or "")
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
    basic_auth: tuple[str, tuple[str, str]] | None = None          # (username, the password's Secret and key)
    oauth2: OAuth2Source | None = None
    client_cert: tuple[tuple[str, str], tuple[str, str]] | None = None   # mTLS: (cert's, key's Secret and key)

    def secrets(self) -> list[tuple[str, tuple[str, str]]]:
        """Every Secret key the source names, with the field that names it."""
        named = [("bearerTokenSecret", self.bearer_token_secret), ("caSecret", self.ca_secret),
                 ("basicAuth.passwordSecret", self.basic_auth[1] if self.basic_auth else None),
                 ("oauth2.clientSecretSecret", self.oauth2.client_secret if self.oauth2 else None),
                 ("tls.certSecret", self.client_cert[0] if self.client_cert else None),
                 ("tls.keySecret", self.client_cert[1] if self.client_cert else None)]
        return [(f, ref) for f, ref in named if ref is not None]


@dataclass(slots=True, frozen=True)
class OAuth2Source:
    """OAuth2 client credentials: where to ask for a token, as whom."""

    token_url: str
    client_id: str
    client_secret: tuple[str, str]          # (Secret name, key) in the rollout's namespace
    scopes: tuple[str, ...] = ()


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
    hooks: tuple[Hook, ...] = ()       # spec.webhooks (graft.rollout.hooks)

    def step(self, index: int) -> Step:
        return self.steps[min(index, len(self.steps) - 1)]

    def hooks_of(self, kind: HookType) -> tuple[Hook, ...]:
        return tuple(h for h in self.hooks if h.type == kind)



def with_defaults(spec: Mapping[str, Any]) -> dict[str, Any]:
    """`spec` with the CRD's defaults filled in (what the API server stores)."""
    out = copy.deepcopy(dict(spec))
    for key, value in DEFAULTS.items():
        if key not in out:
            out[key] = copy.deepcopy(value)
        elif key == "analysis" and isinstance(out[key], dict):   # the one object defaulted field by field
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


def _validated(cls: type[BaseModel], value: Any, path: str) -> Any:
    """`value` through the model `cls`; SpecError naming every bad field."""
    if not isinstance(value, Mapping):
        raise SpecError([FieldError(path, "must be an object")])
    obj, errors = validate(cls, dict(value), path)
    if errors:
        raise SpecError(errors)
    return obj


def parse_spec(spec: Mapping[str, Any], templates: Templates | None = None) -> RolloutSpec:
    """Parse and validate a PatchRollout `spec`; raises SpecError naming every bad field.

    `templates` maps each (name, cluster-scoped) the spec references to that template's `spec`; the
    operator reads them from the API server. A template's checks come first, the rollout's own
    checks replace those of the same name and role.
    """
    if not isinstance(spec, Mapping):
        raise SpecError([FieldError("spec", "must be an object")])
    m, errors = validate(model.PatchRolloutSpec, dict(spec), "spec")
    if m is None:
        # the checks the schema took are still judged by what their metric takes, so that every bad
        # field is named at once
        raise SpecError(_distinct(errors + _checks_alone(spec)))
    r = _Errors()
    analysis = _analysis(r, m.analysis, "spec.analysis", templates or {})
    deadline = parse_duration(m.progress_deadline)
    if deadline <= 0:
        r.fail("spec.progressDeadline", "must be longer than zero")
    if r.errors:
        raise SpecError(_distinct(r.errors))
    hooks = _hooks(r, m.webhooks or [])
    if r.errors:
        raise SpecError(_distinct(r.errors))
    return RolloutSpec(selector_of(m.selector), _patch(m.patch), _routing(m.traffic_routing), _steps(m.steps),
                       analysis, deadline, m.paused, m.action, m.ttl_seconds_after_finished, hooks)


MAX_HOOK_TIMEOUT = 60.0


def _hooks(r: "_Errors", webhooks: list[model.Webhook]) -> tuple[Hook, ...]:
    """spec.webhooks as graft.rollout.hooks takes them; a timeout is more than zero and at most a minute
    (a gate is awaited inside its rollout's reconciliation)."""
    out = []
    for i, w in enumerate(webhooks):
        timeout = parse_duration(w.timeout)
        if not 0 < timeout <= MAX_HOOK_TIMEOUT:
            r.fail(f"spec.webhooks[{i}].timeout", f"must be more than 0s and at most {MAX_HOOK_TIMEOUT:g}s")
            continue
        out.append(Hook(w.name, HookType(w.type), w.url, timeout, w.retries, dict(w.metadata or {})))
    return tuple(out)


def _distinct(errors: list[FieldError]) -> list[FieldError]:
    """Each error once (a rule the model states and the per-check reading may both name)."""
    return list(dict.fromkeys(errors))


def _checks_alone(spec: Mapping[str, Any]) -> list[FieldError]:
    """What `_check` says of each check of a spec the model refused, the checks it took one by one
    (their queries aside: the arguments they need may be what was refused)."""
    r = _Errors()
    analysis = spec.get("analysis")
    for key, role in (("breakers", BREAKER), ("gates", GATE)):
        items = analysis.get(key) if isinstance(analysis, Mapping) else None
        for i, item in enumerate(items if isinstance(items, list) else ()):
            c, errors = validate(common.Check, item, f"spec.analysis.{key}[{i}]")
            if c is not None and c.query is None:
                _check(r, c, {}, f"spec.analysis.{key}[{i}]", role)
    return r.errors


def parse_ttl(spec: Mapping[str, Any]) -> int | None:
    """`spec.ttlSecondsAfterFinished` alone (None when unset); raises SpecError naming the field.

    What deletes a finished rollout reads this field only: the rest of its spec may no longer parse
    (an analysis template deleted since), and that must not keep it forever.
    """
    if not isinstance(spec, Mapping) or "ttlSecondsAfterFinished" not in spec:
        return None
    obj, errors = validate(_Ttl, {"ttlSecondsAfterFinished": spec["ttlSecondsAfterFinished"]}, "spec")
    if errors:
        raise SpecError(errors)
    return obj.ttl_seconds_after_finished


# the one field, with its type and bounds as the model declares them
_Ttl = create_model("Ttl", __base__=ApiModel, ttl_seconds_after_finished=(
    model.PatchRolloutSpec.model_fields["ttl_seconds_after_finished"].annotation,
    model.PatchRolloutSpec.model_fields["ttl_seconds_after_finished"]))


class _Errors:
    """The errors of what runs after the model, gathered so every bad field is named at once."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def errors_at(self, path: str) -> bool:
        return any(e.path == path or e.path.startswith(path + ".") or e.path.startswith(path + "[")
                   for e in self.errors)


def selector_of(m: common.LabelSelector) -> LabelSelector:
    """A validated selector model as the operator matches with it."""
    return LabelSelector(dict(m.match_labels or {}),
                         tuple((e.key, e.operator, tuple(e.values or ())) for e in m.match_expressions or ()))


def _patch(m: common.Patch) -> PatchSpec:
    src = m.source
    source = (PatchSource(builtin=True) if src.builtin is not None else
              PatchSource(False, src.config_map.name, src.config_map.key, src.digest))
    return PatchSpec(m.name, m.version, source, copy.deepcopy(m.config or {}))


def _routing(m: model.TrafficRouting) -> TrafficRouting:
    g = m.gateway_api
    if g is None:
        return TrafficRouting("podRatio")
    return TrafficRouting("gatewayAPI", g.http_route, g.stable_service, g.canary_service)


def _steps(steps: list[model.Step]) -> tuple[Step, ...]:
    out = []
    for s in steps:
        text = s.pause if isinstance(s.pause, str) else None
        out.append(Step(s.weight, parse_duration(text) if text else 0.0, text, s.waits_for_approval))
    return tuple(out)


def _analysis(r: _Errors, m: model.Analysis, path: str, templates: Templates) -> Analysis:
    interval = parse_duration(m.interval)
    if interval < 1:
        r.fail(f"{path}.interval", "must be at least 1s (Prometheus needs two scrapes in a window)")
    refs = [(t.name, bool(t.cluster_scope)) for t in m.templates or ()]
    args = _args(r, m.args or (), f"{path}.args")

    lists: dict[str, list[tuple[common.Check, dict[str, str], str]]] = {"breakers": [], "gates": []}
    trusted: set[str] = set()      # a ClusterPatchAnalysisTemplate's checks: the cluster administrator's queries
    for name, cluster in refs:
        raw = templates.get((name, cluster))
        if raw is None:
            r.fail(f"{path}.templates", f"{'cluster' if cluster else 'namespaced'} analysis template "
                                        f"{name!r} was not found")
            continue
        where = f"{'ClusterPatchAnalysisTemplate' if cluster else 'PatchAnalysisTemplate'} {name}"
        t, errors = validate(template_model.AnalysisTemplateSpec, raw, f"{where}: spec")
        r.errors += errors
        # a refused template: its arguments and checks the model takes one by one are still read,
        # so every bad field of it is named at once
        parts = {key: getattr(t, key) or [] for key in ("args", "breakers", "gates")} if t is not None else \
            _parts_alone(raw, f"{where}: spec")
        targs = {**_args(r, parts["args"], f"{where}: spec.args"), **args}
        for key in ("breakers", "gates"):
            for i, item in (parts[key] if t is None else enumerate(parts[key])):
                lists[key].append((item, targs, f"{where}: spec.{key}[{i}]"))
                if cluster:
                    trusted.add(f"{where}: spec.{key}[{i}]")
    own_given = m.breakers is not None or m.gates is not None
    for key in ("breakers", "gates"):
        items = getattr(m, key)
        if items is None:
            if not refs and not own_given:
                defaults = DEFAULT_BREAKERS if key == "breakers" else DEFAULT_GATES
                items = [common.Check.model_validate(d) for d in defaults]
            else:
                items = []
        names = {c.name for c in items}
        lists[key] = [entry for entry in lists[key] if entry[0].name not in names]
        lists[key] += [(item, args, f"{path}.{key}[{i}]") for i, item in enumerate(items)]
    parsed: dict[str, list[Check]] = {"breakers": [], "gates": []}
    for key, role in (("breakers", BREAKER), ("gates", GATE)):
        seen: set[str] = set()
        for item, item_args, where in lists[key]:
            check = _check(r, item, item_args, where, role)
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
    p = m.prometheus
    source = PrometheusSource(
        p.address or "",
        (p.bearer_token_secret.name, p.bearer_token_secret.key) if p.bearer_token_secret else None,
        (p.ca_secret.name, p.ca_secret.key) if p.ca_secret else None,
        tuple((h.name, h.value) for h in p.headers or ()),
        (p.basic_auth.username, _ref(p.basic_auth.password_secret)) if p.basic_auth else None,
        OAuth2Source(p.oauth2.token_url, p.oauth2.client_id, _ref(p.oauth2.client_secret_secret),
                     tuple(p.oauth2.scopes or ())) if p.oauth2 else None,
        (_ref(p.tls.cert_secret), _ref(p.tls.key_secret)) if p.tls else None)
    return Analysis(source, interval, tuple(parsed["breakers"]), tuple(parsed["gates"]), m.no_data, m.confidence,
                    m.rollback_confidence, m.inconclusive_limit, m.error_limit, parse_duration(m.outage_limit),
                    tuple(refs), m.measurement_retention)


def _ref(ref: Any) -> tuple[str, str]:
    return ref.name, ref.key


def _parts_alone(raw: Any, path: str) -> dict[str, list[Any]]:
    """A refused template's arguments, and its checks with their indexes, that the model takes one by one."""
    out: dict[str, list[Any]] = {"args": [], "breakers": [], "gates": []}
    for key, cls in (("args", common.TemplateArg), ("breakers", common.Check), ("gates", common.Check)):
        items = raw.get(key) if isinstance(raw, Mapping) else None
        for i, item in enumerate(items if isinstance(items, list) else ()):
            obj, errors = validate(cls, item, f"{path}.{key}[{i}]")
            if obj is not None:
                out[key].append(obj if key == "args" else (i, obj))
    return out


def _args(r: _Errors, items: Any, path: str) -> dict[str, str]:
    """Template arguments by name; a value must be one label value's worth (it lands in PromQL)."""
    out = {}
    for i, item in enumerate(items):
        if item.value is None:
            continue
        problem = queries.arg_problem(item.value)
        if problem is not None:
            r.fail(f"{path}[{i}].value", problem)
            continue
        out[item.name] = item.value
    return out


def _with_args(r: _Errors, query: str, args: dict[str, str], where: str) -> str | None:
    """`query` with `{{args.NAME}}` filled from the arguments (None, the error recorded, when one is missing)."""
    try:
        return queries.fill_args(query, args)
    except (KeyError, ValueError) as e:
        r.fail(f"{where}.query", str(e.args[0]))
        return None


def _scoped(r: _Errors, query: str, path: str) -> None:
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


def _check(r: _Errors, c: common.Check, args: dict[str, str], path: str, role: str) -> Check | None:
    """A check the model validated, judged by what its metric takes (no schema says this)."""
    errors_before = len(r.errors)
    query = c.query
    if query is not None:
        query = _with_args(r, query, args, path)
        if query is None:
            return None
        if len(query) > MAX_QUERY:
            r.fail(f"{path}.query", f"must be at most {MAX_QUERY} characters")
        unknown = queries.unknown_vars(query)
        if unknown:
            r.fail(f"{path}.query", f"unknown template variable(s) {', '.join(unknown)} "
                                    f"(known: {', '.join(queries.TEMPLATE_VARS)})")
    web = _web(r, c.web, args, f"{path}.web") if c.web is not None else None
    job = _job(r, c.job, args, f"{path}.job") if c.job is not None else None
    metric = c.metric or ("custom" if query is not None or c.web is not None or c.job is not None
                          or c.name not in BUILTIN_METRICS
                          else c.name)
    kind = "custom" if metric == "custom" else BUILTIN_METRICS[metric]["kind"]
    hi, lo, ratio = c.max, c.min, c.max_ratio
    if kind != "custom":
        for key, value in (("max", hi), ("min", lo)):
            if value is not None and value < 0:
                r.fail(f"{path}.{key}", "must be at least 0")
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
    window_text = c.window or BUILTIN_METRICS.get(metric, {}).get("window", "60s")
    window: float | None = None
    if window_text in CUMULATIVE_WINDOWS:
        if kind not in ("rate", "difference"):
            r.fail(f"{path}.window", f"{window_text!r} does not match {DURATION_PATTERN}: only rates and "
                                     "error-rate-delta look at the traffic since the step or the rollout began")
    else:
        window = parse_duration(window_text)
        if window < 1:
            r.fail(f"{path}.window", "must be at least 1s (a rate needs two scrapes in its window)"
                   + ("; or 'step' (the traffic since the step was in place) or 'rollout' (since the "
                      "rollout started)" if kind in ("rate", "difference") else ""))
    if role == GATE and c.consecutive is not None:
        r.fail(f"{path}.consecutive", "gates take no consecutive: a failing gate holds the step until it passes")
    if len(r.errors) > errors_before:
        return None
    return Check(c.name, role, metric, hi, lo, ratio, window, str(window_text), c.consecutive or 1, query,
                 bool(c.dry_run), c.min_samples, web, job)


def _job(r: _Errors, j: Any, args: dict[str, str], path: str) -> JobSpec | None:
    """A job check's Job with the template's arguments filled; its containers and timeout checked here
    (the JobSpec is free-form in the schema: the API server judges the rest when the Job is made)."""
    try:
        spec = queries.fill_strings(j.spec, lambda text: queries.fill_web_args(text, args, str))
    except KeyError as e:
        r.fail(f"{path}.spec", str(e.args[0]))
        return None
    spec_json = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    if len(spec_json) > common.MAX_JOB_SPEC:
        r.fail(f"{path}.spec", f"must be at most {common.MAX_JOB_SPEC} characters as JSON")
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers")
    if not isinstance(containers, list) or not containers or not all(isinstance(c, dict) for c in containers):
        r.fail(f"{path}.spec.template.spec.containers", "required: the Job's pod needs a container")
    unknown = queries.unknown_vars(spec_json)
    if unknown:
        r.fail(f"{path}.spec", f"unknown template variable(s) {', '.join(unknown)} "
                               f"(known: {', '.join(queries.TEMPLATE_VARS)})")
    timeout = parse_duration(j.timeout)
    if not 0 < timeout <= MAX_JOB_TIMEOUT:
        r.fail(f"{path}.timeout", "must be more than 0s and at most 1h")
    labels = (j.metadata.labels if j.metadata else None) or {}
    annotations = (j.metadata.annotations if j.metadata else None) or {}
    return JobSpec(spec_json, tuple(sorted(labels.items())), tuple(sorted(annotations.items())), j.json_path,
                   timeout)


def _web(r: _Errors, w: Any, args: dict[str, str], path: str) -> WebSpec | None:
    """A web check's request with the template's arguments filled (URL- or JSON-escaped)."""
    try:
        url = queries.fill_web_args(w.url, args, queries.url_escape)
        body = None if w.body is None else queries.fill_web_args(w.body, args, queries.json_escape)
    except KeyError as e:
        r.fail(path, str(e.args[0]))
        return None
    for where, text in (("url", url), ("body", body or "")):
        unknown = queries.unknown_vars(text)
        if unknown:
            r.fail(f"{path}.{where}", f"unknown template variable(s) {', '.join(unknown)} "
                                      f"(known: {', '.join(queries.TEMPLATE_VARS)})")
    headers = tuple((h.name, h.value, None if h.value_from is None else _ref(h.value_from.secret_key_ref))
                    for h in w.headers or ())
    return WebSpec(url, w.method, body, headers, w.json_path, parse_duration(w.timeout))


@dataclass(slots=True, frozen=True)
class FleetSpec:
    """A PatchFleet's `spec`: the pods it covers and the patches they all run (its stable revision)."""

    selector: LabelSelector
    patches: tuple[PatchSpec, ...]
    revision_history_limit: int = DEFAULT_REVISION_HISTORY_LIMIT   # finished rollouts kept


def parse_fleet_spec(spec: Mapping[str, Any]) -> FleetSpec:
    """Parse and validate a PatchFleet `spec` through its model; raises SpecError naming every bad field."""
    m: patchfleet.PatchFleetSpec = _validated(patchfleet.PatchFleetSpec, spec, "spec")
    patches = [_patch(p) for p in m.patches or ()]
    return FleetSpec(selector_of(m.selector), tuple(sorted(patches, key=lambda p: p.name)), m.revision_history_limit)


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
    if value is None:
        raise SpecError([FieldError(path, "required")])
    return selector_of(_validated(common.LabelSelector, value, path))
