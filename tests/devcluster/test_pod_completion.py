"""A pod whose restartPolicy keeps a finished container stopped: kubelet's terminated state and the pod's
phase, as a Job's pod shows them; its log still served."""
from __future__ import annotations

import asyncio
import time

import pytest

from graft.devcluster.podrunner import PodRunner

NS = "default"
PODS = f"/api/v1/namespaces/{NS}/pods"


def task_pod(name: str, code: str, policy: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": policy, "containers": [{"name": "task", "command": ["python", "-c", code]}]}}


async def phase_of(client, name: str, want: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pod = (await client.get(f"{PODS}/{name}")).json()
        if (pod.get("status") or {}).get("phase") == want:
            return pod
        await asyncio.sleep(0.2)
    raise AssertionError(f"pod {name} never reached {want}: {pod.get('status')}")


@pytest.mark.parametrize(("code", "phase", "exit_code", "reason"),
                         [("print('done')", "Succeeded", 0, "Completed"), ("raise SystemExit(3)", "Failed", 3, "Error")])
async def test_a_never_restarted_container_ends_its_pod(api, client, tmp_path, code, phase, exit_code, reason):
    async with PodRunner(api.url, NS, tmp_path / "pods"):
        await client.post(PODS, json=task_pod("task", code, "Never"))
        pod = await phase_of(client, "task", phase)
        await asyncio.sleep(1.0)  # a few runner passes: still not restarted
        cs = (await client.get(f"{PODS}/task")).json()["status"]["containerStatuses"][0]
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (exit_code, reason)
    assert terminated["startedAt"] <= terminated["finishedAt"]
    assert cs["restartCount"] == 0 and "terminated" in cs["state"]


async def test_on_failure_restarts_a_failed_container_only(api, client, tmp_path):
    async with PodRunner(api.url, NS, tmp_path / "pods"):
        await client.post(PODS, json=task_pod("retry", "raise SystemExit(1)", "OnFailure"))
        await client.post(PODS, json=task_pod("once", "print('ok')", "OnFailure"))
        await phase_of(client, "once", "Succeeded")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = (await client.get(f"{PODS}/retry")).json().get("status") or {}
            if (status.get("containerStatuses") or [{}])[0].get("restartCount", 0) >= 1:
                break
            await asyncio.sleep(0.2)
    assert status["containerStatuses"][0]["restartCount"] >= 1
    assert status["phase"] != "Failed"
