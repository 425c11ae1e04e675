"""The demo's live view and `graft rollout status -w` on an 80-column terminal: every line fits,
no word is cut, and each check's detail reads as a sentence, folded under the analysis table as a
numbered note instead of a column of single words; on a wide terminal the table is as it was, the
details in its Detail column."""
import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from graft.demo import DemoPaths, view
from graft.devcluster.traffic import Outcome, TrafficStats
from graft.operator.render import render_status

# the drift drill as the operator reported it the moment output-divergence rolled it back
RESULTS = [
    {"name": "error-rate", "role": "breaker", "value": 0.0, "threshold": "<= 0.005", "window": "60s",
     "verdict": "Successful", "breaches": 0,
     "message": "error-rate 0% (0 errors of 11 canary requests in 60s): not shown above the error rate 0.5%"},
    {"name": "ttft-p99", "role": "breaker", "threshold": "<= 1.5 x stable", "window": "30s", "verdict": "Inconclusive",
     "breaches": 0, "dryRun": True, "message": "ttft-p99: 7 canary samples in 30s, fewer than the 200 a p99 needs"},
    {"name": "cpu", "role": "breaker", "value": 0.1731, "threshold": "<= 0.92", "window": "120s",
     "verdict": "Successful", "breaches": 0, "dryRun": True, "message": "cpu 0.1731 over 120s within <= 0.92"},
    {"name": "output-divergence", "role": "breaker", "value": 1.0, "threshold": "<= 0.05", "window": "rollout",
     "verdict": "Failed", "breaches": 1,
     "message": "output-divergence 3 divergent of 3 compared requests in the rollout so far (100%): above the 5% "
                "limit at 0.999 confidence (lower bound 10%) (breach 1/1)",
     "numbers": {"compared": 3.0, "divergent": 3.0, "share": 1.0}},
    {"name": "error-rate-delta", "role": "gate", "value": 0.0, "threshold": "<= 0.05", "window": "step",
     "verdict": "Inconclusive",
     "message": "error-rate-delta: canary 0/11 errors (0%) vs stable 0/62 (0%) over the step so far, difference "
                "+0 pp, Fisher p=1: upper bound +19.7 pp not yet within +5 pp (about 59 error-free canary "
                "requests show it)"},
    {"name": "output-divergence", "role": "gate", "value": 0.9993, "threshold": "<= 0.05", "window": "rollout",
     "verdict": "Failed", "breaches": 0,
     "message": "output-divergence 3 divergent of 3 compared requests in the rollout so far (99.9%): above the 5% "
                "limit at 0.999 confidence (lower bound 10%)",
     "numbers": {"compared": 3.0, "divergent": 3.0, "share": 0.9993}},
]
MESSAGES = [r["message"] for r in RESULTS]
ROLLOUT = {"metadata": {"name": "drift-drill", "namespace": "llm"},
           "spec": {"patch": {"name": "drift", "version": "1"},
                    "steps": [{"weight": 20, "pause": "1m30s"}, {"weight": 50, "pause": "8s"}, {"weight": 100}]},
           "status": {"phase": "RollingBack", "stepIndex": 0, "weight": 20, "stableRevision": "kv-align@3.2.1",
                      "canaryRevision": "drift@1,kv-align@3.2.1",
                      "message": "analysis failed at step 1/3: reverting drift@1 on 1 pod",
                      "pods": [{"name": "llm-engine-3fa9c1", "track": "canary", "revision": "drift@1,kv-align@3.2.1",
                                "restartCount": 0, "patchedAt": "2026-12-01T22:22:21.104Z"},
                               {"name": "llm-engine-77b0e2", "track": "stable", "revision": "kv-align@3.2.1",
                                "restartCount": 0}],
                      "analysis": {"lastRun": "2026-12-01T22:23:03Z", "verdict": "Failed", "results": RESULTS}}}


def rendered(renderable, width: int) -> list[str]:
    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=False)
    console.print(renderable)
    return console.export_text().splitlines()


