"""End to end: real engines, real Prometheus, the real operator, five rollouts one after another.

Locally (the default) the fleet is `graft.devcluster.DevCluster`: the API server emulator with the
CRDs from crds/, three `graft serve` pods on 127.0.0.2-4 (the real SmolLM2 model, test patches
enabled), a real Prometheus scraping them, and `graft operator` as its own process (tick 1 s).
Client traffic (about one BBH request a second, 4 tokens each) runs through a pod-ratio router the
whole time; every outcome is kept, so each scenario can say which client requests failed and why.
The rollouts are the manifests of examples/ as `graft demo` runs them (`graft.demo.demo_rollout`:
seconds-long pauses, a 2-3 s analysis interval, the checks as the file has them). Such a fleet
cannot gather the ~3000 canary requests the default error-rate-delta gate needs at the last step
with stable pods, so the examples that keep the default gates run here with the gate of
examples/rollout-cpu-fleet.yaml (sized for one request a second, as its comment says). Each scenario
starts once every engine is at `base` and keeps up with the traffic, and ends by deleting its
rollout and reverting every engine. The operator log and the pod logs are under the
cluster's workdir (pytest's tmp folder, `devcluster*/operator.log`, `devcluster*/pods/*.log`);
a failed scenario's report shows their tails, the rollout's status and its Events.

Against a real cluster: set
- `GRAFT_E2E_KUBECONFIG` (and optionally `GRAFT_E2E_CONTEXT`): the cluster to use;
- `GRAFT_E2E_NAMESPACE` (default `llm`): where an engine Deployment labelled `app=llm-engine` runs,
  its engines started with `--enable-test-patches` (scenarios 2-4 use the test patches; the drift
  scenario also needs them to run without `--probe-prompts` as long as the traffic's prompts);
- `GRAFT_E2E_PROMETHEUS`: the Prometheus the operator queries (its GRAFT_PROMETHEUS_ADDRESS: the
  rollouts name none), as the tests reach it (its targets labelled `namespace` and `instance`, as
  the chart's scrape config does, and scraped every few seconds: the checks' windows need two
  samples);
- `GRAFT_E2E_ADMIN_TOKEN`, or `GRAFT_E2E_TOKEN_SECRET` (default `graft-admin-token`, key `token`):
  the engines' admin token.
The operator and the CRD must be installed (the Helm chart), and the tests must reach the pod IPs
(run them in the cluster, or on a routed pod network): they send the client traffic and read each
engine's admin API and /metrics themselves. Scenarios 1-4 run there unchanged; 5 needs local
control of a process (kill an engine) and is skipped, with that reason.

The scenarios in order: kv-align@3.2.1 promoted step by step (its canaries' shadow comparisons all
agreeing); fault@1 rolled back by its error-rate breaker; drift@1, answers wrong past a context
length no probe reaches, rolled back by output-divergence alone; slow@1 rolled back on p99; an
engine killed; a namespace-level attacker; an LLM quality gate (a job check running `graft eval bbh` against the
canary and stable Services) rolling back longctx-test@1 and promoting kv-align@3.2.1. An operator restart (the same step resumed, no pod patched twice) is shown by
tests/operator/test_rollout_operator.py::test_operator_restart_resumes_without_repatching, and a Prometheus outage (the step holds, then goes on by itself, or
pauses past outageLimit) is shown by tests/operator/test_rollout_operator.py against a real
Prometheus stopped and started again.
"""
from __future__ import annotations

import asyncio
import base64
import copy
import json
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from scipy.stats import binom

from graft.api import BASE
from graft.demo import demo_rollout, rollback_cause
from graft.devcluster.cluster import ROOT
from graft.devcluster.traffic import Outcome
from graft.operator.pods import is_ready
from graft.rollout.durations import parse_duration
from graft.rollout.queries import CANARY, COMPARED, DIVERGENT, Context, quantile_query, shadow_query
from graft.rollout.spec import DEFAULT_BREAKERS, parse_spec
from graft.rollout.status import from_time
from tests.e2e.fleet import SCRAPE_INTERVAL, ClientLoad, Fleet, Recorder, Sample, canary_pods
from tests.support import data_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

RUN = secrets.token_hex(2)     # rollout names are new on every run: a real cluster keeps old Events
PAUSE = "3s"
INTERVAL = 2.0                 # seconds between analysis runs
FINAL_TIMEOUT = 240            # generous: the machine may be shared; decisions are asserted exactly
STEP_EVENTS = ("StepStarted", "PodsPatched", "WeightSet")
# the gates a fleet of about one request a second can settle, and the runs that takes (the comment of
# rollout-cpu-fleet.yaml)
CPU_FLEET = yaml.safe_load((ROOT / "examples" / "rollout-cpu-fleet.yaml").read_text())["spec"]["analysis"]


