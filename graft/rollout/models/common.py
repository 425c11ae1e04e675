"""The parts several kinds share: a label selector, a patch and its source, a check of the analysis,
a template argument, a status condition."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, StringConstraints, WithJsonSchema, field_validator

from graft.rollout.models.base import (ARG_NAME_PATTERN, DURATION_PATTERN, HEADER_NAME_PATTERN, MAX_DURATION,
                                       METRIC_NAME_PATTERN, URL_PATTERN, ApiModel,
                                       Cel, DataKey, Digest, K8sName, LabelKey, LabelValue, PatchName, PatchVersion,
                                       Says, StatusModel, cel, described, label_key_ok, refuse)

# -- label selectors -------------------------------------------------------------------------------

SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
# A selector names its fleet by an equality or an `In` term: `NotIn`, `Exists` and `DoesNotExist`
# alone reach pods nobody meant (a database of the namespace), and the operator relabels and calls
# what it selects.
SELECTOR_MUST_NAME = ("must name the fleet: a matchLabels entry or an In expression "
                      "(NotIn, Exists and DoesNotExist alone reach pods outside it)")
LABEL_KEY_TEXT = ("is not a valid label key (an optional DNS-subdomain prefix and '/', then at most 63 letters, "
                  "digits, '-', '_' or '.', starting and ending alphanumeric)")
LABEL_VALUE_TEXT = ("is not a valid label value (at most 63 letters, digits, '-', '_' or '.', starting and "
                    "ending alphanumeric)")
MAX_SELECTOR_TERMS = 16
_KEY_RULE = Cel("self.all(k, size(k) <= 317 && k.matches('^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*"
                "[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$'))",
                "label keys are an optional DNS-subdomain prefix and '/', then at most 63 letters, digits, '-', "
                "'_' or '.', starting and ending alphanumeric")


class SelectorRequirement(ApiModel):
    """One term of a label selector: a key, an operator and the values it compares with."""

    cel_rules: ClassVar = (
        Cel("self.operator in ['Exists', 'DoesNotExist'] ? !has(self.values) || size(self.values) == 0"
            " : has(self.values) && size(self.values) > 0",
            "In and NotIn need values; Exists and DoesNotExist take none"),)

    key: Annotated[LabelKey, StringConstraints(min_length=1)] = described(
        "The label key the term compares, e.g. app or app.kubernetes.io/name.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = described(
        "In: the label's value is one of values; NotIn: it is none of them (or the label is missing); "
        "Exists / DoesNotExist: the label is there / missing, whatever its value.")
    values: Annotated[list[LabelValue], Field(max_length=64)] | None = described(
        "The values In and NotIn compare with (at least one); empty for Exists and DoesNotExist.", default=None)

    def rules(self) -> None:
        if self.operator in ("In", "NotIn") and not self.values:
            raise refuse(f"required for operator {self.operator}", at="values")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise refuse(f"must be empty for operator {self.operator}", at="values")


class LabelSelector(ApiModel):
    """Pods by their labels, as a Deployment's selector picks them."""

    cel_rules: ClassVar = (
        Cel("(has(self.matchLabels) && size(self.matchLabels) > 0) || (has(self.matchExpressions) && "
            "self.matchExpressions.exists(e, e.operator == 'In'))", SELECTOR_MUST_NAME),)

    match_labels: Annotated[dict[LabelKey, LabelValue], Field(max_length=32),
                            Says.of(dict_type="must map label names to string values", key=LABEL_KEY_TEXT,
                                    value=LABEL_VALUE_TEXT)] | None = described(
        "Labels every pod must carry with exactly these values.", default=None,
        json_schema_extra=cel(_KEY_RULE))
    match_expressions: Annotated[list[SelectorRequirement], Field(max_length=MAX_SELECTOR_TERMS)] | None = described(
        "Terms every pod's labels must satisfy, besides matchLabels.", default=None)

    def rules(self) -> None:
        if not self.match_labels and not any(e.operator == "In" for e in self.match_expressions or ()):
            raise refuse(SELECTOR_MUST_NAME)

    @field_validator("match_labels")
    @classmethod
    def _label_keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # the pattern bounds the name part at 63; the prefix's bound (253) needs a length check
        for key in value or {}:
            if not label_key_ok(key):
                raise refuse(f"{key!r} {LABEL_KEY_TEXT}")
        return value


