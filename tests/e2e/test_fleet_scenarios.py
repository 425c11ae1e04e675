"""End to end: the fleet's durable patch state (PatchFleet) as a user sees it on the dev cluster.

One dev cluster for the module: two real `graft serve` engines (test patches enabled) whose
Deployment declares the readiness gate `graft.dev/patched` (the chart's `engine.readinessGate`),
a real Prometheus, the operator as its own process, and light client traffic (short prompts, one a
second) through a router that picks Ready pods only. The scenarios use the Kubernetes API, kubectl
(with the kubeconfig the dev cluster writes) and each engine's admin API, as a person would:

1. a gated fleet with no PatchFleet yet: no pod is Ready; the first rollout creates the fleet,
   which lets the pods in, and promotes (`kubectl wait --for=condition=Promoted`, `kubectl get prl`);
2. `kubectl scale` after a promotion: the new pod runs the promoted patch before it is Ready;
3. a second rollout on the fleet queues (Pending, Queued) and runs once the first has ended;
4. a canary's engine killed as its rollout rolls back comes back without the patch;
5. an upgrade of an applied patch (kv-align@3.2.1 to the test-only 3.2.2-test) fails no client request,
   and its engines' comparisons of their answers with 3.2.1 all agree;
6. `spec.action: revert` takes a promoted patch out of every pod and out of the fleet.

Each scenario starts from the fleet at `base` (its PatchFleet emptied, two pods, every one Ready)
and deletes its rollouts at the end; the first asks for `fresh`, the cluster as it started (no
PatchFleet, pods never let in), which it gets in any order: pods a fleet let in are replaced. Logs: pytest's tmp folder, `fleetcluster*/operator.log` and
`fleetcluster*/pods/*.log`; a failed scenario's report shows their tails.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from graft.operator.pods import is_ready
from graft.rollout.fleet import PATCHED_CONDITION
from graft.rollout.queries import COMPARED, DIVERGENT, Context, shadow_query
from graft.api import BASE, FINAL_PHASES, patches_of
from tests.e2e.fleet import DEPLOYMENT, GROUP_VERSION, ClientLoad, Fleet, Recorder
from tests.support import ROOT
from tests.e2e.fleet_support import (FLEET, PODS, GatedFleet, GateWatch, condition, converged, fleet_refs, gate_open,
                                     kubectl, marks, open_gated_fleet, patch_fleet, rollout_manifest,
                                     set_fleet_patches, until_phase)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

RUN = secrets.token_hex(2)     # rollout names are new on every run
KV = "kv-align@3.2.1"
KV_NEXT = "kv-align@3.2.2-test"
TIMEOUT = 120                  # a rollout of two short steps takes ~10 s; the machine may be busy
START_TIMEOUT = 240            # a new engine process: model load and first prefill on a busy CPU
PROMPTS = ["The capital of France is", "One, two, three,", "Water boils at", "The opposite of hot is"]


def builtin(ref: str) -> dict[str, Any]:
    name, _, version = ref.partition("@")
    return {"name": name, "version": version, "source": {"builtin": {}}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GatedFleet]:
    async with open_gated_fleet(tmp_path_factory.mktemp("fleetcluster")) as f:
        yield f


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def traffic(fleet: Fleet) -> AsyncIterator[ClientLoad]:
    async with fleet.traffic(PROMPTS, rate=1.0, max_tokens=4) as t:
        yield ClientLoad(t)


@pytest_asyncio.fixture(loop_scope="module")
async def fresh(fleet: GatedFleet) -> None:
    """The cluster as it started, whatever ran before: no PatchFleet, and pods no fleet has let in
    (pods a fleet let in are replaced by new ones)."""
    await fleet.start_over(START_TIMEOUT)


@pytest_asyncio.fixture(loop_scope="module", autouse=True)
async def clean_slate(request: pytest.FixtureRequest, fleet: GatedFleet, traffic: ClientLoad) -> AsyncIterator[None]:
    """The fleet at `base` before and after each scenario: no rollout, its PatchFleet empty, two
    pods, each Ready with its gate open; a scenario that asks for `fresh` starts from the cluster
    as it started instead."""
    if "fresh" not in request.fixturenames:
        await fleet.reset(START_TIMEOUT)
    yield
    await fleet.reset(START_TIMEOUT)


async def test_first_rollout_on_a_gated_fleet_creates_the_patchfleet_and_lets_the_pods_in(fleet: Fleet, fresh):
    """Engines behind the gate stay out of service until a fleet exists; a rollout creates it
    (adopting what the pods run), the gates open, and the rollout promotes. `kubectl wait` returns
    once it is promoted and `kubectl get prl` shows where it stands."""
    pods = await fleet.pods()
    assert len(pods) == PODS
    for pod in pods:    # the containers pass their probe, the gate holds the pod
        ready = condition(pod, "Ready")
        assert condition(pod, "ContainersReady")["status"] == "True", pod["metadata"]["name"]
        assert ready["status"] == "False" and ready["reason"] == "ReadinessGatesNotReady", ready
        assert condition(pod, PATCHED_CONDITION) is None

    ro = rollout_manifest(fleet, f"first-{RUN}", KV)
    name = ro["metadata"]["name"]
    started = time.monotonic()
    await fleet.apply(ro)
    waiter = asyncio.create_task(kubectl(fleet, "wait", "--for=condition=Promoted", f"prl/{name}",
                                         f"--timeout={TIMEOUT}s", timeout=TIMEOUT + 30))
    promoted = await until_phase(fleet, name, FINAL_PHASES, TIMEOUT)
    promoted_at = time.monotonic()
    st = promoted["status"]
    assert st["phase"] == "Promoted", st.get("message")
    wait = await waiter
    assert wait.code == 0, wait.err
    assert f"patchrollout.graft.dev/{name} condition met" in wait.out
    waited = time.monotonic() - promoted_at
    assert waited < 10, f"kubectl wait returned {waited:.1f}s after the promotion"

    # the fleet the rollout created: its selector, the promoted patch, and every pod in it
    assert st["fleet"] == FLEET
    pfl = await patch_fleet(fleet)
    assert pfl is not None and pfl["spec"]["selector"] == {"matchLabels": {"app": "llm-engine"}}
    assert fleet_refs(pfl) == [KV]
    await fleet.wait_for(lambda: converged(fleet, KV, PODS), 30, f"every pod at {KV}")

    # kubectl get prl: the printer columns, the step counted from 1
    table = await kubectl(fleet, "get", "prl", name)
    assert table.code == 0, table.err
    header, row = table.out.splitlines()
    assert header.split() == ["NAME", "PHASE", "STEP", "WEIGHT", "CANARY", "STABLE", "AGE"]
    assert row.split()[:6] == [name, "Promoted", "2", "100", KV, KV], row
    # kubectl get pfl: the fleet's revision and pods, and no rollout active on it any more
    async def let_go() -> bool:
        return not ((await patch_fleet(fleet)) or {}).get("status", {}).get("activeRollout")
    await fleet.wait_for(let_go, 10, "the fleet to show no active rollout", interval=0.2)
    released = time.monotonic() - promoted_at
    pfl_table = await kubectl(fleet, "get", "pfl", FLEET)
    assert pfl_table.code == 0, pfl_table.err
    header, row = pfl_table.out.splitlines()
    assert header.split() == ["NAME", "REVISION", "PODS", "CONVERGED", "ROLLOUT", "AGE"]
    cells = row.split()      # an empty ROLLOUT cell: kubectl prints nothing for a missing value
    assert cells[:4] == [FLEET, KV, str(PODS), str(PODS)] and len(cells) == 5, row
    print(f"promoted {promoted_at - started:.1f}s after the rollout was created; kubectl wait returned "
          f"{waited:.1f}s after that; the fleet showed no active rollout {released:.1f}s after it")


async def test_a_pod_added_by_kubectl_scale_runs_the_promoted_patch_before_it_is_ready(
        fleet: Fleet, traffic: ClientLoad):
    """After a promotion, `kubectl scale` adds a pod: the fleet controller patches its engine,
    labels and annotates it, then opens its gate; no client request reaches it before."""
    ro = rollout_manifest(fleet, f"scale-{RUN}", KV)
    await fleet.apply(ro)
    st = (await until_phase(fleet, ro["metadata"]["name"], FINAL_PHASES, TIMEOUT))["status"]
    assert st["phase"] == "Promoted", st.get("message")
    assert fleet_refs(await patch_fleet(fleet)) == [KV]
    before = {p["metadata"]["name"] for p in await fleet.pods()}

    scale = await kubectl(fleet, "scale", f"deployment/{DEPLOYMENT}", "--replicas", str(PODS + 1))
    assert scale.code == 0, scale.err
    scaled = time.time()
    samples: list[tuple[float, dict[str, Any], str | None]] = []   # (time, pod, engine revision)

    async def newcomer_ready() -> dict[str, Any] | None:
        fleet.check_operator()
        new = [p for p in await fleet.pods() if p["metadata"]["name"] not in before]
        if not new:
            return None
        pod = new[0]
        running = (condition(pod, "ContainersReady") or {}).get("status") == "True"
        revision = await fleet.engine_revision(pod) if running else None
        samples.append((time.time(), pod, revision))
        return pod if is_ready(pod) else None
    ready = await fleet.wait_for(newcomer_ready, START_TIMEOUT, "the new pod to turn Ready", interval=0.1)
    ready_at, _, revision_at_ready = samples[-1]
    name = ready["metadata"]["name"]

    # at the first moment the pod is Ready, its engine already runs the fleet's patch
    assert revision_at_ready == KV, f"{name} turned Ready running {revision_at_ready}"
    assert gate_open(ready) and marks(ready) == ("stable", KV)
    held = [(t, r) for t, p, r in samples if r is not None and not is_ready(p)]
    assert held, "the new engine was never seen running before its pod was Ready"
    assert all(not is_ready(p) for _, p, r in samples if r != KV)
    assert condition(ready, "Ready")["status"] == "True"
    await fleet.wait_for(lambda: converged(fleet, KV, PODS + 1), 30, f"{PODS + 1} pods at {KV}")
    # no client request reached it before it was Ready; the ones after were answered
    reached = [o for o in traffic.stats.outcomes if o.pod == name]
    assert all(o.at >= ready_at - 0.5 for o in reached), [o for o in reached if o.at < ready_at - 0.5]
    assert all(o.status == 200 for o in reached), [o for o in reached if o.status != 200]
    first_seen = [t for t, r in held if r == BASE]
    print(f"new pod {name}: Ready {ready_at - scaled:.1f}s after kubectl scale; its engine seen at "
          f"{sorted({r for _, r in held})} while held ({len(first_seen)} samples at base)")


async def test_a_second_rollout_on_the_fleet_queues_until_the_first_ends(fleet: Fleet):
    first = rollout_manifest(fleet, f"queue-a-{RUN}", KV, steps=[{"weight": 50, "pause": "8s"}, {"weight": 100}])
    second = rollout_manifest(fleet, f"queue-b-{RUN}", "sync-free@3.2.1")
    a, b = first["metadata"]["name"], second["metadata"]["name"]
    pods = {p["metadata"]["name"] for p in await fleet.pods()}
    async with GateWatch(fleet) as watch:
        await fleet.apply(first)
        await until_phase(fleet, a, ("Progressing",), TIMEOUT)
        await fleet.apply(second)
        await queued_behind(fleet, a, b)
        first_done = await until_phase(fleet, a, FINAL_PHASES, TIMEOUT)
        second_done = await until_phase(fleet, b, FINAL_PHASES, TIMEOUT)
    # neither rollout's canaries were taken from it: every pod's gate stayed open throughout
    assert watch.closed(pods) == [], watch.closed(pods)[:5]
    assert first_done["status"]["phase"] == "Promoted", first_done["status"].get("message")
    promoted_at = condition(first_done, "Promoted")["lastTransitionTime"]
    st = second_done["status"]
    assert st["phase"] == "Promoted", st.get("message")
    assert st["startedAt"] >= promoted_at, (st["startedAt"], promoted_at)
    assert st["stableRevision"] == st["canaryRevision"] == f"{KV},sync-free@3.2.1"
    assert fleet_refs(await patch_fleet(fleet)) == [KV, "sync-free@3.2.1"]
    await fleet.wait_for(lambda: converged(fleet, f"{KV},sync-free@3.2.1", PODS), 30, "both patches everywhere")


async def queued_behind(fleet: Fleet, a: str, b: str) -> None:
    """`b` waits, Pending with reason Queued, for `a`; the fleet names `a` as its active rollout."""
    async def queued() -> dict[str, Any] | None:
        ro = await fleet.rollout(b)
        return ro if (ro.get("status") or {}).get("reason") == "Queued" else None
    waiting = (await fleet.wait_for(queued, 30, f"{b} queued"))["status"]
    assert waiting["phase"] == "Pending" and a in waiting["message"] and FLEET in waiting["message"]
    assert "Queued" in [e["reason"] for e in await fleet.events(b)]

    async def named() -> bool:     # the fleet controller writes it at its next tick
        table = await kubectl(fleet, "get", "pfl", FLEET, "-o", "jsonpath={.status.activeRollout}")
        return table.out == a
    await fleet.wait_for(named, 10, f"kubectl get pfl to name {a}", interval=0.5)


async def test_a_canary_killed_during_its_rollback_comes_back_clean(fleet: Fleet):
    """fault@1 on one canary of two; its engine is killed as the rollout is aborted: the rollback
    completes, and the canary's engine comes back without fault@1, its annotation too."""
    local = fleet.require_local("killing an engine process")
    assert local.pods is not None
    ro = rollout_manifest(fleet, f"kill-{RUN}", "fault@1", config={"errorRate": 0.0},
                          steps=[{"weight": 50, "pause": "5m"}, {"weight": 100}])
    name = ro["metadata"]["name"]
    await fleet.apply(ro)

    async def in_place() -> str | None:
        st = ((await fleet.rollout(name)) or {}).get("status") or {}
        canaries = [p["name"] for p in st.get("pods") or [] if p.get("track") == "canary"]
        if st.get("phase") != "Progressing" or st.get("weight") != 50 or len(canaries) != 1:
            return None
        pod = await fleet.pod(canaries[0])
        return canaries[0] if "fault@1" in patches_of(await fleet.engine_revision(pod) or "") else None
    victim = await fleet.wait_for(in_place, TIMEOUT, "one canary running fault@1")
    before = (await fleet.pod(victim))["status"]["containerStatuses"][0]
    assert marks(await fleet.pod(victim)) == ("canary", "fault@1")

    local.pods.kill(victim)
    killed = time.time()
    reply = await fleet.api.patch(fleet.rollout_path(name),     # what `graft rollout abort` does
                                  json={"metadata": {"annotations": {"graft.dev/abort": "true"}}},
                                  headers={"content-type": "application/merge-patch+json"})
    reply.raise_for_status()
    samples: list[tuple[float, bool, str | None, tuple]] = []   # the victim: (t, Ready, engine, marks)

    async def back() -> bool:
        fleet.check_operator()
        pod = await fleet.pod(victim)
        cs = pod["status"]["containerStatuses"][0]
        running = (condition(pod, "ContainersReady") or {}).get("status") == "True"
        revision = await fleet.engine_revision(pod) if running else None
        samples.append((time.time(), is_ready(pod), revision, marks(pod)))
        phase = ((await fleet.rollout(name)) or {}).get("status", {}).get("phase")
        return phase in ("RolledBack", "Failed") and cs["restartCount"] == before["restartCount"] + 1 \
            and is_ready(pod) and revision == BASE
    await fleet.wait_for(back, START_TIMEOUT, f"{name} rolled back and {victim} back at base", interval=0.2)
    came_back = time.time()
    st = (await fleet.rollout(name))["status"]
    assert st["phase"] == "RolledBack" and st["reason"] == "Aborted", st
    await fleet.wait_for(lambda: converged(fleet, BASE, PODS), 30, "every pod at base")
    for pod in await fleet.pods():
        assert "fault@1" not in (await fleet.engine_revision(pod) or ""), pod["metadata"]["name"]
        assert marks(pod) == ("stable", BASE)
    # once its container was back, it never served traffic (Ready) while running fault@1
    dirty = [s for s in samples if s[1] and s[2] is not None and "fault@1" in s[2]]
    assert not dirty, f"{victim} was Ready running fault@1: {dirty[:3]}"
    print(f"{victim} back at base {came_back - killed:.1f}s after the kill; "
          f"revisions seen: {sorted({s[2] for s in samples if s[2]})}")


