"""Finished rollouts do not pile up: which ones `graft.rollout.history.plan` deletes, how a stored
PatchRollout is read for it, and the two fields in the CRDs (as the emulated API server, kubectl
explain and the spec parsers see them)."""
from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import aiohttp
import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from graft.devcluster.apiserver import ApiServer
from graft.devcluster.crd import check, served_versions
from graft.devcluster.kubeconfig import write_kubeconfig
from graft.api import Reason
from graft.rollout.history import (RolloutRecord, expired, finished, finished_at,
                                   plan, record, targets)
from graft.rollout.spec import DEFAULT_REVISION_HISTORY_LIMIT, SpecError, parse_fleet_spec, parse_spec
from graft.api import FINAL_PHASES
from graft.rollout.status import PHASES, to_time
from tests.devcluster.kubectl_cli import run_kubectl

ROOT = Path(__file__).resolve().parents[2]
(FLEET_CRD,) = served_versions(yaml.safe_load((ROOT / "crds" / "patchfleet.yaml").read_text()))
(ROLLOUT_CRD,) = served_versions(yaml.safe_load((ROOT / "crds" / "patchrollout.yaml").read_text()))
SELECTOR = {"matchLabels": {"app": "llm-engine"}}
PATCH = {"name": "kv-align", "version": "3.2.1", "source": {"builtin": {}}}


# the decision

def rollout(name, finished_at=None, *, phase="Promoted", ttl=None, keeps_stable=False, created_at=0.0):
    return RolloutRecord(name, "uid-" + name, phase, phase in FINAL_PHASES, finished_at, created_at, ttl, keeps_stable)


def test_the_oldest_finished_go_first_and_active_ones_stay():
    rollouts = [rollout("a", 10), rollout("b", 20, phase="RolledBack"), rollout("c", 30, phase="Failed"),
                rollout("d", phase="Progressing"), rollout("e", phase="Pending")]
    deletions = plan(rollouts, limit=1, now=100)
    assert [(d.rollout.name, d.reason) for d in deletions] == [("a", Reason.HISTORY_PRUNED), ("b", Reason.HISTORY_PRUNED)]
    assert "deleted PatchRollout a (Promoted): the fleet keeps 1 finished rollout (revisionHistoryLimit)" \
        == deletions[0].message
    assert plan(rollouts, limit=3, now=100) == []
    assert [d.rollout.name for d in plan(rollouts, limit=0, now=100)] == ["a", "b", "c"]


def test_the_rollout_that_promoted_what_the_fleet_runs_is_kept_before_newer_ones():
    rollouts = [rollout("promoted", 10, keeps_stable=True), rollout("rolled-back", 20, phase="RolledBack"),
                rollout("failed", 30, phase="Failed")]
    assert [d.rollout.name for d in plan(rollouts, limit=2, now=100)] == ["rolled-back"]
    assert [d.rollout.name for d in plan(rollouts, limit=1, now=100)] == ["rolled-back", "failed"]
    # only a limit below their number deletes one, and says so
    (gone,) = plan(rollouts, limit=0, now=100)[:1]
    assert gone.rollout.name == "promoted" and "fewer than the rollouts that promoted its patches" in gone.message


def test_a_ttl_counts_from_the_finish_and_is_honoured_whatever_the_fleet_keeps():
    done = rollout("done", 100, ttl=30, keeps_stable=True)
    assert plan([done], limit=None, now=129.9) == []
    (d,) = plan([done], limit=None, now=130)
    assert (d.reason, d.message) == (
        Reason.TTL_EXPIRED, "deleted 30.0s after it finished Promoted (ttlSecondsAfterFinished: 30)")
    assert plan([done], limit=10, now=130)[0].reason == Reason.TTL_EXPIRED
    assert expired(rollout("now", 100, ttl=0), 100)
    # an active rollout, or one whose finish time is not known, never expires
    assert not expired(rollout("running", 100, phase="Paused", ttl=0), 1e9)
    assert not expired(rollout("unknown", None, ttl=0), 1e9)


NAMES = [f"r{i}" for i in range(12)]


@st.composite
def fleets(draw):
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=len(NAMES)))
    out = []
    for name in names:
        phase = draw(st.sampled_from(PHASES))
        done = phase in FINAL_PHASES and draw(st.booleans())       # not: refused as invalid, a final phase waiting for a fix
        out.append(RolloutRecord(
            name, "uid-" + name, phase, done,
            draw(st.none() | st.integers(0, 50).map(float)) if done else None,  # ties and unknown finish times
            float(draw(st.integers(0, 50))),
            draw(st.none() | st.integers(0, 60)), draw(st.booleans())))
    return out


