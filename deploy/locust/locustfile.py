"""Load for a Graft engine, or for the fleet behind its Service: BBH chain-of-thought prompts sent
to the OpenAI-compatible /v1/chat/completions.

    GRAFT_DATA_DIR=../shared/data locust -f deploy/locust/locustfile.py \\
        --host http://graft-engine.llm:8000 --headless -u 20 -r 20 -t 10m --csv out/load

The prompts are BBH 3-shot CoT prompts, the first few examples of every task in a fixed shuffled
order, from the folder GRAFT_DATA_DIR names (it holds bbh/bbh/*.json and bbh/cot-prompts/*.txt; see
graft.bench.data). Each simulated user sends one prompt after another, with a short pause between.

Settings (environment):
    GRAFT_LOCUST_PER_TASK     examples taken from each BBH task (default 8)
    GRAFT_LOCUST_MAX_TOKENS   max_tokens per request (default 128)
    GRAFT_LOCUST_MODEL        model name to ask for (default: the first of /v1/models)
    GRAFT_LOCUST_STREAM       1: stream the answers (SSE) and report time to first token too
    GRAFT_LOCUST_WAIT         seconds between a user's requests, "min,max" (default "0.5,2")

Answers the engine turns away under load (429, 503) fail as "rejected: HTTP 429|503", apart from
errors, so a run tells overload from breakage.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import threading
import time

from locust import HttpUser, between, events, task

from graft.bench.data import bbh_prompts

CHAT_PATH = "/v1/chat/completions"
REJECTED = (429, 503)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name} must be a whole number, got {raw!r}") from None
    if value < 1:
        raise SystemExit(f"{name} must be at least 1, got {value}")
    return value


def _wait_range() -> tuple[float, float]:
    raw = os.environ.get("GRAFT_LOCUST_WAIT", "0.5,2")
    try:
        low, high = (float(x) for x in raw.split(","))
    except ValueError:
        raise SystemExit(f'GRAFT_LOCUST_WAIT must be "min,max" in seconds, got {raw!r}') from None
    if not 0 <= low <= high:
        raise SystemExit(f"GRAFT_LOCUST_WAIT needs 0 <= min <= max, got {raw!r}")
    return low, high


def _load_prompts() -> list[str]:
    if not os.environ.get("GRAFT_DATA_DIR"):
        raise SystemExit("set GRAFT_DATA_DIR to the folder holding bbh/ (bbh/bbh and bbh/cot-prompts)")
    try:
        prompts = [p.text for p in bbh_prompts(os.environ["GRAFT_DATA_DIR"],
                                               per_task=_env_int("GRAFT_LOCUST_PER_TASK", 8))]
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise SystemExit(f"cannot read BBH prompts from GRAFT_DATA_DIR: {exc}") from None
    if not prompts:
        raise SystemExit("GRAFT_DATA_DIR holds no BBH prompts")
    # tasks interleaved, the same order every run
    random.Random(0).shuffle(prompts)
    return prompts


# Read once, when locust loads this file: a missing data folder stops the run before any user starts.
PROMPTS = _load_prompts()
MAX_TOKENS = _env_int("GRAFT_LOCUST_MAX_TOKENS", 128)
STREAM = os.environ.get("GRAFT_LOCUST_STREAM", "0") == "1"
_next_prompt = itertools.cycle(PROMPTS)
_prompt_lock = threading.Lock()


def next_prompt() -> str:
    """The next prompt, shared by all users so that together they walk the whole set."""
    with _prompt_lock:
        return next(_next_prompt)


class ChatUser(HttpUser):
    """One client of the chat API."""

    wait_time = between(*_wait_range())

    def on_start(self) -> None:
        self.model = os.environ.get("GRAFT_LOCUST_MODEL") or self._first_model()

    def _first_model(self) -> str:
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as response:
            try:
                model = response.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                response.failure(f"/v1/models did not name a model: {response.text[:200]!r}")
                return "default"
            response.success()
            return model

    @task
    def chat(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": next_prompt()}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": STREAM,
        }
        if STREAM:
            self._chat_streamed(body)
        else:
            self._chat_whole(body)

    def _chat_whole(self, body: dict) -> None:
        with self.client.post(CHAT_PATH, json=body, name=CHAT_PATH, catch_response=True) as response:
            if _bad_status(response):
                return
            try:
                content = response.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                response.failure(f"not a chat completion: {response.text[:200]!r}")
                return
            if not isinstance(content, str):
                response.failure("the completion has no text content")

    def _chat_streamed(self, body: dict) -> None:
        start = time.perf_counter()
        first_token: float | None = None
        with self.client.post(CHAT_PATH, json=body, name=f"{CHAT_PATH} (stream)", stream=True,
                              catch_response=True) as response:
            if _bad_status(response):
                return
            done = False
            for line in response.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    delta = json.loads(data)["choices"][0].get("delta", {})
                except (ValueError, KeyError, IndexError, TypeError):
                    response.failure(f"not a chat completion chunk: {data[:200]!r}")
                    return
                if first_token is None and delta.get("content"):
                    first_token = time.perf_counter()
            if not done:
                response.failure("the stream ended without [DONE]")
                return
        if first_token is not None:
            events.request.fire(request_type="SSE", name="time to first token",
                                response_time=(first_token - start) * 1000, response_length=0,
                                exception=None, context={})


def _bad_status(response) -> bool:
    """Fail a response that is not a 200, telling overload apart from errors; True when failed."""
    if response.status_code in REJECTED:
        response.failure(f"rejected: HTTP {response.status_code}")
        return True
    if response.status_code != 200:
        response.failure(f"HTTP {response.status_code}: {response.text[:200]!r}")
        return True
    return False