async def test_an_upgrade_of_an_applied_patch_fails_no_client_request(fleet: Fleet, traffic: ClientLoad):
    """kv-align@3.2.1 on every pod (written to the PatchFleet, as a user may), then a rollout of
    kv-align@3.2.2-test: each engine swaps one version for the other in one call, no pod is ever
    seen running neither, and every client request is answered. Each engine then compares its
    answers with the 3.2.1 table it replaced: they compare, and none diverges."""
    await set_fleet_patches(fleet, [builtin(KV)])
    await fleet.wait_for(lambda: converged(fleet, KV, PODS), 60, f"every pod at {KV} from the PatchFleet")
    ro = rollout_manifest(fleet, f"upgrade-{RUN}", KV_NEXT)
    ro["spec"]["analysis"]["breakers"].append({"name": "output-divergence", "max": 0.05, "consecutive": 1})
    name = ro["metadata"]["name"]
    pods = {p["metadata"]["name"] for p in await fleet.pods()}
    started = time.time()
    async with GateWatch(fleet) as watch, Recorder(fleet, name, engines=True, every=0.25) as rec:
        await fleet.apply(ro)
        final = await rec.final(TIMEOUT)
        await asyncio.sleep(2)      # requests in flight at the promotion are answered
    st = final.status
    assert final.phase == "Promoted", st.get("message")
    assert (st["stableRevision"], st["canaryRevision"], st.get("stablePatch")) == (KV_NEXT, KV_NEXT, KV)
    assert watch.closed(pods) == [], f"a gate closed during the upgrade: {watch.closed(pods)[:5]}"
    seen = {r for s in rec.samples for r in s.engines.values() if r is not None}
    assert seen <= {KV, KV_NEXT} and KV_NEXT in seen, seen
    assert fleet_refs(await patch_fleet(fleet)) == [KV_NEXT]
    await fleet.wait_for(lambda: converged(fleet, KV_NEXT, PODS), 30, f"every pod at {KV_NEXT}")
    for pod in await fleet.pods():
        applied = (await fleet.engine_patches(pod))["applied"]
        assert [(a["name"], a["version"]) for a in applied] == [("kv-align", "3.2.2-test")]
    answered, failed = traffic.answered(started), traffic.failed(started)
    assert failed == [], f"{len(failed)} client requests failed, first: {failed[0]}"
    assert answered >= (time.time() - started) / 3, f"only {answered} requests answered"

    # the shadow comparisons of 3.2.2-test against 3.2.1: none divergent in any analysis run, and
    # in Prometheus some compared (the engines go on comparing after the promotion) and none divergent
    runs = [(r["numbers"]["compared"], r["numbers"]["divergent"]) for s in rec.samples
            for r in (s.status.get("analysis") or {}).get("results") or []
            if r["name"] == "output-divergence" and "divergent" in (r.get("numbers") or {})]
    assert all(divergent == 0 for _, divergent in runs), runs
    ctx = Context(fleet.namespace, KV_NEXT, KV)

    async def compared() -> dict[str, float] | None:
        window = round(time.time() - started + 5)
        counts = {r: await fleet.query(shadow_query(ctx, window, r)) or 0.0 for r in (COMPARED, DIVERGENT)}
        return counts if counts[COMPARED] > 0 else None
    counts = await fleet.wait_for(compared, 60, f"the engines' shadow comparisons of {KV_NEXT} in Prometheus")
    assert counts[DIVERGENT] == 0, counts
    print(f"upgrade promoted in {final.t - started:.1f}s; {answered} client requests answered, none failed; "
          f"output-divergence saw {max((c for c, _ in runs), default=0):.0f} compared at most, 0 divergent; "
          f"Prometheus {counts[COMPARED]:.1f} compared, {counts[DIVERGENT]:.0f} divergent")


