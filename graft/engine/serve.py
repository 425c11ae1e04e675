"""`graft serve`: the engine, its OpenAI app, its metrics app and its admin app, in one process,
living well in a pod.

SIGTERM turns the engine not-ready and stops admission, lets in-flight requests finish within the
grace period, then exits. Every admin setting (token, trusted keys, TLS files, the spelling of
GRAFT_PATCHES, the self-check's probe prompts) and the ports are checked before the model loads, so a
mistake ends the process at once with a one-line reason; the patches themselves are applied once it
has loaded.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import signal
import ssl
import sys
from dataclasses import dataclass

import uvicorn

from graft.engine.admin import AdminToken
from graft.engine.config import EngineConfig
from graft.engine.engine import LLMEngine
from graft.engine.options import ServeOptions
from graft.engine.patches.base import parse_patch_list
from graft.engine.patches.bundle import BundleVerifier, RevokedDigests, Revocations, parse_min_versions
from graft.engine.server import PublicLimits, build_app, build_metrics_app

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: one process runs several servers and drains first."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass(slots=True)
class AdminSetup:
    """What the admin API needs, checked before the model loads so a bad setting fails in a second."""

    token: AdminToken | None
    verifier: BundleVerifier
    ssl: dict[str, str]


def check_admin_setup(opts: ServeOptions) -> AdminSetup:
    """Validate every admin setting and GRAFT_PATCHES; SystemExit with a one-line reason otherwise."""
    try:
        parse_patch_list(opts.patches)
    except ValueError as exc:
        raise SystemExit(f"GRAFT_PATCHES: {exc}") from None
    if opts.admin_token_overlap < 0:
        raise SystemExit("--admin-token-overlap must not be negative")
    try:
        token = AdminToken.from_env(opts.admin_token_file, overlap=opts.admin_token_overlap)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"admin token: {exc}") from None
    if token is None and not opts.admin_insecure:
        raise SystemExit("the admin API needs a token: set GRAFT_ADMIN_TOKEN or GRAFT_ADMIN_TOKEN_FILE, "
                         "or pass --admin-insecure to run it without one")
    try:
        revocations = Revocations(parse_min_versions(opts.min_patch_versions),
                                  RevokedDigests(opts.revoked_digests) if opts.revoked_digests else None)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:
        verifier = BundleVerifier.from_files(opts.trusted_keys, opts.allow_unsigned_bundles, revocations)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--trusted-key: {exc}") from None
    if opts.allow_unsigned_bundles:
        log.warning("--allow-unsigned-bundles: any caller with the admin token can run code in this engine")
    if opts.bundle_timeout <= 0:
        raise SystemExit("--bundle-timeout must be positive")
    return AdminSetup(token, verifier, _tls(opts))


WILDCARDS = ("0.0.0.0", "::", "")


def check_ports(opts: ServeOptions) -> None:
    """The metrics port is a port of its own: SystemExit with a one-line reason otherwise."""
    if opts.metrics_port is None:
        if opts.metrics_host is not None:
            raise SystemExit("--metrics-host needs a metrics port of its own, not --metrics-port public")
        return
    if not 0 < opts.metrics_port < 65536:
        raise SystemExit(f"--metrics-port {opts.metrics_port}: a port number from 1 to 65535, or `public`")
    host = metrics_host(opts)
    others = [("--port", opts.host, opts.port)]
    if opts.admin_port is not None:
        others.append(("--admin-port", opts.admin_host, opts.admin_port))
    for flag, other_host, port in others:
        if port == opts.metrics_port and (host == other_host or host in WILDCARDS or other_host in WILDCARDS):
            raise SystemExit(f"--metrics-port {opts.metrics_port} is also {flag}: give the metrics a port of their "
                             f"own, or --metrics-port public to serve them on the public port")


def metrics_host(opts: ServeOptions) -> str:
    return opts.host if opts.metrics_host is None else opts.metrics_host


MAX_PROBE_PROMPTS = 8    # each adds a few forward passes (and its logits, kept per revision) to every self-check


def load_probe_prompts(path: str | None) -> list[str]:
    """The self-check's extra probe prompts: a JSON-lines file, one `{"prompt": "..."}` a line
    (blank lines skipped, other keys ignored); none without a file. SystemExit with a one-line
    reason when the file cannot be read or a line is not such an object."""
    if not path:
        return []
    where = f"--probe-prompts {path}"
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"{where}: cannot read it: {exc}") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{where}: line {n} is not JSON ({exc.msg}, column {exc.colno})") from None
        if not isinstance(entry, dict):
            raise SystemExit(f"{where}: line {n} must be a JSON object {{\"prompt\": \"...\"}}")
        prompt = entry.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise SystemExit(f"{where}: line {n} needs \"prompt\", a non-empty string")
        prompts.append(prompt)
    if not prompts:
        raise SystemExit(f"{where}: the file holds no prompts")
    if len(prompts) > MAX_PROBE_PROMPTS:
        raise SystemExit(f"{where}: {len(prompts)} prompts; the self-check takes at most {MAX_PROBE_PROMPTS}")
    return prompts


def _tls(opts: ServeOptions) -> dict[str, str]:
    if (opts.admin_tls_cert is None) != (opts.admin_tls_key is None):
        raise SystemExit("--admin-tls-cert and --admin-tls-key go together")
    if opts.admin_tls_cert is None:
        return {}
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(opts.admin_tls_cert, opts.admin_tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(f"--admin-tls-cert/--admin-tls-key: {exc}") from None
    return {"ssl_certfile": opts.admin_tls_cert, "ssl_keyfile": opts.admin_tls_key}


def served_name(model: str | None) -> str:
    """`SmolLM2-135M-Instruct` for `.../SmolLM2-135M-Instruct.Q4_1.gguf`; a folder's own name otherwise."""
    from pathlib import Path

    from graft.engine.loader import default_model_path
    path = Path(model or default_model_path())
    if path.suffix == ".gguf":
        return re.sub(r"[.-](Q\d\w*|F16|F32|BF16)$", "", path.stem, flags=re.IGNORECASE)
    return path.name


