"""A real Prometheus server (the Debian ``prometheus`` binary) for local fleets and tests.

Targets come through file-based service discovery, so they can change while it runs
(``set_targets``); it can be stopped and brought back on the same port with the same data
(``stop``/``start``/``restart``), the way a Prometheus pod restarts on its volume::

    with PrometheusServer([("127.0.0.1:9400", {"pod": "engine-0"})], scrape_interval="250ms") as prom:
        PrometheusConnect(prom.url, disable_ssl=True).custom_query("rate(graft_requests_total[5s])")

Prometheus is ready about 0.1 s after it starts, but its discovery manager hands targets to the
scrapers at most every 5 s (fixed in 2.42): the first scrape after ``start`` or ``set_targets``
comes up to 5 s later. ``wait_for_targets`` waits for it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Self

import httpx
import yaml

Target = str | tuple[str, dict[str, str]]  # "host:port", or ("host:port", {label: value})


class PrometheusNotFound(RuntimeError):
    """The ``prometheus`` binary is not installed."""


class PrometheusServer:
    """One Prometheus process with its config, its TSDB and its target file in a private folder.

    ``targets`` is either the targets to scrape or the path of a file_sd JSON file that someone
    else keeps up to date. ``port=0`` picks a free port once; restarts keep it.
    """

    def __init__(self, targets: Iterable[Target] | str | os.PathLike[str] = (), *,
                 scrape_interval: str | float = "1s", port: int = 0, host: str = "127.0.0.1",
                 job: str = "graft", metrics_path: str = "/metrics", binary: str = "prometheus") -> None:
        found = shutil.which(binary)
        if found is None:
            raise PrometheusNotFound(f"the Prometheus binary {binary!r} is not on PATH: "
                                     "install it with apt-get install prometheus")
        self.binary = found
        self.host = host
        self.port = port or _free_port(host)
        self.scrape_interval = _duration(scrape_interval)
        self.workdir = Path(tempfile.mkdtemp(prefix="graft-prometheus-"))
        self.config_file = self.workdir / "prometheus.yml"
        self.log_file = self.workdir / "prometheus.log"
        self._process: subprocess.Popen[bytes] | None = None
        try:
            if isinstance(targets, (str, os.PathLike)):
                self.targets_file = Path(targets).resolve()
            else:
                self.targets_file = self.workdir / "targets.json"
                self.set_targets(targets)
            self.config_file.write_text(yaml.safe_dump(self._config(job, metrics_path), sort_keys=False))
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def set_targets(self, targets: Iterable[Target]) -> None:
        """Replace the scraped targets; a running Prometheus picks the change up within a second."""
        groups: dict[str, dict[str, Any]] = {}
        for target in targets:
            address, labels = (target, {}) if isinstance(target, str) else target
            if ":" not in address:
                raise ValueError(f"a target is host:port, got {address!r}")
            key = json.dumps(labels, sort_keys=True)
            groups.setdefault(key, {"targets": [], "labels": dict(labels)})["targets"].append(address)
        # Written whole and renamed, so Prometheus never reads half a file.
        tmp = self.targets_file.with_name(f".{self.targets_file.name}.tmp")
        tmp.write_text(json.dumps(list(groups.values()), indent=1))
        os.replace(tmp, self.targets_file)

    def start(self, timeout: float = 30.0) -> Self:
        """Start Prometheus and wait until it answers ``/-/ready``."""
        if self.running:
            return self
        command = [self.binary, f"--config.file={self.config_file}",
                   f"--storage.tsdb.path={self.workdir / 'data'}",
                   "--storage.tsdb.retention.time=1d", f"--web.listen-address={self.host}:{self.port}",
                   "--web.enable-lifecycle", "--log.level=warn"]
        with open(self.log_file, "ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"Prometheus exited with code {self._process.returncode}:\n{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"Prometheus was not ready within {timeout:g}s:\n{self._log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop Prometheus (SIGTERM, then SIGKILL); its data stays for the next start."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self, timeout: float = 30.0) -> Self:
        """Stop, then start again on the same port with the same data."""
        self.stop()
        return self.start(timeout)

    def close(self) -> None:
        """Stop Prometheus and delete its folder."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def wait_for_targets(self, count: int = 1, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Wait until at least ``count`` targets are discovered and every one was scraped healthy."""
        deadline = time.monotonic() + timeout
        active: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            reply = httpx.get(f"{self.url}/api/v1/targets", params={"state": "active"}, timeout=5.0)
            active = reply.json()["data"]["activeTargets"]
            if len(active) >= count and all(t["health"] == "up" for t in active):
                return active
            time.sleep(0.1)
        raise TimeoutError(f"targets not all up within {timeout:g}s: "
                           f"{[(t['scrapeUrl'], t['health'], t['lastError']) for t in active]}")

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _config(self, job: str, metrics_path: str) -> dict[str, Any]:
        interval = self.scrape_interval
        return {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [{
                "job_name": job,
                "metrics_path": metrics_path,
                "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}],
            }],
        }

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _duration(value: str | float) -> str:
    if isinstance(value, str):
        return value
    if value <= 0:
        raise ValueError(f"scrape interval must be positive, got {value}")
    return f"{round(value * 1000)}ms"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
