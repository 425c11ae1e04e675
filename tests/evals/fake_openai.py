"""A stand-in OpenAI-compatible server on 127.0.0.1: a real HTTP server in a thread whose completions
a test scripts (`answer(prompt) -> text`, or a status to answer with), recording every request."""
from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAI:
    def __init__(self, answer: Callable[[str], str | int]):
        self.answer = answer          # a completion's text, or an HTTP status to fail with
        self.requests: list[dict] = []
        self.url = ""


@contextmanager
def fake_openai(answer: Callable[[str], str | int]) -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI(answer)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _reply(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._reply(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
            else:
                self._reply(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with lock:
                fake.requests.append(body)
            out = fake.answer(body["prompt"])
            if isinstance(out, int):
                headers = {"retry-after": "0"} if out == 429 else None
                self._reply(out, {"error": {"code": out, "message": f"scripted {out}"}}, headers)
            else:
                self._reply(200, {"object": "text_completion", "model": body["model"],
                                  "choices": [{"index": 0, "text": out, "finish_reason": "stop"}]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
