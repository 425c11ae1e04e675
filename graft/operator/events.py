"""Kubernetes Events for a rollout: every transition has its own reason.

Reasons: StepStarted, PodsPatched, WeightSet, AnalysisPassed, AnalysisFailed, AnalysisInconclusive,
Promoted, PromotedByUser, RollingBack, RolledBack, Paused, Resumed, Aborted, PodRepatched,
PodDropped, InvalidSpec, InvalidControl, NoPods, EnginesUnreachable, RollbackBlocked,
ProgressDeadlineExceeded, and the refusals UnknownPatch, PatchConflict, PatchRefused,
Unauthorized, PodMisconfigured, PatchVerifyFailed, PatchChanged, DigestMismatch, BundleMissing, AdminTokenMissing,
HTTPRouteMissing, BackendRefsMissing, HTTPRouteUpdateFailed, VersionReused, SignatureExpired; the
trust refusals PrometheusNotAllowed, PrometheusSecretsNotAllowed, PrometheusSecretMissing; and the
Warning NotAnEngine (a pod the selector picks that is no engine of its workload, left alone).
"""
from __future__ import annotations

from typing import Any

import kopf

from graft.rollout.decision import Event

MAX_MESSAGE = 1000   # the API server keeps at most 1 KiB of an event message


def post(body: Any, event: Event) -> None:
    """Queue `event` on the rollout `body` (kopf posts it in the background)."""
    message = event.message if len(event.message) <= MAX_MESSAGE else event.message[: MAX_MESSAGE - 1] + "…"
    kopf.event(body, type=event.type, reason=event.reason, message=message)
