"""Bundle checks and signatures on their own, without an engine: what is refused, and why."""
from __future__ import annotations

import base64
import json
import os
import sys
import textwrap
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (Encoding, NoEncryption, PrivateFormat,
                                                          load_pem_private_key)

from graft.api import config_digest
from graft.engine.admin import AdminToken
from graft.engine.patches.base import PatchError
from graft.engine.patches.bundle import (BundleCodeError, BundleVerifier, Revocations, RevokedDigests, digest_of,
                                         load_bundle, parse_expiry, parse_min_versions, sign, signed_message,
                                         version_key)
from graft.engine.patches.loading import CheckLimits, check_in_subprocess, run_guarded

GOOD = textwrap.dedent("""
    from graft.engine import attention
    from graft.engine.patches.base import Patch
    print("hello from the bundle")     # a bundle's prints must not confuse the check
    def patches():
        return [Patch("demo", "1.0.0", {"kv.gather": attention.gather_aligned})]
""")


async def test_the_check_lists_the_patches_a_bundle_provides():
    assert await check_in_subprocess(GOOD, timeout=10) == ["demo@1.0.0"]


@pytest.mark.parametrize("body,says", [
    ("raise SystemExit(3)", "SystemExit: 3"),
    ("raise KeyboardInterrupt", "KeyboardInterrupt"),
    ("import os\nos._exit(7)", "exit code 7"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "killed by SIGSEGV"),
    ("x = 1", "no patches() function"),
    ("def patches():\n    return ['not a patch']", "must return Patch objects"),
])
async def test_the_check_refuses_a_bundle_that_exits_crashes_or_provides_nothing(body, says):
    with pytest.raises(PatchError) as info:
        await check_in_subprocess(body, timeout=10)
    assert info.value.status == 422 and says in info.value.message


async def test_the_check_stops_a_bundle_that_never_finishes_at_its_deadline():
    t0 = time.monotonic()
    with pytest.raises(PatchError, match="within 1s"):
        await check_in_subprocess("while True:\n    pass", timeout=1)
    assert time.monotonic() - t0 < 10


async def test_a_guarded_call_gives_up_at_its_deadline_and_turns_exits_into_errors():
    with pytest.raises(PatchError, match="within 0.2s"):
        await run_guarded(time.sleep, 2, timeout=0.2, what="sleeping")
    with pytest.raises(RuntimeError, match="SystemExit"):
        await run_guarded(sys.exit, 3, timeout=1, what="exiting")
    assert await run_guarded(sum, [1, 2], timeout=None, what="adding") == 3


def test_a_loaded_bundle_s_code_cannot_raise_past_exception():
    source = GOOD + textwrap.dedent("""
        def exits(*args):
            raise SystemExit(1)
        def patches():
            return [Patch("demo", "1.0.0", {"kv.gather": exits}, migrate=exits, configure=lambda c: {"sampler": exits})]
    """)
    (patch,) = load_bundle(source, digest_of(source))
    assert patch.digest == digest_of(source)
    for call in (lambda: patch.slots["kv.gather"](), lambda: patch.migrate(None),
                 lambda: patch.configure({})["sampler"]()):
        with pytest.raises(BundleCodeError, match="SystemExit"):
            call()
    with pytest.raises(PatchError, match="SystemExit: 3"):
        load_bundle("raise SystemExit(3)", digest_of("raise SystemExit(3)"))


@pytest.fixture(scope="module")
def keys():
    made = [Ed25519PrivateKey.generate() for _ in range(2)]
    return [(k.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()), k.public_key()) for k in made]


