"""`graft rollout retry NAME`: a rolled-back rollout starts again from its first step."""
from __future__ import annotations

from operator_cluster import create, get_rollout, manifest, phase_is, rollout_cli, until


async def test_an_aborted_rollout_retried_runs_again_to_promotion(cluster, namespace, fleet, operator, prometheus,
                                                                 tmp_path):
    engines = await fleet(2)
    await operator()
    await create(cluster, namespace, manifest(prometheus, steps=[{"weight": 50, "pause": "3s"}, {"weight": 100}]))
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Progressing"), 30, what="Progressing")
    code, _ = await rollout_cli(cluster, namespace, tmp_path, "abort", "kv-align")
    assert code == 0
    await until(lambda: phase_is(cluster, namespace, "kv-align", "RolledBack"), 30, what="RolledBack")
    assert all(e.applied == {} for e in engines)

    code, out = await rollout_cli(cluster, namespace, tmp_path, "retry", "kv-align")
    assert code == 0 and "retrying from its first step (was RolledBack)" in out
    await until(lambda: phase_is(cluster, namespace, "kv-align", "Promoted"), 60, what="Promoted after retry")
    body = await get_rollout(cluster.kube, namespace, "kv-align")
    assert "graft.dev/abort" not in (body["metadata"].get("annotations") or {})
    assert all(e.applied == {"kv-align": "3.2.1"} for e in engines)
    # a promoted rollout is not retried
    code, out = await rollout_cli(cluster, namespace, tmp_path, "retry", "kv-align")
    assert code == 1 and "only a RolledBack or Failed rollout can be retried" in out
