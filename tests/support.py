"""Shared test helpers: free ports, real engine processes, BBH prompts."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def data_dir() -> Path:
    return Path(os.environ.get("GRAFT_DATA_DIR", ROOT.parent / "shared" / "data"))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bbh_prompt(task: str = "date_understanding", index: int = 0) -> str:
    from graft.bench.data import bbh_prompts
    return bbh_prompts(data_dir(), tasks=[task], per_task=index + 1)[index].text


@dataclass
class EngineProcess:
    """A real `graft serve` process with the real model."""

    port: int
    admin_port: int
    token: str
    proc: subprocess.Popen
    log_path: Path
    host: str = "127.0.0.1"
    env: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    def admin(self, token: str | None = "__default__") -> httpx.Client:
        tok = self.token if token == "__default__" else token
        headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        return httpx.Client(base_url=self.admin_url, headers=headers, timeout=60)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_engine(tmp: Path, *args: str, env: dict | None = None, host: str = "127.0.0.1",
                 token: str = "test-token", wait: bool = True, timeout: float = 120) -> EngineProcess:
    port, admin_port = free_port(host), free_port(host)
    log_path = tmp / f"engine-{port}.log"
    full_env = {**os.environ, "GRAFT_ADMIN_TOKEN": token, **(env or {})}
    cmd = [sys.executable, "-m", "graft.cli", "serve", "--host", host, "--port", str(port),
           "--admin-port", str(admin_port), "--kv-cache-memory", "96M", *args]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=full_env,
                            cwd=ROOT)
    eng = EngineProcess(port, admin_port, token, proc, log_path, host, full_env)
    if wait:
        wait_ready(eng, timeout)
    return eng


def wait_ready(eng: EngineProcess, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if eng.proc.poll() is not None:
            raise RuntimeError(f"engine exited with {eng.proc.returncode}:\n{eng.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(eng.url + "/ready", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    eng.stop(signal.SIGKILL)
    raise TimeoutError(f"engine not ready after {timeout}s:\n{eng.log()}")


def metric_value(text: str, metric: str, /, **labels: str) -> float:
    """Sum of the samples of `metric` whose labels include `labels` in Prometheus text format."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(metric + "{") and not line.startswith(metric + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def wait_for_metric(eng: EngineProcess, metric: str, ok, timeout: float = 30, **labels: str) -> float:
    """Poll the engine's /metrics until `ok(value)` holds for `metric` (summed over `labels`)."""
    deadline = time.monotonic() + timeout
    while True:
        value = metric_value(httpx.get(eng.url + "/metrics", timeout=5).text, metric, **labels)
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{metric}{labels} is {value} after {timeout}s")
        time.sleep(0.05)


def sse_events(lines) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out
