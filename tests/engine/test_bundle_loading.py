"""Bundle checks and signatures on their own, without an engine: what is refused, and why."""
from __future__ import annotations

import base64
import sys
import textwrap
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (Encoding, NoEncryption, PrivateFormat,
                                                          load_pem_private_key)

from graft.engine.patches.base import PatchError
from graft.engine.patches.bundle import BundleCodeError, BundleVerifier, digest_of, load_bundle, sign
from graft.engine.patches.loading import check_in_subprocess, run_guarded

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


def test_a_signature_covers_name_version_and_digest(keys):
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