def rollout(fleet: Fleet, example: str, scenario: str, *, interval: float = INTERVAL,
            cpu_fleet_gates: bool = False) -> dict[str, Any]:
    """An examples/ manifest as the demo runs it, named for this scenario and run; `cpu_fleet_gates`
    gives it the gates and inconclusiveLimit of rollout-cpu-fleet.yaml (its own gates would hold
    at the last step with stable pods until the rollout paused)."""
    ro = demo_rollout(ROOT / "examples" / example, fleet.namespace, PAUSE, f"{interval:g}s")
    ro["metadata"]["name"] = f"e2e-{scenario}-{RUN}"
    if cpu_fleet_gates:
        analysis = ro["spec"]["analysis"]
        # naming gates replaces the whole default analysis: an example without breakers keeps the defaults
        analysis.setdefault("breakers", copy.deepcopy(DEFAULT_BREAKERS))
        analysis["gates"] = copy.deepcopy(CPU_FLEET["gates"])
        analysis["inconclusiveLimit"] = CPU_FLEET["inconclusiveLimit"]
    return ro


def revision_of(ro: dict[str, Any]) -> str:
    patch = ro["spec"]["patch"]
    return f"{patch['name']}@{patch['version']}"


def step_of(event: dict[str, Any]) -> int | None:
    """The step number an event's message is about ("step 2/5: ..."), if any."""
    m = re.match(r"step (\d+)/\d+", event.get("message") or "")
    return int(m.group(1)) if m else None


def reasons(events: list[dict[str, Any]]) -> list[str]:
    return [e["reason"] for e in events]


def in_place(rec: Recorder, index: int, weight: int) -> list[Sample]:
    """Samples taken while step `index` was in place (its pods patched, its weight set)."""
    return [s for s in rec.samples if s.phase == "Progressing" and s.step == index and s.weight == weight]


async def assert_all_at(fleet: Fleet, revision: str, track: str) -> None:
    """Every pod: the engine's own revision, the annotation a restart reads, and the track label."""
    pods = await fleet.ready_pods()
    assert len(pods) == fleet.expected_pods
    for pod in pods:
        meta = pod["metadata"]
        assert (await fleet.engine_patches(pod))["revision"] == revision, meta["name"]
        assert meta["annotations"]["graft.dev/patches"] == revision, meta["name"]
        assert meta["labels"].get("graft.dev/track") == track, meta["name"]


def assert_clients(traffic: ClientLoad, since: float, until: float,
                   allowed: Callable[[Outcome], bool] = lambda o: False) -> None:
    """Clients were served all along (a third of the requests sent, at the least: a loaded CPU is
    slow, not idle), and every request that failed is one `allowed` to."""
    answered = traffic.answered(since)
    assert answered >= (until - since) * traffic.traffic.rate / 3, \
        f"only {answered} client requests answered in {until - since:.0f}s"
    unexpected = [o for o in traffic.failed(since) if not allowed(o)]
    assert unexpected == [], f"{len(unexpected)} client requests failed, first: {unexpected[0]}"


def assert_step_events(events: list[dict[str, Any]], steps: int) -> None:
    """StepStarted, PodsPatched, WeightSet once per step in step order; a step ends (and the rollout
    promotes) only after an AnalysisPassed with nothing failed or inconclusive since."""
    flow = [(e["reason"], step_of(e)) for e in events if e["reason"] in STEP_EVENTS]
    assert flow == [(r, k) for k in range(1, steps + 1) for r in STEP_EVENTS], flow
    passed = False
    for e in events:
        if e["reason"] == "AnalysisPassed":
            passed = True
        elif e["reason"] in ("AnalysisInconclusive", "AnalysisFailed"):
            passed = False
        elif e["reason"] == "Promoted" or (e["reason"] == "StepStarted" and step_of(e) != 1):
            assert passed, f"{e['reason']} ({e['message']}) without a passing analysis before it"


def divergence_series(rec: Recorder) -> tuple[list[float], list[float]]:
    """output-divergence's counts (compared, divergent) at each analysis run the recorder saw."""
    compared, divergent, runs = [], [], set()
    for s in rec.samples:
        analysis = s.status.get("analysis") or {}
        for r in analysis.get("results") or []:
            numbers = r.get("numbers") or {}
            if r["name"] == "output-divergence" and "compared" in numbers and analysis.get("lastRun") not in runs:
                runs.add(analysis.get("lastRun"))
                compared.append(numbers["compared"])
                divergent.append(numbers["divergent"])
    return compared, divergent


async def shadow_counts(fleet: Fleet, revision: str, window: float) -> dict[str, float]:
    """The canary engines' shadow comparisons of `revision` over the last `window` seconds, asked
    of Prometheus the way output-divergence asks (graft.rollout.queries.shadow_query)."""
    ctx = Context(fleet.namespace, revision, BASE)
    return {result: await fleet.query(shadow_query(ctx, round(window), result)) or 0.0
            for result in (COMPARED, DIVERGENT)}


