"""Graceful shutdown end to end: `--grace` bounds in-flight requests, and each gets a proper answer."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.support import start_engine, wait_for_metric

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
GRACE = 2.0


def test_requests_cut_at_the_grace_deadline_end_with_an_error_event_or_a_503(tmp_path):
    eng = start_engine(tmp_path, "--grace", str(GRACE))
    body = {"model": MODEL, "prompt": "Count to a thousand: 1, 2, 3,", "max_tokens": 4000, "ignore_eos": True}
    first_token, lines, whole, ended = threading.Event(), [], {}, {}

    def streamed() -> None:
        with httpx.stream("POST", eng.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in filter(None, r.iter_lines()):
                lines.append(line)
                if '"text"' in line:
                    first_token.set()
        ended["stream"] = time.monotonic()

    def not_streamed() -> None:
        whole["r"] = httpx.post(eng.url + "/v1/completions", json=body, timeout=60)
        ended["whole"] = time.monotonic()

    threads = [threading.Thread(target=streamed), threading.Thread(target=not_streamed)]
    try:
        for t in threads:
            t.start()
        assert first_token.wait(60)
        wait_for_metric(eng, "graft_num_requests_running", lambda v: v == 2)  # both really running
        signalled = time.monotonic()
        eng.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        exit_code = eng.proc.wait(30)
    finally:
        eng.stop(signal.SIGKILL)

    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    assert sum('"text"' in line for line in lines) >= 1
    r = whole["r"]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "server_shutting_down"
    for name, at in ended.items():  # cut at the deadline, not before it and not seconds after
        assert GRACE - 0.2 <= at - signalled <= GRACE + 2.5, (name, at - signalled)
    assert exit_code == 0


def test_a_request_that_finishes_within_the_grace_period_completes(tmp_path):
    eng = start_engine(tmp_path, "--grace", "30")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    first_token = threading.Event()

    def streamed() -> None:
        with httpx.stream("POST", eng.url + "/v1/completions", json=body, timeout=60) as r:
            for line in filter(None, r.iter_lines()):
                lines.append(line)
                first_token.set()

    t = threading.Thread(target=streamed)
    try:
        t.start()
        assert first_token.wait(60)
        eng.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert eng.proc.wait(30) == 0
    finally:
        eng.stop(signal.SIGKILL)
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    last = json.loads(lines[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length"
