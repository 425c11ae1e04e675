"""The job metric provider: a check's number from a Kubernetes Job, made once per step.

A check with `job: {metadata, spec, jsonPath, timeout}` gets one Job per step of its rollout: made in
the rollout's namespace when the step's analysis first runs, its placeholders filled
(graft.rollout.queries.render_job), and judged once it ends. Until then the check is pending: it
holds the step whatever its role (graft.rollout.analysis). The Job is the measurement of the whole
step, so it is not made again at each analysis run; its number is final (a gate it breaches rolls
back) and is read once per Job (`JobProvider._done`).

The number: without `jsonPath`, the exit code of the Job's container (0 when the Job completed); with
it, the step's value in the last line of the container's log that is a JSON object (the last line of
`graft eval bbh`, for instance), read with web's safe JSONPath subset; nothing or null there is no
data. A Job that failed with a `jsonPath` is an error naming its reason, exit code and last line;
so is one past its deadline.

The Job's name is the rollout's and the check's, and a digest of the rollout's uid, the check, the
step and when the step started: a retried rollout or a step begun again gets a Job of its own, and
the same step asks the same Job whichever replica of the operator asks. It carries labels
`graft.dev/rollout-uid` and `graft.dev/check`, annotations `graft.dev/rollout` and `graft.dev/step`,
and an ownerReference to the PatchRollout, so deleting the rollout deletes its Jobs. Unset in the
spec: `backoffLimit` 0 (one pod: its exit code is the answer), `activeDeadlineSeconds` the check's
timeout, `ttlSecondsAfterFinished` an hour, the pod's `restartPolicy` Never.

Whether Jobs are made at all is the administrator's choice (`GRAFT_JOB_CHECKS`, and the service
accounts their pods may run as, `GRAFT_JOB_SERVICE_ACCOUNTS`): see graft.operator.runtime.job_refusal.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections import OrderedDict
from datetime import datetime
from typing import Any

from graft.api import API_VERSION
from graft.operator.kube import Kube, KubeError, job_path, pods_path
from graft.operator.web import MISSING, json_path
from graft.rollout.observation import Measurement

ROLLOUT_UID_LABEL = "graft.dev/rollout-uid"
CHECK_LABEL = "graft.dev/check"
ROLLOUT_ANNOTATION = "graft.dev/rollout"
STEP_ANNOTATION = "graft.dev/step"
TTL_SECONDS = 3600           # a finished Job is deleted after an hour unless its spec says otherwise
LOG_LINES = "200"            # the tail of the log read for the JSON line
LOG_BYTES = str(256 * 1024)
REMEMBERED = 1024            # finished Jobs whose result is kept (by uid)
_NAME = re.compile(r"[^a-z0-9-]+")


def job_name(rollout: str, check: str, identity: str) -> str:
    """A DNS label (at most 63 characters): rollout and check as far as they fit, then a digest of `identity`."""
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    stem = _NAME.sub("-", f"{rollout}-{check}".lower())[:52].strip("-")
    return f"{stem}-{digest}"


def job_spec_with_defaults(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """`spec` (a JobSpec) with what it leaves unset filled as the module docstring says."""
    spec.setdefault("backoffLimit", 0)
    spec.setdefault("activeDeadlineSeconds", max(1, math.ceil(timeout)))
    spec.setdefault("ttlSecondsAfterFinished", TTL_SECONDS)
    spec.setdefault("template", {}).setdefault("spec", {}).setdefault("restartPolicy", "Never")
    return spec


def job_manifest(name: str, namespace: str, spec_json: str, *, labels: dict[str, str],
                 annotations: dict[str, str], timeout: float, owner: dict[str, Any]) -> dict[str, Any]:
    """The Job to create: the check's spec with its defaults (`job_spec_with_defaults`), labelled and owned."""
    spec = job_spec_with_defaults(json.loads(spec_json), timeout)
    template = spec["template"]
    pod_labels = (template.setdefault("metadata", {})).setdefault("labels", {})
    pod_labels.update({ROLLOUT_UID_LABEL: owner["uid"], CHECK_LABEL: labels[CHECK_LABEL]})
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations,
                         "ownerReferences": [{"apiVersion": API_VERSION, "kind": "PatchRollout",
                                              "name": owner["name"], "uid": owner["uid"]}]},
            "spec": spec}