async def test_builtin_patch_is_promoted_step_by_step(fleet: Fleet, traffic: ClientLoad):
    """kv-align@3.2.1 through 1, 5, 20, 50, 100 % of the pods: every pod patched, nothing failed."""
    ro = rollout(fleet, "rollout-cpu-fleet.yaml", "promote")
    name, revision, n = ro["metadata"]["name"], revision_of(ro), fleet.expected_pods
    weights = [s["weight"] for s in ro["spec"]["steps"]]
    assert weights == [1, 5, 20, 50, 100]
    assert ("breaker", "output-divergence") in {(c.role, c.name) for c in parse_spec(ro["spec"]).analysis.checks
                                               if not c.dry_run}
    started = time.time()
    async with Recorder(fleet, name, engines=True) as rec:
        await fleet.apply(ro)
        final = await rec.final(FINAL_TIMEOUT)

    assert final.phase == "Promoted", final.status.get("message")
    # the canaries compared their answers with base all along, and none diverged: in the rollout's
    # own analysis (each run's counts over the rollout so far) and in Prometheus
    compared, divergent = divergence_series(rec)
    assert compared and compared[-1] > 0, f"no shadow comparison reached the analysis: {compared[-5:]}"
    assert max(divergent) == 0, f"divergent comparisons in the analysis: {divergent}"
    shadow = await shadow_counts(fleet, revision, time.time() - started + 5)
    assert shadow[COMPARED] > 0 and shadow[DIVERGENT] == 0, shadow
    assert (final.status["stableRevision"], final.status["canaryRevision"]) == (revision, revision)
    for i, w in enumerate(weights):
        want = canary_pods(n, w)         # 3 pods: 1, 1, 1, 2, 3
        seen = in_place(rec, i, w)
        assert seen, f"step {i + 1} (weight {w}%) was never seen in place"
        assert {len(s.recorded("canary")) for s in seen} == {want}, f"step {i + 1}"
        # the pods themselves agree: labelled canary, and their engines answer with the patch
        assert any(len(s.labelled("canary")) == want and list(s.engines.values()).count(revision) == want
                   for s in seen), f"step {i + 1}: never {want} canary pods running {revision}"
    await assert_all_at(fleet, revision, "stable")
    for pod in await fleet.ready_pods():
        applied = (await fleet.engine_patches(pod))["applied"]
        assert [(a["name"], a["version"]) for a in applied] == [("kv-align", "3.2.1")]

    events = await fleet.events(name)
    assert_step_events(events, len(weights))
    assert reasons(events)[-1] == "Promoted"
    assert not {"AnalysisFailed", "RollingBack", "RolledBack"} & set(reasons(events))
    for e in events:
        if e["reason"] == "PodsPatched":
            step = step_of(e)
            assert f"{canary_pods(n, weights[step - 1])} of {n} pods" in e["message"], e["message"]
    assert_clients(traffic, started, final.t)
    print(f"promoted {final.t - started:.0f}s after the start; output-divergence saw {compared[-1]:.0f} compared, "
          f"0 divergent; Prometheus {shadow[COMPARED]:.1f} compared, {shadow[DIVERGENT]:.0f} divergent")


async def test_faulty_patch_is_rolled_back_at_the_first_step(fleet: Fleet, traffic: ClientLoad):
    """fault@1 fails 30% of its requests: its error-rate breaker rolls it back at step 1, within
    its `consecutive` runs (and one more interval) of the data showing a breach."""
    interval = 3.0
    ro = rollout(fleet, "rollout-fault-test.yaml", "fault", interval=interval)
    # a step-1 pause of 90 s: the step cannot end before the breaker has its evidence
    ro["spec"]["steps"][0]["pause"] = "90s"
    name, revision = ro["metadata"]["name"], revision_of(ro)
    (breaker,) = [b for b in parse_spec(ro["spec"]).analysis.breakers if b.name == "error-rate"]
    confidence = parse_spec(ro["spec"]).analysis.rollback_confidence
    assert breaker.name == "error-rate" and breaker.consecutive == 2
    seen: list[tuple[float, bool]] = []     # (when, the window's counts breach at the confidence)

    async def watch_errors() -> None:
        """The test's own verdict on the breaker's window, read from Prometheus four times a
        second: would these counts be rarer than 1 - rollbackConfidence at the breaker's limit?"""
        while True:
            n, k = await fleet.counts(revision, breaker.window)
            n, k = round(n), round(k)
            seen.append((time.time(), bool(k) and binom.sf(k - 1, n, breaker.max) < 1 - confidence))
            await asyncio.sleep(0.25)

    started = time.time()
    async with Recorder(fleet, name) as rec:
        await fleet.apply(ro)
        watcher = asyncio.create_task(watch_errors())
        try:
            final = await rec.final(FINAL_TIMEOUT)
        finally:
            watcher.cancel()

    st = final.status
    assert final.phase == "RolledBack", st.get("message")
    assert st["reason"] == "AnalysisFailed" and st["stepIndex"] == 0
    assert st["analysis"]["verdict"] == "Failed" and "breaker error-rate" in st["message"]
    decided = from_time(st["analysis"]["lastRun"])
    before = [(t, b) for t, b in seen if t < decided]
    assert any(b for _, b in before), "Prometheus never showed the canary breaching before the rollback"
    # A window of ten canary requests breaches and recovers as requests enter and leave it (2 of 9
    # is a breach at 0.999, 2 of 10 is not), and `consecutive` counts consecutive breaching runs:
    # the clock starts when the breach the rule acted on began, the last uninterrupted streak of
    # breaching readings before the decision.
    last = max(i for i, (_, b) in enumerate(before) if b)
    first = last
    while first > 0 and before[first - 1][1]:
        first -= 1
    breach = before[first][0]
    # counted in analysis runs, not seconds: a loaded machine stretches the timer, not the rule.
    # The deciding run is the breaker's `consecutive`-th after the breach showed, one more allowed
    # for a run whose query went out just before the test's own query saw it.
    runs = sorted({from_time(t) for s in rec.samples if (t := s.status.get("analysis", {}).get("lastRun"))})
    after = [t for t in runs if breach < t <= decided]
    assert decided in runs and len(after) <= breaker.consecutive + 1, \
        f"rolled back by the {len(after)}th analysis run after the breach began " \
        f"({decided - breach:.1f}s, interval {interval:g}s)"
    # and the breaker counted its breaches in consecutive runs up to the decision
    fails = [e["message"] for e in await fleet.events(name) if e["reason"] == "AnalysisFailed"]
    assert fails and f"(breach {breaker.consecutive}/{breaker.consecutive})" in fails[-1], fails
    events = await fleet.events(name)
    rs = reasons(events)
    assert rs.index("AnalysisFailed") < rs.index("RollingBack") < rs.index("RolledBack")
    assert "Promoted" not in rs and [step_of(e) for e in events if e["reason"] == "StepStarted"] == [1]
    await fleet.wait_for(lambda: settled(fleet, "base", "stable"), 30, "every pod back at base")

    # the only failures: the injected ones, answered by the canary while it ran fault@1
    canaries = {p for s in rec.samples for p in s.recorded("canary")}
    assert canaries and any(o.pod in canaries for o in traffic.failed(started)), "no request saw the fault"
    injected = sorted(o.at + o.latency for o in traffic.failed(started) if o.status == 500)
    print(f"injected errors answered {[round(t - started, 1) for t in injected[:3]]}s after the start, a breach "
          f"in Prometheus {breach - started:.1f}s, rolled back by the run {decided - breach:.1f}s later")
    assert_clients(traffic, started, final.t, allowed=lambda o: (
        o.status == 500 and "injected fault" in o.error and o.pod in canaries and o.at <= final.t))