def words(text: str) -> list[str]:
    """A line's words, the table's rules left out."""
    return re.sub(r"[│┃┏┓┗┛┡┩└┘┌┐━─╇╈┳┻┼┬┴╋]", " ", text).split()


def test_at_80_columns_the_details_are_sentences_under_the_table():
    lines = rendered(render_status(ROLLOUT), 80)
    assert max(len(line) for line in lines) <= 80
    assert "…" not in "\n".join(lines), "a word cut short"
    joined = " ".join(" ".join(words(line)) for line in lines)
    for number, message in enumerate(MESSAGES, 1):
        note = f"[{number}] {message}"
        assert note in joined, f"the detail of {RESULTS[number - 1]['name']} is not whole: {note}"
    table = lines[:next(i for i, line in enumerate(lines) if line.startswith("[1] "))]
    message_words = {w for m in MESSAGES for w in m.split()}
    alone = [line for line in table if len(words(line)) == 1 and words(line)[0] in message_words]
    assert alone == [], "a word of a detail alone on its line in the table"
    # a note wraps at the full width: only its last line may hold a single word, never two in a row
    singles = [i for i, line in enumerate(lines) if len(words(line)) == 1]
    assert not any(b == a + 1 for a, b in zip(singles, singles[1:])), "a column of single words"
    # each check's row names its note, and notes take the full width: at most 3 lines each
    assert sum("[" in line for line in table) == len(MESSAGES)
    assert len(lines) - len(table) <= 3 * len(MESSAGES)
    assert any(line.split()[:3] == ["output-divergence", "breaker", "100%"] for line in table)


@pytest.mark.parametrize("width", [160, 220])
def test_on_a_wide_terminal_the_details_stay_in_their_column(width):
    lines = rendered(render_status(ROLLOUT), width)
    assert max(len(line) for line in lines) <= width
    header = next(line for line in lines if "┃ Check" in line)
    assert words(header) == ["Check", "Role", "Value", "Threshold", "Window", "Verdict", "Breaches", "Detail"]
    assert not any(line.startswith("[1] ") for line in lines), "no note under the table"
    row = next(line for line in lines if line.startswith("│ output-divergence") and "breaker" in line)
    assert "│ output-divergence" in row and "output-divergence 3 divergent of 3" in row.split("│")[-2]
    assert "ttft-p99 (dry run)" in "\n".join(lines)


def test_details_short_enough_stay_in_their_column_below_the_width_long_ones_need():
    short = {**ROLLOUT, "status": {**ROLLOUT["status"], "analysis": {
        "lastRun": "2026-12-01T22:23:03Z", "verdict": "Successful",
        "results": [{"name": "cpu", "role": "breaker", "value": 0.2, "threshold": "<= 0.92", "window": "120s",
                     "verdict": "Successful", "breaches": 0, "message": "cpu 0.2 within <= 0.92"}]}}}
    lines = rendered(render_status(short), 100)
    assert any("cpu 0.2 within <= 0.92" in line and "│ cpu" in line for line in lines)
    assert not any(line.startswith("[1] ") for line in lines)


def test_the_demos_live_view_at_80_columns_cuts_no_pod_name():
    pods = [{"metadata": {"name": p["name"], "labels": {"graft.dev/track": p["track"]},
                          "annotations": {"graft.dev/patches": p["revision"]}},
             "status": {"conditions": [{"type": "Ready", "status": "True"},
                                       {"type": "graft.dev/patched", "status": "True"}],
                        "containerStatuses": [{"restartCount": 0}]}} for p in ROLLOUT["status"]["pods"]]
    stats = TrafficStats()
    stats.outcomes.append(Outcome(0.0, "llm-engine-3fa9c1", 200, 0.5))
    lines = rendered(view(ROLLOUT, [], pods, stats, DemoPaths(Path(".graft-demo"), Path(".graft-demo/cluster"))), 80)
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    assert "…" not in text
    pods_rows = [line for line in lines if line.startswith("│ llm-engine-")]
    assert [words(line)[0] for line in pods_rows] == ["llm-engine-3fa9c1", "llm-engine-77b0e2"] * 2
    assert f"[{len(MESSAGES)}] output-divergence 3 divergent" in text
