"""Where a pod's admin API is: a pod without an IP is asked again, a malformed annotation is final."""
import pytest

from graft.operator.kube import pods_path
from graft.operator.pods import BadAdminPort, NoPodIP
from graft.rollout.observation import PERMANENT_ERRORS, PodError

from operator_cluster import create, events_with, manifest, phase_is, until

pytestmark = pytest.mark.timeout(120)


def test_an_address_error_says_whether_it_is_permanent():
    assert not PodError(NoPodIP("pod a has no IP yet").kind, "").permanent
    malformed = BadAdminPort("annotation graft.dev/admin-port must be a port number, got 'http'")
    assert PodError(malformed.kind, malformed.message).permanent
    assert PERMANENT_ERRORS[malformed.kind] == "PodMisconfigured"
    assert isinstance(malformed, ValueError), "callers that treat a bad annotation as bad input still do"


async def test_a_malformed_admin_port_annotation_fails_the_rollout_at_once(cluster, namespace, fleet, operator,
                                                                          prometheus):
    """A pod template with a bad annotation: nothing but an edit of the pods fixes it, so the rollout
    fails on its first tick, naming a pod and the annotation, rather than asking again until its
    deadline."""
    engines = await fleet(2)
    for pod in ("engine-0", "engine-1"):
        await cluster.kube.merge_patch(pods_path(namespace, pod),
                                       {"metadata": {"annotations": {"graft.dev/admin-port": "http"}}})
    await operator()
    await create(cluster, namespace, manifest(prometheus))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Failed"), 20)
    assert obj["status"]["reason"] == "PodMisconfigured"
    assert obj["status"]["message"] == ("pod engine-0: annotation graft.dev/admin-port must be a port number "
                                        "(1-65535), got 'http'; fix the pod template")
    await until(lambda: events_with(cluster, namespace, "PodMisconfigured"), 10)
    assert sum(e.posts for e in engines) == 0