def context_reach(prompts: list[str]) -> tuple[int, int]:
    """The longest context the self-check's probe runs, and the shortest prompt, in the engines'
    tokens (the engines run the built-in probe alone: no --probe-prompts)."""
    from graft.engine.loader import load_tokenizer
    from graft.engine.runner import build_probe_plan

    tokenizer = load_tokenizer()
    return build_probe_plan(tokenizer.encode).longest, min(len(tokenizer.encode(p)) for p in prompts)


async def test_silent_drift_is_rolled_back_by_output_divergence_at_the_first_step(fleet: Fleet, traffic: ClientLoad):
    """drift@1 answers wrongly past `fromTokens` of context: beyond the longest context the
    self-check's probe runs (so the apply passes), below every prompt of the traffic (so every
    answer drifts). It fails no request, and the latency and CPU checks run dry: output-divergence,
    the canary's comparison of its answers with the table it ran before, rolls it back at step 1."""
    ro = rollout(fleet, "rollout-drift-test.yaml", "drift")
    from_tokens = ro["spec"]["patch"]["config"]["fromTokens"]
    reach, shortest = context_reach(traffic.traffic.prompts)
    assert reach < from_tokens < shortest, (reach, from_tokens, shortest)
    # a step-1 pause of 90 s: the step cannot end before the canary has compared its answers
    ro["spec"]["steps"][0]["pause"] = "90s"
    name, revision = ro["metadata"]["name"], revision_of(ro)
    analysis = parse_spec(ro["spec"]).analysis
    acting = {(c.role, c.name) for c in analysis.checks if not c.dry_run}
    assert acting == {("breaker", "error-rate"), ("breaker", "output-divergence"), ("gate", "error-rate-delta"),
                      ("gate", "output-divergence")}, acting
    assert {c.name for c in analysis.checks if c.dry_run} == {"ttft-p99", "tpot-p99", "cpu"}
    (check,) = [c for c in analysis.breakers if c.name == "output-divergence"]
    started = time.time()
    async with Recorder(fleet, name) as rec:
        await fleet.apply(ro)
        final = await rec.final(FINAL_TIMEOUT)

    st = final.status
    assert final.phase == "RolledBack", st.get("message")
    assert st["reason"] == "AnalysisFailed" and st["stepIndex"] == 0, st
    assert rollback_cause({"status": st}) == ["output-divergence"], st.get("cause")
    assert "breaker output-divergence" in st["message"], st["message"]
    results = {(r.get("role", "breaker"), r["name"]): r for r in st["analysis"]["results"]}
    numbers = results["breaker", "output-divergence"]["numbers"]
    assert results["breaker", "output-divergence"]["verdict"] == "Failed"
    assert numbers["divergent"] >= 3 and numbers["lower"] > check.max, numbers
    assert results["breaker", "error-rate"]["verdict"] != "Failed", results["breaker", "error-rate"]
    events = await fleet.events(name)
    fails = [e["message"] for e in events if e["reason"] == "AnalysisFailed"]
    assert fails and all(re.match(r"(breaker|gate) output-divergence ", m) for m in fails), fails
    (rolling,) = [e["message"] for e in events if e["reason"] == "RollingBack"]
    assert "breaker output-divergence" in rolling and f"reverting {revision}" in rolling, rolling
    assert [step_of(e) for e in events if e["reason"] == "StepStarted"] == [1]
    # the canary's own counters, as Prometheus scraped them, say the same
    seen = await shadow_counts(fleet, revision, time.time() - started + 5)
    assert seen[DIVERGENT] > 0, seen
    await fleet.wait_for(lambda: settled(fleet, "base", "stable"), 30, "every pod back at base")
    # nothing else saw it: every client request was answered
    assert_clients(traffic, started, final.t)
    print(f"fromTokens {from_tokens} (probe reach {reach}, shortest prompt {shortest}): rolled back "
          f"{final.t - started:.0f}s after the start on {numbers['divergent']:.0f} divergent of "
          f"{numbers['compared']:.0f} compared requests (lower bound {numbers['lower']:.3g}); "
          f"Prometheus: {seen[DIVERGENT]:.1f} divergent of {seen[COMPARED]:.1f}")


