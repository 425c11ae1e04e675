"""The admin API's defaults are the safe ones: loopback only, no bundles without a trusted key, a
token that follows its file, and start-up settings checked before the model loads."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from graft.engine.patches.bundle import digest_of
from tests.support import ROOT, start_engine

pytestmark = pytest.mark.slow
NO_MODEL = "/nonexistent/model.gguf"   # a setting checked before the model loads never gets this far
OVERLAP = 3.0                           # the engine's --admin-token-overlap


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRAFT_ADMIN_TOKEN": "t", **(env or {})}
    return subprocess.run([sys.executable, "-m", "graft.cli", "serve", "--port", "0", "--model", NO_MODEL, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("patches", ["kv-align", "kv-align@3.2.1,nl\n@1", "kv-align@3.2.1\n@x"])
def test_a_malformed_graft_patches_stops_the_engine_with_one_line_before_the_model_loads(patches):
    r = serve(env={"GRAFT_PATCHES": patches})
    assert r.returncode == 1
    assert r.stderr.startswith("GRAFT_PATCHES: ") and "name@version" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("args,says", [
    (["--allow-unsigned-bundles", "--trusted-key", "k.pub"], "exclude each other"),
    (["--admin-tls-cert", "cert.pem"], "--admin-tls-key"),
    (["--admin-tls-cert", "missing.pem", "--admin-tls-key", "missing.key"], "--admin-tls-cert"),
    (["--bundle-timeout", "0"], "--bundle-timeout"),
    (["--admin-token-overlap", "-1"], "--admin-token-overlap"),
    (["--min-patch-version", "demo"], "--min-patch-version"),
    (["--revoked-digests", "missing.txt"], "--revoked-digests"),
    (["--revoked-digests", "k.pub"], "--revoked-digests"),
])
def test_contradictory_or_missing_admin_settings_stop_the_engine_before_the_model_loads(tmp_path, args, says):
    (tmp_path / "k.pub").write_text("not a key")
    r = subprocess.run([sys.executable, "-m", "graft.cli", "serve", "--model", NO_MODEL, *args], cwd=tmp_path,
                       env={**os.environ, "GRAFT_ADMIN_TOKEN": "t"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def secret_volume(root, token: str, version: int) -> None:
    """Lay out a token the way the kubelet mounts a Secret: token -> ..data/token, ..data -> ..v<N>."""
    (root / f"..v{version}").mkdir()
    (root / f"..v{version}" / "token").write_text(token + "\n")
    tmp = root / "..data_tmp"
    tmp.symlink_to(f"..v{version}")
    os.replace(tmp, root / "..data")
    if not (root / "token").is_symlink():
        (root / "token").symlink_to("..data/token")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("defaults")
    secret = tmp / "secret"
    secret.mkdir()
    secret_volume(secret, "first-token", 1)
    eng = start_engine(tmp, "--admin-token-overlap", str(OVERLAP), host="127.0.0.2", token="first-token",
                       env={"GRAFT_ADMIN_TOKEN_FILE": str(secret / "token"), "GRAFT_ADMIN_TOKEN": "ignored"})
    eng.secret = secret
    yield eng
    eng.stop()


def test_the_admin_api_listens_on_loopback_only_by_default(engine):
    assert httpx.get(engine.url + "/health").status_code == 200           # inference: on --host
    loopback = f"http://127.0.0.1:{engine.admin_port}/admin/health"
    assert httpx.get(loopback, headers={"Authorization": "Bearer first-token"}).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(engine.admin_url + "/admin/health", timeout=5)          # not on the pod address


def test_without_a_trusted_key_no_bundle_runs(engine, tmp_path):
    marker = tmp_path / "ran"
    source = textwrap.dedent(f"""
        from pathlib import Path
        Path({str(marker)!r}).write_text("ran")
        def patches():
            return []
    """)
    with httpx.Client(base_url=f"http://127.0.0.1:{engine.admin_port}",
                      headers={"Authorization": "Bearer first-token"}) as admin:
        r = admin.post("/admin/patches", json={"name": "demo", "version": "1", "source": {
            "module": source, "digest": digest_of(source)}})
    assert r.status_code == 403, r.text
    message = r.json()["error"]["message"]
    assert "--trusted-key" in message and "--allow-unsigned-bundles" in message
    assert not marker.exists()


def test_a_rotated_token_file_takes_effect_without_a_restart(engine):
    def status(token: str) -> int:
        return httpx.get(f"http://127.0.0.1:{engine.admin_port}/admin/patches",
                         headers={"Authorization": f"Bearer {token}"}).status_code

    assert status("first-token") == 200 and status("ignored") == 403
    secret_volume(engine.secret, "second-token", 2)
    rotated = time.monotonic()
    assert status("second-token") == 200      # the very next request sees the new file
    assert status("first-token") == 200       # ... and the previous token still works, for the overlap
    assert status("ignored") == 403
    time.sleep(max(0.0, rotated + OVERLAP + 0.5 - time.monotonic()))
    assert status("first-token") == 403 and status("second-token") == 200
    assert engine.proc.poll() is None
