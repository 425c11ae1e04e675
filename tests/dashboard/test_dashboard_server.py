"""`graft dashboard` as a process against the API server emulator: it acts only for its own page
(the token the page carries, its own Host), refuses an unknown verb, says a refused verb's reason
in the CLI's words, and `kubectl graft dashboard` is the same command."""
import asyncio
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from graft.devcluster.apiserver import ApiServer
from graft.devcluster.kubeconfig import write_kubeconfig

pytestmark = pytest.mark.timeout(90)
CRDS = Path(__file__).resolve().parents[2] / "crds"
ROLLOUT = {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout", "metadata": {"name": "kv-align"},
           "spec": {"selector": {"matchLabels": {"app": "llm-engine"}},
                    "patch": {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}}}}


@pytest.fixture
async def dashboard(tmp_path):
    async with ApiServer(crd_paths=[CRDS]) as api:
        async with httpx.AsyncClient(base_url=api.url, timeout=10) as client:
            await client.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace",
                                                          "metadata": {"name": "llm"}})
            await client.post("/apis/graft.dev/v1alpha1/namespaces/llm/patchrollouts", json=ROLLOUT)
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url, namespace="llm")
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "graft.cli", "dashboard", "--kubeconfig",
                                                    str(kubeconfig), "--port", "0", stdout=subprocess.PIPE)
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert line.startswith("Graft dashboard for namespace llm: http://127.0.0.1:"), line
            yield line.rsplit(" ", 1)[1].strip()
        finally:
            proc.terminate()
            await proc.wait()


async def test_an_action_needs_the_pages_token_and_the_servers_own_host(dashboard):
    async with httpx.AsyncClient(base_url=dashboard, timeout=10) as client:
        page = (await client.get("/")).text
        token = re.search(r'name="graft-token" content="([^"]+)"', page).group(1)
        # another site's form or script: no token (a form cannot send the header), or a rebound name
        refused = await client.post("/api/rollouts/kv-align/pause")
        assert refused.status_code == 403 and "X-Graft-Token" in refused.json()["message"]
        rebound = await client.post("/api/rollouts/kv-align/pause", headers={"X-Graft-Token": token,
                                                                             "Host": "attacker.example"})
        assert rebound.status_code == 400
        unknown = await client.post("/api/rollouts/kv-align/delete", headers={"X-Graft-Token": token})
        assert unknown.status_code == 404 and "promote, pause, resume, abort, retry, undo" in unknown.json()["message"]
        # the CLI's refusal, word for word
        retry = await client.post("/api/rollouts/kv-align/retry", headers={"X-Graft-Token": token})
        assert retry.status_code == 409
        assert retry.json()["message"] == ("PatchRollout llm/kv-align is Pending: only a RolledBack or Failed rollout "
                                           "can be retried")
        paused = await client.post("/api/rollouts/kv-align/pause", headers={"X-Graft-Token": token})
        assert paused.json() == {"ok": True, "message": "PatchRollout llm/kv-align paused"}

        async def seen_paused():
            while not (await client.get("/api/state")).json()["rollouts"][0]["paused"]:
                await asyncio.sleep(0.1)
        await asyncio.wait_for(seen_paused(), 10)      # the watch brought the change back


def test_kubectl_graft_dashboard_is_graft_dashboard():
    plugin = shutil.which("kubectl-graft", path=str(Path(sys.executable).parent))
    assert plugin, "kubectl-graft is not installed beside the interpreter"
    out = subprocess.run([plugin, "dashboard", "--help"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "--address" in out.stdout and "--port" in out.stdout and "--kubeconfig" in out.stdout, out.stdout