async def settled(fleet: Fleet, revision: str, track: str) -> bool:
    try:
        await assert_all_at(fleet, revision, track)
    except AssertionError:
        return False
    return True


WINDOW = "20s"                 # the latency scenario's window


async def test_latency_regression_is_rolled_back_on_p99(fleet: Fleet, traffic: ClientLoad):
    """slow@1 adds 300 ms to every request and fails none: latency-p99 alone rolls it back."""
    # The threshold comes from the fleet as it is: the stable p99 over the checks' own window, read
    # from Prometheus just before the rollout, plus 150 ms (half the regression): a patch that
    # leaves latency alone stays under it, slow@1 goes over. The window read must hold only
    # requests of the steady fleet, none from before it kept up with the traffic.
    await asyncio.sleep(max(0.0, traffic.warm_at + parse_duration(WINDOW) + 3 * SCRAPE_INTERVAL - time.time()))
    stable_p99 = await fleet.query(quantile_query(Context(fleet.namespace, "base", "base"), CANARY,
                                                  "graft_request_duration_seconds", 0.99, parse_duration(WINDOW)))
    assert stable_p99 is not None, "no stable latency in Prometheus"
    threshold = round(stable_p99 + 0.15, 3)

    ro = rollout(fleet, "rollout-cpu-fleet.yaml", "slow")
    ro["spec"]["patch"] = {"name": "slow", "version": "1", "source": {"builtin": {}}}
    ro["spec"]["steps"][0]["pause"] = "90s"    # step 1 may not pass before its data is judged
    # a p99 needs 200 samples by default; one canary pod of this fleet answers a few requests in the
    # window, so the breaker is told to judge on 3 (its p99 is then the slowest of them)
    ro["spec"]["analysis"]["breakers"] = [
        {"name": "error-rate", "max": 0.005, "window": WINDOW},
        {"name": "latency-p99", "max": threshold, "window": WINDOW, "minSamples": 3},
    ]
    name = ro["metadata"]["name"]
    started = time.time()
    async with Recorder(fleet, name) as rec:
        await fleet.apply(ro)
        final = await rec.final(FINAL_TIMEOUT)

    st = final.status
    assert final.phase == "RolledBack", f"{st.get('message')} (threshold {threshold}s)"
    assert st["reason"] == "AnalysisFailed" and st["stepIndex"] == 0
    results = {r["name"]: r for r in st["analysis"]["results"]}
    assert results["latency-p99"]["verdict"] == "Failed" and results["latency-p99"]["value"] > threshold
    assert results["error-rate"]["verdict"] != "Failed"
    failed_checks = [e["message"] for e in await fleet.events(name) if e["reason"] == "AnalysisFailed"]
    assert failed_checks and all(m.startswith("breaker latency-p99") for m in failed_checks), failed_checks
    await fleet.wait_for(lambda: settled(fleet, "base", "stable"), 30, "every pod back at base")
    assert_clients(traffic, started, final.t)
    print(f"stable p99 {stable_p99:.3f}s, threshold {threshold:.3f}s, canary p99 "
          f"{results['latency-p99']['value']:.3f}s: rolled back {final.t - started:.0f}s after the start")


