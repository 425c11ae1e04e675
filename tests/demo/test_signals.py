"""`graft demo` ended by SIGINT (Ctrl-C), SIGTERM or SIGHUP (its terminal closed) leaves nothing
running: the demo runs as its own process with one engine pod, is signalled as soon as Prometheus,
the operator and the engine are up, and every process it had started by then, and any process in
their sessions, must be gone once it exits."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from graft.demo import child_groups, end_groups
from tests.support import data_dir

pytestmark = pytest.mark.timeout(150)


def kind(p: psutil.Process) -> str | None:
    """Which of the demo's children `p` is, from its command line."""
    try:
        argv = p.cmdline()
    except psutil.Error:
        return None
    if argv and os.path.basename(argv[0]) == "prometheus":
        return "prometheus"
    if argv[1:4] in (["-m", "graft.cli", "operator"], ["-m", "graft.cli", "serve"]):
        return argv[3]
    return None


def running(p: psutil.Process) -> bool:
    """Alive, as a process that can still do something (a zombie is dead, only not yet reaped)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def session(p: psutil.Process) -> int | None:
    """The session `p` runs in; None once it is gone (or not ours to ask about)."""
    try:
        return os.getsid(p.pid) if running(p) else None
    except (ProcessLookupError, PermissionError):
        return None


def in_sessions(sessions: set[int]) -> list[psutil.Process]:
    """The processes still running in any of `sessions`."""
    return [p for p in psutil.process_iter() if session(p) in sessions]


@pytest.fixture
def leftovers():
    """Processes the test saw the demo start: whatever is still running after the test is killed,
    so that a failing case leaves no engine behind either."""
    seen: list[psutil.Process] = []
    yield seen
    for p in seen:
        if running(p):
            p.kill()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_stops_everything_the_demo_started(tmp_path, sig, leftovers):
    output = tmp_path / "terminal.txt"
    with open(output, "wb") as out:
        demo = subprocess.Popen([sys.executable, "-m", "graft.cli", "demo", "--pods", "1",
                                 "--out", str(tmp_path / "run"), "--data-dir", str(data_dir())],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        tree: list[psutil.Process] = []
        while {"prometheus", "operator", "serve"} - {kind(p) for p in tree}:
            assert demo.poll() is None, f"the demo exited {demo.returncode} before it started its children:\n" \
                                        f"{output.read_text()}"
            assert time.monotonic() < deadline, f"no Prometheus, operator and engine after 90 s: {tree}"
            time.sleep(0.1)
            tree = psutil.Process(demo.pid).children(recursive=True)
            leftovers.extend(p for p in tree if p not in leftovers)
        sessions = {session(p) for p in tree} - {None, os.getsid(demo.pid)}
        assert len(sessions) >= 3, "Prometheus, the operator and the engine each run in a session of their own"

        demo.send_signal(sig)
        code = demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    terminal = output.read_text()
    assert [p for p in tree if running(p)] == [], "processes the demo started are still running"
    assert in_sessions(sessions) == [], "processes started by the demo's children are still running"
    assert code == 128 + sig, terminal
    if sig == signal.SIGHUP:
        assert "stopped by" not in terminal, "with its terminal gone, the demo writes nothing more to it"
    else:
        assert f"graft demo stopped by {sig.name}: everything it started is stopped" in terminal


def test_what_a_child_left_in_its_process_group_is_ended_even_if_it_ignores_sigterm(leftovers):
    # a child in a session of its own (as the dev cluster starts each engine) starts a grandchild
    # that ignores SIGTERM, then exits: nothing but the group links the grandchild to this process
    script = ("import signal, subprocess, sys\n"
              "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(120)'], "
              "stdout=subprocess.PIPE)\n"
              "g.stdout.readline()\n"
              "print(g.pid, flush=True)\n"
              "input()\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    grandchild = psutil.Process(int(child.stdout.readline()))
    leftovers.append(grandchild)
    assert child.pid in child_groups(), "the child leads a process group of its own"
    child.communicate("\n", timeout=10)          # the child is gone and reaped; its grandchild is not
    assert running(grandchild) and grandchild.ppid() != os.getpid()
    assert child.pid not in child_groups(), "nothing but the group links the grandchild to this process"
    started = time.monotonic()
    assert end_groups({child.pid}, grace=0.5) == [child.pid]
    assert time.monotonic() - started >= 0.5, "SIGTERM first, then the grace period"
    grandchild.wait(timeout=5)
    assert not running(grandchild)
    assert end_groups({child.pid}, grace=0.5) == [], "an empty group needs nothing"
