"""The Locust file: a real headless Locust run against a local chat endpoint that records what it is
sent, with a tiny BBH-shaped data folder."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.deploy.manifests import DEPLOY, ROOT

LOCUSTFILE = DEPLOY / "locust" / "locustfile.py"
MODEL = "smollm2-test"


class ChatServer(ThreadingHTTPServer):
    """An OpenAI-style chat endpoint that answers every fourth request 429, like a full queue."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.bodies: list[dict] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class ChatHandler(BaseHTTPRequestHandler):
    server: ChatServer

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append(body)
            count = len(self.server.bodies)
        if self.path != "/v1/chat/completions":
            self._json(404, {"error": "not found"})
        elif count % 4 == 0:
            self._json(429, {"error": "queue full"}, {"Retry-After": "1"})
        elif body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for piece in ("So", " the", " answer is (A)."):
                chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": piece}}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
        else:
            self._json(200, {"object": "chat.completion", "model": MODEL, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "So the answer is (A)."},
                 "finish_reason": "stop"}]})

    def _json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def chat_server():
    server = ChatServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def bbh_dir(tmp_path) -> Path:
    """Two BBH tasks in the layout of the real data set."""
    root = tmp_path / "data"
    for task, inputs in (("navigate", ["Take 1 step. Take 2 steps back.", "Turn left. Take 3 steps."]),
                         ("web_of_lies", ["Ka lies. Does Ka tell the truth?"])):
        (root / "bbh" / "bbh").mkdir(parents=True, exist_ok=True)
        (root / "bbh" / "cot-prompts").mkdir(parents=True, exist_ok=True)
        (root / "bbh" / "bbh" / f"{task}.json").write_text(json.dumps(
            {"canary": "x", "examples": [{"input": i, "target": "No"} for i in inputs]}))
        (root / "bbh" / "cot-prompts" / f"{task}.txt").write_text(
            f"canary header\n-----\nSolve {task} step by step.\n\nQ: example\nA: Let's think step by step. No.")
    return root


def run_locust(url: str, data_dir: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "GRAFT_DATA_DIR": str(data_dir), "GRAFT_LOCUST_WAIT": "0,0.05",
                   "GRAFT_LOCUST_MAX_TOKENS": "32", "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "3", "-r", "3",
         "-t", "3s", "--stop-timeout", "2", "--host", url, "--json", "--only-summary",
         "--loglevel", "WARNING"],
        env=environment, capture_output=True, text=True, timeout=60, cwd=cwd)


def stats(done: subprocess.CompletedProcess) -> dict[str, dict]:
    """Locust's final statistics (printed as JSON), by request name."""
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return {row["name"]: row for row in json.loads(done.stdout)}


def test_locust_sends_bbh_prompts_to_chat_completions(chat_server, bbh_dir, tmp_path):
    done = run_locust(chat_server.url, bbh_dir, tmp_path)
    chat = stats(done)["/v1/chat/completions"]
    assert chat["num_requests"] == len(chat_server.bodies) >= 8
    # the only failures are the engine's admission control, and they are reported as such
    assert chat["num_failures"] == len(chat_server.bodies) // 4
    assert "rejected: HTTP 429" in done.stderr
    prompts = {b["messages"][0]["content"] for b in chat_server.bodies}
    assert len(prompts) == 3  # every prompt of the folder, cycled through
    for body in chat_server.bodies:
        assert body["model"] == MODEL and body["max_tokens"] == 32 and body["stream"] is False
        (message,) = body["messages"]
        assert message["role"] == "user"
        assert message["content"].startswith("Solve ") and message["content"].endswith("A: Let's think step by step.")


def test_locust_streams_and_reports_time_to_first_token(chat_server, bbh_dir, tmp_path):
    done = run_locust(chat_server.url, bbh_dir, tmp_path, GRAFT_LOCUST_STREAM="1", GRAFT_LOCUST_MODEL="chosen")
    rows = stats(done)
    streamed = rows["/v1/chat/completions (stream)"]
    assert streamed["num_requests"] == len(chat_server.bodies) >= 8
    # every answered stream has its time to first token; rejected ones have none
    assert rows["time to first token"]["num_requests"] == streamed["num_requests"] - streamed["num_failures"]
    assert "/v1/models" not in rows
    assert all(b["stream"] is True and b["model"] == "chosen" for b in chat_server.bodies)


def test_locust_stops_at_once_without_data(chat_server, tmp_path):
    done = run_locust(chat_server.url, tmp_path / "nowhere", tmp_path)
    assert done.returncode != 0
    assert "GRAFT_DATA_DIR" in done.stderr
    assert chat_server.bodies == []