def test_a_signature_covers_name_version_digest_config_and_expiry(keys):
    (private, public), (stranger, _) = keys
    verifier, digest = BundleVerifier([public]), digest_of(GOOD)
    signature = sign("demo", "1.0.0", digest, private)
    assert verifier.verify(GOOD, digest.upper().replace("SHA256", "sha256"), signature,
                           name="demo", version="1.0.0") == digest
    refusals = {
        "renamed": dict(name="other", version="1.0.0", signature=signature),
        "re-versioned": dict(name="demo", version="1.0.1", signature=signature),
        "unsigned": dict(name="demo", version="1.0.0", signature=None),
        "another key": dict(name="demo", version="1.0.0", signature=sign("demo", "1.0.0", digest, stranger)),
        "the source alone signed": dict(name="demo", version="1.0.0", signature=base64.b64encode(
            load_pem_private_key(private, None).sign(GOOD.encode())).decode()),
        "another config": dict(name="demo", version="1.0.0", signature=signature, config={"block": 32}),
        "signed for a config, applied without": dict(name="demo", version="1.0.0", config=None, signature=sign(
            "demo", "1.0.0", digest, private, config={"block": 32})),
        "expiry altered": dict(name="demo", version="1.0.0", signature="v2:" + str(int(signature.split(":")[1]) + 1)
                               + ":" + signature.split(":")[2]),
    }
    for why, kwargs in refusals.items():
        signature_ = kwargs.pop("signature")
        with pytest.raises(PatchError) as info:
            verifier.verify(GOOD, digest, signature_, **kwargs)
        assert info.value.status == 403 and "signature" in info.value.message, why


def test_without_a_trusted_key_only_an_explicit_development_flag_runs_bundles(keys):
    digest = digest_of(GOOD)
    with pytest.raises(PatchError) as info:
        BundleVerifier([]).verify(GOOD, digest, None, name="demo", version="1.0.0")
    assert info.value.status == 403 and "--trusted-key" in info.value.message
    assert BundleVerifier([], allow_unsigned=True).verify(GOOD, digest, None, name="demo", version="1.0.0") == digest
    with pytest.raises(PatchError, match="pinned digest"):
        BundleVerifier([], allow_unsigned=True).verify(GOOD + "#", digest, None, name="demo", version="1.0.0")
    with pytest.raises(ValueError, match="exclude each other"):
        BundleVerifier([keys[0][1]], allow_unsigned=True)


@pytest.mark.parametrize("digest", ["sha256:" + "0" * 63 + "\n", "sha256:" + "0" * 63, "md5:00", None, 7])
def test_a_malformed_digest_is_400(digest):
    with pytest.raises(PatchError) as info:
        BundleVerifier([], allow_unsigned=True).verify(GOOD, digest, None, name="demo", version="1.0.0")
    assert info.value.status == 400 and "digest" in info.value.message


def test_a_signature_is_for_one_config_and_an_empty_config_is_its_own(keys):
    (private, public), _ = keys
    verifier, digest = BundleVerifier([public]), digest_of(GOOD)
    config = {"block": 32, "mode": "fast"}
    signature = sign("demo", "1.0.0", digest, private, config=config)
    assert verifier.verify(GOOD, digest, signature, name="demo", version="1.0.0",
                           config={"mode": "fast", "block": 32}) == digest     # key order does not matter
    with pytest.raises(PatchError) as info:
        verifier.verify(GOOD, digest, signature, name="demo", version="1.0.0", config={"block": 64, "mode": "fast"})
    assert info.value.status == 403 and config_digest({"block": 64, "mode": "fast"}) in info.value.message
    assert "--config" in info.value.message
    unconfigured = sign("demo", "1.0.0", digest, private)
    for empty in (None, {}):
        assert verifier.verify(GOOD, digest, unconfigured, name="demo", version="1.0.0", config=empty) == digest
    assert signed_message("demo", "1.0.0", digest, None, 5) != signed_message("demo", "1.0.0", digest, config, 5)