async def test_revert_takes_a_promoted_patch_out_of_every_pod_and_the_fleet(fleet: Fleet):
    """kv-align@3.2.1 on every pod, then a rollout of `action: revert`: promoted, it has taken the
    patch out of every engine and out of the PatchFleet, and the fleet controller leaves it out."""
    await set_fleet_patches(fleet, [builtin(KV)])
    await fleet.wait_for(lambda: converged(fleet, KV, PODS), 60, f"every pod at {KV}")
    ro = rollout_manifest(fleet, f"revert-{RUN}", KV, action="revert")
    name = ro["metadata"]["name"]
    await fleet.apply(ro)
    st = (await until_phase(fleet, name, FINAL_PHASES, TIMEOUT))["status"]
    assert st["phase"] == "Promoted", st.get("message")
    assert (st["stableRevision"], st["canaryRevision"]) == (BASE, BASE)
    assert "RolledBack" not in [e["reason"] for e in await fleet.events(name)]
    assert fleet_refs(await patch_fleet(fleet)) == []
    await fleet.wait_for(lambda: converged(fleet, BASE, PODS), 30, "every pod at base")
    await asyncio.sleep(3)          # and the fleet controller leaves them so
    assert await converged(fleet, BASE, PODS)


BUNDLE = "short-first@1.0.0"


