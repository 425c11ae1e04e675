"""The admin API only runs code it was asked for and could verify; everything else is refused."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import httpx
import pytest

from graft.engine.patches.bundle import digest_of, sign
from tests.support import ROOT, start_engine

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    for who in ("trusted", "stranger"):
        subprocess.run([sys.executable, "-m", "graft.cli", "patch", "keygen", str(d / who)], check=True,
                       cwd=ROOT, capture_output=True)
    return d


@pytest.fixture(scope="module")
def engine(tmp_path_factory, keys):
    tmp = tmp_path_factory.mktemp("secure")
    revoked = tmp / "revoked-digests"
    revoked.write_text("# bundles this engine refuses\n")
    eng = start_engine(tmp, "--trusted-key", str(keys / "trusted.pub"), "--min-patch-version", "demo=1.0.1",
                       "--revoked-digests", str(revoked))
    eng.revoked = revoked
    yield eng
    eng.stop()


def bundle(marker, body: str = "") -> str:
    return textwrap.dedent(f"""
        from pathlib import Path
        from graft.engine import attention
        from graft.engine.patches.base import Patch
        Path({str(marker)!r}).write_text("imported")
        {body}
        def patches():
            return [Patch("kv-align", "9.9.9", {{"kv.gather": attention.gather_aligned}})]
    """)


def signed(source: str, key, name: str = "kv-align", version: str = "9.9.9", **kwargs) -> str:
    return sign(name, version, digest_of(source), key.read_bytes(), **kwargs)


def post(eng, body, token: str | None = "__default__") -> httpx.Response:
    with eng.admin(token) as admin:
        return admin.post("/admin/patches", json=body) if not isinstance(body, str) else \
            admin.post("/admin/patches", content=body, headers={"content-type": "application/json"})


def still_serving(eng) -> bool:
    r = httpx.post(eng.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    return r.status_code == 200


def test_no_token_is_401_and_a_wrong_token_is_403(engine):
    body = {"name": "kv-align", "version": "3.2.1", "source": {"builtin": True}}
    assert post(engine, body, token=None).status_code == 401
    assert post(engine, body, token="not-the-token").status_code == 403
    with engine.admin(token="not-the-token") as admin:
        assert admin.get("/admin/patches").status_code == 403
        assert admin.delete("/admin/patches/kv-align").status_code == 403
    assert still_serving(engine)


@pytest.mark.parametrize("body", [
    "{oops", "[]", {"version": "1", "source": {"builtin": True}}, {"name": "Bad_Name", "version": "1",
     "source": {"builtin": True}}, {"name": "kv-align", "source": {"builtin": True}},
    {"name": "kv-align", "version": "3.2.1"}, {"name": "kv-align", "version": "3.2.1", "source": {}},
    {"name": "kv-align", "version": "3.2.1", "source": {"builtin": True, "module": "x"}},
    {"name": "kv-align", "version": "3.2.1", "source": {"module": "x = 1", "digest": "md5:abc"}},
])
def test_malformed_bodies_are_400(engine, body):
    r = post(engine, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


BUILTIN = '{"name": "kv-align", "version": "3.2.1", "source": {"builtin": %s}%s}'


@pytest.mark.parametrize("body,says", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": ' * 65 + "1" + "}" * 65, "nested too deeply"),
    (BUILTIN % ("true", ', "config": {"n": ' + "9" * 100_000 + "}"), "more than 4300 digits"),
    (BUILTIN % ("true", ', "config": {"n": 1e999}'), "beyond the range"),
    (BUILTIN % ("true", ', "config": {"n": NaN}'), "NaN"),
    ('{"name": "kv-align", "version": "9.9.9", "source": {"module": "x = \'\\ud800\'", "digest": "sha256:'
     + "0" * 64 + '"}}', "lone surrogate"),
    (BUILTIN % ("false", ""), "must be true"),
    (BUILTIN % ("1", ""), "must be true"),
    (BUILTIN % ('"true"', ""), "must be true"),
    (BUILTIN % ("{}", ""), "must be true"),
])
def test_hostile_bodies_are_400_with_a_reason_and_apply_nothing(engine, body, says):
    r = post(engine, body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    with engine.admin() as admin:
        assert admin.get("/admin/patches").json()["revision"] == "base"
    assert still_serving(engine)


def test_a_body_over_the_limit_is_413(engine):
    big = '{"name": "kv-align", "version": "3.2.1", "source": {"builtin": true}, "pad": "' + "x" * (5 << 20) + '"}'
    r = post(engine, big)
    assert r.status_code == 413 and "MiB" in r.json()["error"]["message"], r.text
    assert still_serving(engine)


def test_unknown_patch_is_404(engine):
    r = post(engine, {"name": "no-such-patch", "version": "1.0", "source": {"builtin": True}})
    assert r.status_code == 404
    assert "kv-align@3.2.1" in r.json()["error"]["message"]  # says what is available
    with engine.admin() as admin:
        assert admin.delete("/admin/patches/kv-align").status_code == 404


def test_test_patches_are_not_registered_without_the_flag(engine):
    assert post(engine, {"name": "fault", "version": "1", "source": {"builtin": True}}).status_code == 404


def test_a_bundle_with_the_wrong_digest_never_runs(engine, keys, tmp_path):
    marker = tmp_path / "ran"
    source = bundle(marker)
    wrong = digest_of(source + "\n# tampered")
    r = post(engine, {"name": "kv-align", "version": "9.9.9",
                      "source": {"module": source, "digest": wrong, "signature": signed(source, keys / "trusted.key")}})
    assert r.status_code == 403 and "digest" in r.json()["error"]["message"]
    assert not marker.exists()


def test_a_bundle_without_a_trusted_signature_never_runs(engine, keys, tmp_path):
    marker = tmp_path / "ran"
    source = bundle(marker)
    for signature in (None, signed(source, keys / "stranger.key"), "bm90LWEtc2lnbmF0dXJl"):
        r = post(engine, {"name": "kv-align", "version": "9.9.9",
                          "source": {"module": source, "digest": digest_of(source), "signature": signature}})
        assert r.status_code == 403, r.text
        assert "signature" in r.json()["error"]["message"]
    assert not marker.exists()
    assert still_serving(engine)


def test_a_verified_bundle_applies_and_a_conflicting_one_is_409(engine, keys, tmp_path):
    marker = tmp_path / "ran"
    source = bundle(marker)
    body = {"name": "kv-align", "version": "9.9.9",
            "source": {"module": source, "digest": digest_of(source),
                       "signature": signed(source, keys / "trusted.key")}}
    r = post(engine, body)
    assert r.status_code == 200, r.text
    assert marker.read_text() == "imported"
    try:
        with engine.admin() as admin:
            applied = admin.get("/admin/patches").json()["applied"]
        assert applied[0]["digest"] == digest_of(source)
        conflict = post(engine, {"name": "kv-align", "version": "3.2.1", "source": {"builtin": True}})
        assert conflict.status_code == 409
    finally:
        with engine.admin() as admin:
            assert admin.delete("/admin/patches/kv-align").json()["revision"] == "base"


def test_a_verified_bundle_that_raises_on_import_is_422_and_changes_nothing(engine, keys, tmp_path):
    source = bundle(tmp_path / "ran", body="raise RuntimeError('broken bundle')")
    r = post(engine, {"name": "kv-align", "version": "9.9.9",
                      "source": {"module": source, "digest": digest_of(source),
                                 "signature": signed(source, keys / "trusted.key")}})
    assert r.status_code == 422
    assert "broken bundle" in r.json()["error"]["message"]
    with engine.admin() as admin:
        assert admin.get("/admin/patches").json()["revision"] == "base"
    assert still_serving(engine)


def test_the_admin_api_refuses_to_start_without_a_token():
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("GRAFT_ADMIN_TOKEN")}
    r = subprocess.run([sys.executable, "-m", "graft.cli", "serve", "--port", "0"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--admin-insecure" in r.stderr


def demo_bundle(version: str) -> str:
    return textwrap.dedent(f"""
        from graft.engine import attention
        from graft.engine.patches.base import Patch
        def patches():
            return [Patch("demo", {version!r}, {{"kv.gather": attention.gather_aligned}})]
    """)


def demo_body(source: str, version: str, signature: str, **extra) -> dict:
    return {"name": "demo", "version": version, "source": {"module": source, "digest": digest_of(source),
                                                            "signature": signature}, **extra}


def test_an_old_signed_version_cannot_be_replayed_over_its_fix(engine, keys):
    key = keys / "trusted.key"
    fixed, vulnerable = demo_bundle("1.0.1"), demo_bundle("1.0.0")
    r = post(engine, demo_body(fixed, "1.0.1", signed(fixed, key, "demo", "1.0.1")))
    assert r.status_code == 200, r.text
    try:
        r = post(engine, demo_body(vulnerable, "1.0.0", signed(vulnerable, key, "demo", "1.0.0"), replace=True))
        assert r.status_code == 403, r.text
        assert "--min-patch-version demo=1.0.1" in r.json()["error"]["message"]
        with engine.admin() as admin:
            assert admin.get("/admin/patches").json()["revision"] == "demo@1.0.1"
    finally:
        with engine.admin() as admin:
            admin.delete("/admin/patches/demo")


def test_expired_and_other_config_signatures_are_403(engine, keys):
    key = keys / "trusted.key"
    source = demo_bundle("2.0.0")
    expired = post(engine, demo_body(source, "2.0.0", signed(source, key, "demo", "2.0.0", expires=1_000_000_000)))
    assert expired.status_code == 403 and "expired at 2001-09-09T01:46:40Z" in expired.json()["error"]["message"]
    other = post(engine, demo_body(source, "2.0.0", signed(source, key, "demo", "2.0.0", config={"a": 1}),
                                   config={"a": 2}))
    assert other.status_code == 403 and "config" in other.json()["error"]["message"], other.text
    with engine.admin() as admin:
        assert admin.get("/admin/patches").json()["revision"] == "base"
    ok = post(engine, demo_body(source, "2.0.0", signed(source, key, "demo", "2.0.0", config={"a": 2}),
                                config={"a": 2}))
    assert ok.status_code == 200, ok.text
    with engine.admin() as admin:
        assert admin.delete("/admin/patches/demo").json()["revision"] == "base"


def test_a_revoked_digest_is_403_once_the_file_lists_it(engine, keys):
    source = demo_bundle("3.0.0")
    body = demo_body(source, "3.0.0", signed(source, keys / "trusted.key", "demo", "3.0.0"))
    engine.revoked.write_text(f"# vulnerable\n{digest_of(source)}\n")
    try:
        r = post(engine, body)
        assert r.status_code == 403 and "revoked" in r.json()["error"]["message"], r.text
    finally:
        engine.revoked.write_text("")
    assert post(engine, body).status_code == 200
    with engine.admin() as admin:
        assert admin.delete("/admin/patches/demo").json()["revision"] == "base"