# -- patches ---------------------------------------------------------------------------------------


class Builtin(ApiModel):
    """A patch shipped with the engine: nothing to fetch."""


class ConfigMapRef(ApiModel):
    """A key of a ConfigMap in the rollout's namespace."""

    name: K8sName = described("The ConfigMap's name.")
    key: DataKey = described("Its data key holding the bundle's Python source.")


class PatchSource(ApiModel):
    """Where the patch's code comes from."""

    cel_rules: ClassVar = (
        Cel("has(self.builtin) != has(self.configMap)", "exactly one of builtin or configMap is required"),
        Cel("!has(self.configMap) || has(self.digest)", "a configMap source needs its pinned sha256 digest"),
        Cel("!has(self.builtin) || !has(self.digest)", "only a configMap source is pinned by digest"),
    )

    builtin: Builtin | None = described("The patch ships with the engine (the default).", default=None)
    config_map: ConfigMapRef | None = described(
        "A Python bundle in a ConfigMap of the rollout's namespace; needs digest.", default=None,
        alias="configMap")
    digest: Digest | None = described(
        "sha256:<64 lower-case hex digits> of the bundle: the engine refuses a bundle that differs.", default=None)

    def rules(self) -> None:
        one, pinned, only_bundles = PatchSource.cel_rules
        if (self.builtin is None) == (self.config_map is None):
            raise refuse(one.message)
        if self.config_map is not None and self.digest is None:
            raise refuse(f"required: {pinned.message}", at="digest")
        if self.builtin is not None and self.digest is not None:
            raise refuse(only_bundles.message, at="digest")


class Patch(ApiModel):
    """A hot patch as the engine's admin API names it, with its settings and its code's source."""

    name: PatchName = described("The patch's name (a DNS label), as the engine's admin API knows it.")
    version: PatchVersion = described("The patch's version (letters, digits and . + _ -, at most 64).")
    config: dict[str, Any] | None = described("Settings passed to the patch when it is applied.", default=None)
    source: PatchSource = described(
        "builtin: shipped with the engine; configMap: a Python bundle pinned by its sha256 digest.",
        default=PatchSource(builtin=Builtin()))


# -- the analysis: checks and template arguments ---------------------------------------------------

BUILTIN_METRIC_NAMES = ("error-rate", "success-rate", "error-rate-delta", "latency-p99", "ttft-p99", "tpot-p99",
                        "cpu", "output-divergence")
QUANTILE_METRICS = ("latency-p99", "ttft-p99", "tpot-p99")
MAX_QUERY = 8192
MAX_CHECKS = 20
WINDOW_PATTERN = r"^(([0-9]+(\.[0-9]+)?(ms|s|m|h))+|step|rollout)$"
assert WINDOW_PATTERN[2:].startswith(DURATION_PATTERN[1:-1])


LIST_MAP_NAME = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}


class SecretKeyRef(ApiModel):
    """A key of a Secret in the rollout's namespace."""

    name: K8sName = described("The Secret's name.")
    key: DataKey = described("Its data key.")


class SecretSource(ApiModel):
    """Where a value comes from."""

    secret_key_ref: SecretKeyRef = described(SecretKeyRef.__doc__)


class WebHeader(ApiModel):
    """A header of a web check's request: a value, or one from a Secret."""

    cel_rules: ClassVar = (Cel("has(self.value) != has(self.valueFrom)", "a header has a value or a valueFrom"),)

    name: Annotated[str, StringConstraints(max_length=64, pattern=HEADER_NAME_PATTERN)] = described("The header's name.")
    value: Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^[^\r\n]+$")] | None = described(
        "The header's value (one line).", default=None)
    value_from: SecretSource | None = described("The header's value from a Secret in the rollout's namespace.",
                                                default=None)

    def rules(self) -> None:
        if (self.value is None) == (self.value_from is None):
            raise refuse(self.cel_rules[0].message)


