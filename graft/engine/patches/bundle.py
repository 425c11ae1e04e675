"""Patch bundles: Python source shipped to a running engine, executed only once verified.

A bundle is one Python module whose `patches()` returns the Patch objects it provides. It travels
as text with a pinned digest (`sha256:<hex>` of its UTF-8 bytes) and a base64 Ed25519 signature
over `name`, `version` and that digest (`signed_message`), so a signature vouches for one patch
of one bundle: the same source cannot be replayed under another name or version. An engine runs
bundles only when it trusts at least one key (`--trusted-key`), or, for development, when it was
started with `--allow-unsigned-bundles` (the digest alone proves nothing about the author: the
caller supplies it). The engine checks the digest, then the signature, and only then runs the
module, under the watch of `graft.engine.patches.loading`.

`graft patch keygen|pack|sign|verify` make and check bundles; `pack --configmap NAME` prints the
ConfigMap the operator reads (key `bundle.py` holds the source, `bundle.py.sig` the signature).
"""
from __future__ import annotations

import argparse
import base64
import functools
import hmac
import json
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from graft.api import DIGEST_PREFIX, DIGEST_RE, NAME_RE, VERSION_RE, digest_of
from graft.engine.patches.base import Patch, PatchError

SIGNATURE_CONTEXT = "graft-bundle-signature/v1"


def signed_message(name: str, version: str, digest: str) -> bytes:
    """The bytes a bundle signature covers: which patch, which version, which source.

    Name and version are validated patterns (no newline), so the newline-joined form is
    unambiguous; the context string keeps these signatures apart from anything else the key signs.
    """
    if not NAME_RE.fullmatch(name) or not VERSION_RE.fullmatch(version) or not DIGEST_RE.fullmatch(digest):
        raise ValueError(f"cannot sign {name!r}@{version!r} with digest {digest!r}: not a valid name, "
                         "version or sha256 digest")
    return f"{SIGNATURE_CONTEXT}\n{name}\n{version}\n{digest.lower()}\n".encode()


def load_public_key(pem: bytes):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    key = load_pem_public_key(pem)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("trusted keys must be Ed25519 public keys")
    return key


def sign(name: str, version: str, digest: str, private_pem: bytes) -> str:
    """The base64 signature of `name@version` from the bundle with `digest`."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    key = load_pem_private_key(private_pem, password=None)
    return base64.b64encode(key.sign(signed_message(name, version, digest))).decode()


def _exclusive(keys: list, allow_unsigned: bool) -> None:
    if keys and allow_unsigned:
        raise ValueError("--allow-unsigned-bundles and --trusted-key exclude each other: "
                         "an engine that trusts keys requires every bundle to be signed")


@dataclass(slots=True)
class BundleVerifier:
    trusted_keys: list              # Ed25519PublicKey objects
    allow_unsigned: bool = False    # development only: the pinned digest is the whole check

    def __post_init__(self) -> None:
        _exclusive(self.trusted_keys, self.allow_unsigned)

    @classmethod
    def from_files(cls, paths: list[str], allow_unsigned: bool = False) -> "BundleVerifier":
        _exclusive(paths, allow_unsigned)
        return cls([load_public_key(Path(p).read_bytes()) for p in paths], allow_unsigned)

    def verify(self, source: str, digest: Any, signature: Any, *, name: str, version: str) -> str:
        """The normalised digest once the bundle may run; PatchError (400 or 403) otherwise."""
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
            raise PatchError(400, "source.digest must be 'sha256:' followed by 64 hex digits")
        if signature is not None and not isinstance(signature, str):
            raise PatchError(400, "source.signature must be a base64 string")
        digest = digest.lower()
        if not self.trusted_keys and not self.allow_unsigned:
            raise PatchError(403, "this engine runs no bundles: it trusts no signing key; start it with "
                                  "--trusted-key PUB.pem (or --allow-unsigned-bundles, for development only)")
        if not hmac.compare_digest(digest_of(source), digest):
            raise PatchError(403, "the bundle does not match its pinned digest; refusing it")
        if self.allow_unsigned:
            return digest
        if not signature:
            raise PatchError(403, "this engine requires signed bundles and the bundle has no signature")
        try:
            raw = base64.b64decode(signature, validate=True)
        except ValueError:
            raise PatchError(403, "the bundle signature is not valid base64") from None
        from cryptography.exceptions import InvalidSignature
        message = signed_message(name, version, digest)
        for key in self.trusted_keys:
            try:
                key.verify(raw, message)
                return digest
            except InvalidSignature:
                continue
        raise PatchError(403, f"the bundle signature does not verify for {name}@{version} against any "
                              "trusted key")


class BundleCodeError(RuntimeError):
    """Bundle code raised a BaseException (SystemExit, KeyboardInterrupt...): an error, not an exit."""


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _contained(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    """`fn`, with anything it raises beyond Exception turned into BundleCodeError.

    The step loop and the event loop catch Exception; a SystemExit from a patch slot would end the
    step loop's thread, or the whole process.
    """
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception:
            raise
        except BaseException as exc:
            raise BundleCodeError(f"{what} raised {describe(exc)}") from None
    return call


def _contained_slots(slots: Mapping[str, Callable[..., Any]], who: str) -> dict[str, Callable[..., Any]]:
    return {point: _contained(fn, f"{who} {point}") if callable(fn) else fn for point, fn in slots.items()}


def _as_bundled(p: Patch, digest: str) -> Patch:
    """A bundle's patch: its digest recorded and every callable of it contained."""
    configure = None
    if p.configure is not None:
        inner = _contained(p.configure, f"{p.id} configure()")

        def configure(config: Mapping[str, Any]) -> dict[str, Callable[..., Any]]:
            return _contained_slots(inner(config), p.id)
    return replace(p, digest=digest, slots=_contained_slots(p.slots, p.id), configure=configure,
                   migrate=p.migrate and _contained(p.migrate, f"{p.id} migrate()"),
                   unmigrate=p.unmigrate and _contained(p.unmigrate, f"{p.id} unmigrate()"))


