"""`graft demo` starts `graft dashboard` on its dev cluster for as long as it runs, prints its
address, and its report links each rollout's view there."""
import asyncio
from pathlib import Path
from types import SimpleNamespace

import httpx

from graft.demo import dashboard, dashboard_section
from graft.devcluster.apiserver import ApiServer
from graft.devcluster.kubeconfig import write_kubeconfig

CRDS = Path(__file__).resolve().parents[2] / "crds"


async def test_the_demo_serves_the_dashboard_while_it_runs_and_links_each_rollout(tmp_path):
    async with ApiServer(crd_paths=[CRDS]) as api:
        async with httpx.AsyncClient(base_url=api.url, timeout=10) as client:
            await client.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace",
                                                          "metadata": {"name": "llm"}})
            rollout = {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout", "metadata": {"name": "kv-align"},
                       "spec": {"selector": {"matchLabels": {"app": "llm-engine"}},
                                "patch": {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}}}}
            created = await client.post("/apis/graft.dev/v1alpha1/namespaces/llm/patchrollouts", json=rollout)
            assert created.status_code == 201, created.text
        cluster = SimpleNamespace(kubeconfig=write_kubeconfig(tmp_path / "kubeconfig", api.url), namespace="llm",
                                  api_server=SimpleNamespace(url=api.url))
        async with dashboard(cluster, tmp_path) as url:
            assert url and url.startswith("http://127.0.0.1:"), url
            async with httpx.AsyncClient(timeout=10) as browser:
                page = await browser.get(url)
                for _ in range(100):          # until its first list of every collection is in
                    state = (await browser.get(url + "api/state")).json()
                    if state["synced"]:
                        break
                    await asyncio.sleep(0.1)
            assert page.status_code == 200 and "Graft dashboard: llm" in page.text
            assert state["namespace"] == "llm" and [r["name"] for r in state["rollouts"]] == ["kv-align"]
            section = await dashboard_section(cluster, url)
        assert f"- [kv-align]({url}#rollout/kv-align): Pending" in section, section
        try:
            httpx.get(url, timeout=2)
            raise AssertionError("the dashboard still answers after the demo's block")
        except httpx.TransportError:
            pass
        assert await dashboard_section(cluster, None) == []
