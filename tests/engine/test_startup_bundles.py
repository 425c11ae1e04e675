"""A restarted container whose pod annotation names a bundle's patch: up, out of traffic, then back.

The engine keeps no code it was sent, so `GRAFT_PATCHES` naming a bundle's `name@version` cannot be
applied at start-up from the environment alone. The engine does not exit over it (that would be a
CrashLoopBackOff the operator could never repair): it applies the built-in entries, stays up
(/health 200) and out of traffic (/ready 503, naming what it waits for), and turns ready once the
operator applies the bundle again through the admin API.
"""
from __future__ import annotations

import textwrap
import time

import httpx
import pytest

from graft.engine.patches.bundle import digest_of
from tests.support import start_engine

pytestmark = pytest.mark.slow

BUNDLE = textwrap.dedent("""
    from graft.engine import attention
    from graft.engine.patches.base import Patch

    def patches():
        return [Patch("my-bundle", "1.0.0", {"kv.gather": attention.gather_aligned})]
""")


def _wait(url: str, ok, timeout: float = 180) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(url, timeout=2)
            if ok(r):
                return r
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer as expected within {timeout}s")
        time.sleep(0.25)


def test_an_engine_restarted_with_a_bundle_in_graft_patches_waits_for_it_out_of_traffic(tmp_path):
    eng = start_engine(tmp_path, "--allow-unsigned-bundles", wait=False,
                       env={"GRAFT_PATCHES": "my-bundle@1.0.0,sync-free@3.2.1"})
    try:
        _wait(eng.url + "/health", lambda r: r.status_code == 200)
        ready = httpx.get(eng.url + "/ready", timeout=5)
        assert ready.status_code == 503, ready.text
        body = ready.json()
        assert body == {"status": "awaiting-patches"}         # which patches: the admin API's to tell
        assert eng.proc.poll() is None                        # up, not crash-looping

        with eng.admin() as admin:
            listing = admin.get("/admin/patches").json()
            assert listing["awaiting"] == ["my-bundle@1.0.0"]   # what the operator reads
            assert listing["revision"] == "sync-free@3.2.1"     # the built-in entry is applied
            r = admin.post("/admin/patches", json={"name": "my-bundle", "version": "1.0.0",
                                                   "source": {"module": BUNDLE, "digest": digest_of(BUNDLE)}})
            assert r.status_code == 200, r.text
            assert r.json()["revision"] == "my-bundle@1.0.0,sync-free@3.2.1"
        _wait(eng.url + "/ready", lambda r: r.status_code == 200, timeout=10)
        with eng.admin() as admin:
            assert admin.get("/admin/patches").json()["revision"] == "my-bundle@1.0.0,sync-free@3.2.1"
            assert admin.get("/admin/patches").json()["awaiting"] == []
    finally:
        eng.stop()


def test_a_revert_of_an_awaited_bundle_lets_the_engine_in_without_it(tmp_path):
    """The rollout that patched this pod rolled back while it restarted: the operator wants it
    without the bundle and reverts it; the engine (which never ran it) turns ready at once."""
    eng = start_engine(tmp_path, "--allow-unsigned-bundles", wait=False, env={"GRAFT_PATCHES": "my-bundle@1.0.0"})
    try:
        _wait(eng.url + "/health", lambda r: r.status_code == 200)
        assert httpx.get(eng.url + "/ready", timeout=5).status_code == 503
        with eng.admin() as admin:
            r = admin.delete("/admin/patches/my-bundle")
            assert r.status_code == 404, r.text                 # it never ran: nothing to take out
            assert admin.get("/admin/patches").json()["awaiting"] == []
        _wait(eng.url + "/ready", lambda r: r.status_code == 200, timeout=10)
        with eng.admin() as admin:
            assert admin.get("/admin/patches").json()["revision"] == "base"
    finally:
        eng.stop()


def test_a_built_in_entry_that_cannot_be_applied_still_stops_the_engine(tmp_path):
    """A built-in entry whose self-check fails is no bundle to wait for: the start-up fails, naming it."""
    eng = start_engine(tmp_path, "--enable-test-patches", wait=False, env={"GRAFT_PATCHES": "kv-align@3.2.2-skew"})
    try:
        assert eng.proc.wait(timeout=180) != 0
    finally:
        eng.stop()
    assert "GRAFT_PATCHES: cannot apply kv-align@3.2.2-skew" in eng.log()