@st.composite
def moments(draw, rollouts):
    """Any time, or one exactly when a TTL runs out (the edge a comparison can get wrong)."""
    deadlines = [r.finished_at + r.ttl for r in rollouts if r.finished_at is not None and r.ttl is not None]
    return draw(st.sampled_from(deadlines)) if deadlines and draw(st.booleans()) else float(draw(st.integers(0, 120)))


@settings(max_examples=200, deadline=None)
@given(st.data(), fleets(), st.none() | st.integers(0, 8))
def test_plan_properties(data, rollouts, limit):
    now = data.draw(moments(rollouts))
    deletions = plan(rollouts, limit=limit, now=now)
    deleted = {d.rollout.name: d for d in deletions}
    assert len(deleted) == len(deletions), "each rollout at most once"
    # never an active rollout
    assert all(d.rollout.finished for d in deletions)
    # the TTL: exactly the finished rollouts whose finish time plus TTL has passed
    assert {n for n, d in deleted.items() if d.reason == Reason.TTL_EXPIRED} == {
        r.name for r in rollouts if r.finished and r.ttl is not None and r.finished_at is not None
        and now >= r.finished_at + r.ttl}
    if limit is None:
        assert all(d.reason == Reason.TTL_EXPIRED for d in deletions)
        return
    # the limit: exactly min(limit, finished) kept among those the TTL leaves
    candidates = [r for r in rollouts if r.finished and not expired(r, now)]
    kept = [r for r in candidates if r.name not in deleted]
    assert len(kept) == min(limit, len(candidates))
    pruned = [deleted[r.name].rollout for r in candidates if r.name in deleted]
    # those that promoted the fleet's patches first, then the newest
    for group in (True, False):
        kept_g = [r for r in kept if r.keeps_stable is group]
        pruned_g = [r for r in pruned if r.keeps_stable is group]
        assert all(p.order < k.order for p in pruned_g for k in kept_g)
    if any(p.keeps_stable for p in pruned):
        assert all(k.keeps_stable for k in kept) and len(kept) == limit
    # oldest first within each reason
    for reason in (Reason.TTL_EXPIRED, Reason.HISTORY_PRUNED):
        orders = [d.rollout.order for d in deletions if d.reason == reason]
        assert orders == sorted(orders)
    assert [d.reason for d in deletions] == sorted((d.reason for d in deletions), key=[Reason.TTL_EXPIRED,
                                                                                         Reason.HISTORY_PRUNED].index)


# reading the stored objects

def stored(name, phase="Promoted", *, reason="Promoted", done_at=100.0, fleet="llm-engine", ttl=None,
           action="apply", patch="kv-align@3.2.1"):
    spec = {"selector": SELECTOR, "patch": PATCH, "action": action}
    if ttl is not None:
        spec["ttlSecondsAfterFinished"] = ttl
    conditions = [{"type": "Completed", "status": "True" if phase in FINAL_PHASES else "False",
                   "lastTransitionTime": to_time(done_at)}] if done_at is not None else []
    return {"metadata": {"name": name, "uid": "uid-" + name, "creationTimestamp": to_time(50.0)}, "spec": spec,
            "status": {"phase": phase, "reason": reason, "patch": patch, "fleet": fleet, "conditions": conditions}}


def test_a_stored_rollout_is_read_with_its_finish_time_ttl_and_whether_it_made_the_fleet():
    r = record(stored("a", ttl=5), ["kv-align@3.2.1", "sync-free@3.2.1"])
    assert (r.name, r.uid, r.finished, r.finished_at, r.created_at, r.ttl, r.keeps_stable) == (
        "a", "uid-a", True, 100.0, 50.0, 5, True)
    assert not record(stored("a"), ["kv-align@3.2.2"]).keeps_stable            # an upgrade replaced it since
    assert not record(stored("a", action="revert"), ["kv-align@3.2.1"]).keeps_stable
    assert not record(stored("a", "RolledBack", reason="AnalysisFailed"), ["kv-align@3.2.1"]).keeps_stable
    assert record(stored("a", ttl="soon")).ttl is None                           # refused by the API server
    assert record(stored("a", done_at=None)).finished_at is None


def test_a_spec_refused_as_invalid_waits_for_its_fix_and_is_not_history():
    assert finished({"phase": "Failed", "reason": "ProgressDeadlineExceeded"})
    assert not finished({"phase": "Failed", "reason": "InvalidSpec"})
    assert not finished({"phase": "RollingBack"}) and not finished(None)
    assert finished_at({"conditions": [{"type": "Completed", "status": "False", "lastTransitionTime":
                                        to_time(5.0)}]}) is None


