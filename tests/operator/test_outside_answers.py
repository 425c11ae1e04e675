"""The operator under bad answers from outside: a breaker whose query answers +Inf.

A custom breaker `vector(1) / 0` (what any ratio over an empty denominator gives) against the real
Prometheus: every run is an Error naming the non-finite answer, the status keeps being written (JSON
has no Inf: before, the write raised on every tick and the breach counts never persisted), and at
the error limit the rollout pauses for a person with the reason, within seconds at this interval.
Deleting it then completes, with the canary reverted.
"""
import pytest

from graft.operator.kube import rollout_path

from operator_cluster import create, get_rollout, manifest, phase_is, until

pytestmark = pytest.mark.timeout(120)

INFINITE = {"breakers": [{"name": "queue-ratio", "max": 1, "window": "2s",
                          "query": "vector(1) / 0"}], "gates": []}


async def test_an_infinite_breaker_pauses_the_rollout_saying_why_and_delete_completes(
        cluster, namespace, fleet, operator, prometheus):
    engines = await fleet(2)
    await operator()
    await create(cluster, namespace, manifest(prometheus, analysis=INFINITE,
                                              steps=[{"weight": 50, "pause": "1s"}, {"weight": 100}]))
    obj = await until(lambda: phase_is(cluster, namespace, "kv-align", "Paused", "Promoted", "RolledBack"), 40,
                      what="the analysis pause")
    status = obj["status"]
    assert status["phase"] == "Paused" and status["reason"] == "AnalysisErrorLimit", status["message"]
    (result,) = status["analysis"]["results"]
    assert result["verdict"] == "Error" and "not a finite number" in result["message"], result
    assert "value" not in result and status["analysis"]["errorRuns"] >= 4
    assert sum(e.revision != "base" for e in engines) == 1, "held at the canary, nothing promoted"

    await cluster.kube.delete(rollout_path(namespace, "kv-align"))

    async def gone():
        return await get_rollout(cluster.kube, namespace, "kv-align") is None
    await until(gone, 30, what="the rollout to be gone")
    assert all(e.revision == "base" for e in engines)