def bundle_objects(fleet: Fleet) -> tuple[dict[str, Any], dict[str, Any]]:
    """examples/rollout-bundle.yaml in the fleet's namespace: the ConfigMap of short-first@1.0.0
    (a scheduling policy) and its patch source, as the example pins it."""
    import yaml
    config_map, example = yaml.safe_load_all((ROOT / "examples" / "rollout-bundle.yaml").read_text())
    config_map["metadata"]["namespace"] = fleet.namespace
    return config_map, example["spec"]["patch"]["source"]


async def test_a_promoted_bundle_survives_its_engine_being_killed(fleet: Fleet, traffic: ClientLoad):
    """A bundle rollout promoted over the fleet; one pod's engine process killed. It restarts with
    GRAFT_PATCHES naming the bundle, which only the operator can hand back: the engine waits, not
    ready, the fleet controller applies the bundle again, and the pod turns Ready running it. At no
    time is it Ready without the bundle, and its new engine serves no request on base."""
    local = fleet.require_local("killing an engine process")
    assert local.pods is not None
    config_map, source = bundle_objects(fleet)
    await fleet.apply(config_map)
    ro = rollout_manifest(fleet, f"bundle-{RUN}", BUNDLE)
    ro["spec"]["patch"]["source"] = source
    name = ro["metadata"]["name"]
    await fleet.apply(ro)
    st = (await until_phase(fleet, name, FINAL_PHASES, TIMEOUT))["status"]
    assert st["phase"] == "Promoted", st.get("message")
    assert fleet_refs(await patch_fleet(fleet)) == [BUNDLE]
    await fleet.wait_for(lambda: converged(fleet, BUNDLE, PODS), 30, f"every pod at {BUNDLE}")

    victim = sorted(p["metadata"]["name"] for p in await fleet.pods())[0]
    before = (await fleet.pod(victim))["status"]["containerStatuses"][0]
    local.pods.kill(victim)
    killed = time.time()
    samples: list[tuple[float, bool, str | None]] = []      # the victim: (t, Ready, engine revision)

    async def back() -> dict[str, Any] | None:
        fleet.check_operator()
        pod = await fleet.pod(victim)
        cs = pod["status"]["containerStatuses"][0]
        restarted = cs["restartCount"] == before["restartCount"] + 1
        running = restarted and (condition(pod, "ContainersReady") or {}).get("status") == "True"
        revision = await fleet.engine_revision(pod) if running or restarted else None
        samples.append((time.time(), is_ready(pod), revision))
        return pod if restarted and is_ready(pod) and revision == BUNDLE else None
    pod = await fleet.wait_for(back, START_TIMEOUT, f"{victim} back, Ready, running {BUNDLE}", interval=0.2)
    came_back = time.time()

    assert pod["status"]["containerStatuses"][0]["containerID"] != before["containerID"]
    assert local.pods.containers[victim].env_snapshot.get("GRAFT_PATCHES") == BUNDLE
    unready_bundle = [s for s in samples if s[1] and s[2] != BUNDLE and s[2] is not None]
    assert not unready_bundle, f"{victim} was Ready without {BUNDLE}: {unready_bundle[:3]}"
    assert any(not ready and revision == BASE for _, ready, revision in samples), \
        "the new engine was never seen waiting for its bundle"
    patches = await fleet.engine_patches(pod)
    applied = [(a["name"], a["version"], a["digest"]) for a in patches["applied"]]
    assert applied == [("short-first", "1.0.0", source["digest"])], applied
    assert await fleet.engine_metric(pod, "graft_requests_total", revision=BASE) == 0, "it served base"
    assert await fleet.engine_metric(pod, "graft_requests_total", revision=BUNDLE) >= 0
    await fleet.wait_for(lambda: converged(fleet, BUNDLE, PODS), 30, f"every pod at {BUNDLE} again")
    reached = [o for o in traffic.stats.outcomes if o.pod == victim and killed + 1 < o.at < came_back - 0.5]
    assert not reached, f"client requests reached {victim} while it waited: {reached[:3]}"
    print(f"{victim} back, Ready with {BUNDLE}, {came_back - killed:.1f}s after the kill; "
          f"revisions seen: {sorted({s[2] for s in samples if s[2]})}")


