"""`graft serve`'s options beyond the engine's own (graft.engine.config): ports, the admin API, the
public port's limits. Each is declared once, as a dataclass field with its default and its flag's
help (`opt(...)`); `add_serve_args` makes the flags from those fields and `serve_options` reads them
back, so a default lives in one place. Free of heavy imports: the CLI builds its parser eagerly.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def opt(default: Any = MISSING, *, help: str, factory: Any = MISSING, flag: str | None = "", **argparse_kwargs: Any
        ) -> Any:
    """A field with its flag: `flag` "" is --the-field-name, None no flag (set otherwise);
    `argparse_kwargs` (action, type, metavar) as argparse takes them."""
    meta = {"flag": flag, "help": help, "argparse": argparse_kwargs}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def metrics_port(value: str) -> int | None:
    """`--metrics-port`: a port from 1 to 65535, or `public` (None: /metrics on the public port)."""
    if value == "public":
        return None
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a port from 1 to 65535 nor `public`")
    return port


@dataclass(slots=True)
class PublicLimitSettings:
    """What a client of the public port may ask (graft.engine.server.PublicLimits, which enforces them)."""

    max_request_bytes: int = opt(4 << 20, type=int, metavar="BYTES",
                                 help="larger request bodies are answered 413 before they are parsed (default 4 MiB)")
    request_timeout: float = opt(600.0, type=float, metavar="SECONDS",
                                 help="the engine ends a request after this long (504; counted as `timeout`, a "
                                      "failure in canary analysis, unlike a client's hang-up) (default 600)")
    client_priority_band: int = opt(1, type=int, metavar="N",
                                    help="a request's own `priority` is clamped into [-N, N]; 0 ignores it (default 1)")
    priority_header: str | None = opt(None, metavar="NAME",
                                      help="a header set by a trusted gateway that gives the priority in full "
                                           "(off by default)")
    tenant_header: str | None = opt(None, metavar="NAME",
                                    help="a header set by a trusted gateway that names the tenant for fairness "
                                         "(default: the connection's peer address)")

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        if not 0 <= self.client_priority_band <= 1000:
            raise ValueError(f"client_priority_band must be within [0, 1000], got {self.client_priority_band}")


@dataclass(slots=True)
class ServeOptions:
    host: str = opt("0.0.0.0", help="the public port's address")
    port: int = opt(8000, type=int, help="the public port: the OpenAI API, /health, /ready")
    # /metrics on a port of its own, for Prometheus: its series are labelled by revision, which
    # the public port's clients must not read. None (`--metrics-port public`): on the public port.
    metrics_port: int | None = opt(9400, type=metrics_port, metavar="PORT|public",
                                   help="the port of /metrics alone, for Prometheus (default 9400): its series name "
                                        "each engine's revision, which tells canaries apart, so the public port "
                                        "answers 404 there. `public` serves /metrics on the public port instead, for "
                                        "one port: then let only /v1/* reach the engines from outside")
    metrics_host: str | None = opt(None, help="the metrics port's address (default: --host)")
    # only the operator calls it: not on every interface unless asked
    admin_host: str = opt("127.0.0.1", help="admin API address (default 127.0.0.1: give the pod IP, or 0.0.0.0, "
                                            "for the operator)")
    admin_port: int | None = opt(8081, type=int, help="the admin API's port (default 8081; --no-admin: none)")
    admin_insecure: bool = opt(False, action="store_true", help="run the admin API without a token")
    admin_token_file: str | None = opt(None, help="file holding the admin token, re-read when it changes "
                                                  "(default: $GRAFT_ADMIN_TOKEN_FILE)")
    admin_tls_cert: str | None = opt(None, metavar="FILE", help="serve the admin API over TLS with this PEM certificate")
    admin_tls_key: str | None = opt(None, metavar="FILE", help="the private key (PEM) of --admin-tls-cert")
    enable_test_patches: bool = opt(False, action="store_true", help="register fault@1, slow@1 and skew@1")
    trusted_keys: list[str] = opt(factory=list, flag="--trusted-key", action="append",
                                  help="Ed25519 public key (PEM file) bundles must be signed with; without one no "
                                       "bundle runs")
    allow_unsigned_bundles: bool = opt(False, action="store_true",
                                       help="development only: run bundles checked by their pinned digest alone")
    bundle_timeout: float = opt(10.0, type=float, help="seconds a bundle may take to load (and to configure or "
                                                       "migrate) before it is refused")
    min_patch_versions: list[str] = opt(factory=list, flag="--min-patch-version", action="append",
                                        metavar="NAME=VERSION",
                                        help="refuse versions of patch NAME older than VERSION (repeatable): revokes "
                                             "old signed versions")
    revoked_digests: str | None = opt(None, metavar="FILE", help="file of revoked bundle digests (sha256:..., one "
                                                                 "per line), re-read when it changes")
    admin_token_overlap: float = opt(300.0, type=float, metavar="SECONDS",
                                     help="seconds the previous admin token stays accepted after the token file "
                                          "changes (default 300)")
    patches: str = opt("", flag=None, help="`name@version,...` applied at start-up (GRAFT_PATCHES)")
    grace: float = opt(30.0, type=float, help="seconds to finish in-flight requests on SIGTERM")
    served_model_name: str | None = opt(None, help="the model name the API answers to (default: the model's)")
    probe_prompts: str | None = opt(None, metavar="FILE",
                                    help="JSON lines of {\"prompt\": ...}: long contexts of your own traffic that the "
                                         "patch self-check also runs, up to 2,048 tokens each (default: "
                                         "$GRAFT_PROBE_PROMPTS_FILE)")
    public: PublicLimitSettings = opt(factory=PublicLimitSettings, flag=None,
                                      help="what clients of the public port may ask")


def _flagged(cls: type) -> list[tuple[Any, str]]:
    """The fields of `cls` that have a flag, with the flag."""
    return [(f, f.metadata["flag"] or "--" + f.name.replace("_", "-"))
            for f in fields(cls) if f.metadata.get("flag") is not None]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`graft serve`'s flags beyond the engine's, each with its field's default."""
    for cls in (ServeOptions, PublicLimitSettings):
        for f, flag in _flagged(cls):
            kwargs = dict(f.metadata["argparse"])
            if kwargs.get("action") != "append":
                kwargs["default"] = f.default
            parser.add_argument(flag, dest=f.name, help=f.metadata["help"], **kwargs)
    parser.add_argument("--no-admin", action="store_true", help="no admin API (no hot patches)")


def serve_options(args: argparse.Namespace, env: dict[str, str] | None = None) -> ServeOptions:
    """The ServeOptions the flags of `add_serve_args` say (GRAFT_PATCHES from the environment)."""
    env = os.environ if env is None else env

    def values(cls: type) -> dict[str, Any]:
        return {f.name: getattr(args, f.name) or [] if f.metadata["argparse"].get("action") == "append"
                else getattr(args, f.name) for f, _ in _flagged(cls)}

    opts = ServeOptions(**values(ServeOptions), patches=env.get("GRAFT_PATCHES", ""),
                        public=PublicLimitSettings(**values(PublicLimitSettings)))
    if args.no_admin:
        opts.admin_port = None
    return opts
