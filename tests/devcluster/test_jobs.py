"""Jobs in the dev cluster, run by the real pod runner on the emulator with `python -c` containers:
success, retries up to backoffLimit, a deadline, the pod's log, deletion after ttlSecondsAfterFinished."""
from __future__ import annotations

import asyncio
import time

from graft.devcluster.podrunner import PodRunner

NS = "default"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
PODS = f"/api/v1/namespaces/{NS}/pods"


def job(name: str, code: str, **spec) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {**spec, "template": {"spec": {"restartPolicy": "Never",
                                                   "containers": [{"name": "task", "command": ["python", "-c", code]}]}}}}


async def finished(client, name: str, timeout: float = 40.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = (await client.get(f"{JOBS}/{name}")).json()
        conds = {c["type"] for c in (obj.get("status") or {}).get("conditions") or [] if c["status"] == "True"}
        if conds & {"Complete", "Failed"}:
            return obj
        await asyncio.sleep(0.2)
    raise AssertionError(f"job {name} never finished: {obj.get('status')}")


def conditions(obj: dict) -> dict[str, str]:
    return {c["type"]: c["reason"] for c in obj["status"]["conditions"]}


async def test_a_job_that_succeeds_and_its_log(api, client, tmp_path):
    async with PodRunner(api.url, NS, tmp_path / "pods", poll=0.2) as _:
        await client.post(JOBS, json=job("ok", "print('{\"score\": 0.9}')"))
        done = await finished(client, "ok")
        pods = (await client.get(PODS, params={"labelSelector": "job-name=ok"})).json()["items"]
    assert conditions(done)["Complete"] == "CompletionsReached"
    assert done["status"]["succeeded"] == 1 and done["status"]["active"] == 0
    assert done["status"]["startTime"] <= done["status"]["completionTime"]
    assert len(pods) == 1 and pods[0]["metadata"]["labels"]["batch.kubernetes.io/job-name"] == "ok"
    assert pods[0]["metadata"]["ownerReferences"][0]["uid"] == done["metadata"]["uid"]


async def test_a_failing_job_is_retried_up_to_its_backoff_limit(api, client, tmp_path):
    async with PodRunner(api.url, NS, tmp_path / "pods", poll=0.2):
        await client.post(JOBS, json=job("bad", "raise SystemExit(2)", backoffLimit=1))
        done = await finished(client, "bad")
        pods = (await client.get(PODS, params={"labelSelector": "job-name=bad"})).json()["items"]
    assert conditions(done)["Failed"] == "BackoffLimitExceeded"
    assert done["status"]["failed"] == 2 and len(pods) == 2
    assert {p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] for p in pods} == {2}


async def test_a_job_past_its_deadline_fails_and_a_finished_one_goes_after_its_ttl(api, client, tmp_path):
    async with PodRunner(api.url, NS, tmp_path / "pods", poll=0.2):
        await client.post(JOBS, json=job("slow", "import time; time.sleep(60)", activeDeadlineSeconds=1,
                                         ttlSecondsAfterFinished=2))
        done = await finished(client, "slow")
        assert conditions(done)["Failed"] == "DeadlineExceeded"
        deadline = time.monotonic() + 20
        while (await client.get(f"{JOBS}/slow")).status_code != 404:
            assert time.monotonic() < deadline, "the finished job was never deleted"
            await asyncio.sleep(0.3)