def test_a_rollout_belongs_to_the_fleet_its_status_names_or_else_by_selector():
    query = "app=llm-engine"
    assert targets(stored("a"), "llm-engine", query)
    assert not targets(stored("a", fleet="other"), "llm-engine", query)
    never_started = stored("a", "Failed", fleet=None)
    assert targets(never_started, "llm-engine", query) and not targets(never_started, "llm-engine", "app=x")
    never_started["spec"]["selector"] = {"matchLabels": {"zzz!": "q"}}
    assert not targets(never_started, "llm-engine", query)


# the two fields in the CRDs and in the spec parsers

@pytest.mark.parametrize("path", ["patchfleet.yaml", "patchrollout.yaml"])
def test_both_crds_stay_valid_for_kube_apiserver(path):
    crd = yaml.safe_load((ROOT / "crds" / path).read_text())
    kubernetes_validate.validate(crd, "1.32", strict=True)
    assert check(crd) == []


def fleet_errors(spec):
    body = {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet", "metadata": {"name": "f"}, "spec": spec}
    FLEET_CRD.prune(body)
    FLEET_CRD.default(body)
    return body, [e.field for e in FLEET_CRD.validate(body)]


def test_a_fleet_keeps_ten_finished_rollouts_unless_told_otherwise():
    body, errors = fleet_errors({"selector": SELECTOR})
    assert errors == [] and body["spec"]["revisionHistoryLimit"] == DEFAULT_REVISION_HISTORY_LIMIT == 10
    assert parse_fleet_spec(body["spec"]).revision_history_limit == 10
    assert parse_fleet_spec({"selector": SELECTOR}).revision_history_limit == 10     # an older CRD: no default
    assert parse_fleet_spec({"selector": SELECTOR, "revisionHistoryLimit": 0}).revision_history_limit == 0


@pytest.mark.parametrize("value", [-1, 1.5, "3", True])
def test_a_history_limit_that_is_no_count_is_refused_by_both(value):
    _, errors = fleet_errors({"selector": SELECTOR, "revisionHistoryLimit": value})
    assert any(e.startswith("spec.revisionHistoryLimit") for e in errors), errors
    with pytest.raises(SpecError) as refused:
        parse_fleet_spec({"selector": SELECTOR, "revisionHistoryLimit": value})
    assert refused.value.paths == ["spec.revisionHistoryLimit"]


@pytest.mark.parametrize("value, ok", [(0, True), (86400, True), (-1, False), (2.5, False), ("60", False)])
def test_a_ttl_is_a_count_of_seconds_for_both(value, ok):
    body = {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchRollout", "metadata": {"name": "r"},
            "spec": {"selector": SELECTOR, "patch": copy.deepcopy(PATCH), "ttlSecondsAfterFinished": value}}
    ROLLOUT_CRD.default(body)
    errors = [e.field for e in ROLLOUT_CRD.validate(body)]
    if ok:
        assert errors == [] and parse_spec(body["spec"]).ttl_seconds_after_finished == value
    else:
        assert any(e.startswith("spec.ttlSecondsAfterFinished") for e in errors), errors
        with pytest.raises(SpecError) as refused:
            parse_spec(body["spec"])
        assert refused.value.paths == ["spec.ttlSecondsAfterFinished"]
    assert parse_spec({"selector": SELECTOR, "patch": PATCH}).ttl_seconds_after_finished is None


async def test_the_api_server_refuses_a_negative_history_limit_and_kubectl_explains_both_fields(tmp_path):
    async with ApiServer(crd_paths=[ROOT / "crds"]) as api:
        fleet = {"apiVersion": "graft.dev/v1alpha1", "kind": "PatchFleet", "metadata": {"name": "llm-engine"},
                 "spec": {"selector": SELECTOR, "revisionHistoryLimit": -1}}
        async with aiohttp.ClientSession(api.url) as http:
            async with http.post("/apis/graft.dev/v1alpha1/namespaces/default/patchfleets", json=fleet) as reply:
                status, answer = reply.status, json.loads(await reply.text())
        assert status == 422, answer
        causes = [c.get("field") for c in answer["details"]["causes"]]
        assert causes == ["spec.revisionHistoryLimit"], answer
        assert "should be greater than or equal to 0" in answer["message"]

        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
        for field, words in [("patchfleets.spec.revisionHistoryLimit", "How many finished PatchRollouts"),
                             ("patchrollouts.spec.ttlSecondsAfterFinished", "Seconds after the rollout finishes")]:
            explained = await asyncio.to_thread(run_kubectl, kubeconfig, "explain", field)
            assert explained.returncode == 0, explained.stderr
            text = " ".join(explained.stdout.split())
            assert words in text and "<integer>" in text, text
