"""Fixtures for the operator tests: an API server, a namespace, fake engine pods, Prometheus, the operator.

The API server is the local emulator (graft.devcluster.apiserver), or a real cluster when
GRAFT_E2E_KUBECONFIG names a kubeconfig; tests that need pods whose engines they control (every
"fleet" test) skip on a real cluster, since there a kubelet owns the pods.
"""
import asyncio
import os
import time
import uuid
from pathlib import Path

import pytest

from graft.devcluster.apiserver import ApiServer
from graft.devcluster.prometheus import PrometheusServer
from graft.operator.kube import Kube, KubeError, rollout_path
from graft.operator.runtime import _from_kubeconfig
from graft.operator.settings import OperatorSettings

from operator_cluster import TOKEN, Cluster, OperatorHandle, create_pod
from operator_fakes import FakeEngine

ROOT = Path(__file__).resolve().parents[2]
E2E_KUBECONFIG = os.environ.get("GRAFT_E2E_KUBECONFIG")


@pytest.fixture
async def cluster():
    if E2E_KUBECONFIG:
        kube = Kube.from_connection(_from_kubeconfig(E2E_KUBECONFIG, None))
        import yaml
        for path in ("patchrollout.yaml", "patchanalysistemplate.yaml"):
            for crd in yaml.safe_load_all((ROOT / "crds" / path).read_text()):
                try:
                    await kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
                except KubeError as e:
                    if e.status != 409:
                        raise
        yield Cluster(kube, None, E2E_KUBECONFIG)
        await kube.aclose()
        return
    # every CRD under crds/: PatchRollout and the (cluster) analysis templates it may name
    async with ApiServer(crd_paths=[ROOT / "crds"]) as api:
        kube = Kube(api.url)
        yield Cluster(kube, api.url, None)
        await kube.aclose()


@pytest.fixture
def needs_fake_pods(cluster):
    if cluster.real:
        pytest.skip("GRAFT_E2E_KUBECONFIG: needs pods whose engines the test controls; "
                    "on a real cluster the kubelet owns pods")


@pytest.fixture
async def namespace(cluster):
    name = f"graft-test-{uuid.uuid4().hex[:8]}"
    await cluster.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                     "metadata": {"name": name}})
    yield name
    if cluster.real:
        # no operator is left to remove its finalizers, and they would hold the namespace forever
        for obj in await cluster.kube.list(rollout_path(name, "x")[: -len("/x")]):
            await cluster.kube.merge_patch(rollout_path(name, obj["metadata"]["name"]),
                                           {"metadata": {"finalizers": None}})
        await cluster.kube.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="module")
def prometheus():
    # every 500 ms, and so a 500 ms scrape timeout (Prometheus caps it at the interval): a fake
    # engine in a process starved by the other worker answered 200 ms timeouts too late, and a new
    # revision's series then stayed empty for a whole rollout
    with PrometheusServer(scrape_interval="500ms") as prom:
        yield prom


@pytest.fixture
async def operator(request, cluster, namespace):
    """`await operator(**settings)` starts an operator for the test's namespace; `.stop()` ends it.
    A test with the `prometheus` fixture may name that Prometheus (its rollouts' address)."""
    running = []
    allowed = [request.getfixturevalue("prometheus").url] if "prometheus" in request.fixturenames else []

    async def start(**overrides):
        # the fake engines listen on loopback over plain http; a refused token is final at its third
        # tick unless a test gives it a grace in seconds
        settings = OperatorSettings(namespaces=[namespace], tick=0.25, admin_token=TOKEN, admin_timeout=2.0,
                                    admin_scheme="http", admin_plain_http=True, admin_token_grace=0.0,
                                    admin_retries=1, prometheus_timeout=2.0, prometheus_allowed=list(allowed),
                                    kube_server=cluster.url, kubeconfig=cluster.kubeconfig)
        for key, value in overrides.items():
            setattr(settings, key, value)
        handle = OperatorHandle(settings)
        await handle.start()
        running.append(handle)
        return handle

    yield start
    for handle in running:
        if handle.thread.is_alive():
            await handle.stop()


def scraping(prometheus: PrometheusServer, addresses: list[str], timeout: float = 30.0) -> None:
    """Wait until Prometheus scrapes exactly these targets (not the last test's), every one up."""
    want = {f"http://{a}/metrics" for a in addresses}
    deadline = time.monotonic() + timeout
    while True:
        active = prometheus.wait_for_targets(len(want), timeout)
        if {t["scrapeUrl"] for t in active} == want:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Prometheus scrapes {[t['scrapeUrl'] for t in active]}, not {sorted(want)}")
        time.sleep(0.2)


@pytest.fixture
async def fleet(cluster, namespace, prometheus, needs_fake_pods):
    """`await fleet(n)` starts n fake engines, each behind a Pod, all scraped by Prometheus."""
    engines: list[FakeEngine] = []

    async def make(n: int, gated: bool = False, **engine_kwargs) -> list[FakeEngine]:
        for _ in range(n):
            engine = await FakeEngine(f"127.0.0.{len(engines) + 2}", TOKEN, **engine_kwargs).start()
            engines.append(engine)
            await create_pod(cluster.kube, namespace, f"engine-{len(engines) - 1}", engine, gated=gated)
        prometheus.set_targets([(e.address, {"namespace": namespace}) for e in engines])
        # Prometheus hands new targets to its scrapers up to 5 s later: until then a rollout's checks
        # would see no traffic at all, and a breaker without data holds nothing
        await asyncio.to_thread(scraping, prometheus, [e.address for e in engines])
        return engines

    yield make
    for engine in engines:
        await engine.stop()
