"""The dev cluster's Job controller: batch/v1 Jobs of one pod at a time (completions and parallelism 1).

Each pass makes the Job's next pod from its template (labels `job-name` and `batch.kubernetes.io/job-name`,
an ownerReference to the Job), counts its pods' phases, and writes the status kube-controller-manager
writes: active/succeeded/failed, startTime, completionTime, conditions Complete or Failed (with
SuccessCriteriaMet / FailureTarget first). A failed pod is retried up to `backoffLimit` (default 6);
`activeDeadlineSeconds` fails the Job and deletes its running pod; `ttlSecondsAfterFinished` deletes a
finished Job and its pods.
"""
from __future__ import annotations

import logging
import secrets
import time
from datetime import datetime, timezone
from typing import Any

import httpx

log = logging.getLogger(__name__)

JOB_NAME = "job-name"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
_MERGE = {"content-type": "application/merge-patch+json"}


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def _condition(kind: str, reason: str, message: str, now: float) -> dict[str, Any]:
    return {"type": kind, "status": "True", "reason": reason, "message": message,
            "lastProbeTime": _stamp(now), "lastTransitionTime": _stamp(now)}


def job_pod(job: dict, namespace: str) -> dict[str, Any]:
    """The next pod of `job`, made from its template as the Job controller makes it."""
    name = job["metadata"]["name"]
    template = job["spec"]["template"]
    meta = template.get("metadata") or {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-{secrets.token_hex(3)}", "namespace": namespace,
                         "labels": {**(meta.get("labels") or {}), JOB_NAME: name, JOB_NAME_LABEL: name,
                                    "batch.kubernetes.io/controller-uid": job["metadata"]["uid"]},
                         "annotations": dict(meta.get("annotations") or {}),
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                              "uid": job["metadata"]["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": {**template["spec"], "restartPolicy": template["spec"].get("restartPolicy", "Never")}}


async def reconcile_jobs(api: httpx.AsyncClient, namespace: str, pods: list[dict]) -> None:
    """One pass of the Job controller over `namespace`'s Jobs, given its pods as listed."""
    base = f"/apis/batch/v1/namespaces/{namespace}/jobs"
    pod_base = f"/api/v1/namespaces/{namespace}/pods"
    r = await api.get(base)
    r.raise_for_status()
    now = time.time()
    for job in r.json().get("items") or []:
        if job["metadata"].get("deletionTimestamp"):
            continue
        name = job["metadata"]["name"]
        spec, status = job.get("spec") or {}, dict(job.get("status") or {})
        owned = [p for p in pods if (p["metadata"].get("labels") or {}).get(JOB_NAME) == name
                 and not p["metadata"].get("deletionTimestamp")]
        phases = [(p.get("status") or {}).get("phase") for p in owned]
        active = [p for p, ph in zip(owned, phases) if ph not in ("Succeeded", "Failed")]
        succeeded, failed = phases.count("Succeeded"), phases.count("Failed")
        finished = any(c["type"] in ("Complete", "Failed") and c["status"] == "True"
                       for c in status.get("conditions") or [])
        if finished:
            ttl = spec.get("ttlSecondsAfterFinished")
            done = status.get("completionTime") or next(
                (c["lastTransitionTime"] for c in status.get("conditions") or [] if c["type"] == "Failed"), None)
            if ttl is not None and done and now >= _seconds(done) + int(ttl):
                for p in owned:
                    await api.delete(f"{pod_base}/{p['metadata']['name']}")
                await api.delete(f"{base}/{name}")
                log.info("job %s: deleted %s s after it finished (ttlSecondsAfterFinished)", name, ttl)
            continue
        start = status.get("startTime") or _stamp(now)
        want: dict[str, Any] = {"startTime": start, "succeeded": succeeded, "failed": failed}
        deadline = spec.get("activeDeadlineSeconds")
        backoff = int(spec.get("backoffLimit", 6))
        conditions: list[dict] = []
        if succeeded:
            conditions = [_condition("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods", now),
                          _condition("Complete", "CompletionsReached", "Reached expected number of succeeded pods", now)]
            want["completionTime"] = _stamp(now)
        elif deadline is not None and now >= _seconds(start) + int(deadline):
            for p in active:
                await api.delete(f"{pod_base}/{p['metadata']['name']}")
            active = []
            message = "Job was active longer than specified deadline"
            conditions = [_condition("FailureTarget", "DeadlineExceeded", message, now),
                          _condition("Failed", "DeadlineExceeded", message, now)]
        elif failed > backoff:
            message = "Job has reached the specified backoff limit"
            conditions = [_condition("FailureTarget", "BackoffLimitExceeded", message, now),
                          _condition("Failed", "BackoffLimitExceeded", message, now)]
        elif not active:
            created = await api.post(pod_base, json=job_pod(job, namespace))
            created.raise_for_status()
            active = [created.json()]
            log.info("job %s: created pod %s", name, created.json()["metadata"]["name"])
        want["active"] = len(active)
        if conditions:
            want["conditions"] = conditions
        if any(status.get(k) != v for k, v in want.items()):
            await api.patch(f"{base}/{name}/status", json={"status": want}, headers=_MERGE)
