"""The step loop runs unhindered: the OpenMP team a thread started loading the model ends, and a
serving process hands the GIL back quickly."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from graft.engine import openmp


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settle(until, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until():
            return True
        time.sleep(0.01)
    return until()


def parallel_work() -> None:
    x = torch.randn(2048, 2048)
    for _ in range(3):
        x = x * 1.0001 + 1.0     # large elementwise operators run on the thread's OpenMP team


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a team of one thread has no workers to end")
def test_release_ends_the_calling_threads_team_and_a_later_region_starts_one_again():
    result = {}

    def body():
        parallel_work()
        with_team = threads()
        result["released"] = openmp.release_threads()
        result["ended"] = settle(lambda: threads() <= with_team - (torch.get_num_threads() - 1))
        before = threads()
        parallel_work()                 # the thread can still run parallel work: a new team
        result["again"] = threads() > before - 1 and torch.get_num_threads() >= 2

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert result == {"released": True, "ended": True, "again": True}


def test_an_engine_ends_the_team_of_the_thread_that_built_it(monkeypatch):
    """`graft serve` builds the engine on a worker thread of its event loop; that thread's team must
    end, or the step loop's operators stop spinning and pay a wake-up each."""
    from graft.engine.config import EngineConfig
    from graft.engine.engine import LLMEngine

    calls = []
    real = openmp.release_threads
    monkeypatch.setattr(openmp, "release_threads", lambda: calls.append(threading.get_ident()) or real())
    built = {}
    builder = threading.Thread(target=lambda: built.setdefault("engine", LLMEngine(EngineConfig(kv_cache_memory=16 << 20))))
    builder.start()
    builder.join()
    assert calls == [builder.ident]
    engine = built["engine"]
    engine.start()
    try:
        assert calls == [builder.ident, threading.get_ident()]
    finally:
        engine.stop()


def test_a_serving_process_hands_the_gil_back_to_the_step_loop_within_half_a_millisecond():
    """The step loop retakes the GIL after every operator; a 5 ms wait each time behind the event
    loop's token streaming would leave the cores idle."""
    import sys

    from graft.engine import serve

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        serve.tune_interpreter()
        assert sys.getswitchinterval() == pytest.approx(0.0005, rel=0.05)
        sys.setswitchinterval(0.0001)            # never raised above what someone chose
        serve.tune_interpreter()
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
    finally:
        sys.setswitchinterval(before)
