"""Signed bundles end to end: `graft patch keygen` and `pack --configmap` on one side, an engine
started with `--trusted-key` on the other. A signature is for one name, one version, one source,
one config, until it expires."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import yaml

from graft.api import config_digest
from tests.support import ROOT, start_engine

pytestmark = pytest.mark.slow

BUNDLE = textwrap.dedent("""
    from graft.engine import attention
    from graft.engine.patches.base import Patch

    def patches():
        return [Patch(name, version, {"kv.gather": attention.gather_aligned})
                for name, version in (("alpha", "1.0.0"), ("alpha", "2.0.0"), ("beta", "1.0.0"))]
""")
SINGLE = textwrap.dedent("""
    from graft.engine import attention
    from graft.engine.patches.base import Patch

    def patches():
        return [Patch("solo", "0.1.0", {"kv.gather": attention.gather_aligned})]
""")


def graft(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graft.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("signing")
    for who in ("release", "stranger"):
        assert graft("patch", "keygen", who, cwd=d).returncode == 0
    (d / "bundle.py").write_text(BUNDLE)
    (d / "single.py").write_text(SINGLE)
    return d


def configmap(work, module: str, *args: str) -> dict:
    r = graft("patch", "pack", module, *args, "--configmap", "my-bundle", "--namespace", "llm", cwd=work)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, work):
    eng = start_engine(tmp_path_factory.mktemp("signed"), "--trusted-key", str(work / "release.pub"))
    yield eng
    eng.stop()


def apply(eng, cm: dict, name: str, version: str, signature: str | None = "from-configmap",
          config: dict | None = None) -> httpx.Response:
    source = {"module": cm["data"]["bundle.py"], "digest": cm["metadata"]["annotations"]["graft.dev/digest"]}
    if signature == "from-configmap":
        signature = cm["data"].get("bundle.py.sig")
    if signature:
        source["signature"] = signature
    with eng.admin() as admin:
        return admin.post("/admin/patches", json={"name": name, "version": version, "source": source,
                                                  **({"config": config} if config is not None else {})})


def test_pack_signs_the_named_patch_and_names_it_in_the_configmap(work):
    cm = configmap(work, "bundle.py", "--key", "release.key", "--name", "alpha", "--version", "1.0.0")
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["namespace"] == "llm"
    assert cm["metadata"]["annotations"]["graft.dev/signed-for"] == "alpha@1.0.0"
    assert cm["data"]["bundle.py"] == BUNDLE and cm["data"]["bundle.py.sig"].startswith("v2:")
    assert cm["metadata"]["annotations"]["graft.dev/signature-expires"].endswith("Z")


def test_pack_finds_a_single_patch_bundle_s_name_itself_and_asks_otherwise(work):
    cm = configmap(work, "single.py", "--key", "release.key")
    assert cm["metadata"]["annotations"]["graft.dev/signed-for"] == "solo@0.1.0"
    r = graft("patch", "pack", "bundle.py", "--key", "release.key", cwd=work)
    assert r.returncode != 0
    assert "alpha@1.0.0, alpha@2.0.0, beta@1.0.0" in r.stderr and "--name" in r.stderr


def test_a_trusted_engine_applies_the_signed_patch(engine, work):
    cm = configmap(work, "bundle.py", "--key", "release.key", "--name", "alpha", "--version", "1.0.0")
    r = apply(engine, cm, "alpha", "1.0.0")
    assert r.status_code == 200 and r.json()["revision"] == "alpha@1.0.0", r.text
    with engine.admin() as admin:
        assert admin.delete("/admin/patches/alpha").json()["revision"] == "base"


@pytest.mark.parametrize("name,version,key,signature", [
    ("beta", "1.0.0", "release.key", "from-configmap"),      # renamed
    ("alpha", "2.0.0", "release.key", "from-configmap"),     # re-versioned
    ("alpha", "1.0.0", "release.key", None),                 # unsigned
    ("alpha", "1.0.0", "stranger.key", "from-configmap"),    # signed by a key the engine does not trust
])
def test_a_trusted_engine_refuses_what_the_signature_does_not_cover(engine, work, name, version, key, signature):
    cm = configmap(work, "bundle.py", "--key", key, "--name", "alpha", "--version", "1.0.0")
    r = apply(engine, cm, name, version, signature)
    assert r.status_code == 403, r.text
    assert "signature" in r.json()["error"]["message"]
    with engine.admin() as admin:
        assert admin.get("/admin/patches").json()["revision"] == "base"


def test_verify_checks_name_version_and_key_like_the_engine(work):
    cm = configmap(work, "bundle.py", "--key", "release.key", "--name", "alpha", "--version", "1.0.0")
    digest, sig = cm["metadata"]["annotations"]["graft.dev/digest"], cm["data"]["bundle.py.sig"]

    def verify(name: str, version: str, key: str = "release.pub", *extra: str) -> subprocess.CompletedProcess:
        return graft("patch", "verify", "bundle.py", "--digest", digest, "--name", name, "--version", version,
                     "--signature", sig, "--trusted-key", key, *extra, cwd=work)

    assert verify("alpha", "1.0.0").stdout.strip() == "ok"
    for refused in (verify("beta", "1.0.0"), verify("alpha", "2.0.0"), verify("alpha", "1.0.0", "stranger.pub")):
        assert refused.returncode == 1 and "signature" in refused.stderr


def test_sign_covers_the_config_and_the_expiry_it_is_given(engine, work):
    (work / "config.json").write_text('{"block": 16}')
    cm = configmap(work, "bundle.py", "--key", "release.key", "--name", "alpha", "--version", "1.0.0",
                   "--config", "config.json", "--expires", "2h")
    expires = int(cm["data"]["bundle.py.sig"].split(":")[1])
    assert abs(expires - (time.time() + 7200)) < 120
    assert cm["metadata"]["annotations"]["graft.dev/signed-config"] == config_digest({"block": 16})
    assert apply(engine, cm, "alpha", "1.0.0").status_code == 403               # sent without its config
    assert apply(engine, cm, "alpha", "1.0.0", config={"block": 32}).status_code == 403
    r = apply(engine, cm, "alpha", "1.0.0", config={"block": 16})
    assert r.status_code == 200, r.text
    with engine.admin() as admin:
        assert admin.delete("/admin/patches/alpha").json()["revision"] == "base"
    inline = graft("patch", "sign", "bundle.py", "--key", "release.key", "--name", "alpha", "--version", "1.0.0",
                   "--config", '{"block": 16}', "--expires", "2h", cwd=work)
    assert inline.returncode == 0 and inline.stdout.startswith("v2:"), inline.stderr
    for bad in (["--expires", "yesterday"], ["--config", "[1]"], ["--config", "missing.json"]):
        r = graft("patch", "sign", "bundle.py", "--key", "release.key", "--name", "alpha", "--version", "1.0.0",
                  *bad, cwd=work)
        assert r.returncode != 0 and bad[0] in r.stderr, r.stderr


def test_verify_checks_the_config_and_the_expiry_like_the_engine(work):
    digest = configmap(work, "bundle.py")["metadata"]["annotations"]["graft.dev/digest"]

    def signature(*extra: str) -> str:
        r = graft("patch", "sign", "bundle.py", "--key", "release.key", "--name", "alpha", "--version", "1.0.0",
                  *extra, cwd=work)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def verify(sig: str, *extra: str) -> subprocess.CompletedProcess:
        return graft("patch", "verify", "bundle.py", "--digest", digest, "--name", "alpha", "--version", "1.0.0",
                     "--signature", sig, "--trusted-key", "release.pub", *extra, cwd=work)

    configured = signature("--config", '{"block": 16}')
    assert verify(configured, "--config", '{"block": 16}').stdout.strip() == "ok"
    refused = verify(configured)
    assert refused.returncode == 1 and "config" in refused.stderr
    soon = signature("--expires", "1s")
    time.sleep(2.1)
    refused = verify(soon)
    assert refused.returncode == 1 and "expired at" in refused.stderr
    refused = verify(signature(), "--min-patch-version", "alpha=1.0.1")
    assert refused.returncode == 1 and "--min-patch-version alpha=1.0.1" in refused.stderr