# The step loop thread gives up the GIL around every torch operator (hundreds a step) and must
# take it back after each; when the event loop thread holds it then (streaming tokens), CPython
# makes the step loop wait up to the switch interval, 5 ms by default, with the model's cores
# idle. At 0.5 ms a pass of the BBH workload through `graft serve` ran 1.08x faster (two
# alternated pairs, 102.7-105.3 against 112.4-112.8 tok/s) on fewer CPU-seconds.
GIL_SWITCH_INTERVAL_S = 0.0005


def tune_interpreter() -> None:
    """Process-wide settings for a process that serves: the GIL switch interval (above)."""
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))


async def serve(config: EngineConfig, opts: ServeOptions) -> None:
    probe_prompts = load_probe_prompts(opts.probe_prompts or os.environ.get("GRAFT_PROBE_PROMPTS_FILE"))
    check_ports(opts)
    admin = check_admin_setup(opts) if opts.admin_port is not None else None
    tune_interpreter()
    try:
        engine = await asyncio.to_thread(functools.partial(LLMEngine, config, probe_prompts=probe_prompts))
    except ValueError as exc:   # a KV cache too small for the probe, or for one block
        raise SystemExit(f"graft serve: {exc}") from None
    if probe_prompts:
        log.info("the self-check probes with its built-in plan and %d prompts of --probe-prompts: %d positions "
                 "compared, contexts up to %d tokens, %d KV blocks kept aside", len(probe_prompts),
                 len(engine.probe_plan.rows), engine.probe_plan.longest, engine.probe_plan.num_blocks)
    engine.start()
    model_name = opts.served_model_name or served_name(config.model)
    public_metrics = opts.metrics_port is None
    apps = [(build_app(engine, model_name, PublicLimits.of(opts.public), metrics=public_metrics), opts.host, opts.port, {})]
    if not public_metrics:
        apps.append((build_metrics_app(engine), metrics_host(opts), opts.metrics_port, {}))
    manager = None
    if admin is not None:
        from graft.engine.admin import build_admin_app
        from graft.engine.patches.manager import PatchManager
        manager = PatchManager(engine, enable_test_patches=opts.enable_test_patches, verifier=admin.verifier,
                               bundle_timeout=opts.bundle_timeout)
        if opts.patches:
            await manager.apply_startup(opts.patches)
            # the start-up patches were never run the other way here: nothing to compare against
            await engine.between_steps(engine.shadow.forget)
        apps.append((build_admin_app(manager, admin.token), opts.admin_host, opts.admin_port, admin.ssl))
    servers = [_Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                      access_log=False, timeout_graceful_shutdown=5, **tls))
               for app, host, port, tls in apps]

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
    admin_url = f"{'https' if admin.ssl else 'http'}://{opts.admin_host}:{opts.admin_port}" if admin else None
    metrics_url = "the public port" if public_metrics else f"http://{metrics_host(opts)}:{opts.metrics_port}/metrics"
    print(f"graft engine serving {model_name} on http://{opts.host}:{opts.port}, metrics on {metrics_url}"
          + (f", admin on {admin_url}" if admin_url else ""), flush=True)
    # the self-check's reference for the running revision, so the first apply probes the new table alone
    warm = asyncio.create_task(manager.warm_up()) if manager is not None else None
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()  # a server that failed to start (port in use) ends the process with its error
        stopping.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        watcher.cancel()
        if warm is not None:
            warm.cancel()
        engine.stop()
