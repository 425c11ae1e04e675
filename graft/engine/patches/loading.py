"""Running a verified bundle's code without letting it stop, block or outlive the engine.

A signature says who wrote a bundle, not that its code behaves: its module body may raise
SystemExit, sleep, or loop forever. Two steps keep the engine serving whatever it does:

1. **A check in a throwaway interpreter.** `check_in_subprocess` runs the module and its
   `patches()` in a fresh `python -m graft.engine.patches.loading`, under `timeout` seconds counted
   from the moment the bundle starts (the child imports torch first, so a slow interpreter start is
   not held against the bundle). A bundle that exits, crashes or overruns is refused (422) and
   its process killed; nothing of it ever ran in the engine. A process is the only thing Python
   can stop from outside: a thread running `while True: pass` cannot be interrupted, and would
   keep a core and a share of the GIL for the engine's lifetime.
2. **The real import, off the event loop.** Only a bundle that passed the check is run in the
   engine, in a daemon thread that the event loop awaits with the same deadline (`run_guarded`),
   so `/health`, inference and the admin API keep answering while it loads, and SIGTERM still ends
   the process. A bundle that behaves differently the second time and overruns is refused too;
   its thread cannot be stopped and is left to finish, logged.

A bundle's module body therefore runs twice (once in the check), which is why bundles should be
free of side effects at import. Re-applying an applied bundle runs nothing: the patch manager keeps
loaded bundles by digest.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from graft.engine.patches.base import Patch, PatchError
from graft.engine.patches.bundle import describe, execute, load_bundle

log = logging.getLogger(__name__)

T = TypeVar("T")
START_TIMEOUT = 120.0   # seconds for the check's interpreter to import torch and say it is ready
READY = b"ready\n"


async def run_guarded(fn: Callable[..., T], *args: Any, timeout: float | None, what: str) -> T:
    """`fn(*args)` in a daemon thread, awaited for at most `timeout` seconds.

    Raises what `fn` raises (BaseException included, as an ordinary exception of this coroutine),
    or PatchError(422) when the deadline passes; the thread is then left to finish on its own.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error if isinstance(error, Exception) else RuntimeError(describe(error)))
        else:
            done.set_result(result)

    def target() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed back to the awaiting coroutine, never raised here
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name=f"graft-bundle: {what}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), timeout)
    except TimeoutError:
        log.error("%s did not finish within %gs; its thread is left running", what, timeout)
        raise PatchError(422, f"{what} did not finish within {timeout:g}s; refused") from None


async def check_in_subprocess(source: str, timeout: float) -> list[str]:
    """Run a bundle once in a throwaway interpreter; the ids (`name@version`) of its patches.

    Raises PatchError(422) when the bundle raises, exits, crashes or overruns `timeout`.
    """
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "graft.engine.patches.loading",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)   # stderr: the engine's log
    try:
        proc.stdin.write(source.encode("utf-8"))
        proc.stdin.close()
        try:
            ready = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT)
        except TimeoutError:
            raise PatchError(503, f"the bundle check did not start within {START_TIMEOUT:g}s") from None
        if ready != READY:
            raise PatchError(503, f"the bundle check did not start (exit code {await proc.wait()})")
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            raise PatchError(422, f"the bundle did not finish loading within {timeout:g}s; refused") from None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    try:
        result = json.loads(out.decode("utf-8").strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise PatchError(422, f"the bundle ended its process while loading ({_exit_status(proc.returncode)})") \
            from None
    if "error" in result:
        raise PatchError(422, f"the bundle failed to load: {result['error']}")
    return list(result["patches"])


async def load_checked(source: str, digest: str, timeout: float) -> list[Patch]:
    """A verified bundle's patches, loaded into this process once a throwaway run of it passed."""
    await check_in_subprocess(source, timeout)
    return await run_guarded(load_bundle, source, digest, timeout=timeout, what="loading the bundle")


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


# the check's own process
def _die_with_parent() -> None:
    """Ask Linux to kill this process when the engine goes, whatever the bundle is doing."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)


def _check_main() -> None:
    _die_with_parent()
    results = os.fdopen(os.dup(1), "w")   # the answer to the engine; the bundle's prints go to stderr
    os.dup2(2, 1)
    import torch  # noqa: F401 - warm: bundles use it, and its import is not the bundle's time
    source = sys.stdin.buffer.read().decode("utf-8")
    results.write(READY.decode())
    results.flush()
    try:
        answer: dict[str, Any] = {"patches": [p.id for p in execute(source, "sha256:check")]}
    except PatchError as exc:
        answer = {"error": exc.message}
    except BaseException as exc:  # SystemExit, KeyboardInterrupt...: all of it is the bundle's failure
        answer = {"error": describe(exc)}
    results.write(json.dumps(answer) + "\n")
    results.flush()
    os._exit(0)   # no atexit handler or lingering thread of the bundle runs after this


if __name__ == "__main__":
    _check_main()