async def test_an_infinite_breaker_pauses_its_rollout_within_a_minute_and_delete_completes(fleet: Fleet):
    """A custom breaker answering +Inf (`vector(1) / 0`) is no number to judge: the rollout pauses
    for a person within a minute, saying so, and `kubectl delete` of it completes with the canary
    reverted (a status write that raised on Inf once wedged the rollout and its finaliser)."""
    ro = rollout_manifest(fleet, f"inf-{RUN}", KV, steps=[{"weight": 50, "pause": "2s"}, {"weight": 100}])
    ro["spec"]["analysis"]["breakers"] = [{"name": "queue-ratio", "max": 1, "window": "10s", "query": "vector(1) / 0"}]
    name = ro["metadata"]["name"]
    started = time.time()
    await fleet.apply(ro)
    obj = await until_phase(fleet, name, ("Paused", *FINAL_PHASES), 60)
    took = time.time() - started
    st = obj["status"]
    assert (st["phase"], st["reason"]) == ("Paused", "AnalysisErrorLimit"), st.get("message")
    assert [c["reason"] for c in st["pauseConditions"]] == ["AnalysisErrorLimit"] and obj["spec"]["paused"] is False
    (result,) = st["analysis"]["results"]
    assert result["verdict"] == "Error" and "not a finite number" in result["message"], result
    await fleet.delete_rollout(name)
    fleet.rollouts.remove(name)
    await fleet.wait_for(lambda: converged(fleet, BASE, PODS), 60, "the canary reverted")
    print(f"paused {took:.1f}s after the apply: {st['message']}")


