"""PatchRollout: roll one hot patch across the engine pods a selector picks, a traffic step at a time,
judged by Prometheus. Its spec and status, field by field."""
from __future__ import annotations

import math
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, PlainSerializer, StringConstraints, WithJsonSchema, field_validator

from graft.api import Phase
from graft.rollout.models.base import (DURATION_PATTERN, HEADER_NAME_PATTERN, MAX_DURATION, METRIC_NAME_PATTERN,
                                       URL_PATTERN, ApiModel, Cel,
                                       Column, DataKey, Duration, K8sName, Kind, OrNone, PatchName, PatchVersion, Says,
                                       StatusModel, Time, cel, described, refuse)
from graft.rollout.models.common import (CONDITIONS_LIST, LIST_MAP_NAME, ArgList, BreakerList, Builtin, Condition,
                                         GateList, LabelSelector, Patch, PatchSource, SecretKeyRef)

IMMUTABLE = "self == oldSelf"


class RolloutSelector(LabelSelector):
    """The engine pods to patch, by label (as a Deployment's selector); fixed when the rollout is created."""

    cel_rules: ClassVar = LabelSelector.cel_rules + (
        Cel(IMMUTABLE, "is immutable: the pods a rollout acts on are chosen when it is created; "
                       "create a new PatchRollout"),)


class RolloutPatchSource(PatchSource):
    """Where the patch's code comes from; fixed when the rollout is created."""

    cel_rules: ClassVar = PatchSource.cel_rules + (
        Cel(IMMUTABLE, "is immutable: create a new PatchRollout for another patch"),)


class RolloutPatch(Patch):
    """The hot patch to roll out, as the engine's admin API names it; fixed when the rollout is created."""

    cel_rules: ClassVar = (Cel(IMMUTABLE, "is immutable (its config too): create a new PatchRollout for another "
                                          "patch or config"),)

    name: PatchName = described(
        Patch.model_fields["name"].description,
        json_schema_extra=cel(Cel(IMMUTABLE, "is immutable: create a new PatchRollout for another patch")))
    version: PatchVersion = described(
        Patch.model_fields["version"].description,
        json_schema_extra=cel(Cel(IMMUTABLE, "is immutable: create a new PatchRollout for another version")))
    source: RolloutPatchSource = described(
        Patch.model_fields["source"].description,
        default=RolloutPatchSource(builtin=Builtin()))


# -- traffic routing -------------------------------------------------------------------------------


class PodRatio(ApiModel):
    """The share of canary pods among the fleet's Ready pods sets the weight."""


class GatewayApi(ApiModel):
    """A Gateway API HTTPRoute splits traffic between two Services by its backends' weights."""

    cel_rules: ClassVar = (Cel("self.stableService != self.canaryService",
                               "canaryService must differ from stableService"),)

    http_route: K8sName = described("The HTTPRoute, in the rollout's namespace, whose backend weights Graft sets.",
                                    alias="httpRoute")
    stable_service: K8sName = described("The Service of the stable pods.")
    canary_service: K8sName = described("The Service of the canary pods.")

    def rules(self) -> None:
        if self.stable_service == self.canary_service:
            raise refuse("must differ from stableService", at="canaryService")


class TrafficRouting(ApiModel):
    """How the canary's share of the traffic is set: one of podRatio or gatewayAPI."""

    cel_rules: ClassVar = (Cel("has(self.podRatio) != has(self.gatewayAPI)",
                               "exactly one of podRatio or gatewayAPI is required"),)

    pod_ratio: PodRatio | None = described(PodRatio.__doc__, default=None)
    gateway_api: GatewayApi | None = described(GatewayApi.__doc__, default=None, alias="gatewayAPI")

    @classmethod
    def presence(cls, data: dict[str, Any]) -> None:
        if cls.given(data, "pod_ratio") == cls.given(data, "gateway_api"):
            raise refuse(cls.cel_rules[0].message)


# -- steps -----------------------------------------------------------------------------------------

PAUSE_DESCRIPTION = (
    'How long the step holds once in place, a duration ("10m"); or {}, as in Argo Rollouts, to hold until a '
    "person approves (the same as untilApproved: true). A duration or an empty object: the field has no type, as "
    'a structural schema cannot say "string or object", and the operator refuses any other value (InvalidSpec).')
