"""The vocabulary every part of Graft shares: the engine, the operator, the CLI, the demo and the tests.

It names the custom resources, the phases and verdicts a rollout reports, and how a patch and an
engine's revision are written (`name@version`, sorted and comma-joined, `base` when nothing is
applied). It imports neither torch nor kopf, so any process may use it.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# -- the custom resources --------------------------------------------------------------------------

GROUP = "graft.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
ROLLOUTS = "patchrollouts"
FLEETS = "patchfleets"
TEMPLATES = "patchanalysistemplates"
CLUSTER_TEMPLATES = "clusterpatchanalysistemplates"


class Phase(StrEnum):
    """Where a PatchRollout stands (`status.phase`)."""

    PENDING = "Pending"
    PROGRESSING = "Progressing"
    PAUSED = "Paused"
    PROMOTED = "Promoted"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"
    FAILED = "Failed"

    @property
    def final(self) -> bool:
        """A final phase never changes again (short of `graft rollout retry`)."""
        return self in (Phase.PROMOTED, Phase.ROLLED_BACK, Phase.FAILED)

    @property
    def active(self) -> bool:
        """An active rollout holds its fleet: it acts on its pods (no other rollout of the fleet may
        start, and the fleet controller leaves it its patch and its pods' labels)."""
        return self in (Phase.PROGRESSING, Phase.PAUSED, Phase.ROLLING_BACK)


FINAL_PHASES = frozenset(p.value for p in Phase if p.final)
ACTIVE_PHASES = frozenset(p.value for p in Phase if p.active)


class Verdict(StrEnum):
    """The outcome of one check, or of one analysis run."""

    SUCCESSFUL = "Successful"
    FAILED = "Failed"
    INCONCLUSIVE = "Inconclusive"
    ERROR = "Error"
    SKIPPED = "Skipped"


class Track(StrEnum):
    """Which side of a rollout a pod serves (the `graft.dev/track` label)."""

    CANARY = "canary"
    STABLE = "stable"


NORMAL, WARNING = "Normal", "Warning"     # the two Kubernetes Event types


class Reason(StrEnum):
    """Why a rollout or a fleet is where it is: the reason of every Event the operator posts and of
    `status.reason` (and a PatchFleet's Converged condition). One vocabulary for both.

    Each member carries `text`, one line on when it is used, and `type`, the Event type it is posted
    with (`Normal` or `Warning`), or None where that depends (or where it is never an Event).
    """

    text: str
    type: str | None

    def __new__(cls, value: str, text: str, type: str | None = None) -> "Reason":
        member = str.__new__(cls, value)
        member._value_ = value
        member.text, member.type = text, type
        return member

    # a rollout moving through its steps
    STEP_STARTED = "StepStarted", "a step begins: its weight and what it holds for", NORMAL
    PODS_PATCHED = "PodsPatched", "the step's canaries run the patch", NORMAL
    WEIGHT_SET = "WeightSet", "the router sends the step's weight to the canaries", NORMAL
    STARTED = "Started", "status only: the rollout has begun its first step"
    PROGRESSING = "Progressing", "status only: the rollout moves on, nothing holds it"
    ANALYSIS_PASSED = "AnalysisPassed", "an analysis run passed", NORMAL
    ANALYSIS_FAILED = "AnalysisFailed", "a check reached its breach limit: the rollout rolls back", WARNING
    ANALYSIS_INCONCLUSIVE = "AnalysisInconclusive", "an analysis run could not decide: the step holds", WARNING
    ANALYSIS_UNAVAILABLE = ("AnalysisUnavailable", "Prometheus cannot be reached: the step holds and goes on by itself",
                            WARNING)
    ANALYSIS_AVAILABLE = "AnalysisAvailable", "Prometheus answers again: the step goes on", NORMAL
    INCONCLUSIVE_LIMIT = "InconclusiveLimit", "too many inconclusive runs: paused until resumed or aborted", WARNING
    ANALYSIS_ERROR_LIMIT = "AnalysisErrorLimit", "too many analysis runs failed in a row: paused", WARNING
    ANALYSIS_OUTAGE_LIMIT = "AnalysisOutageLimit", "Prometheus unreachable past outageLimit: paused", WARNING
    COARSE_STEPS = "CoarseSteps", "pod-ratio routing cannot give a step's weight: one pod is a larger share", WARNING
    CANARY_RETURNED = "CanaryReturned", "a canary beyond what the step asks for goes back to stable", NORMAL
    POD_REPATCHED = "PodRepatched", "a canary restarted without the patch and gets it again", WARNING
    POD_DROPPED = "PodDropped", "a pod of the rollout is gone", NORMAL
    # people
    PAUSED = "Paused", "paused (spec.paused, or created paused)", NORMAL
    RESUMED = "Resumed", "spec.paused was cleared: the step's pause starts over", NORMAL
    PAUSE_ENDED = "PauseEnded", "a pause ended by the user (graft.dev/resume)", NORMAL
    AWAITING_APPROVAL = "AwaitingApproval", "a manual step passed its analysis and waits for a person", NORMAL
    APPROVED = "Approved", "a person approved a manual step (graft.dev/promote)", NORMAL
    AWAITING_CONFIRMATION = ("AwaitingConfirmation",
                             "a confirm-rollout or confirm-promotion webhook has not answered 2xx: the rollout waits",
                             NORMAL)
    CONFIRMED = "Confirmed", "the confirm-promotion webhooks answered 2xx: the step goes on", NORMAL
    PRE_ROLLOUT_FAILED = "PreRolloutFailed", "a pre-rollout webhook failed: the rollout ends before any pod is touched", \
        WARNING
    PROMOTED_BY_USER = "PromotedByUser", "a person promoted a step or the whole rollout (graft.dev/promote)", NORMAL
    INVALID_CONTROL = "InvalidControl", "an annotation control has a value it cannot take", WARNING
    ABORTED = "Aborted", "aborted by the user (graft.dev/abort)", WARNING
    # the end
    PROMOTED = "Promoted", "every pod runs the patch: the fleet keeps it", NORMAL
    ROLLING_BACK = "RollingBack", "the rollout reverts its patch: route first, then the engines", WARNING
    ROLLED_BACK = "RolledBack", "the patch is reverted on every pod (a Warning when the rollout failed)"
    ROLLBACK_BLOCKED = "RollbackBlocked", "the rollback cannot finish yet", WARNING
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded", "a step made no progress within progressDeadline", WARNING
    # waiting for something outside the rollout
    NO_PODS = "NoPods", "no pod the selector picks is Ready", WARNING
    ENGINES_UNREACHABLE = "EnginesUnreachable", "no engine answers its admin API", WARNING
    QUEUED = "Queued", "another rollout is active on the same fleet", WARNING
    FLEET_OVERLAP = "FleetOverlap", "the selector shares pods with another PatchFleet", WARNING
    NOT_AN_ENGINE = "NotAnEngine", "a pod the selector picks is no engine of its workload: left alone", WARNING
    ACTION_FAILED = ("ActionFailed", "an action on a pod failed unexpectedly (Kubernetes refused a write, an operator "
                     "error): tried again next tick", WARNING)
    # refusals: the rollout cannot go on
    INVALID_SPEC = "InvalidSpec", "the spec does not parse: the rollout fails, a fixed spec retries it", WARNING
    UNKNOWN_PATCH = "UnknownPatch", "the engine does not know the patch (404)", WARNING
    PATCH_CONFLICT = "PatchConflict", "the patch conflicts with one the engine runs (409)", WARNING
    PATCH_REFUSED = "PatchRefused", "the engine refuses the patch as malformed (400)", WARNING
    UNAUTHORIZED = "Unauthorized", "the engine refuses the operator's token or the bundle's signer (401/403)", WARNING
    POD_MISCONFIGURED = "PodMisconfigured", "an engine the operator cannot call as it is declared", WARNING
    PATCH_VERIFY_FAILED = ("PatchVerifyFailed", "the engine applied the patch, failed its check and reverted it (422)",
                           WARNING)
    PATCH_CHANGED = "PatchChanged", "spec.patch changed during the rollout", WARNING
    VERSION_REUSED = "VersionReused", "an engine runs this name@version from other code", WARNING
    DIGEST_MISMATCH = "DigestMismatch", "the bundle's digest is not the one the rollout pins", WARNING
    BUNDLE_MISSING = "BundleMissing", "the bundle's ConfigMap or key is missing", WARNING
    SIGNATURE_EXPIRED = "SignatureExpired", "the bundle's signature has expired", WARNING
    ADMIN_TOKEN_MISSING = "AdminTokenMissing", "the engines' admin token Secret or key is missing", WARNING
    HTTP_ROUTE_MISSING = "HTTPRouteMissing", "the rollout's HTTPRoute is not found", WARNING
    BACKEND_REFS_MISSING = "BackendRefsMissing", "the HTTPRoute has no rule with backendRefs to both Services", WARNING
    HTTP_ROUTE_UPDATE_FAILED = "HTTPRouteUpdateFailed", "the HTTPRoute cannot be written", WARNING
    PROMETHEUS_NOT_ALLOWED = "PrometheusNotAllowed", "the rollout names a Prometheus the operator may not ask", WARNING
    PROMETHEUS_SECRETS_NOT_ALLOWED = ("PrometheusSecretsNotAllowed",
                                      "the rollout names Prometheus Secrets the operator may not read", WARNING)
    PROMETHEUS_SECRET_MISSING = "PrometheusSecretMissing", "a Prometheus Secret or key is missing", WARNING
    WEB_NOT_ALLOWED = "WebNotAllowed", "a web check names an address the operator may not ask", WARNING
    JOB_NOT_ALLOWED = "JobNotAllowed", ("a job check where the operator runs none, or whose pod would run as a "
                                        "service account it may not use"), WARNING
    # fleets and history
    CONVERGED = "Converged", "status only (a PatchFleet's Converged condition): every pod runs its patches"
    CONVERGING = ("Converging",
                  "status only (a PatchFleet's Converged condition, a pod's Patched one): pods are still pending")
    PATCHED = "Patched", "status only (an engine pod's Patched condition): the pod runs its fleet's patches"
    FLEET_CONVERGED = "FleetConverged", "a PatchFleet's pods all run its patches", NORMAL
    FLEET_CONVERGING = "FleetConverging", "a PatchFleet's pods changed and some are still pending", NORMAL
    TTL_EXPIRED = "TTLExpired", "a finished rollout past ttlSecondsAfterFinished is deleted", NORMAL
    HISTORY_PRUNED = ("HistoryPruned", "a finished rollout beyond the fleet's history limit is deleted, on the PatchFleet",
                      NORMAL)


def reason_table() -> str:
    """The Markdown table of every `Reason` (docs/architecture.md carries it between marker comments)."""
    rows = ["| Reason | Event type | When |", "| --- | --- | --- |"]
    for r in Reason:
        kind = r.type or ("—" if r.text.startswith("status only") else "varies")
        rows.append(f"| `{r}` | {kind} | {r.text} |")
    return "\n".join(rows) + "\n"


# -- patches and revisions -------------------------------------------------------------------------

# Patterns for `re.fullmatch` only: `re.match` with `$` would accept a trailing newline.
NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
VERSION_RE = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")
# lower-case hex, as hashlib writes it and the CRDs take it (graft.rollout.models builds its pattern from this)
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
DIGEST_PREFIX = "sha256:"
BASE = "base"


def digest_of(source: str) -> str:
    """The pinned digest of a bundle's source, as a rollout's `spec.patch.digest` writes it."""
    return DIGEST_PREFIX + hashlib.sha256(source.encode("utf-8")).hexdigest()


def config_digest(config: Mapping[str, Any] | None) -> str:
    """The digest of a patch's `config` (canonical JSON: sorted keys, no spaces; none is `{}`): how
    an engine's answer and a PatchFleet tell one config of the same `name@version` from another."""
    text = json.dumps(dict(config or {}), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return DIGEST_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True, order=True)
class PatchRef:
    """One patch at one version: `kv-align@3.2.1`."""

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    @classmethod
    def parse(cls, text: str) -> "PatchRef":
        name, sep, version = text.strip().partition("@")
        if not sep or not NAME_RE.fullmatch(name) or not VERSION_RE.fullmatch(version):
            raise ValueError(f"{text!r} is not of the form name@version")
        return cls(name, version)


def patch_ref(name: str, version: str) -> str:
    return str(PatchRef(name, version))


def revision_of(refs: Iterable[str]) -> str:
    """An engine's revision: its applied patches, sorted and comma-joined; `base` when none."""
    return ",".join(sorted(set(refs))) or BASE


def patches_of(revision: str) -> list[str]:
    """`a@1,b@2` -> ['a@1', 'b@2']; `base` or '' -> []."""
    return [p for p in (s.strip() for s in revision.split(",")) if p and p != BASE]


def parse_revision(text: str) -> list[PatchRef]:
    """A revision or a `GRAFT_PATCHES` list as validated references; raises ValueError naming the bad item."""
    return [PatchRef.parse(p) for p in patches_of(text)]


def has_patch(revision: str | None, ref: str) -> bool:
    return revision is not None and ref in patches_of(revision)


def with_patch(revision: str, ref: str) -> str:
    """The revision after applying `ref`, replacing any other version of the same patch."""
    name = ref.partition("@")[0]
    return revision_of([p for p in patches_of(revision) if p.partition("@")[0] != name] + [ref])


def without_patch(revision: str, ref: str) -> str:
    """The revision after reverting the patch named in `ref` (any version of it)."""
    name = ref.partition("@")[0]
    return revision_of(p for p in patches_of(revision) if p.partition("@")[0] != name)
