"""Patch bundles: Python source shipped to a running engine, executed only once verified.

A bundle is one Python module whose `patches()` returns the Patch objects it provides. It travels
as text with a pinned digest (`sha256:<hex>` of its UTF-8 bytes) and a signature. An engine runs
bundles only when it trusts at least one key (`--trusted-key`), or, for development, when it was
started with `--allow-unsigned-bundles` (the digest alone proves nothing about the author: the
caller supplies it). The engine checks the digest, then the signature and the revocation rules,
and only then runs the module, under the watch of `graft.engine.patches.loading`.

**Signatures** (format v2) are one string, as `bundle.py.sig` and `source.signature` carry it:

    v2:<expires>:<base64 Ed25519 signature>

`<expires>` is a Unix time in whole seconds. The Ed25519 signature covers (`signed_message`) the
patch's name, its version, the bundle's digest, the digest of the patch's `config`
(`graft.api.config_digest`; an absent config is `{}`) and `<expires>`. So a signature vouches for
one patch of one bundle with one config, until a given time: the same source cannot be replayed
under another name or version, with another config, or after it expired. `graft patch sign`
signs for `--expires` (a duration such as `30d`, `12h`, `90m`, or an ISO 8601 date; default 30
days) and `--config` (a JSON object, or a file holding one; default none). An engine refuses an
expired signature, one made for another config, and the unexpiring v1 signatures of earlier
releases (re-sign those with `graft patch sign`), each with 403.

**Revocation.** `--min-patch-version NAME=VERSION` (repeatable) refuses any version of NAME below
VERSION, built in or bundled (versions compare as `version_key` orders them: dot-separated
numbers numerically, a `-pre-release` before its release, `+build` ignored); `--revoked-digests
FILE` (one `sha256:` digest a line, `#` comments) refuses those bundles, and is read again when the
file changes. An old signed version therefore cannot be applied again over its fix.

`graft patch keygen|pack|sign|verify` make and check bundles; `pack --configmap NAME` prints the
ConfigMap the operator reads (key `bundle.py` holds the source, `bundle.py.sig` the signature).
"""
from __future__ import annotations

import argparse
import base64
import functools
import hmac
import json
import logging
import os
import re
import sys
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from graft.api import DIGEST_PREFIX, DIGEST_RE, NAME_RE, VERSION_RE, config_digest, digest_of
from graft.engine.patches.base import Patch, PatchError

log = logging.getLogger(__name__)

SIGNATURE_CONTEXT = "graft-bundle-signature/v2"
SIGNATURE_RE = re.compile(r"v2:([0-9]{1,12}):([A-Za-z0-9+/=]+)")
DEFAULT_VALIDITY_S = 30 * 86400   # `graft patch sign --expires`: 30 days
RESIGN = "re-sign it with `graft patch sign`"


def signed_message(name: str, version: str, digest: str, config: Mapping[str, Any] | None, expires: int) -> bytes:
    """The bytes a bundle signature covers: which patch, which version, which source, which config, until when.

    Name and version are validated patterns (no newline), so the newline-joined form is
    unambiguous; the context string keeps these signatures apart from anything else the key signs.
    """
    # either case is taken and written lower-case (DIGEST_RE is the API's spelling: lower-case hex)
    if not NAME_RE.fullmatch(name) or not VERSION_RE.fullmatch(version) or not DIGEST_RE.fullmatch(digest.lower()):
        raise ValueError(f"cannot sign {name!r}@{version!r} with digest {digest!r}: not a valid name, "
                         "version or sha256 digest")
    return (f"{SIGNATURE_CONTEXT}\n{name}\n{version}\n{digest.lower()}\n{config_digest(config)}\n"
            f"{int(expires)}\n").encode()


def load_public_key(pem: bytes):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    key = load_pem_public_key(pem)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("trusted keys must be Ed25519 public keys")
    return key