PAUSE_SCHEMA = {"description": PAUSE_DESCRIPTION, "x-kubernetes-preserve-unknown-fields": True,
                "maxLength": MAX_DURATION, "pattern": DURATION_PATTERN, "maxProperties": 0}
PAUSE_FORM = 'must be a duration ("10m") or {} (wait for approval)'
MAX_STEPS = 20


class Step(ApiModel):
    """One traffic step: its weight, then how it holds (a pause, an analysis that passes, a person)."""

    weight: Annotated[int, Field(ge=1, le=100)] = described(
        "The canary's share of the traffic in this step, percent.")
    # a duration or {}: no type in the schema (see PAUSE_DESCRIPTION); checked here in Python
    pause: Annotated[Any, WithJsonSchema(PAUSE_SCHEMA)] = Field(default=None)
    until_approved: bool | None = described(
        "Once the step's analysis passes, hold until a person approves: graft rollout promote NAME (the annotation "
        "graft.dev/promote: step). The analysis goes on meanwhile and still rolls back, and the progress deadline "
        "waits. Not with a duration pause.", default=None)

    @field_validator("pause", mode="before")
    @classmethod
    def _pause(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            if not value:
                raise refuse("must be a non-empty string")
            if len(value) > MAX_DURATION:
                raise refuse(f"must be at most {MAX_DURATION} characters")
            if not re.fullmatch(DURATION_PATTERN[1:-1], value) or value.endswith("\n"):
                raise refuse(f"{value!r} does not match {DURATION_PATTERN}")
            return value
        if isinstance(value, dict):
            if value:
                hint = (f"; a duration is written pause: {value['duration']}"
                        if set(value) == {"duration"} and isinstance(value["duration"], str) else "")
                raise refuse(f"{PAUSE_FORM}; {{}} takes no fields, not {', '.join(map(str, value))}{hint}")
            return {}
        raise refuse(f"{PAUSE_FORM}, not {value!r:.40}")

    def rules(self) -> None:
        # what the schema cannot see (pause has no type, so no CEL rule may name it): a step waits for
        # its duration or for a person, never both
        if isinstance(self.pause, str) and self.until_approved:
            raise refuse(f"a step waits for a duration (pause: {self.pause}) or for approval (untilApproved: true), "
                         "not both; drop one")
        if self.pause == {} and self.until_approved is False:
            raise refuse("pause: {} waits for approval, untilApproved: false says not to; drop one")

    @property
    def waits_for_approval(self) -> bool:
        return bool(self.until_approved) or self.pause == {}


DEFAULT_STEPS: list[dict[str, Any]] = [
    {"weight": 1, "pause": "5m"},
    {"weight": 5, "pause": "10m"},
    {"weight": 20, "pause": "10m"},
    {"weight": 50, "pause": "10m"},
    {"weight": 100},
]
STEP_RULES = (Cel("self[size(self) - 1].weight == 100", "the last step must have weight 100"),
              Cel("self.map(s, s.weight).isSorted() && self.all(a, self.exists_one(b, b.weight == a.weight))",
                  "step weights must strictly increase"))


def _step_rules(steps: list[Step]) -> list[Step]:
    # STEP_RULES in Python, on the field itself: it runs even when a sibling field is bad
    for i in range(1, len(steps)):
        if steps[i].weight <= steps[i - 1].weight:
            raise refuse(f"must be greater than the previous step's weight ({steps[i - 1].weight})",
                         at=f"[{i}].weight")
    if steps[-1].weight != 100:
        raise refuse(STEP_RULES[0].message, at=f"[{len(steps) - 1}].weight")
    return steps


# -- analysis --------------------------------------------------------------------------------------


class Header(ApiModel):
    """An HTTP header sent with every query."""

    name: Annotated[str, StringConstraints(max_length=64, pattern=HEADER_NAME_PATTERN)] = described(
        "The header's name.")
    value: Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^[^\r\n]+$")] = described(
        "The header's value (one line).")


class BasicAuth(ApiModel):
    """HTTP basic authentication: a user name and its password from a Secret."""

    username: Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^:\r\n]+$")] = described(
        "The user name (no colon).")
    password_secret: SecretKeyRef = described("A Secret in the rollout's namespace holding the password.")