async def test_killed_engine_comes_back_on_its_track(fleet: Fleet, traffic: ClientLoad):
    """A canary engine killed mid-rollout restarts patched, and the rollout still promotes."""
    local = fleet.require_local("killing an engine process")
    assert local.pods is not None
    ro = rollout(fleet, "rollout-sync-free.yaml", "crash", cpu_fleet_gates=True)
    ro["spec"]["steps"][1]["pause"] = "30s"    # time for the engine to come back within the step
    name, revision = ro["metadata"]["name"], revision_of(ro)
    weight = ro["spec"]["steps"][1]["weight"]
    started = time.time()
    async with Recorder(fleet, name) as rec:
        await fleet.apply(ro)
        at_kill = await rec.until(lambda s: s.step == 1 and s.weight == weight, FINAL_TIMEOUT, "step 2 in place")
        victim = at_kill.recorded("canary")[0]
        before = await fleet.pod(victim)
        cs_before = before["status"]["containerStatuses"][0]
        assert before["metadata"]["annotations"]["graft.dev/patches"] == revision
        local.pods.kill(victim)
        killed = time.time()

        async def back() -> dict[str, Any] | None:
            pod = await fleet.pod(victim)
            cs = pod["status"]["containerStatuses"][0]
            return pod if cs.get("ready") and cs["restartCount"] == cs_before["restartCount"] + 1 else None
        returned = await fleet.wait_for(back, 180, f"{victim} to restart and turn ready")
        came_back = time.time()
        revision_back = await fleet.engine_revision(returned)
        final = await rec.final(FINAL_TIMEOUT)

    assert final.phase == "Promoted", final.status.get("message")
    assert returned["status"]["containerStatuses"][0]["containerID"] != cs_before["containerID"]
    events = await fleet.events(name)
    # while it was down another pod took its share; back, it is either still a canary (running the
    # patch) or a canary beyond the step's count, returned to stable (CanaryReturned) and reverted
    returned_to_stable = any(e["reason"] == "CanaryReturned" and victim in e["message"] for e in events)
    assert revision_back in ((revision, "base") if returned_to_stable else (revision,)), \
        f"{victim} came back running {revision_back}"
    # brought back by the annotation (GRAFT_PATCHES at start-up) or by the operator
    assert local.pods.containers[victim].env_snapshot.get("GRAFT_PATCHES") == revision or \
        "PodRepatched" in reasons(events)
    await assert_all_at(fleet, revision, "stable")
    # only requests to the killed engine, sent before it was back, may have failed
    assert_clients(traffic, started, final.t, allowed=lambda o: o.pod == victim and o.at <= came_back)
    print(f"{victim} back {came_back - killed:.1f}s after the kill")


# ---- a namespace-level attacker: create on Pods, Secrets and PatchRollouts in this namespace ----

# A pod labelled into the fleet that is no engine of its workload: its "admin port" records every
# call (and the Authorization it carried), its HTTP port tells what it recorded.
TRAP_POD = r'''
import http.server, json, os, threading
seen = []
class Admin(http.server.BaseHTTPRequestHandler):
    def record(self):
        seen.append({"method": self.command, "path": self.path, "authorization": self.headers.get("Authorization")})
        self.send_response(200); self.send_header("content-type", "application/json"); self.end_headers()
        self.wfile.write(b'{"revision": "base", "applied": []}')
    do_GET = do_POST = do_PUT = do_DELETE = record
    def log_message(self, *args): pass
class Seen(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps(seen).encode()
        self.send_response(200); self.send_header("content-type", "application/json"); self.end_headers()
        self.wfile.write(body)
    do_POST = do_GET
    def log_message(self, *args): pass
ip = os.environ["POD_IP"]
threading.Thread(target=http.server.ThreadingHTTPServer((ip, 8081), Admin).serve_forever, daemon=True).start()
http.server.ThreadingHTTPServer((ip, 8000), Seen).serve_forever()
'''