JSON_PATH_PATTERN = r"^\$(\.[A-Za-z_][A-Za-z0-9_-]*|\[[0-9]{1,6}\]|\['[^'\\]{1,256}'\])*$"
WEB_TIMEOUT_PATTERN = r"^([1-9]|[1-5][0-9]|60)s$"   # whole seconds, 1s to 60s


class Web(ApiModel):
    """A number from any HTTP service: a GET (or POST) answered with JSON, and where in it the number is."""

    cel_rules: ClassVar = (Cel("!has(self.body) || self.method == 'POST'", "only a POST has a body"),)

    url: Annotated[str, StringConstraints(max_length=2048, pattern=URL_PATTERN)] = described(
        "Where to ask; may use {{namespace}}, {{canaryRevision}}, {{stableRevision}}, {{patchName}}, "
        "{{patchVersion}}, {{window}} and {{args.NAME}} (URL-escaped). It must lie under an address the operator "
        "allows (GRAFT_WEB_ALLOWED, the chart's webChecks.allowedAddresses), else the rollout fails with "
        "WebNotAllowed.")
    method: Literal["GET", "POST"] = described("The HTTP method.", default="GET", json_schema_extra={"type": "string"})
    body: Annotated[str, StringConstraints(max_length=8192)] | None = described(
        "A POST's body, sent as application/json; the same placeholders, JSON-escaped.", default=None)
    headers: Annotated[list[WebHeader], Field(max_length=16, json_schema_extra=LIST_MAP_NAME)] | None = described(
        "Headers sent with the request (a token from a Secret: valueFrom.secretKeyRef).", default=None)
    json_path: Annotated[str, StringConstraints(max_length=1024, pattern=JSON_PATH_PATTERN)] = described(
        "Where the number is in the JSON answer: $ then .field, ['field'] or [index] steps, e.g. "
        "$.data.result[0].value. A number, or true/false (1/0); nothing there is no data.")
    timeout: Annotated[str, StringConstraints(pattern=WEB_TIMEOUT_PATTERN),
                       Says.of(string_pattern_mismatch="must be whole seconds from 1s to 60s, e.g. 10s")] = described(
        "How long the answer may take: whole seconds, 1s to 60s.", default="10s")

    def rules(self) -> None:
        if self.body is not None and self.method != "POST":
            raise refuse(self.cel_rules[0].message, at="body")


MAX_JOB_SPEC = 64 * 1024     # characters of a job check's JobSpec, as JSON
JOB_SPEC_SCHEMA = {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                   "description": "The Job's spec, a batch/v1 JobSpec (template.spec.containers and the rest), "
                                  "checked by the API server when the Job is made. Every string may use the "
                                  "placeholders of a query ({{namespace}}, {{canaryRevision}}, {{stableRevision}}, "
                                  "{{patchName}}, {{patchVersion}}, {{args.NAME}}), filled as they are. Unset, "
                                  "backoffLimit is 0, activeDeadlineSeconds the timeout and ttlSecondsAfterFinished "
                                  "one hour."}


class JobMetadata(ApiModel):
    """Labels and annotations for the Job (and, through its template, nothing else)."""

    labels: dict[str, LabelValue] | None = described("Labels of the Job.", default=None)
    annotations: dict[str, Annotated[str, StringConstraints(max_length=4096)]] | None = described(
        "Annotations of the Job.", default=None)


class JobCheck(ApiModel):
    """A number from a Kubernetes Job the operator runs in the rollout's namespace, once per step."""

    metadata: JobMetadata | None = described(JobMetadata.__doc__, default=None)
    spec: Annotated[dict[str, Any], WithJsonSchema(JOB_SPEC_SCHEMA)] = Field(
        description=JOB_SPEC_SCHEMA["description"])
    json_path: Annotated[str, StringConstraints(max_length=1024, pattern=JSON_PATH_PATTERN)] | None = described(
        "Where the number is in the last line of the Job's log that is a JSON object (the same steps as web's "
        "jsonPath). Unset: the number is the exit code of the Job's container, 0 when it succeeded.", default=None)
    timeout: Annotated[str, StringConstraints(max_length=MAX_DURATION, pattern=DURATION_PATTERN)] = described(
        "How long the Job may run (its activeDeadlineSeconds unless the spec sets one); at most 1h. Past it the "
        "check has no number: an error.", default="10m")