class OAuth2(ApiModel):
    """OAuth2 client credentials (RFC 6749 4.4): the operator asks tokenUrl for an access token, keeps
    it until shortly before it expires, and asks again once after a 401."""

    token_url: Annotated[str, StringConstraints(max_length=2048, pattern=URL_PATTERN)] = described(
        "The token endpoint; it must lie under an address the operator allows (GRAFT_PROMETHEUS_ALLOWED).")
    client_id: Annotated[str, StringConstraints(min_length=1, max_length=256)] = described("The client's id.")
    client_secret_secret: SecretKeyRef = described("A Secret in the rollout's namespace holding the client secret.")
    scopes: Annotated[list[Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[!#-\[\]-~]+$")]],
                      Field(max_length=16)] | None = described("Scopes to ask for.", default=None)


class ClientTls(ApiModel):
    """A client certificate for mutual TLS: the certificate and its key, PEM, from Secrets."""

    cert_secret: SecretKeyRef = described("A Secret in the rollout's namespace holding the PEM client certificate.")
    key_secret: SecretKeyRef = described("A Secret in the rollout's namespace holding its PEM private key.")


class Prometheus(ApiModel):
    """Where the analysis asks, and how it logs in: at most one of bearerTokenSecret, basicAuth and
    oauth2, with a client certificate (tls) or not."""

    cel_rules: ClassVar = (
        Cel("[has(self.bearerTokenSecret), has(self.basicAuth), has(self.oauth2)].filter(x, x).size() <= 1",
            "at most one of bearerTokenSecret, basicAuth and oauth2"),
    )

    address: Annotated[str, StringConstraints(max_length=2048, pattern=URL_PATTERN)] | None = described(
        "Prometheus base URL; when omitted, the operator's GRAFT_PROMETHEUS_ADDRESS (the chart's "
        "prometheus.address). Any other address must lie under one the operator allows (GRAFT_PROMETHEUS_ALLOWED), "
        "else the rollout fails with PrometheusNotAllowed.", default=None)
    bearer_token_secret: SecretKeyRef | None = described(
        "A Secret in the rollout's namespace holding a bearer token for Prometheus.", default=None)
    ca_secret: SecretKeyRef | None = described(
        "A Secret in the rollout's namespace holding the PEM CA bundle that Prometheus' TLS certificate is "
        "verified against (default: the system's CAs).", default=None)
    headers: Annotated[list[Header], Field(max_length=16, json_schema_extra=LIST_MAP_NAME)] | None = described(
        "Extra HTTP headers sent with every query.", default=None)
    basic_auth: BasicAuth | None = described(BasicAuth.__doc__, default=None)
    oauth2: OAuth2 | None = described(OAuth2.__doc__, default=None)
    tls: ClientTls | None = described(ClientTls.__doc__, default=None)

    def rules(self) -> None:
        given = [f for f, v in (("bearerTokenSecret", self.bearer_token_secret), ("basicAuth", self.basic_auth),
                                ("oauth2", self.oauth2)) if v is not None]
        if len(given) > 1:
            raise refuse(f"{self.cel_rules[0].message}, not {' and '.join(given)}", at=given[1])


class TemplateRef(ApiModel):
    """A PatchAnalysisTemplate, or a ClusterPatchAnalysisTemplate, whose checks the rollout uses."""

    name: K8sName = described("The template's name.")
    cluster_scope: bool | None = described(
        "A ClusterPatchAnalysisTemplate rather than a PatchAnalysisTemplate in the rollout's namespace.",
        default=None)


DEFAULT_CONFIDENCE = 0.95
DEFAULT_ROLLBACK_CONFIDENCE = 0.999
DEFAULT_INCONCLUSIVE_LIMIT = 20
DEFAULT_ERROR_LIMIT = 4
DEFAULT_OUTAGE_LIMIT = "10m"
DEFAULT_MEASUREMENT_RETENTION = 10   # analysis runs kept in status.analysisHistory
MAX_MEASUREMENT_RETENTION = 100


class Analysis(ApiModel):
    """How each step is judged. With no breakers, gates or templates the default analysis applies
    (docs/analysis.md)."""

    prometheus: Prometheus = described(Prometheus.__doc__, default=Prometheus())
    interval: Duration = described("Time between two analysis runs (at least 1s).", default="30s")
    breakers: BreakerList | None = described(
        "Absolute limits that roll back: a breaker breaching `consecutive` runs in a row rolls the rollout back.",
        default=None)
    gates: GateList | None = described(
        "Criteria a step must meet to advance: a failing gate holds the step; it rolls back only on conclusive "
        "evidence (rollbackConfidence).", default=None)
    templates: Annotated[list[TemplateRef], Field(max_length=8),
                         Says.of(too_long="must be a list of at most 8 template references")] | None = described(
        "PatchAnalysisTemplates (or cluster-scoped ClusterPatchAnalysisTemplates) whose checks come first; the "
        "rollout's own checks replace those of the same name.", default=None)
    args: ArgList | None = described("Values for the templates' {{args.NAME}} placeholders.", default=None)
    no_data: Literal["hold", "fail", "pass"] = described(
        "A query that returns nothing: hold (Inconclusive), fail (a breach) or pass.", default="hold",
        json_schema_extra={"type": "string"})
    confidence: Annotated[float, Field(ge=0.5, le=0.9999)] = described(
        "How sure a gate must be that it holds before the step advances.", default=DEFAULT_CONFIDENCE)
    rollback_confidence: Annotated[float, Field(ge=0.5, le=0.9999)] = described(
        "How sure the analysis must be that an error rate is above its limit before it counts as a breach or a "
        "conclusive gate failure.", default=DEFAULT_ROLLBACK_CONFIDENCE)
    inconclusive_limit: Annotated[int, Field(ge=0, le=1000)] = described(
        "Runs in a row that hold a step after its pause before the rollout pauses for a person (0: never).",
        default=DEFAULT_INCONCLUSIVE_LIMIT)
    error_limit: Annotated[int, Field(ge=0, le=1000)] = described(
        "Runs in a row whose queries fail other than by an outage (a refused query, a non-finite or malformed "
        "answer) before the rollout pauses for a person (0: never).", default=DEFAULT_ERROR_LIMIT)
    outage_limit: Duration = described(
        "How long the step holds while Prometheus cannot be reached (unreachable, a timeout, 5xx) before the "
        "rollout pauses for a person; shorter outages pass by themselves and the rollout goes on (0s: hold for "
        "ever).", default=DEFAULT_OUTAGE_LIMIT)
    measurement_retention: Annotated[int, Field(ge=0, le=MAX_MEASUREMENT_RETENTION)] = described(
        "How many analysis runs status.analysisHistory keeps, the oldest dropped first (graft rollout history "
        "shows them; 0: none, the latest run stays in status.analysis).", default=DEFAULT_MEASUREMENT_RETENTION)


# -- webhooks and notifications ----------------------------------------------------------------------

HOOK_TYPES = ("confirm-rollout", "pre-rollout", "rollout", "confirm-promotion", "post-rollout", "rollback", "event")
MOMENTS = ("started", "step", "paused", "promoted", "rolledBack", "failed")
MAX_WEBHOOKS = 16
HookName = Annotated[str, StringConstraints(max_length=63, pattern=METRIC_NAME_PATTERN)]


class Webhook(ApiModel):
    """An HTTP endpoint the rollout POSTs its payload to at one of its turning points (docs/architecture.md,
    "Notifications and webhooks")."""

    name: HookName = described("The hook's name (a rollout hook's answers are the check webhook/NAME).")
    type: Literal[HOOK_TYPES] = described(
        "When it is called and what its answer means. Awaited gates: confirm-rollout (the rollout waits, touching "
        "no pod, while it answers non-2xx), pre-rollout (non-2xx fails the rollout before any pod is touched), "
        "rollout (at every analysis run; non-2xx is a failed check), confirm-promotion (a manual step, and the "
        "step before the last, wait while it answers non-2xx; a 2xx approves a manual step). Fired, not awaited: "
        "post-rollout (the rollout ended), rollback (a rollback began), event (every Event).",
        json_schema_extra={"type": "string"})
    url: Annotated[str, StringConstraints(max_length=2048, pattern=URL_PATTERN)] = described(
        "The URL to POST to (http or https).")
    timeout: Duration = described("How long one call may take: more than 0s, at most 60s (a gate is awaited).",
                                  default="10s")
    retries: Annotated[int, Field(ge=0, le=5)] = described(
        "Tries after the first when the call fails to connect, times out or answers 408, 429 or 5xx (a 4xx is an "
        "answer).", default=2)
    metadata: Annotated[dict[str, Annotated[str, StringConstraints(max_length=1024)]],
                        Field(max_length=16)] | None = described(
        "Key-value pairs sent with every call, in the body's metadata.", default=None)


class NotificationRule(ApiModel):
    """One of the operator's notification receivers (the chart's notifications.receivers) and what it hears."""

    receiver: HookName = described("The receiver's name, as the chart's notifications.receivers names it.")
    moments: Annotated[list[Literal[MOMENTS]], Field(max_length=len(MOMENTS))] | None = described(
        "Which moments it is told of: started, step, paused, promoted, rolledBack, failed (default: the "
        "receiver's own, as the chart sets them).", default=None,
        json_schema_extra={"items": {"type": "string", "enum": list(MOMENTS)}})


class PatchRolloutSpec(ApiModel):
    """What to roll out, to which pods, in which steps, judged how."""

    selector: RolloutSelector = described(RolloutSelector.__doc__)
    patch: RolloutPatch = described(RolloutPatch.__doc__)
    traffic_routing: TrafficRouting = described(
        "podRatio: the share of canary pods sets the weight; gatewayAPI: an HTTPRoute's backend weights do.",
        default=TrafficRouting(pod_ratio=PodRatio()))
    steps: Annotated[list[Step], Field(min_length=1, max_length=MAX_STEPS), AfterValidator(_step_rules),
                     Says.of(too_short="must be a non-empty list")] = described(
        "Traffic steps; weights strictly increase and the last is 100. A step holds for its pause, then for a "
        "passing analysis, then (untilApproved, or pause {}) for a person's approval.",
        default=[Step.model_validate(s) for s in DEFAULT_STEPS], json_schema_extra=cel(*STEP_RULES))
    analysis: Analysis = described(Analysis.__doc__, default=Analysis())
    progress_deadline: Duration = described(
        "How long a step may go past its pause without advancing before the rollout rolls back.", default="30m")
    paused: bool = described("Hold at the current step (yours alone: a pause the analysis decides lives in "
                             "status.pauseConditions).", default=False)
    action: Literal["apply", "revert"] = described(
        "apply: roll the patch out (a new version of an applied patch replaces it, pod by pod). revert: take an "
        "applied patch out of the fleet, through the same steps and checks.", default="apply",
        json_schema_extra={"type": "string", **cel(Cel(IMMUTABLE, "is immutable: create a new PatchRollout to undo "
                                                                  "a patch"))})
    webhooks: Annotated[list[Webhook], Field(max_length=MAX_WEBHOOKS, json_schema_extra=LIST_MAP_NAME)] | None = \
        described("HTTP endpoints called at the rollout's turning points: gates that confirm or refuse, and hooks "
                  "told what happened.", default=None)
    notifications: Annotated[list[NotificationRule], Field(max_length=16, json_schema_extra={
            "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["receiver"]})] | None = described(
        "Which of the operator's notification receivers hear of this rollout, and of what; when absent, every "
        "receiver with its own moments; an empty list: none.", default=None)
    ttl_seconds_after_finished: Annotated[int, Field(ge=0)] | None = described(
        "Seconds after the rollout finishes (Promoted, RolledBack or Failed; not a spec refused as invalid, which "
        "waits to be fixed) before the operator deletes it. 0: as soon as it finishes. Unset: kept, up to its "
        "PatchFleet's revisionHistoryLimit.", default=None)

    def rules(self) -> None:
        # list-map keys: the API server refuses a key twice (x-kubernetes-list-type: map)
        for field, items, key in (("webhooks", self.webhooks, "name"), ("notifications", self.notifications, "receiver")):
            seen: set[str] = set()
            for i, item in enumerate(items or ()):
                value = getattr(item, key)
                if value in seen:
                    raise refuse(f"duplicate {key} {value!r}", at=f"{field}[{i}].{key}")
                seen.add(value)


# -- status ----------------------------------------------------------------------------------------


def _finite(value: float | None) -> float | None:
    """A number a status can hold (JSON has no NaN or Inf): non-finite values are written as none."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _numbers(values: dict[str, float] | None) -> dict[str, float] | None:
    kept = {k: float(f"{v:.6g}") for k, v in (values or {}).items() if _finite(v) is not None}
    return kept or None


class PodStatus(StatusModel):
    """One engine pod as the rollout last saw it."""

    compact: ClassVar = True

    name: str = described("The pod's name.")
    uid: str | None = described("The pod's UID (a pod of the same name recreated is another pod).", default=None)
    container_id: str | None = described("The engine container's ID (a restart changes it).", default=None,
                                         alias="containerID")
    restart_count: int | None = described("The engine container's restarts.", default=None)
    track: str | None = described("canary or stable.", default=None)
    revision: str | None = described("The engine's revision when last confirmed (name@version, ... or base).",
                                     default=None)
    patched_at: Time = described("When the canary patch was confirmed applied.", default=None)


class CheckRecord(StatusModel):
    """One check of a past analysis run: its numbers and verdict, without the sentence."""

    compact: ClassVar = True

    name: str = described("The check's name.")
    role: str | None = described("breaker or gate.", default=None)
    value: Annotated[float | None, PlainSerializer(_finite)] = described(
        "The measured value (none when there was no data).", default=None, json_schema_extra={"nullable": True})
    threshold: str | None = described("The limit, in words (<= 0.005, <= 1.3 x stable).", default=None)
    window: str | None = described("The window the run looked at.", default=None)
    verdict: str | None = described("Successful, Failed, Inconclusive, Error or Skipped.", default=None)
    breaches: int | None = described("Breaches in a row (breakers).", default=None)
    dry_run: Annotated[bool | None, OrNone] = described("Judged and reported but never decides.", default=None)
    conclusive: Annotated[bool | None, OrNone] = described("A gate's failure strong enough to roll back.",
                                                           default=None)
    numbers: Annotated[dict[str, float] | None, PlainSerializer(_numbers)] = described(
        "The counts and bounds the verdict rests on (requests, errors, lower and upper bounds, ...).", default=None)


class CheckStatus(CheckRecord):
    """One check of the latest analysis run, with the numbers it was judged on."""

    short: Annotated[bool | None, OrNone] = described(
        "Inconclusive for lack of traffic (not for lack of data).", default=None)
    pending: Annotated[bool | None, OrNone] = described(
        "Inconclusive while its number is being made (a job check's Job runs): the step waits, whatever the role.",
        default=None)
    message: str | None = described("The verdict in words.", default=None)


class AnalysisStatus(StatusModel):
    """The latest analysis run and the counts that pause a rollout."""

    compact: ClassVar = True
    always: ClassVar = ("outage_since",)      # null clears it in the merge patch

    last_run: Time = described("When the latest run was made.", default=None)
    verdict: str | None = described("Its verdict: Successful, Failed, Inconclusive or Error.", default=None)
    inconclusive_runs: int | None = described("Holding runs in a row since the step's pause ended.", default=None)
    error_runs: int | None = described("Runs in a row whose queries failed, outages aside.", default=None)
    outage_since: Time = described("Since when Prometheus cannot be reached (the step holds).", default=None,
                                   json_schema_extra={"nullable": True})
    outage_seconds: Annotated[float | None, PlainSerializer(lambda v: None if v is None else round(v, 3))] = described(
        "Time this step held for Prometheus; its progress deadline waited as long.", default=None)
    results: list[CheckStatus] | None = described("Each check of the latest run.", default=None)


class AnalysisRunStatus(StatusModel):
    """One past analysis run."""

    time: Time = described("When it ran.", default=None)
    step: int | None = described("The step the run judged, counted from 1.", default=None)
    verdict: str | None = described("Its verdict.", default=None)
    results: list[CheckRecord] | None = described("Each check's numbers and verdict.", default=None)


class PauseCondition(StatusModel):
    """A pause the controller decided because the analysis could not decide."""

    compact: ClassVar = True

    reason: str = described("InconclusiveLimit, AnalysisErrorLimit or AnalysisOutageLimit.")
    message: str | None = described("Why, in words.", default=None)
    start_time: str = described("When the pause began.")


class PatchRolloutStatus(StatusModel):
    """Where the rollout stands, kept in the object so a restarted operator resumes the same step. Every
    field is written on every change; one without a value as null, which the merge patch clears."""

    phase: str | None = described(
        "Pending, Progressing, Paused, Promoted, RollingBack, RolledBack or Failed.", default=None,
        json_schema_extra={"enum": [p.value for p in Phase]})
    reason: str | None = described("Why it is where it is, in one CamelCase word (as its latest Event).",
                                   default=None)
    message: str | None = described("Why, in words.", default=None)
    observed_generation: int | None = described("The spec's generation the status was written from.", default=None)
    patch: str | None = described("The patch this rollout applies, name@version.", default=None)
    stable_patch: Annotated[str | None, OrNone] = described(
        "An upgrade: the version of the patch the stable side runs.", default=None)
    step_index: int | None = described("The current step, counted from 0.", default=None)
    step: int | None = described("The current step, counted from 1 (as in Events and the CLI).", default=None)
    weight: int | None = described("The traffic weight in effect, percent.", default=None)
    canary_pods: int | None = described("Ready pods on the canary track.", default=None)
    traffic_share: float | None = described(
        "The canary's real share of the traffic, percent: canary pods over Ready pods with pod-ratio routing, the "
        "route's weight with Gateway API.", default=None)
    stable_revision: str | None = described("What the stable pods run (name@version, ... or base).", default=None)
    canary_revision: str | None = described("What the canary pods run.", default=None)
    started_at: Time = described("When the rollout started.", default=None)
    step_started_at: Time = described("When the current step started.", default=None)
    step_ready_at: Time = described("When the step's pods and route were in place.", default=None)
    awaiting_approval_since: Time = described(
        "Since when the step (an untilApproved one) has waited for a person's approval (graft rollout promote).",
        default=None)
    end_phase: Annotated[str | None, OrNone] = described("Where RollingBack settles: RolledBack or Failed.",
                                                         default=None)
    cause: Annotated[str | None, OrNone] = described("Why it is rolling back.", default=None)
    full_promotion: bool | None = described("Promoted at once (graft rollout promote --full).", default=None)
    fleet: Annotated[str | None, OrNone] = described(
        "The PatchFleet this rollout acts on (its durable patch state).", default=None)
    pods: list[PodStatus] | None = described("The engine pods the rollout acts on.", default=None)
    analysis: AnalysisStatus | None = described(AnalysisStatus.__doc__, default=None)
    analysis_history: Annotated[list[AnalysisRunStatus] | None, Field(max_length=MAX_MEASUREMENT_RETENTION),
                                OrNone] = described(
        "The latest analysis runs, oldest first, at most spec.analysis.measurementRetention of them: per run its "
        "time, step and verdict, and per check its value, threshold, counts and bounds (numbers) and verdict.",
        default=None)
    pause_conditions: Annotated[list[PauseCondition] | None, Field(max_length=8), OrNone] = described(
        "Pauses the controller decided because the analysis could not (InconclusiveLimit, AnalysisErrorLimit, "
        "AnalysisOutageLimit); the annotation graft.dev/resume: \"true\" ends them.", default=None)
    conditions: Annotated[list[Condition] | None, Field(json_schema_extra=CONDITIONS_LIST), OrNone] = described(
        "Progressing, Promoted, Healthy and Completed, as the Kubernetes API conventions spell conditions (kubectl "
        "wait --for=condition=Promoted).", default=None)


KIND = Kind(
    kind="PatchRollout", plural="patchrollouts", short_names=("prl",),
    description="Rolls one hot patch across the engine pods a selector picks, a traffic step at a time, each step "
                "judged by Prometheus; promotes it into their PatchFleet, or rolls it back.",
    spec=PatchRolloutSpec, spec_description=PatchRolloutSpec.__doc__,
    status=PatchRolloutStatus, status_description=PatchRolloutStatus.__doc__,
    columns=(Column("Phase", "string", ".status.phase"), Column("Step", "integer", ".status.step"),
             Column("Weight", "integer", ".status.weight"),
             Column("Share", "number", ".status.trafficShare", priority=1),
             Column("Canary", "string", ".status.canaryRevision"), Column("Stable", "string", ".status.stableRevision"),
             Column("Age", "date", ".metadata.creationTimestamp")))
