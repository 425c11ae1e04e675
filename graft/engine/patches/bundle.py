"""Patch bundles: Python source shipped to a running engine, executed only once verified.

A bundle is one Python module whose `patches()` returns the Patch objects it provides. It travels
as text with a pinned digest (`sha256:<hex>` of its UTF-8 bytes) and, when the engine trusts
Ed25519 keys, a base64 signature over the same bytes. The engine checks the digest, then the
signature, and only then compiles and runs the module. `graft patch pack|sign|verify|keygen`
make and check bundles; `pack --configmap NAME` prints the ConfigMap the operator reads
(key `bundle.py` holds the source, `bundle.py.sig` the signature).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from graft.engine.patches.base import Patch, PatchError

DIGEST_PREFIX = "sha256:"


def digest_of(source: str) -> str:
    return DIGEST_PREFIX + hashlib.sha256(source.encode("utf-8")).hexdigest()


def load_public_key(pem: bytes):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    key = load_pem_public_key(pem)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("trusted keys must be Ed25519 public keys")
    return key


def sign(source: str, private_pem: bytes) -> str:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    key = load_pem_private_key(private_pem, password=None)
    return base64.b64encode(key.sign(source.encode("utf-8"))).decode()


@dataclass(slots=True)
class BundleVerifier:
    trusted_keys: list  # Ed25519PublicKey objects; empty: digest only

    @classmethod
    def from_files(cls, paths: list[str]) -> "BundleVerifier":
        return cls([load_public_key(Path(p).read_bytes()) for p in paths])

    def verify(self, source: str, digest: str, signature: str | None) -> None:
        """Raise PatchError unless the source matches its pinned digest and, if keys are trusted, a signature."""
        if not isinstance(digest, str) or not digest.startswith(DIGEST_PREFIX) or len(digest) != 71:
            raise PatchError(400, "source.digest must be 'sha256:' followed by 64 hex digits")
        if not hmac.compare_digest(digest_of(source), digest.lower()):
            raise PatchError(403, "the bundle does not match its pinned digest; refusing it")
        if not self.trusted_keys:
            return
        if not signature:
            raise PatchError(403, "this engine requires signed bundles and the bundle has no signature")
        try:
            raw = base64.b64decode(signature, validate=True)
        except ValueError:
            raise PatchError(403, "the bundle signature is not valid base64") from None
        from cryptography.exceptions import InvalidSignature
        for key in self.trusted_keys:
            try:
                key.verify(raw, source.encode("utf-8"))
                return
            except InvalidSignature:
                continue
        raise PatchError(403, "the bundle signature does not verify against any trusted key")


def load_bundle(source: str, digest: str) -> list[Patch]:
    """Compile and run a verified bundle; call only after BundleVerifier.verify passed."""
    module = types.ModuleType(f"graft_bundle_{digest[len(DIGEST_PREFIX):][:16]}")
    module.__file__ = f"<bundle {digest}>"
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102 - verified above
        factory = getattr(module, "patches", None)
        if not callable(factory):
            raise PatchError(422, "the bundle defines no patches() function")
        found = list(factory())
    except PatchError:
        raise
    except Exception as exc:
        raise PatchError(422, f"the bundle failed to load: {type(exc).__name__}: {exc}") from None
    if not all(isinstance(p, Patch) for p in found):
        raise PatchError(422, "the bundle's patches() must return Patch objects")
    return [_with_digest(p, digest) for p in found]


def _with_digest(p: Patch, digest: str) -> Patch:
    from dataclasses import replace
    return replace(p, digest=digest)


# graft patch ...
def add_cli_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="patch_command", required=True)
    pack = sub.add_parser("pack", help="bundle a patch module: prints JSON (or a ConfigMap) with its digest")
    pack.add_argument("module")
    pack.add_argument("--key", help="Ed25519 private key (PEM) to sign with")
    pack.add_argument("--configmap", metavar="NAME", help="print a ConfigMap manifest for the operator")
    pack.add_argument("--namespace", default=None)
    s = sub.add_parser("sign", help="sign a module with an Ed25519 private key; prints the signature")
    s.add_argument("module")
    s.add_argument("--key", required=True)
    v = sub.add_parser("verify", help="check a module against a digest and optionally a signature")
    v.add_argument("module")
    v.add_argument("--digest", required=True)
    v.add_argument("--signature")
    v.add_argument("--trusted-key", action="append", default=[])
    k = sub.add_parser("keygen", help="make an Ed25519 key pair: PREFIX.key (private) and PREFIX.pub")
    k.add_argument("prefix")


def cli_main(args: argparse.Namespace) -> int:
    cmd = args.patch_command
    if cmd == "keygen":
        from cryptography.hazmat.primitives import serialization as ser
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        key = Ed25519PrivateKey.generate()
        Path(f"{args.prefix}.key").write_bytes(key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8,
                                                                 ser.NoEncryption()))
        Path(f"{args.prefix}.pub").write_bytes(key.public_key().public_bytes(
            ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo))
        print(f"wrote {args.prefix}.key and {args.prefix}.pub")
        return 0
    source = Path(args.module).read_text(encoding="utf-8")
    if cmd == "sign":
        print(sign(source, Path(args.key).read_bytes()))
        return 0
    if cmd == "verify":
        try:
            BundleVerifier.from_files(args.trusted_key).verify(source, args.digest, args.signature)
        except PatchError as exc:
            print(f"refused: {exc.message}", file=sys.stderr)
            return 1
        print("ok")
        return 0
    digest = digest_of(source)
    signature = sign(source, Path(args.key).read_bytes()) if args.key else None
    if args.configmap:
        import yaml
        data = {"bundle.py": source}
        if signature:
            data["bundle.py.sig"] = signature
        meta = {"name": args.configmap, **({"namespace": args.namespace} if args.namespace else {}),
                "annotations": {"graft.dev/digest": digest}}
        print(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data},
                             sort_keys=False), end="")
        return 0
    print(json.dumps({"module": source, "digest": digest, **({"signature": signature} if signature else {})}))
    return 0