def _condition(job: dict[str, Any]) -> dict[str, Any] | None:
    """The Job's Complete or Failed condition, when it has ended."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return cond
    return None


def _age(job: dict[str, Any], now: float) -> str:
    created = (job.get("metadata") or {}).get("creationTimestamp")
    try:
        since = datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    except (AttributeError, ValueError):
        return ""
    return f" for {max(0, int(now - since))}s"


def _exit_code(pod: dict[str, Any] | None) -> int | None:
    for status in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated is not None and terminated.get("exitCode") is not None:
            return int(terminated["exitCode"])
    return None


def last_json_line(log: str) -> dict[str, Any] | None:
    """The last line of `log` that is a JSON object."""
    for line in reversed(log.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                return doc
    return None


class JobProvider:
    """Makes each step's Job of a job check and reads its number once it has ended."""

    def __init__(self) -> None:
        self._done: OrderedDict[str, Measurement] = OrderedDict()   # a finished Job's uid -> its result

    async def measure(self, kube: Kube, key: str, job: Any, *, namespace: str, owner: dict[str, Any],
                      check: str, step: int, step_started: float | None) -> Measurement:
        """The check's Measurement for this run: pending while its Job runs, then its number."""
        identity = f"{owner['uid']}/{key}/{step}/{step_started or 0:.0f}"
        name = job_name(owner["name"], check, identity)
        path = job_path(namespace, name)
        try:
            found = await kube.get(path)
            if found is None:
                labels = {**dict(job.labels), ROLLOUT_UID_LABEL: owner["uid"], CHECK_LABEL: check}
                annotations = {**dict(job.annotations), ROLLOUT_ANNOTATION: owner["name"], STEP_ANNOTATION: str(step)}
                body = job_manifest(name, namespace, job.spec_json, labels=labels, annotations=annotations,
                                    timeout=job.timeout, owner=owner)
                try:
                    made = await kube.create(job_path(namespace), body)
                except KubeError as e:
                    if e.status != 409:         # made meanwhile (another replica): read it next run
                        raise
                else:
                    if made.get("kind") == "Status":    # a 404: no such namespace, or no Jobs here
                        return Measurement(key, error=f"job {name}: {made.get('message') or 'not found'}")
                return Measurement(key, {"value": None}, pending=f"job {name} started")
        except KubeError as e:
            return Measurement(key, error=f"job {name}: {e.message}", outage=e.status >= 500 or e.status == 429)
        ended = _condition(found)
        if ended is None:
            return Measurement(key, {"value": None}, pending=f"job {name} running{_age(found, time.time())}")
        uid = found["metadata"].get("uid") or name
        if uid not in self._done:
            try:
                self._done[uid] = await self._result(kube, key, found, ended, job.json_path)
            except KubeError as e:
                return Measurement(key, error=f"job {name}: {e.message}", outage=e.status >= 500)
            while len(self._done) > REMEMBERED:
                self._done.popitem(last=False)
        done = self._done[uid]
        return Measurement(key, dict(done.values), error=done.error, final=done.final)

    async def _result(self, kube: Kube, key: str, found: dict[str, Any], ended: dict[str, Any],
                      path: str | None) -> Measurement:
        meta = found["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        pods = await kube.list(pods_path(namespace), label_selector=f"job-name={name}")
        pod = max(pods, key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]),
                  default=None)
        code = _exit_code(pod)
        failed = ended["type"] == "Failed"
        why = f"job {name} failed ({ended.get('reason') or 'Failed'}" + (f", exit code {code}" if code is not None else "")
        if path is None:
            if not failed:
                return Measurement(key, {"value": 0.0}, final=True)
            if code is None:
                return Measurement(key, error=f"{why}): {ended.get('message') or 'no container ran to its end'}")
            return Measurement(key, {"value": float(code)}, final=True)
        log = ""
        if pod is not None:
            log = await kube.text(pods_path(namespace, pod["metadata"]["name"]) + "/log",
                                  tailLines=LOG_LINES, limitBytes=LOG_BYTES) or ""
        last = next((line for line in reversed(log.splitlines()) if line.strip()), "")
        if failed:
            return Measurement(key, error=f"{why}): {last[:300] or ended.get('message') or 'no log'}")
        doc = last_json_line(log)
        if doc is None:
            return Measurement(key, error=f"job {name} printed no line that is a JSON object (last: {last[:200]!r})")
        value = json_path(doc, path)
        if value is MISSING or value is None:
            return Measurement(key, {"value": None}, final=True)
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)):
            return Measurement(key, error=f"job {name}: {path} is {json.dumps(value)[:80]}, not a number")
        return Measurement(key, {"value": float(value)}, final=True)