async def test_a_template_deleted_mid_rollout_holds_saying_why_and_delete_completes(fleet: Fleet):
    template = f"checks-{RUN}"
    path = f"/apis/{GROUP_VERSION}/namespaces/{fleet.namespace}/patchanalysistemplates"
    reply = await fleet.api.post(path, json={
        "apiVersion": GROUP_VERSION, "kind": "PatchAnalysisTemplate", "metadata": {"name": template},
        "spec": {"breakers": [{"name": "error-rate", "max": 0.5, "window": "10s"}]}})
    assert reply.status_code == 201, reply.text
    ro = rollout_manifest(fleet, f"tpl-{RUN}", KV, steps=[{"weight": 50, "pause": "5m"}, {"weight": 100}])
    ro["spec"]["analysis"] = {"interval": "2s", "noData": "pass", "templates": [{"name": template}]}
    name = ro["metadata"]["name"]
    await fleet.apply(ro)

    async def canary_in_place() -> dict[str, Any] | None:
        st = ((await fleet.rollout(name)) or {}).get("status") or {}
        return st if st.get("phase") == "Progressing" and st.get("weight") == 50 and st.get("stepReadyAt") else None
    await fleet.wait_for(canary_in_place, TIMEOUT, "the 50% step in place")
    assert (await fleet.api.delete(f"{path}/{template}")).status_code == 200

    async def says_why() -> dict[str, Any] | None:
        ro = await fleet.rollout(name)
        st = (ro or {}).get("status") or {}
        return ro if "holding until it is fixed" in st.get("message", "") else None
    held = await fleet.wait_for(says_why, 60, f"{name} to say its template is gone")
    assert held["status"]["phase"] == "Progressing"
    assert f"analysis template {template!r} was not found" in held["status"]["message"], held["status"]["message"]
    assert {c["type"] for c in held["status"]["conditions"]} >= {"Progressing", "Completed"}
    t0 = time.time()
    await fleet.delete_rollout(name)          # kubectl delete: the finaliser reverts the canary and lets go
    fleet.rollouts.remove(name)
    await fleet.wait_for(lambda: converged(fleet, BASE, PODS), 60, "the canary reverted")
    print(f"held on its invalid spec; deleted and reverted in {time.time() - t0:.1f}s")