def test_an_expired_signature_is_403_saying_when_it_expired(keys):
    (private, public), _ = keys
    digest = digest_of(GOOD)
    signature = sign("demo", "1.0.0", digest, private, expires=2_000_000_000)
    assert signature.startswith("v2:2000000000:")
    assert BundleVerifier([public], clock=lambda: 1_999_999_999).verify(
        GOOD, digest, signature, name="demo", version="1.0.0") == digest
    with pytest.raises(PatchError) as info:
        BundleVerifier([public], clock=lambda: 2_000_000_000).verify(GOOD, digest, signature, name="demo",
                                                                     version="1.0.0")
    assert info.value.status == 403 and "expired at 2033-05-18T03:33:20Z" in info.value.message
    assert "graft patch sign" in info.value.message
    default = sign("demo", "1.0.0", digest, private)
    assert abs(int(default.split(":")[1]) - (time.time() + 30 * 86400)) < 60


def test_a_v1_signature_is_403_asking_to_re_sign(keys):
    (private, public), _ = keys
    digest = digest_of(GOOD)
    v1 = load_pem_private_key(private, None).sign(
        f"graft-bundle-signature/v1\ndemo\n1.0.0\n{digest}\n".encode())
    with pytest.raises(PatchError) as info:
        BundleVerifier([public]).verify(GOOD, digest, base64.b64encode(v1).decode(), name="demo", version="1.0.0")
    assert info.value.status == 403 and "v1" in info.value.message and "graft patch sign" in info.value.message


def test_expiry_takes_durations_and_dates():
    now = 1_700_000_000
    assert parse_expiry("30d", now) == now + 30 * 86400
    assert parse_expiry("12h", now) == now + 12 * 3600 and parse_expiry("90m", now) == now + 5400
    assert parse_expiry("2030-01-01", now) == 1893456000
    assert parse_expiry("2030-01-01T01:00:00+01:00", now) == 1893456000
    for bad in ("0d", "soon", "2020-01-01", "-5d"):
        with pytest.raises(ValueError, match="--expires"):
            parse_expiry(bad, now)


def test_versions_order_like_semver():
    ordered = ["0.9", "1.0.0-alpha", "1.0.0-alpha.2", "1.0.0-beta", "1.0.0", "1.0.1", "1.2", "1.10.0", "2"]
    assert sorted(ordered, key=version_key) == ordered
    assert version_key("1.0") == version_key("1.0.0") == version_key("1.0.0+build.7")


def test_a_minimum_version_refuses_older_signed_and_built_in_versions(keys):
    (private, public), _ = keys
    source = GOOD
    digest = digest_of(source)
    verifier = BundleVerifier([public], revocations=Revocations(parse_min_versions(["demo=1.0.1"])))
    with pytest.raises(PatchError) as info:
        verifier.verify(source, digest, sign("demo", "1.0.0", digest, private), name="demo", version="1.0.0")
    assert info.value.status == 403 and "--min-patch-version demo=1.0.1" in info.value.message
    assert verifier.verify(source, digest, sign("demo", "1.0.1", digest, private), name="demo",
                           version="1.0.1") == digest
    assert verifier.verify(source, digest, sign("other", "0.1", digest, private), name="other",
                           version="0.1") == digest
    with pytest.raises(PatchError, match="min-patch-version"):
        verifier.revocations.check("demo", "1.0.1-rc.1", None)
    for bad in (["demo"], ["demo=1.0\n"], ["Demo=1"]):
        with pytest.raises(ValueError, match="NAME=VERSION"):
            parse_min_versions(bad)


def test_revoked_digests_are_refused_and_the_list_is_read_again_when_it_changes(keys, tmp_path):
    (private, public), _ = keys
    digest = digest_of(GOOD)
    listing = tmp_path / "revoked"
    listing.write_text("# none yet\n")
    verifier = BundleVerifier([public], revocations=Revocations(revoked=RevokedDigests(str(listing))))
    signature = sign("demo", "1.0.0", digest, private)
    assert verifier.verify(GOOD, digest, signature, name="demo", version="1.0.0") == digest
    listing.write_text(f"{digest.upper().replace('SHA256', 'sha256')}   # vulnerable\n")
    with pytest.raises(PatchError) as info:
        verifier.verify(GOOD, digest, signature, name="demo", version="1.0.0")
    assert info.value.status == 403 and "revoked" in info.value.message and str(listing) in info.value.message
    listing.write_text("not a digest\n")        # a broken edit keeps the last good list
    with pytest.raises(PatchError, match="revoked"):
        verifier.verify(GOOD, digest, signature, name="demo", version="1.0.0")
    with pytest.raises(ValueError, match="line 1"):
        RevokedDigests(str(listing))


