"""Shared test helpers: free ports, real engine processes, BBH prompts."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx

from graft.engine import launcher
from graft.engine.launcher import free_port  # noqa: F401  (the tests' helper of the same name)

ROOT = Path(__file__).resolve().parents[1]


def data_dir() -> Path:
    return Path(os.environ.get("GRAFT_DATA_DIR", ROOT.parent / "shared" / "data"))


def bbh_prompt(task: str = "date_understanding", index: int = 0) -> str:
    from graft.bench.data import bbh_prompts
    return bbh_prompts(data_dir(), tasks=[task], per_task=index + 1)[index].text


class EngineProcess(launcher.EngineProcess):
    """A real `graft serve` process with the real model, as `graft.engine.launcher` starts it."""

    def admin(self, token: str | None = "__default__") -> httpx.Client:
        tok = self.token if token == "__default__" else token
        headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        return httpx.Client(base_url=self.admin_url, headers=headers, timeout=60)


# The tests compare logits and rely on the self-check's exact float32 tolerances, so their engines
# run in float32 unless a test asks otherwise; a small KV cache keeps many engines side by side.
TEST_ENGINE_ARGS = ("--kv-cache-memory", "96M", "--dtype", "float32")


def start_engine(tmp: Path, *args: str, env: dict | None = None, host: str = "127.0.0.1",
                 token: str = "test-token", wait: bool = True, timeout: float = 120) -> EngineProcess:
    return launcher.launch_engine([*TEST_ENGINE_ARGS, *args], env=env, host=host, token=token, wait=wait,
                                  timeout=timeout, cwd=ROOT, log_path=tmp / f"engine-{launcher.free_port(host)}.log",
                                  process_class=EngineProcess)


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
        value = metric_value(httpx.get(eng.metrics_url + "/metrics", timeout=5).text, metric, **labels)
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
