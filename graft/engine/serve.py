"""`graft serve`: the engine, its OpenAI app and its admin app, in one process, living well in a pod.

SIGTERM turns the engine not-ready and stops admission, lets in-flight requests finish within the
grace period, then exits.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
from dataclasses import dataclass, field

import uvicorn

from graft.engine.config import EngineConfig
from graft.engine.engine import LLMEngine
from graft.engine.server import build_app

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: one process runs two servers and drains first."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass(slots=True)
class ServeOptions:
    host: str = "0.0.0.0"
    port: int = 8000
    admin_host: str | None = None       # defaults to host
    admin_port: int | None = 8081       # None: no admin API
    admin_insecure: bool = False
    enable_test_patches: bool = False
    trusted_keys: list[str] = field(default_factory=list)
    patches: str = ""                   # `name@version,...` applied at start-up (GRAFT_PATCHES)
    grace: float = 30.0
    served_model_name: str | None = None


def served_name(model: str | None) -> str:
    """`SmolLM2-135M-Instruct` for `.../SmolLM2-135M-Instruct.Q4_1.gguf`; a folder's own name otherwise."""
    from pathlib import Path

    from graft.engine.loader import default_model_path
    path = Path(model or default_model_path())
    if path.suffix == ".gguf":
        return re.sub(r"[.-](Q\d\w*|F16|F32|BF16)$", "", path.stem, flags=re.IGNORECASE)
    return path.name


def load_admin_token() -> str | None:
    """The admin token from GRAFT_ADMIN_TOKEN, or from the file GRAFT_ADMIN_TOKEN_FILE names."""
    path = os.environ.get("GRAFT_ADMIN_TOKEN_FILE")
    if path:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
        if not token:
            raise SystemExit(f"GRAFT_ADMIN_TOKEN_FILE {path} is empty")
        return token
    return os.environ.get("GRAFT_ADMIN_TOKEN") or None


async def serve(config: EngineConfig, opts: ServeOptions) -> None:
    token = load_admin_token()
    if opts.admin_port is not None and token is None and not opts.admin_insecure:
        raise SystemExit("the admin API needs a token: set GRAFT_ADMIN_TOKEN or GRAFT_ADMIN_TOKEN_FILE, "
                         "or pass --admin-insecure to run it without one")
    engine = await asyncio.to_thread(LLMEngine, config)
    engine.start()
    model_name = opts.served_model_name or served_name(config.model)
    apps = [(build_app(engine, model_name), opts.host, opts.port)]
    if opts.admin_port is not None:
        from graft.engine.admin import build_admin_app
        from graft.engine.patches.manager import PatchManager
        manager = PatchManager(engine, enable_test_patches=opts.enable_test_patches,
                               trusted_keys=opts.trusted_keys)
        if opts.patches:
            await manager.apply_startup(opts.patches)
        apps.append((build_admin_app(manager, token), opts.admin_host or opts.host, opts.admin_port))
    servers = [_Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                      access_log=False, timeout_graceful_shutdown=5))
               for app, host, port in apps]

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stopping.set)

    async def shutdown() -> None:
        await stopping.wait()
        log.info("draining: not ready, finishing in-flight requests (grace %.0fs)", opts.grace)
        clean = await engine.drain(opts.grace)
        if not clean:
            log.warning("grace period over with %d requests in flight", engine.num_active)
        for s in servers:
            s.should_exit = True

    tasks = [asyncio.create_task(s.serve()) for s in servers]
    watcher = asyncio.create_task(shutdown())
    print(f"graft engine serving {model_name} on http://{opts.host}:{opts.port}"
          + (f", admin on :{opts.admin_port}" if opts.admin_port is not None else ""), flush=True)
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()  # a server that failed to start (port in use) ends the process with its error
        stopping.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        watcher.cancel()
        engine.stop()