def sign(name: str, version: str, digest: str, private_pem: bytes, *, config: Mapping[str, Any] | None = None,
         expires: int | None = None) -> str:
    """The v2 signature (`v2:<expires>:<base64>`) of `name@version` from the bundle with `digest`,
    applied with `config`, valid until `expires` (Unix seconds; default DEFAULT_VALIDITY_S from now)."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    key = load_pem_private_key(private_pem, password=None)
    expires = int(time.time()) + DEFAULT_VALIDITY_S if expires is None else int(expires)
    raw = key.sign(signed_message(name, version, digest, config, expires))
    return f"v2:{expires}:{base64.b64encode(raw).decode()}"


def _when(unix: int) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_expiry(text: str, now: float | None = None) -> int:
    """`--expires`: a duration (`30d`, `12h`, `90m`, `3600s`) from `now`, or an ISO 8601 date or time
    (UTC unless it says otherwise); Unix seconds. ValueError otherwise."""
    now = time.time() if now is None else now
    m = re.fullmatch(r"\s*([0-9]+)\s*([smhdw])\s*", text)
    if m:
        seconds = int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]
        if seconds <= 0:
            raise ValueError("--expires: a duration must be positive")
        return int(now) + seconds
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--expires: {text!r} is neither a duration (30d, 12h, 90m) nor an ISO 8601 date") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    expires = int(when.timestamp())
    if expires <= now:
        raise ValueError(f"--expires: {text} is in the past")
    return expires


def parse_config(text: str | None) -> dict[str, Any]:
    """`--config`: a JSON object, or the path of a file holding one; {} for none."""
    if not text:
        return {}
    stripped = text.strip()
    if not stripped.startswith("{"):
        try:
            stripped = Path(text).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--config: {text!r} is neither a JSON object nor a readable file ({exc})") from None
    try:
        config = json.loads(stripped)
    except ValueError as exc:
        raise ValueError(f"--config: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("--config: must be a JSON object")
    return config


# -- revocation ------------------------------------------------------------------------------------

def version_key(version: str) -> tuple:
    """The order of patch versions, semver-like: `1.2.10` > `1.2.9` > `1.2.9-rc.1`; trailing `.0`s
    and `+build` metadata do not count; a numeric part sorts before an alphanumeric one."""
    main, _, pre = version.partition("+")[0].partition("-")

    def parts(text: str) -> tuple:
        return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[._]", text) if p)

    release = list(parts(main))
    while release and release[-1] == (0, 0, ""):
        release.pop()
    return (tuple(release), (0, parts(pre)) if pre else (1, ()))


def parse_min_versions(items: list[str]) -> dict[str, str]:
    """`--min-patch-version NAME=VERSION` flags as {name: version}; ValueError naming a bad one."""
    out = {}
    for item in items:
        name, sep, version = item.partition("=")
        if not sep or not NAME_RE.fullmatch(name) or not VERSION_RE.fullmatch(version):
            raise ValueError(f"--min-patch-version {item!r}: must be NAME=VERSION")
        out[name] = version
    return out


class RevokedDigests:
    """`--revoked-digests FILE`: bundle digests refused, one a line; read again when the file changes
    (its mtime, inode and size, stat'ed on each check). A file that becomes unreadable or malformed
    leaves the last good list in force, logged."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._digests: frozenset[str] = frozenset()
        self.current(strict=True)

    @staticmethod
    def parse(text: str, path: str) -> frozenset[str]:
        found = set()
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if not DIGEST_RE.fullmatch(line.lower()):     # a hand-written list may use either case
                raise ValueError(f"{path} line {n}: {line[:80]!r} is not 'sha256:' and 64 hex digits")
            found.add(line.lower())
        return frozenset(found)

    def current(self, strict: bool = False) -> frozenset[str]:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
            if stamp != self._stamp:
                self._digests = self.parse(Path(self.path).read_text(encoding="utf-8"), self.path)
                if self._stamp is not None:
                    log.info("--revoked-digests %s changed: %d digests revoked", self.path, len(self._digests))
                self._stamp = stamp
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            if strict:
                raise ValueError(f"--revoked-digests: {exc}") from None
            log.error("--revoked-digests %s: %s; keeping the last good list", self.path, exc)
        return self._digests


@dataclass(slots=True)
class Revocations:
    """What an engine refuses even when signed: versions below a minimum, revoked bundle digests."""

    min_versions: dict[str, str] = field(default_factory=dict)
    revoked: RevokedDigests | None = None

    def check(self, name: str, version: str, digest: str | None) -> None:
        """PatchError(403) naming the rule that refuses `name@version` (bundle `digest`; None: built in)."""
        floor = self.min_versions.get(name)
        if floor is not None and version_key(version) < version_key(floor):
            raise PatchError(403, f"{name}@{version} is revoked: this engine accepts {name} from version {floor} "
                                  f"on (--min-patch-version {name}={floor})")
        if digest is not None and self.revoked is not None and digest.lower() in self.revoked.current():
            raise PatchError(403, f"the bundle {digest.lower()} is revoked (listed in --revoked-digests "
                                  f"{self.revoked.path})")


def _exclusive(keys: list, allow_unsigned: bool) -> None:
    if keys and allow_unsigned:
        raise ValueError("--allow-unsigned-bundles and --trusted-key exclude each other: "
                         "an engine that trusts keys requires every bundle to be signed")


@dataclass(slots=True)
class BundleVerifier:
    trusted_keys: list              # Ed25519PublicKey objects
    allow_unsigned: bool = False    # development only: the pinned digest is the whole check
    revocations: Revocations = field(default_factory=Revocations)
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        _exclusive(self.trusted_keys, self.allow_unsigned)

    @classmethod
    def from_files(cls, paths: list[str], allow_unsigned: bool = False,
                   revocations: Revocations | None = None) -> "BundleVerifier":
        _exclusive(paths, allow_unsigned)
        return cls([load_public_key(Path(p).read_bytes()) for p in paths], allow_unsigned,
                   revocations or Revocations())

    def verify(self, source: str, digest: Any, signature: Any, *, name: str, version: str,
               config: Mapping[str, Any] | None = None) -> str:
        """The normalised digest once the bundle may run with `config`; PatchError (400 or 403) otherwise."""
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest.lower()):   # either case, normalised below
            raise PatchError(400, "source.digest must be 'sha256:' followed by 64 hex digits")
        if signature is not None and not isinstance(signature, str):
            raise PatchError(400, "source.signature must be a string (v2:<expires>:<base64>)")
        digest = digest.lower()
        if not self.trusted_keys and not self.allow_unsigned:
            raise PatchError(403, "this engine runs no bundles: it trusts no signing key; start it with "
                                  "--trusted-key PUB.pem (or --allow-unsigned-bundles, for development only)")
        if not hmac.compare_digest(digest_of(source), digest):
            raise PatchError(403, "the bundle does not match its pinned digest; refusing it")
        self.revocations.check(name, version, digest)
        if self.allow_unsigned:
            return digest
        if not signature:
            raise PatchError(403, "this engine requires signed bundles and the bundle has no signature")
        m = SIGNATURE_RE.fullmatch(signature.strip())
        if m is None:
            if ":" not in signature:
                raise PatchError(403, "the bundle signature is a v1 signature, which neither expires nor covers "
                                      f"the patch's config; {RESIGN}")
            raise PatchError(403, "the bundle signature is not of the form v2:<expires>:<base64>")
        expires = int(m.group(1))
        if self.clock() >= expires:
            raise PatchError(403, f"the bundle signature for {name}@{version} expired at {_when(expires)}; {RESIGN}")
        try:
            raw = base64.b64decode(m.group(2), validate=True)
        except ValueError:
            raise PatchError(403, "the bundle signature is not valid base64") from None
        from cryptography.exceptions import InvalidSignature
        message = signed_message(name, version, digest, config, expires)
        for key in self.trusted_keys:
            try:
                key.verify(raw, message)
                return digest
            except InvalidSignature:
                continue
        raise PatchError(403, f"the bundle signature does not verify for {name}@{version} with config "
                              f"{config_digest(config)} against any trusted key (a signature covers the name, "
                              "the version, the bundle and the config: sign this config with `graft patch sign "
                              "--config`)")


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
    configure: Callable[..., Any] | None = None
    if p.configure is not None:
        inner = _contained(p.configure, f"{p.id} configure()")

        def contained_configure(config: Mapping[str, Any]) -> dict[str, Callable[..., Any]]:
            return _contained_slots(inner(config), p.id)
        configure = contained_configure
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
    _add_signing_args(pack)
    pack.add_argument("--configmap", metavar="NAME", help="print a ConfigMap manifest for the operator")
    pack.add_argument("--namespace", default=None)
    s = sub.add_parser("sign", help="sign a module's patch with an Ed25519 private key; prints the signature")
    s.add_argument("module")
    s.add_argument("--key", required=True)
    _add_patch_args(s, "the patch to sign (default: the bundle's only patch)")
    _add_signing_args(s)
    v = sub.add_parser("verify", help="check a module against a digest and a signature, as an engine does")
    v.add_argument("module")
    v.add_argument("--digest", required=True)
    _add_patch_args(v, "the patch the signature must be for", required=True)
    v.add_argument("--signature")
    v.add_argument("--config", help="the config the patch is applied with: a JSON object or a file (default: none)")
    v.add_argument("--trusted-key", action="append", default=[])
    v.add_argument("--min-patch-version", action="append", default=[], metavar="NAME=VERSION")
    v.add_argument("--revoked-digests", metavar="FILE")
    v.add_argument("--allow-unsigned-bundles", action="store_true", help="check the digest only")
    k = sub.add_parser("keygen", help="make an Ed25519 key pair: PREFIX.key (private) and PREFIX.pub")
    k.add_argument("prefix")


