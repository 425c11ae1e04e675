"""Pod conditions and Deployment replicas as clients write them: strategic merge patches that merge
lists by their key (a pod's conditions by type), and the scale subresource `kubectl scale` uses."""

import asyncio

import httpx
import pytest
import yaml

from graft.devcluster.apimachinery import MergeList, StrategicError, strategic_merge

from .kubectl_cli import run_kubectl

PODS = "/api/v1/namespaces/default/pods"
DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"
SMP = {"content-type": "application/strategic-merge-patch+json"}
MERGE = {"content-type": "application/merge-patch+json"}


def conditions(pod: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in pod["status"]["conditions"]}


async def running_pod(client: httpx.AsyncClient, name: str = "p") -> None:
    await client.post(PODS, json={"metadata": {"name": name}, "spec": {
        "containers": [{"name": "engine", "image": "graft", "env": [{"name": "A", "value": "1"}]}],
        "readinessGates": [{"conditionType": "graft.dev/patched"}]}})
    r = await client.patch(f"{PODS}/{name}/status", headers=MERGE, json={"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"},
        {"type": "ContainersReady", "status": "True"}]}})
    assert r.status_code == 200, r.text


async def test_a_strategic_merge_patch_merges_pod_conditions_by_type(client):
    await running_pod(client)
    gate = {"type": "graft.dev/patched", "status": "True", "reason": "Patched"}
    r = await client.patch(f"{PODS}/p/status", headers=SMP, json={"status": {"conditions": [gate]}})
    assert r.status_code == 200, r.text
    assert conditions(r.json()) == {"Ready": "False", "ContainersReady": "True", "graft.dev/patched": "True"}

    # the same type again replaces that one element, field by field; the others stay
    r = await client.patch(f"{PODS}/p/status", headers=SMP, json={"status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": None}]}})
    assert conditions(r.json()) == {"Ready": "True", "ContainersReady": "True", "graft.dev/patched": "True"}
    assert "reason" not in r.json()["status"]["conditions"][0]
    assert r.json()["status"]["conditions"][2]["reason"] == "Patched"

    # a merge patch replaces the whole list, as RFC 7386 says
    r = await client.patch(f"{PODS}/p/status", headers=MERGE, json={"status": {"conditions": [gate]}})
    assert conditions(r.json()) == {"graft.dev/patched": "True"}

    # `$patch: delete` removes one element; the directive itself is not stored
    r = await client.patch(f"{PODS}/p/status", headers=SMP, json={"status": {"conditions": [
        {"type": "graft.dev/patched", "$patch": "delete"}, {"type": "Ready", "status": "False"}]}})
    assert r.json()["status"]["conditions"] == [{"type": "Ready", "status": "False"}]


async def test_a_strategic_patch_without_the_merge_key_is_refused_naming_the_field(client):
    await running_pod(client)
    r = await client.patch(f"{PODS}/p/status", headers=SMP, json={"status": {"conditions": [{"status": "True"}]}})
    assert r.status_code == 400
    assert "status.conditions[0]: does not contain declared merge key: type" in r.json()["message"]
    assert conditions((await client.get(f"{PODS}/p")).json()) == {"Ready": "False", "ContainersReady": "True"}


async def test_kubectl_patch_of_a_pod_merges_containers_by_name(api, client, tmp_path):
    await running_pod(client)
    config = api.write_kubeconfig(tmp_path / "kubeconfig")
    patch = '{"spec": {"containers": [{"name": "engine", "env": [{"name": "B", "value": "2"}]}]}}'
    done = await asyncio.to_thread(run_kubectl, config, "patch", "pod", "p", "-p", patch)  # strategic by default
    assert done.returncode == 0, done.stderr
    container = (await client.get(f"{PODS}/p")).json()["spec"]["containers"][0]
    assert container["image"] == "graft"
    assert container["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]


def test_strategic_merge_directives():
    schema = {"spec": {"items": MergeList("name"), "tags": MergeList(None)}}
    old = {"spec": {"items": [{"name": "a", "v": 1}, {"name": "b", "v": 2}], "tags": ["x", "y"],
                    "keep": 1, "drop": 2}}
    patch = {"spec": {"items": [{"name": "c", "v": 3}, {"name": "a", "w": 1}],
                      "$setElementOrder/items": [{"name": "c"}, {"name": "a"}, {"name": "b"}],
                      "tags": ["z", "x"], "$deleteFromPrimitiveList/tags": ["y"],
                      "$retainKeys": ["items", "tags", "keep"]}}
    assert strategic_merge(old, patch, schema) == {"spec": {
        "items": [{"name": "c", "v": 3}, {"name": "a", "v": 1, "w": 1}, {"name": "b", "v": 2}],
        "tags": ["x", "z"], "keep": 1}}
    assert strategic_merge(old, {"spec": {"items": [{"$patch": "replace"}, {"name": "n"}]}}, schema)["spec"]["items"] \
        == [{"name": "n"}]
    assert strategic_merge(old, {"spec": {"$patch": "replace", "keep": 5}}, schema) == {"spec": {"keep": 5}}
    assert strategic_merge(old, {"spec": {"keep": {"$patch": "delete"}}}, schema)["spec"].get("keep") is None
    with pytest.raises(StrategicError, match=r"spec.items\[0\]"):
        strategic_merge(old, {"spec": {"items": [{"v": 9}]}}, schema)


async def deployment(client: httpx.AsyncClient, replicas: int = 1) -> dict:
    r = await client.post(DEPLOYMENTS, json={"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
                                             "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
                                                      "template": {"metadata": {"labels": {"app": "web"}},
                                                                   "spec": {"containers": [{"name": "c"}]}}}})
    assert r.status_code == 201, r.text
    return r.json()