def execute(source: str, digest: str) -> list[Patch]:
    """Compile and run a bundle's module and call its `patches()`; raises whatever the bundle raises."""
    module = types.ModuleType(f"graft_bundle_{digest[len(DIGEST_PREFIX):][:16]}")
    module.__file__ = f"<bundle {digest}>"
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102 - verified by the caller
    factory = getattr(module, "patches", None)
    if not callable(factory):
        raise PatchError(422, "the bundle defines no patches() function")
    found = list(factory())
    if not all(isinstance(p, Patch) for p in found):
        raise PatchError(422, "the bundle's patches() must return Patch objects")
    return found


def load_bundle(source: str, digest: str) -> list[Patch]:
    """Run a verified bundle in this process: its patches, or PatchError(422) with the cause.

    Call only after BundleVerifier.verify passed; the engine calls it through
    `graft.engine.patches.loading`, which checks the bundle in a throwaway process first.
    """
    try:
        found = execute(source, digest)
    except PatchError:
        raise
    except BaseException as exc:  # SystemExit included: bundle code never ends the engine
        raise PatchError(422, f"the bundle failed to load: {describe(exc)}") from None
    return [_as_bundled(p, digest) for p in found]


# graft patch ...
def add_cli_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="patch_command", required=True)
    pack = sub.add_parser("pack", help="bundle a patch module: prints JSON (or a ConfigMap) with its digest")
    pack.add_argument("module")
    pack.add_argument("--key", help="Ed25519 private key (PEM) to sign with")
    _add_patch_args(pack, "the patch to sign (default: the bundle's only patch)")
    pack.add_argument("--configmap", metavar="NAME", help="print a ConfigMap manifest for the operator")
    pack.add_argument("--namespace", default=None)
    s = sub.add_parser("sign", help="sign a module's patch with an Ed25519 private key; prints the signature")
    s.add_argument("module")
    s.add_argument("--key", required=True)
    _add_patch_args(s, "the patch to sign (default: the bundle's only patch)")
    v = sub.add_parser("verify", help="check a module against a digest and a signature, as an engine does")
    v.add_argument("module")
    v.add_argument("--digest", required=True)
    _add_patch_args(v, "the patch the signature must be for", required=True)
    v.add_argument("--signature")
    v.add_argument("--trusted-key", action="append", default=[])
    v.add_argument("--allow-unsigned-bundles", action="store_true", help="check the digest only")
    k = sub.add_parser("keygen", help="make an Ed25519 key pair: PREFIX.key (private) and PREFIX.pub")
    k.add_argument("prefix")


def _add_patch_args(p: argparse.ArgumentParser, what: str, required: bool = False) -> None:
    p.add_argument("--name", required=required, help=what)
    p.add_argument("--version", required=required)


def _which_patch(source: str, name: str | None, version: str | None) -> tuple[str, str]:
    """`--name`/`--version`, or the bundle's only patch matching them (found by a checked run of it)."""
    if name and version:
        return name, version
    import asyncio

    from graft.engine.patches.loading import check_in_subprocess
    try:
        ids = asyncio.run(check_in_subprocess(source, timeout=30.0))
    except PatchError as exc:
        raise SystemExit(f"cannot list the bundle's patches: {exc.message}") from None
    found = [tuple(i.split("@", 1)) for i in ids]
    found = [(n, v) for n, v in found if (name or n) == n and (version or v) == v]
    if len(found) != 1:
        raise SystemExit(f"the bundle provides {', '.join(ids) or 'no patch'}: pick one with --name and --version")
    return found[0]


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
    digest = digest_of(source)
    if cmd == "verify":
        try:
            BundleVerifier.from_files(args.trusted_key, args.allow_unsigned_bundles).verify(
                source, args.digest, args.signature, name=args.name, version=args.version)
        except (PatchError, ValueError) as exc:
            print(f"refused: {getattr(exc, 'message', exc)}", file=sys.stderr)
            return 1
        print("ok")
        return 0
    signed_for = _which_patch(source, args.name, args.version) if args.key else None
    signature = sign(*signed_for, digest, Path(args.key).read_bytes()) if signed_for else None
    if cmd == "sign":
        print(signature)
        return 0
    if args.configmap:
        import yaml
        data = {"bundle.py": source}
        annotations = {"graft.dev/digest": digest}
        if signed_for:
            data["bundle.py.sig"] = signature
            annotations["graft.dev/signed-for"] = "@".join(signed_for)
        meta = {"name": args.configmap, **({"namespace": args.namespace} if args.namespace else {}),
                "annotations": annotations}
        print(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data},
                             sort_keys=False), end="")
        return 0
    print(json.dumps({"module": source, "digest": digest, **({"signature": signature} if signature else {})}))
    return 0