class Listener:
    """An HTTP server on this machine's loopback posing as Prometheus: it records every request."""

    def __init__(self) -> None:
        import http.server
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append({"path": self.path, "authorization": self.headers.get("Authorization")})
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"status": "success", "data": {"resultType": "vector", "result": []}}')
            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_a_namespace_level_attacker_gets_no_token_no_secret_and_no_query_of_its_own(fleet: Fleet,
                                                                                         traffic: ClientLoad):
    """What someone allowed only to create Pods, Secrets and PatchRollouts in the fleet's namespace
    tries: a trap pod labelled into the rollout, a rollout sending a Secret to a listener of its
    own, a selector that matches every pod, and an argument that rewrites an administrator's
    template query. The trap receives no call (so no token), the listener nothing, the selector is
    refused at admission, and the argument stays one label value of the administrator's query."""
    ns, api = fleet.namespace, fleet.api
    trap_name, secret, template = f"trap-{RUN}", f"prom-token-{RUN}", f"admin-checklist-{RUN}"
    listener = Listener()
    (engine_pod,) = (await fleet.ready_pods())[:1]
    trap = {"apiVersion": "v1", "kind": "Pod",
            # the rollout's selector, and nothing of the workload's own labels (no owner, no template hash)
            "metadata": {"name": trap_name, "namespace": ns, "labels": {"app": "llm-engine"}},
            "spec": {"containers": [{
                "name": "engine", "image": engine_pod["spec"]["containers"][0].get("image", "graft/engine"),
                "command": ["python", "-c", TRAP_POD],
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                "ports": [{"name": "http", "containerPort": 8000}, {"name": "admin", "containerPort": 8081}]}]}}
    base = {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout",
            "spec": {"selector": {"matchLabels": {"app": "llm-engine"}},
                     "patch": {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}},
                     "steps": [{"weight": 1, "pause": "10m"}, {"weight": 100}]}}

    def named(name: str, **spec: Any) -> dict[str, Any]:
        ro = copy.deepcopy(base)
        ro["metadata"] = {"name": f"e2e-{name}-{RUN}", "namespace": ns}
        ro["spec"].update(spec)
        return ro

    async def trap_saw() -> list[dict[str, Any]]:
        pod = await fleet.pod(trap_name)
        reply = await fleet.http.get(f"http://{pod['status']['podIP']}:8000/seen")
        return reply.json()

    try:
        reply = await api.post(f"/api/v1/namespaces/{ns}/pods", json=trap)
        assert reply.status_code == 201, reply.text

        async def trap_ready() -> bool:
            pod = await fleet.pod(trap_name)
            return bool(pod and (pod.get("status") or {}).get("podIP") and is_ready(pod))
        await fleet.wait_for(trap_ready, 60, "the trap pod to be Ready")
        reply = await api.post(f"/api/v1/namespaces/{ns}/secrets", json={
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": ns},
            "data": {"token": base64.b64encode(b"prometheus-bearer-secret").decode()}})
        assert reply.status_code == 201, reply.text

        # 1. a Prometheus of the attacker's choosing, with a Secret to send it
        exfil = named("exfil", analysis={"prometheus": {
            "address": listener.url, "bearerTokenSecret": {"name": secret, "key": "token"}}})
        await fleet.apply(exfil)

        async def refused() -> dict[str, Any] | None:
            status = ((await fleet.rollout(exfil["metadata"]["name"])) or {}).get("status") or {}
            return status if status.get("reason") == "PrometheusNotAllowed" else None
        status = await fleet.wait_for(refused, 60, "the rollout refused with PrometheusNotAllowed")
        assert listener.url in status["message"] and "GRAFT_PROMETHEUS_ALLOWED" in status["message"]
        await fleet.delete_rollout(exfil["metadata"]["name"])

        # 2. a selector that names no fleet: refused by the API server, nothing created
        everything = named("everything", selector={"matchExpressions": [
            {"key": "app", "operator": "NotIn", "values": ["nothing"]}]})
        reply = await api.post(fleet.rollout_path(), json=everything)
        assert reply.status_code == 422 and "must name the fleet" in reply.text, reply.text
        assert await fleet.rollout(everything["metadata"]["name"]) is None

        # 3. an administrator's template, and an argument that tries to rewrite its query into a 7
        reply = await api.post("/apis/graft.dev/v1alpha1/clusterpatchanalysistemplates", json={
            "apiVersion": "graft.dev/v1alpha1", "kind": "ClusterPatchAnalysisTemplate",
            "metadata": {"name": template},
            "spec": {"args": [{"name": "route"}], "breakers": [{
                "name": "route-errors", "max": 5,
                "query": 'sum(graft_requests_total{namespace="{{namespace}}",route="{{args.route}}"}) or vector(0)'}]}})
        assert reply.status_code == 201, reply.text
        rewrite = named("rewrite", analysis={"interval": "2s", "templates": [{"name": template, "clusterScope": True}],
                                             "args": [{"name": "route", "value": 'x"}) or vector(7) or sum(up{a="'}]})
        async with Recorder(fleet, rewrite["metadata"]["name"]) as rec:
            await fleet.apply(rewrite)
            judged = await rec.until(lambda s: any(r["name"] == "route-errors" and r.get("value") is not None
                                                   for r in (s.status.get("analysis") or {}).get("results") or []),
                                     FINAL_TIMEOUT, "an analysis run of the template's breaker")
        (result,) = [r for r in judged.status["analysis"]["results"] if r["name"] == "route-errors"]
        assert result["value"] == 0 and result["verdict"] != "Failed", result    # one label value, matching nothing
        assert judged.recorded("canary"), "the rollout went on with the engines of the workload"
        assert trap_name not in judged.recorded("canary") + judged.recorded("stable")
        events = await fleet.events(rewrite["metadata"]["name"])
        assert any(e["reason"] == "NotAnEngine" and trap_name in e["message"] and e["type"] == "Warning"
                   for e in events), reasons(events)
        assert await trap_saw() == [], "the trap pod was called"
        assert listener.seen == [], "the listener was asked"
    finally:
        listener.close()
        for path in (f"/api/v1/namespaces/{ns}/pods/{trap_name}", f"/api/v1/namespaces/{ns}/secrets/{secret}",
                     f"/apis/graft.dev/v1alpha1/clusterpatchanalysistemplates/{template}"):
            await api.delete(path)
        await fleet.wait_for(lambda: _gone(fleet, trap_name), 60, "the trap pod to be gone")


async def _gone(fleet: Fleet, pod: str) -> bool:
    return await fleet.pod(pod) is None


QUALITY_GATE = "rollout-quality-gate-test.yaml"


async def jobs_of(fleet: Fleet, rollout_uid: str) -> list[dict[str, Any]]:
    r = await fleet.api.get(f"/apis/batch/v1/namespaces/{fleet.namespace}/jobs",
                            params={"labelSelector": f"graft.dev/rollout-uid={rollout_uid}"})
    r.raise_for_status()
    return r.json()["items"]


