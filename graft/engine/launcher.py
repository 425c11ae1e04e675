"""Start a real `graft serve` process on free local ports (public, metrics, admin) and wait until it
is ready.

The one launcher of engine processes outside a cluster: `graft bench` measures through it and the
tests start their engines with it. The engine runs in its own process exactly as in production, so
what is measured or tested is HTTP, tokenization, scheduling and the model together.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class EngineProcess:
    """A running `graft serve`; `stop()` ends it (SIGTERM, then SIGKILL after `timeout`)."""

    proc: subprocess.Popen
    port: int
    admin_port: int
    token: str
    log_path: Path
    host: str = "127.0.0.1"
    env: dict = field(default_factory=dict)
    remove_log: bool = False        # a log the launcher made up is removed by `stop()`
    metrics_port: int | None = None  # None: /metrics on the public port (`--metrics-port public`)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """Where /metrics is served: `metrics_url + "/metrics"` is what Prometheus would scrape."""
        return self.url if self.metrics_port is None else f"http://{self.host}:{self.metrics_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Poll /ready, then the metrics port; an engine that exits or is not ready in time is killed
        and its log raised."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200 and self._metrics_listening():
                    return
            time.sleep(0.2)
        message = f"the engine was not ready after {timeout:.0f}s:\n{self.log_tail()}"
        self.stop(signal.SIGKILL)
        raise TimeoutError(message)

    def _metrics_listening(self) -> bool:
        """The metrics server accepts connections (a connection only: a scrape has effects, see
        `EngineMetrics.render`)."""
        if self.metrics_port is None:
            return True
        try:
            socket.create_connection((self.host, self.metrics_port), timeout=2).close()
        except OSError:
            return False
        return True

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """End the process (safe to call twice); returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.remove_log:
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode

    def cpu_seconds(self) -> float | None:
        """User + system CPU time the engine process has used so far (Linux /proc); None elsewhere.

        On a shared machine wall time moves with everyone else's load; CPU time much less so.
        """
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_engine(args: Sequence[str] = (), *, env: Mapping[str, str] | None = None, host: str = "127.0.0.1",
                  token: str | None = None, log_path: str | os.PathLike | None = None, wait: bool = True,
                  timeout: float = 300.0, cwd: str | os.PathLike | None = None,
                  process_class: type[EngineProcess] = EngineProcess) -> EngineProcess:
    """`graft serve --host HOST --port P --metrics-port M --admin-port A *args` with GRAFT_ADMIN_TOKEN set.

    `args` are `graft serve` flags (later ones win, as argparse reads them: `--metrics-port public`
    among them serves /metrics on the public port, and the handle's `metrics_url` says so); `env` is
    added to this process's environment (e.g. GRAFT_PATCHES). Without `log_path` the output goes to
    a temporary file removed on `stop()`. With `wait` this returns once the engine answers /ready
    and its metrics port listens.
    `process_class` lets a caller add helpers of its own to the handle it gets back.
    """
    port, admin_port = free_port(host), free_port(host)
    asked = flag_value(args, "--metrics-port")     # None: a free port; "public": the public port
    metrics_port = free_port(host) if asked is None else None if asked == "public" else int(asked)
    token = token or secrets.token_hex(16)
    remove_log = log_path is None
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="graft-engine-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    full_env = {**os.environ, "GRAFT_ADMIN_TOKEN": token, **(env or {})}
    cmd = [sys.executable, "-m", "graft.cli", "serve", "--host", host, "--port", str(port),
           "--metrics-port", asked or str(metrics_port), "--admin-port", str(admin_port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd)
    eng = process_class(proc, port, admin_port, token, log_path, host, full_env, remove_log, metrics_port)
    if wait:
        try:
            eng.wait_ready(timeout)
        except BaseException:
            eng.stop(signal.SIGKILL)
            raise
    return eng


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value the last `flag VALUE` or `flag=VALUE` of `args` gives, as argparse would read it."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value
