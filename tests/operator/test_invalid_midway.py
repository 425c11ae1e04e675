"""A spec that turns invalid while canaries run: the rollout says so, holds, and can always be deleted.

The rollout's analysis template is deleted mid-rollout. The operator cannot judge a step any more,
so it holds with the reason in its status and conditions (never acting on a spec it cannot read);
`kubectl delete` of the rollout still completes: the rest of the spec (selector, patch, routing)
still reads, which is all an abort needs, so the canary is reverted and the finaliser lets go. A
rollout that is refused from the start gets conditions too, so `kubectl wait` ends on it.
"""
import pytest

from graft.operator.kube import rollout_path

from operator_cluster import create, get_rollout, manifest, phase_is, until

pytestmark = pytest.mark.timeout(120)

TEMPLATES = "/apis/graft.dev/v1alpha1/namespaces/{}/patchanalysistemplates"


async def test_a_template_deleted_mid_rollout_holds_it_and_delete_still_reverts_the_canary(
        cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2)
    await cluster.kube.create(TEMPLATES.format(namespace), {
        "apiVersion": "graft.dev/v1alpha1", "kind": "PatchAnalysisTemplate", "metadata": {"name": "checks"},
        "spec": {"breakers": [{"name": "error-rate", "max": 0.2, "window": "2s"}]}})
    await operator()
    await create(cluster, namespace, manifest(prometheus, analysis={"templates": [{"name": "checks"}]},
                                              steps=[{"weight": 50, "pause": "1h"}, {"weight": 100}]))
    await until(lambda: any(e.revision != "base" for e in engines), 30, what="a canary")
    await cluster.kube.delete(TEMPLATES.format(namespace) + "/checks")

    async def holding():
        obj = await get_rollout(cluster.kube, namespace, "kv-align")
        return obj if "holding until it is fixed" in (obj.get("status") or {}).get("message", "") else None
    obj = await until(holding, 30, what="the rollout to hold on its invalid spec")
    status = obj["status"]
    assert status["phase"] == "Progressing" and "analysis template 'checks' was not found" in status["message"]
    assert {c["type"] for c in status["conditions"]} >= {"Progressing", "Completed"}
    assert sum(e.revision != "base" for e in engines) == 1, "nothing acted on a spec it cannot read"

    await cluster.kube.delete(rollout_path(namespace, "kv-align"))

    async def gone():
        return await get_rollout(cluster.kube, namespace, "kv-align") is None
    await until(gone, 30, what="the rollout to be gone")
    assert all(e.revision == "base" for e in engines)


async def test_a_refused_rollout_has_conditions_kubectl_wait_can_end_on(cluster, namespace, operator, prometheus):
    await operator()
    await create(cluster, namespace, manifest(prometheus, analysis={"templates": [{"name": "nowhere"}]}))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 20)
    conditions = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conditions["Completed"]["status"] == "True" and conditions["Completed"]["reason"] == "InvalidSpec"
    assert conditions["Promoted"]["status"] == "False"