async def test_a_rollout_over_part_of_the_fleet_holds_while_the_fleet_promotes(fleet: Fleet):
    """Two rollouts whose selectors overlap (app=llm-engine, and app=llm-engine,zone=a over one of
    its pods): the second holds, Pending with reason FleetOverlap, the first promotes undisturbed,
    and no second PatchFleet appears to revert its patch as drift."""
    victim = sorted(p["metadata"]["name"] for p in await fleet.pods())[0]
    pod_path = f"/api/v1/namespaces/{fleet.namespace}/pods/{victim}"
    merge = {"content-type": "application/merge-patch+json"}
    (await fleet.api.patch(pod_path, json={"metadata": {"labels": {"zone": "a"}}}, headers=merge)).raise_for_status()
    try:
        first = rollout_manifest(fleet, f"whole-{RUN}", KV, steps=[{"weight": 50, "pause": "6s"}, {"weight": 100}])
        part = rollout_manifest(fleet, f"part-{RUN}", "sync-free@3.2.1")
        part["spec"]["selector"]["matchLabels"]["zone"] = "a"
        pods = {p["metadata"]["name"] for p in await fleet.pods()}
        async with GateWatch(fleet) as watch:
            await fleet.apply(first)
            await until_phase(fleet, first["metadata"]["name"], ("Progressing",), TIMEOUT)
            await fleet.apply(part)

            async def held() -> dict[str, Any] | None:
                ro = await fleet.rollout(part["metadata"]["name"])
                return ro if ((ro or {}).get("status") or {}).get("reason") == "FleetOverlap" else None
            hold = (await fleet.wait_for(held, 30, "the overlapping rollout to hold"))["status"]
            done = await until_phase(fleet, first["metadata"]["name"], FINAL_PHASES, TIMEOUT)
        assert done["status"]["phase"] == "Promoted", done["status"].get("message")
        assert hold["phase"] == "Pending" and f"PatchFleet {FLEET}" in hold["message"] and victim in hold["message"]
        assert watch.closed(pods) == [], watch.closed(pods)[:5]
        assert fleet_refs(await patch_fleet(fleet)) == [KV]
        items = (await fleet.api.get(f"/apis/{GROUP_VERSION}/namespaces/{fleet.namespace}/patchfleets")).json()["items"]
        assert [f["metadata"]["name"] for f in items] == [FLEET], "no second fleet"
        await fleet.wait_for(lambda: converged(fleet, KV, PODS), 30, f"every pod at {KV}")
        assert ((await fleet.rollout(part["metadata"]["name"]))["status"]).get("phase") == "Pending"
    finally:
        await fleet.api.patch(pod_path, json={"metadata": {"labels": {"zone": None}}}, headers=merge)