async def job_answer(fleet: Fleet, job: dict[str, Any]) -> dict[str, Any]:
    """The JSON line the job's pod printed last: what the quality gate read."""
    r = await fleet.api.get(f"/api/v1/namespaces/{fleet.namespace}/pods",
                            params={"labelSelector": f"job-name={job['metadata']['name']}"})
    (pod,) = r.json()["items"]
    log = await fleet.api.get(f"/api/v1/namespaces/{fleet.namespace}/pods/{pod['metadata']['name']}/log")
    return json.loads([line for line in log.text.splitlines() if line.startswith("{")][-1])


def quality_gate(fleet: Fleet, scenario: str, patch: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """examples/rollout-quality-gate-test.yaml as the demo runs it: its two Services and its rollout
    in the fleet's namespace, the evaluation reading this machine's BBH data; `patch` replaces the
    rollout's patch."""
    *services, _ = yaml.safe_load_all((ROOT / "examples" / QUALITY_GATE).read_text())
    for svc in services:
        svc["metadata"]["namespace"] = fleet.namespace
    ro = demo_rollout(ROOT / "examples" / QUALITY_GATE, fleet.namespace, PAUSE, f"{INTERVAL:g}s")
    ro["metadata"]["name"] = f"e2e-{scenario}-{RUN}"
    if patch is not None:
        ro["spec"]["patch"] = patch
    (container,) = ro["spec"]["analysis"]["gates"][0]["job"]["spec"]["template"]["spec"]["containers"]
    container["env"] = [{**e, "value": str(data_dir())} if e["name"] == "GRAFT_DATA_DIR" else e
                        for e in container["env"]]
    return [*services, ro]


async def test_a_quality_gate_rolls_back_a_patch_that_loses_answers_and_promotes_one_that_does_not(
        fleet: Fleet, traffic: ClientLoad):
    """longctx-test@1 is exact below 208 tokens of context and wrong past it: the self-check, the
    error rate and the latency cannot tell. The quality gate's Job (`graft eval bbh` on a fixed
    sample of 235-242-token prompts, against the canary and the stable Services) sees the canary
    lose its answers and rolls it back at the first step; kv-align@3.2.1 loses none and is promoted,
    one Job per step with stable pods."""
    fleet.require_local("Services reached through their ClusterIP from a Job's pod")
    *services, bad = quality_gate(fleet, "quality-bad")
    for svc in services:
        await fleet.apply(svc)
    try:
        started = time.time()
        async with Recorder(fleet, bad["metadata"]["name"]) as rec:
            created = await fleet.apply(bad)
            final = await rec.final(FINAL_TIMEOUT)
        st = final.status
        assert final.phase == "RolledBack", st.get("message")
        assert st["reason"] == "AnalysisFailed" and st["stepIndex"] == 0, st
        assert rollback_cause({"status": st}) == ["bbh-accuracy-drop"], st.get("cause")
        (result,) = [r for r in st["analysis"]["results"] if r["name"] == "bbh-accuracy-drop"]
        assert result["verdict"] == "Failed" and result["value"] > 0.2, result
        (job,) = await jobs_of(fleet, created["metadata"]["uid"])
        answer = await job_answer(fleet, job)
        assert answer["difference"] == result["value"] and answer["n"] == 10 and answer["errors"] == 0, answer
        assert answer["accuracy"] < answer["baseline_accuracy"], answer
        # the Job ran while the step waited for it: the gate was pending before it failed
        assert any(r.get("pending") for s in rec.samples for r in (s.status.get("analysis") or {}).get("results") or []
                   if r["name"] == "bbh-accuracy-drop"), "the gate was never seen waiting for its Job"
        await fleet.wait_for(lambda: settled(fleet, "base", "stable"), 60, "every pod back at base")
        assert_clients(traffic, started, final.t)
        print(f"rolled back {final.t - started:.0f}s after the start: accuracy {answer['accuracy']} against "
              f"{answer['baseline_accuracy']} on stable ({answer['changed']} answers changed)")

        *_, good = quality_gate(fleet, "quality-good", {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}})
        started = time.time()
        async with Recorder(fleet, good["metadata"]["name"]) as rec:
            created = await fleet.apply(good)
            final = await rec.final(FINAL_TIMEOUT)
        assert final.phase == "Promoted", final.status.get("message")
        jobs = await jobs_of(fleet, created["metadata"]["uid"])
        weights = [s["weight"] for s in good["spec"]["steps"]]
        assert sorted(int(j["metadata"]["annotations"]["graft.dev/step"]) for j in jobs) == \
            [i for i, w in enumerate(weights) if w < 100], "one Job per step with stable pods"
        for job in jobs:
            answer = await job_answer(fleet, job)
            assert answer["difference"] <= 0.2 and answer["errors"] == answer["baseline_errors"] == 0, answer
        await assert_all_at(fleet, "kv-align@3.2.1", "stable")
        assert_clients(traffic, started, final.t)
        print(f"promoted {final.t - started:.0f}s after the start, {len(jobs)} Jobs")
    finally:
        for svc in services:
            await fleet.api.delete(f"/api/v1/namespaces/{fleet.namespace}/services/{svc['metadata']['name']}")
