"""The one executor of pod actions: every outcome comes back as data, the unexpected included.

The engine and the API server are played over HTTP (httpx's mock transport), so each call is the
one the executor really sends; the rollout and the fleet controllers both read these outcomes.
"""
import json

import httpx

from graft.api import Reason
from graft.operator.admin import AdminClient
from graft.operator.executor import PodExecutor
from graft.operator.kube import Kube
from graft.operator.podcache import PodCache
from graft.operator.problems import TokenError
from graft.rollout.actions import ApplyPatch, LabelPod, RevertPatch, SetPatched, apply_patch
from graft.rollout.observation import Problem
from graft.rollout.spec import PatchSource, PatchSpec

KV = PatchSpec("kv-align", "3.2.2", PatchSource(builtin=True))
POD = {"metadata": {"name": "engine-0", "namespace": "ns"},
       "status": {"phase": "Running", "podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]}}


class Workloads:
    """The vetted engines' admin addresses, as graft.operator.pods.Workloads gives them."""

    def address(self, pod):
        ip = (pod.get("status") or {}).get("podIP")
        return (ip, 8081) if ip else None


class Runtime:
    def __init__(self, kube, admin, token_missing=False):
        self.kube, self._admin, self.token_missing = kube, admin, token_missing
        self.unauthorized = {}
        self.pod_cache = PodCache(lambda: kube)      # told of the pods the executor writes

    async def admin(self):
        if self.token_missing:
            raise TokenError(Problem(Reason.ADMIN_TOKEN_MISSING, "Secret ops/admin-token not found"))
        return self._admin


def executor(engine, api=None, pods=None, **runtime):
    kube = Kube("http://api", transport=httpx.MockTransport(api or (lambda r: httpx.Response(200, json={}))))
    admin = AdminClient("tok", transport=httpx.MockTransport(engine), backoff=0.001, retries=0)
    return PodExecutor(Runtime(kube, admin, **runtime), "ns", Workloads(), {"engine-0": POD} if pods is None else pods)


async def test_an_apply_sends_replace_only_when_a_version_of_the_patch_runs_there():
    bodies = []

    def engine(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"revision": "kv-align@3.2.2"})

    run = executor(engine)
    upgrade = apply_patch("engine-0", KV, "kv-align@3.2.1,sync-free@3.2.1")
    assert upgrade.replace
    outcome = await run.run(upgrade)
    assert outcome.ok and outcome.revision == "kv-align@3.2.2"
    assert bodies[-1]["replace"] is True
    fresh = apply_patch("engine-0", KV, "sync-free@3.2.1")
    assert not fresh.replace
    await run.run(fresh)
    assert "replace" not in bodies[-1]


async def test_an_engines_refusal_is_about_its_pod():
    run = executor(lambda r: httpx.Response(409, json={"error": {"code": 409, "message": "kv-align@3.2.1 applied"}}))
    outcome = await run.run(ApplyPatch("engine-0", KV))
    assert outcome.problem is None and outcome.error.kind == "conflict"
    assert "409" in outcome.message


async def test_a_pod_without_an_ip_is_an_error_not_a_crash():
    run = executor(lambda r: httpx.Response(200, json={"revision": "base"}),
                   pods={"engine-0": {**POD, "status": {"phase": "Pending"}}})
    outcome = await run.run(RevertPatch("engine-0", "kv-align"))
    assert outcome.error.kind == "unreachable" and "no IP" in outcome.message


async def test_a_missing_token_stops_the_controller_with_its_own_reason():
    run = executor(lambda r: httpx.Response(200, json={"revision": "base"}), token_missing=True)
    outcome = await run.run(RevertPatch("engine-0", "kv-align"))
    assert outcome.problem.reason == Reason.ADMIN_TOKEN_MISSING and outcome.error is None


async def test_an_api_server_refusal_and_an_operator_bug_surface_as_action_failed():
    def api(request):
        return httpx.Response(422, json={"message": "metadata.labels: Invalid value"})

    run = executor(lambda r: httpx.Response(200, json={"revision": "base"}), api=api)
    refused = await run.run(LabelPod("engine-0", "canary", "kv-align@3.2.2"))
    assert refused.problem.reason == Reason.ACTION_FAILED
    assert refused.message.startswith("labelling pod engine-0 canary (kv-align@3.2.2): the API server answered 422")
    # a pod the executor was never given: a bug, which the status must show rather than lose
    bug = await run.run(SetPatched("engine-9", True, "runs base"))
    assert bug.problem.reason == Reason.ACTION_FAILED
    assert bug.message == "setting graft.dev/patched=True on pod engine-9 failed: KeyError: 'engine-9'"


async def test_a_bundle_is_read_once_for_every_pod_of_a_tick():
    reads = []

    def api(request):
        reads.append(request.url.path)
        return httpx.Response(404, json={"message": "not found"})

    bundle = PatchSpec("short-first", "1.0.0", PatchSource(builtin=False, config_map="short-first", key="bundle.py",
                                                         digest="sha256:" + "0" * 64))
    pods = {f"engine-{i}": {**POD, "metadata": {"name": f"engine-{i}"}} for i in range(3)}
    run = executor(lambda r: httpx.Response(200, json={"revision": "base"}), api=api, pods=pods)
    outcomes = await run.run_all(ApplyPatch(f"engine-{i}", bundle) for i in range(3))
    assert [o.problem.reason for o in outcomes] == [Reason.BUNDLE_MISSING] * 3
    assert len(reads) == 1