def recorder(path) -> str:
    """A bundle that appends, on each run of it, what it sees of itself and of its environment."""
    return GOOD + textwrap.dedent(f"""
        import json as _json, os as _os
        with open({str(path)!r}, "a") as _f:
            _f.write(_json.dumps([__name__, __file__, _os.environ.get("GRAFT_ADMIN_TOKEN"),
                                  _os.environ.get("AWS_SECRET_ACCESS_KEY")]) + "\\n")
    """)


async def test_the_check_runs_the_bundle_as_the_real_load_does_but_without_the_engine_s_secrets(
        tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_ADMIN_TOKEN", "engine-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret")
    runs = tmp_path / "runs"
    source = recorder(runs)
    digest = digest_of(source)
    assert await check_in_subprocess(source, timeout=10, digest=digest) == ["demo@1.0.0"]
    load_bundle(source, digest)
    checked, loaded = (json.loads(line) for line in runs.read_text().splitlines())
    assert checked[:2] == loaded[:2] and loaded[0].startswith("graft_bundle_") and digest in loaded[1]
    assert checked[2:] == [None, None] and loaded[2:] == ["engine-secret", "cloud-secret"]


async def test_the_check_caps_the_memory_a_bundle_may_take():
    with pytest.raises(PatchError) as info:
        await check_in_subprocess("x = bytearray(3 << 30)", timeout=20, limits=CheckLimits(memory=1 << 30))
    assert info.value.status == 422 and "MemoryError" in info.value.message and "1024 MiB" in info.value.message
    assert await check_in_subprocess(GOOD + "\nx = bytearray(64 << 20)", timeout=20,
                                     limits=CheckLimits(memory=1 << 30)) == ["demo@1.0.0"]


async def test_the_check_caps_the_cpu_time_a_bundle_may_use():
    t0 = time.monotonic()
    with pytest.raises(PatchError) as info:
        await check_in_subprocess("while True:\n    pass", timeout=60, limits=CheckLimits(cpu_seconds=1))
    assert info.value.status == 422 and "1 CPU-seconds" in info.value.message, info.value.message
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("body", ["print('x' * 200_000)", "import sys\nsys.stderr.write('y' * 200_000)",
                                  "import os\nos.write(1, b'z' * 200_000)"])
async def test_the_check_caps_what_a_bundle_prints(body):
    with pytest.raises(PatchError) as info:
        await check_in_subprocess(GOOD + "\n" + body, timeout=20)
    assert info.value.status == 422 and "printed more than 64 KiB" in info.value.message
    assert await check_in_subprocess(GOOD + "\nprint('y' * 1000)", timeout=20) == ["demo@1.0.0"]


def test_the_previous_admin_token_is_accepted_only_within_its_overlap(tmp_path):
    now = [1000.0]
    path = tmp_path / "token"
    path.write_text("old-token\n")
    token = AdminToken(path=str(path), overlap=120, clock=lambda: now[0])
    assert token.accepts(b"old-token") and not token.accepts(b"new-token")
    path.write_text("new-token\n")
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)   # a new mtime even on a coarse clock
    assert token.accepts(b"new-token") and token.accepts(b"old-token")
    now[0] += 119
    assert token.accepts(b"old-token")
    now[0] += 2
    assert not token.accepts(b"old-token") and token.accepts(b"new-token")
    assert not token.accepts(b"anything-else")
    fixed = AdminToken("only", overlap=120, clock=lambda: now[0])
    assert fixed.accepts(b"only") and not fixed.accepts(b"old-token")
