"""A real `graft serve` process for benchmarks, and an async client for its admin API.

The engine runs in its own process, exactly as in production, so the benchmark measures HTTP,
tokenization, scheduling and the model together.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class EngineOptions:
    """The `graft serve` flags a benchmark varies; `patches` is GRAFT_PATCHES (`name@version,...`)."""

    model: str | None = None
    dtype: str = "bfloat16"
    device: str = "auto"
    kv_cache_memory: str = "2G"
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    prefix_caching: bool = True
    patches: str = ""
    extra_args: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        args = ["--dtype", self.dtype, "--device", self.device, "--kv-cache-memory", self.kv_cache_memory,
                "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(max(self.max_num_batched_tokens, self.max_num_seqs))]
        if self.model:
            args += ["--model", self.model]
        if not self.prefix_caching:
            args.append("--no-prefix-caching")
        return args + self.extra_args


class EngineServer:
    """`with EngineServer(options) as eng:` starts `graft serve` on free local ports and waits until ready."""

    def __init__(self, options: EngineOptions, host: str = "127.0.0.1", ready_timeout: float = 300.0):
        self.options = options
        self.host = host
        self.ready_timeout = ready_timeout
        self.port = free_port(host)
        self.admin_port = free_port(host)
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="graft-bench-engine-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    @property
    def log_path(self) -> Path:
        return Path(self._log.name)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def start(self) -> "EngineServer":
        env = {**os.environ, "GRAFT_ADMIN_TOKEN": self.token, "GRAFT_PATCHES": self.options.patches}
        cmd = [sys.executable, "-m", "graft.cli", "serve", "--host", self.host, "--port", str(self.port),
               "--admin-port", str(self.admin_port), *self.options.argv()]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"the engine was not ready after {self.ready_timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.log_path.unlink(missing_ok=True)

    def cpu_seconds(self) -> float | None:
        """User + system CPU time the engine process has used so far (Linux /proc); None elsewhere.

        On a shared machine wall time moves with everyone else's load; CPU time much less so.
        """
        if self.proc is None:
            return None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def admin(self) -> "AdminClient":
        return AdminClient(self.admin_url, self.token)

    def __enter__(self) -> "EngineServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True, slots=True)
class AdminCall:
    """One admin call: the engine's own answer and the client-side round trip."""

    answer: dict[str, Any]
    round_trip_ms: float

    @property
    def apply_ms(self) -> float:
        return float(self.answer["applyMs"])


class AdminClient:
    """Async client of the admin API: apply and revert built-in patches, read the applied set."""

    def __init__(self, admin_url: str, token: str, timeout: float = 120.0):
        self._client = httpx.AsyncClient(base_url=admin_url, timeout=timeout,
                                         headers={"Authorization": f"Bearer {token}"})

    async def __aenter__(self) -> "AdminClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def patches(self) -> dict[str, Any]:
        resp = await self._client.get("/admin/patches")
        _check(resp)
        return resp.json()

    async def apply(self, name: str, version: str) -> AdminCall:
        t0 = time.perf_counter()
        resp = await self._client.post("/admin/patches",
                                       json={"name": name, "version": version, "source": {"builtin": True}})
        ms = (time.perf_counter() - t0) * 1000
        _check(resp)
        return AdminCall(resp.json(), ms)

    async def revert(self, name: str) -> AdminCall:
        t0 = time.perf_counter()
        resp = await self._client.delete(f"/admin/patches/{name}")
        ms = (time.perf_counter() - t0) * 1000
        _check(resp)
        return AdminCall(resp.json(), ms)


def _check(resp: httpx.Response) -> None:
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:300]
        raise RuntimeError(f"admin API {resp.request.method} {resp.request.url.path} answered "
                           f"{resp.status_code}: {message}")