class Check(ApiModel):
    """One check of the analysis: a breaker (rolls back) or a gate (must hold for a step to advance)."""

    cel_rules: ClassVar = (
        Cel("has(self.metric) || has(self.query) || has(self.web) || has(self.job) || self.name in ["
            + ", ".join(f"'{n}'" for n in BUILTIN_METRIC_NAMES) + "]",
            "a check that is not built in needs its query, web or job"),
        Cel("[has(self.metric), has(self.query), has(self.web), has(self.job)].filter(x, x).size() <= 1",
            "a check has one source: a built-in metric, a query, web or job"),
        Cel("has(self.max) || has(self.min) || has(self.maxRatio)", "a check needs a threshold: max, min or maxRatio"),
        Cel("!has(self.max) || !has(self.min) || self.min <= self.max", "min must not exceed max"),
    )

    name: Annotated[str, StringConstraints(max_length=63, pattern=METRIC_NAME_PATTERN)] = described(
        "Unique in its list; a built-in metric's name selects it unless metric or query says otherwise.")
    metric: Annotated[Literal[BUILTIN_METRIC_NAMES],  # type: ignore[valid-type]
                      Says.of(literal_error="{input} is not a built-in metric ("
                                            + ", ".join(BUILTIN_METRIC_NAMES) + ")")] | None = described(
        "The built-in measurement (defaults to name): error-rate/success-rate (canary counts against max/min, "
        "judged with confidence bounds), error-rate-delta (canary minus stable error rate, judged with confidence "
        "bounds), latency-p99/ttft-p99/tpot-p99 (the median over pods of each pod's p99, against max seconds or "
        "maxRatio x stable), cpu (utilisation of the CPU quota), output-divergence (the share of the canary's "
        "shadow comparisons, requests it re-ran through the table it ran before the patch, that diverged beyond "
        "the dtype's tolerance: against max, judged with confidence bounds, over the step by default).",
        default=None, json_schema_extra={"type": "string"})
    query: Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUERY),
                     Says.of(string_too_long=f"must be at most {MAX_QUERY} characters")] | None = described(
        "A custom check: PromQL giving one number; may use {{namespace}}, {{canaryRevision}}, {{stableRevision}}, "
        "{{window}}, {{patchName}}, {{patchVersion}} and a template's {{args.NAME}}. Every vector selector of a "
        "PatchRollout's or a PatchAnalysisTemplate's query must carry namespace=\"{{namespace}}\".", default=None)
    web: Web | None = described(Web.__doc__ + " A custom check, like query.", default=None)
    job: JobCheck | None = described(
        JobCheck.__doc__ + " Its Job is made when the step's analysis first runs and judged once it ends; until "
        "then the check waits (Inconclusive). Only where the operator allows job checks (GRAFT_JOB_CHECKS, the "
        "chart's jobChecks), else the rollout fails with JobNotAllowed.", default=None)
    max: float | None = described(
        "Upper limit: a fraction for rates and output-divergence, percentage points as a fraction for "
        "error-rate-delta, seconds for latency, a fraction of the quota for cpu.", default=None)
    min: float | None = described("Lower limit (success-rate, custom checks).", default=None)
    max_ratio: Annotated[float, Field(gt=0)] | None = described(
        "Latency only: canary quantile at most this many times stable's.", default=None)
    window: Annotated[str, StringConstraints(max_length=MAX_DURATION, pattern=WINDOW_PATTERN)] | None = described(
        "How far back each run looks (at least 1s); 'step' (rates and error-rate-delta, whose default it is): all "
        "the traffic since the step was in place; 'rollout' (rates; the default of output-divergence): since the "
        "rollout started.", default=None)
    consecutive: Annotated[int, Field(ge=1, le=100)] | None = described(
        "Breakers only: breaches in a row that roll back.", default=None)
    min_samples: Annotated[int, Field(ge=1, le=10_000_000)] | None = described(
        "The traffic a run needs before it judges; default: derived from the threshold.", default=None)
    dry_run: bool | None = described("Judged and reported but never decides.", default=None)

    def rules(self) -> None:
        custom = self.query is not None or self.web is not None or self.job is not None
        if self.metric is None and not custom and self.name not in BUILTIN_METRIC_NAMES:
            raise refuse(f"{self.cel_rules[0].message}: {self.name!r} is not a built-in metric "
                         f"({', '.join(BUILTIN_METRIC_NAMES)})", at="query")
        if self.metric is not None and self.query is not None:
            raise refuse(f"a built-in metric ({self.metric}) takes no query; give the check another name", at="query")
        sources = [name for name in ("metric", "query", "web", "job") if getattr(self, name) is not None]
        if len(sources) > 1:
            raise refuse(self.cel_rules[1].message, at=sources[-1])
        if self.max is None and self.min is None and self.max_ratio is None:
            metric = self.metric or (self.name if not custom else None)
            raise refuse("needs a threshold: max, min" + (" or maxRatio" if metric in QUANTILE_METRICS else ""))
        if self.max is not None and self.min is not None and self.min > self.max:
            raise refuse(f"must not exceed max ({self.max:g})", at="min")