def _add_patch_args(p: argparse.ArgumentParser, what: str, required: bool = False) -> None:
    p.add_argument("--name", required=required, help=what)
    p.add_argument("--version", required=required)


def _add_signing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="the config the patch will be applied with (the rollout's spec.patch.config): "
                                    "a JSON object or a file holding one (default: none); the signature covers it")
    p.add_argument("--expires", default="30d", help="when the signature expires: a duration (30d, 12h, 90m) or an "
                                                  "ISO 8601 date (default: 30d)")


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
    try:
        config = parse_config(args.config)
        expires = parse_expiry(args.expires) if cmd != "verify" and args.key else None
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if cmd == "verify":
        try:
            revocations = Revocations(parse_min_versions(args.min_patch_version),
                                      RevokedDigests(args.revoked_digests) if args.revoked_digests else None)
            BundleVerifier.from_files(args.trusted_key, args.allow_unsigned_bundles, revocations).verify(
                source, args.digest, args.signature, name=args.name, version=args.version, config=config)
        except (PatchError, ValueError) as exc:
            print(f"refused: {getattr(exc, 'message', exc)}", file=sys.stderr)
            return 1
        print("ok")
        return 0
    signed_for = _which_patch(source, args.name, args.version) if args.key else None
    signature = sign(*signed_for, digest, Path(args.key).read_bytes(), config=config, expires=expires) \
        if signed_for else None
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
            annotations["graft.dev/signature-expires"] = _when(expires)
            annotations["graft.dev/signed-config"] = config_digest(config)
        meta = {"name": args.configmap, **({"namespace": args.namespace} if args.namespace else {}),
                "annotations": annotations}
        print(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data},
                             sort_keys=False), end="")
        return 0
    print(json.dumps({"module": source, "digest": digest, **({"signature": signature} if signature else {})}))
    return 0