async def test_the_scale_subresource_reads_and_writes_spec_replicas(client):
    dep = await deployment(client)
    r = await client.get(f"{DEPLOYMENTS}/web/scale")
    assert r.status_code == 200
    scale = r.json()
    assert (scale["kind"], scale["apiVersion"]) == ("Scale", "autoscaling/v1")
    assert scale["spec"] == {"replicas": 1} and scale["status"]["selector"] == "app=web"

    r = await client.patch(f"{DEPLOYMENTS}/web/scale", headers=MERGE, json={"spec": {"replicas": 4}})
    assert r.status_code == 200 and r.json()["spec"]["replicas"] == 4
    stored = (await client.get(f"{DEPLOYMENTS}/web")).json()
    assert stored["spec"]["replicas"] == 4 and stored["metadata"]["generation"] == dep["metadata"]["generation"] + 1

    stale = {**scale, "spec": {"replicas": 2}}  # the resourceVersion read before the patch
    assert (await client.put(f"{DEPLOYMENTS}/web/scale", json=stale)).status_code == 409
    fresh = {**r.json(), "spec": {"replicas": 2}}
    assert (await client.put(f"{DEPLOYMENTS}/web/scale", json=fresh)).json()["spec"]["replicas"] == 2

    bad = await client.patch(f"{DEPLOYMENTS}/web/scale", headers=MERGE, json={"spec": {"replicas": -1}})
    assert bad.status_code == 422 and bad.json()["details"]["causes"][0]["field"] == "spec.replicas"
    assert (await client.get(f"{DEPLOYMENTS}/web")).json()["spec"]["replicas"] == 2

    discovery = (await client.get("/apis/apps/v1")).json()["resources"]
    entry = next(e for e in discovery if e["name"] == "deployments/scale")
    assert (entry["group"], entry["version"], entry["kind"]) == ("autoscaling", "v1", "Scale")
    assert (await client.get("/api/v1/namespaces/default/pods/x/scale")).status_code == 404


async def test_kubectl_scale_sets_the_deployment_replicas(api, client, tmp_path):
    await deployment(client)
    config = api.write_kubeconfig(tmp_path / "kubeconfig")
    done = await asyncio.to_thread(run_kubectl, config, "scale", "deployment", "web", "--replicas", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "deployment.apps/web scaled"
    assert (await client.get(f"{DEPLOYMENTS}/web")).json()["spec"]["replicas"] == 3
    done = await asyncio.to_thread(run_kubectl, config, "scale", "deployment", "web", "--current-replicas", "3",
                                   "--replicas", "2")
    assert done.returncode == 0, done.stderr
    assert (await client.get(f"{DEPLOYMENTS}/web")).json()["spec"]["replicas"] == 2


async def test_kubectl_apply_of_a_changed_deployment_merges_its_lists_by_key(api, client, tmp_path):
    """A second `kubectl apply` sends a three-way strategic merge patch: lists merged by key, a removed
    env var as a `$patch: delete` element, `$setElementOrder` for the order."""
    def manifest(env: list[dict]) -> str:
        return yaml.safe_dump({
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": "default"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}}, "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "c", "image": "graft", "env": env}]}}}})

    config = api.write_kubeconfig(tmp_path / "kubeconfig")
    first = [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]
    done = await asyncio.to_thread(run_kubectl, config, "apply", "-f", "-", stdin=manifest(first))
    assert done.returncode == 0, done.stderr
    # someone else adds a variable; the next apply must keep it (it was never in the manifest)
    r = await client.patch(f"{DEPLOYMENTS}/web", headers=SMP, json={"spec": {"template": {"spec": {"containers": [
        {"name": "c", "env": [{"name": "OTHER", "value": "x"}]}]}}}})
    assert r.status_code == 200, r.text
    second = [{"name": "C", "value": "3"}, {"name": "A", "value": "10"}]
    done = await asyncio.to_thread(run_kubectl, config, "apply", "-f", "-", stdin=manifest(second))
    assert done.returncode == 0, done.stderr
    container = (await client.get(f"{DEPLOYMENTS}/web")).json()["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "graft"
    assert {e["name"]: e["value"] for e in container["env"]} == {"A": "10", "C": "3", "OTHER": "x"}
    assert [e["name"] for e in container["env"]][:2] == ["C", "A"]