CheckList = Annotated[list[Check], Field(max_length=MAX_CHECKS)]
GATE_RULE = Cel("self.all(g, !has(g.consecutive))",
                "gates take no consecutive: a failing gate holds the step until it passes")


def _no_consecutive(gates: list[Check]) -> list[Check]:
    # a field's own validator: it runs even when a sibling field is bad, so every bad field is named at once
    for i, gate in enumerate(gates):
        if gate.consecutive is not None:
            raise refuse(GATE_RULE.message, at=f"[{i}].consecutive")
    return gates


BreakerList = Annotated[CheckList, Field(json_schema_extra=LIST_MAP_NAME)]
GateList = Annotated[CheckList, AfterValidator(_no_consecutive),
                     Field(json_schema_extra={**LIST_MAP_NAME, **cel(GATE_RULE)})]


class Arg(ApiModel):
    """A value for a template's {{args.NAME}} placeholder."""

    name: Annotated[str, StringConstraints(max_length=63, pattern=ARG_NAME_PATTERN)] = described(
        "The placeholder's NAME in {{args.NAME}}.")
    value: Annotated[str, StringConstraints(max_length=1024)] = described(
        "The text put in its place: one label value's worth (no quotes, backslashes or newlines).")


class TemplateArg(ApiModel):
    """A placeholder a template's queries use, with an optional default value."""

    name: Annotated[str, StringConstraints(max_length=63, pattern=ARG_NAME_PATTERN)] = described(
        "The placeholder's NAME in {{args.NAME}}.")
    value: Annotated[str, StringConstraints(max_length=1024)] | None = described(
        "The default, when a rollout gives none.", default=None)


ArgList = Annotated[list[Arg], Field(max_length=32, json_schema_extra=LIST_MAP_NAME),
                    Says.of(too_long="must be a list of at most 32 arguments")]


# -- status ----------------------------------------------------------------------------------------


class Condition(StatusModel):
    """A condition, as the Kubernetes API conventions spell it."""

    compact: ClassVar = True

    type: str = described("The condition's name.")
    status: Literal["True", "False", "Unknown"] = described("Whether it holds: True, False or Unknown.")
    reason: str | None = described("Why, in one CamelCase word.", default=None)
    message: str | None = described("Why, in words.", default=None)
    last_transition_time: str | None = described("When status last changed (RFC 3339).", default=None)
    observed_generation: int | None = described("The object's generation the condition was set from.", default=None)


CONDITIONS_LIST = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
