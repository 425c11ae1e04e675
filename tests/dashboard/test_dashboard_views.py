"""What the dashboard shows of a rollout, from the object and its Events alone: the step ladder and
the time spent on each step, each check's series with the limit and bounds the decision used,
canary against stable latency, output divergence, and which verbs apply."""
from graft.dashboard.views import actions, check_series, rollout_view, step_ladder

T0 = 1_767_000_000.0


def iso(t: float) -> str:
    from graft.rollout.status import to_time
    return to_time(t)


def event(reason: str, message: str, t: float, name: str = "kv-align") -> dict:
    return {"reason": reason, "message": message, "type": "Normal", "lastTimestamp": iso(t),
            "involvedObject": {"kind": "PatchRollout", "name": name}, "metadata": {"uid": f"{reason}-{t}"}}


def rollout(phase="Progressing", step=1, history=(), **status) -> dict:
    return {"metadata": {"name": "kv-align", "namespace": "llm", "resourceVersion": "7"},
            "spec": {"patch": {"name": "kv-align", "version": "3.2.1"},
                     "steps": [{"weight": 1, "pause": "1s"}, {"weight": 50, "untilApproved": True}, {"weight": 100}],
                     "analysis": {"measurementRetention": 5}},
            "status": {"phase": phase, "stepIndex": step, "weight": 50, "stepStartedAt": iso(T0 + 30),
                       "analysisHistory": list(history), **status}}


def run(t: float, step: int, *results, verdict="Successful") -> dict:
    return {"time": iso(t), "step": step, "verdict": verdict, "results": list(results)}


RATE = {"name": "error-rate", "role": "breaker", "value": 0.01, "threshold": "<= 0.05", "verdict": "Successful",
        "numbers": {"requests": 800, "errors": 8, "rate": 0.01, "lower": 0.004, "upper": 0.019, "limit": 0.05}}
P99 = {"name": "latency-p99", "role": "breaker", "value": 1.1, "threshold": "<= 1.5 x stable", "verdict": "Successful",
       "numbers": {"canary_quantile": 0.22, "stable_quantile": 0.2, "canary_samples": 900, "stable_samples": 950,
                   "ratio": 1.1}}
DIVERGENCE = {"name": "output-divergence", "role": "gate", "value": 0.0, "threshold": "<= 0.01", "verdict": "Successful",
              "numbers": {"compared": 40, "divergent": 0, "share": 0.0, "lower": 0.0, "upper": 0.07, "limit": 0.01}}


def test_the_ladder_times_each_step_from_its_step_started_event_and_counts_the_current_one_to_now():
    events = [event("StepStarted", "step 1/3: weight 1%, 1 of 3 pods run kv-align@3.2.1", T0),
              event("StepStarted", "step 2/3: weight 50%, 2 of 3 pods run kv-align@3.2.1", T0 + 30)]
    ladder = step_ladder(rollout(), events, now=T0 + 75)
    assert [(s["state"], s["seconds"], s["manual"]) for s in ladder] == [
        ("done", 30.0, False), ("current", 45.0, True), ("next", None, False)]

    finished = rollout(phase="RolledBack", step=1, conditions=[
        {"type": "Completed", "status": "True", "lastTransitionTime": iso(T0 + 50)}])
    ladder = step_ladder(finished, events, now=T0 + 500)
    assert [(s["state"], s["seconds"]) for s in ladder] == [("done", 30.0), ("left", 20.0), ("next", None)]


def test_each_check_is_a_series_with_the_limit_and_the_bounds_it_was_judged_by():
    history = [run(T0 + 10, 1, RATE, P99), run(T0 + 20, 2, {**RATE, "value": 0.09, "verdict": "Failed",
                                                            "numbers": {**RATE["numbers"], "lower": 0.06}}, P99)]
    series = {s["name"]: s for s in check_series(rollout(history=history))}
    rate = series["error-rate"]
    assert rate["kind"] == "rate" and [p["value"] for p in rate["points"]] == [0.01, 0.09]
    assert [p["limit"] for p in rate["points"]] == [0.05, 0.05]
    assert [p["lower"] for p in rate["points"]] == [0.004, 0.06] and rate["points"][1]["verdict"] == "Failed"
    p99 = series["latency-p99"]
    # a ratio check names its limit only in the threshold: the page draws 1.5
    assert p99["kind"] == "latency" and p99["points"][0]["limit"] == 1.5
    assert (p99["points"][0]["canary"], p99["points"][0]["stable"]) == (0.22, 0.2)


def test_the_view_carries_latency_divergence_events_in_order_and_only_the_verbs_that_apply():
    history = [run(T0 + 10, 1, RATE, P99, DIVERGENCE)]
    events = [event("AwaitingApproval", "step 2/3 waits", T0 + 40), event("StepStarted", "step 1/3: weight 1%", T0),
              event("StepStarted", "step 1/1", T0, name="other")]
    view = rollout_view(rollout(history=history), events, now=T0 + 60)
    assert [s["name"] for s in view["latency"]] == ["latency-p99"]
    assert [s["name"] for s in view["divergence"]] == ["output-divergence"]
    assert view["divergence"][0]["points"][0]["text"] == "0% (0 of 40)"
    assert [e["reason"] for e in view["events"]] == ["StepStarted", "AwaitingApproval"]
    assert view["retention"] == 5 and (view["step"], view["steps"]) == (2, 3)

    assert actions(rollout()) == ["promote", "pause", "abort"]
    assert actions(rollout(phase="Paused")) == ["promote", "resume", "abort"]
    assert actions(rollout(phase="Promoted")) == ["undo"]
    assert actions(rollout(phase="RolledBack")) == ["retry"] == actions(rollout(phase="Failed"))
