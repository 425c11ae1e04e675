"""The one `graft` command. Each subcommand imports only what it needs, so the operator image
(no torch) can run `graft operator` and `graft rollout`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def cmd_serve(args: argparse.Namespace) -> int:
    from graft.engine.serve import ServeOptions, serve
    from graft.engine.server import PublicLimits
    opts = ServeOptions(host=args.host, port=args.port, metrics_port=args.metrics_port,
                        metrics_host=args.metrics_host, admin_host=args.admin_host,
                        admin_port=None if args.no_admin else args.admin_port,
                        admin_insecure=args.admin_insecure, admin_token_file=args.admin_token_file,
                        admin_tls_cert=args.admin_tls_cert, admin_tls_key=args.admin_tls_key,
                        enable_test_patches=args.enable_test_patches, trusted_keys=args.trusted_key or [],
                        allow_unsigned_bundles=args.allow_unsigned_bundles, bundle_timeout=args.bundle_timeout,
                        min_patch_versions=args.min_patch_version or [], revoked_digests=args.revoked_digests,
                        admin_token_overlap=args.admin_token_overlap,
                        patches=os.environ.get("GRAFT_PATCHES", ""), grace=args.grace,
                        served_model_name=args.served_model_name, probe_prompts=args.probe_prompts,
                        public=PublicLimits(max_request_bytes=args.max_request_bytes,
                                            request_timeout=args.request_timeout,
                                            client_priority_band=args.client_priority_band,
                                            priority_header=args.priority_header, tenant_header=args.tenant_header))
    from graft.engine.config import config_from_args
    asyncio.run(serve(config_from_args(args), opts))
    return 0


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


def cmd_bench(args: argparse.Namespace) -> int:
    from graft.bench.cli import main as bench_main
    return bench_main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from graft.demo import main as demo_main
    return demo_main(args)


def cmd_patch(args: argparse.Namespace) -> int:
    from graft.engine.patches.bundle import cli_main
    return cli_main(args)


def cmd_operator(args: argparse.Namespace) -> int:
    from graft.operator.main import main_operator
    return main_operator(args.rest)


def cmd_rollout(args: argparse.Namespace) -> int:
    from graft.operator.cli import main_rollout
    return main_rollout(args.rest, admission=crd_admission)


def crd_admission(folder):
    """`graft rollout lint`'s reviewer of manifests as the API server admits them (the dev cluster's:
    strict fields, the CRDs' schemas and CEL rules), or None without the `devcluster` extra (the
    operator image). Passed in from here: the operator's own modules never import the dev cluster."""
    try:
        from graft.devcluster.crd import Admission
    except ImportError:
        return None
    return Admission.load(folder)


def cmd_dev_cluster(args: argparse.Namespace) -> int:
    from graft.devcluster.cluster import main as cluster_main
    return cluster_main(args)


def build_parser() -> argparse.ArgumentParser:
    # the module docstring's first paragraph, whole (its first line alone stops mid-sentence)
    parser = argparse.ArgumentParser(prog="graft", description=" ".join(__doc__.split("\n\n")[0].split())
                                     if __doc__ else None)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the inference engine (OpenAI API + admin API)")
    from graft.engine.config import add_engine_args
    add_engine_args(s)
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=8000, help="the public port: the OpenAI API, /health, /ready")
    s.add_argument("--metrics-port", type=metrics_port, default=9400, metavar="PORT|public",
                   help="the port of /metrics alone, for Prometheus (default 9400): its series name each "
                        "engine's revision, which tells canaries apart, so the public port answers 404 there. "
                        "`public` serves /metrics on the public port instead, for one port: then let only /v1/* "
                        "reach the engines from outside")
    s.add_argument("--metrics-host", default=None, help="the metrics port's address (default: --host)")
    s.add_argument("--admin-host", default="127.0.0.1",
                   help="admin API address (default 127.0.0.1: give the pod IP, or 0.0.0.0, for the operator)")
    s.add_argument("--admin-port", type=int, default=8081)
    s.add_argument("--no-admin", action="store_true", help="no admin API (no hot patches)")
    s.add_argument("--admin-insecure", action="store_true", help="run the admin API without a token")
    s.add_argument("--admin-token-file", default=None,
                   help="file holding the admin token, re-read when it changes (default: $GRAFT_ADMIN_TOKEN_FILE)")
    s.add_argument("--admin-tls-cert", metavar="FILE", help="serve the admin API over TLS with this PEM certificate")
    s.add_argument("--admin-tls-key", metavar="FILE", help="the private key (PEM) of --admin-tls-cert")
    s.add_argument("--enable-test-patches", action="store_true", help="register fault@1, slow@1 and skew@1")
    s.add_argument("--trusted-key", action="append",
                   help="Ed25519 public key (PEM file) bundles must be signed with; without one no bundle runs")
    s.add_argument("--allow-unsigned-bundles", action="store_true",
                   help="development only: run bundles checked by their pinned digest alone")
    s.add_argument("--bundle-timeout", type=float, default=10.0,
                   help="seconds a bundle may take to load (and to configure or migrate) before it is refused")
    s.add_argument("--min-patch-version", action="append", metavar="NAME=VERSION",
                   help="refuse versions of patch NAME older than VERSION (repeatable): revokes old signed versions")
    s.add_argument("--revoked-digests", metavar="FILE", default=None,
                   help="file of revoked bundle digests (sha256:..., one per line), re-read when it changes")
    s.add_argument("--admin-token-overlap", type=float, default=300.0, metavar="SECONDS",
                   help="seconds the previous admin token stays accepted after the token file changes (default 300)")
    s.add_argument("--grace", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-request-bytes", type=int, default=4 << 20, metavar="BYTES",
                   help="larger request bodies are answered 413 before they are parsed (default 4 MiB)")
    s.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="the engine ends a request after this long (504; counted as `timeout`, a failure "
                        "in canary analysis, unlike a client's hang-up) (default 600)")
    s.add_argument("--client-priority-band", type=int, default=1, metavar="N",
                   help="a request's own `priority` is clamped into [-N, N]; 0 ignores it (default 1)")
    s.add_argument("--priority-header", default=None, metavar="NAME",
                   help="a header set by a trusted gateway that gives the priority in full (off by default)")
    s.add_argument("--tenant-header", default=None, metavar="NAME",
                   help="a header set by a trusted gateway that names the tenant for fairness "
                        "(default: the connection's peer address)")
    s.add_argument("--probe-prompts", metavar="FILE", default=None,
                   help="JSON lines of {\"prompt\": ...}: long contexts of your own traffic that the patch "
                        "self-check also runs, up to 2,048 tokens each (default: $GRAFT_PROBE_PROMPTS_FILE)")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks: BBH throughput, patch apply latency, ...")
    from graft.bench.args import add_bench_args
    add_bench_args(b)
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("demo", help="the whole story on this machine: fleet, Prometheus, operator, rollouts")
    d.add_argument("--data-dir", default=None)
    d.add_argument("--out", default=".graft-demo",
                   help="folder for the report, plots and logs (docs/demo: refresh the committed example)")
    d.add_argument("--pause", default="8s", help="pause per step (the CRD default is 5m/10m)")
    d.add_argument("--interval", default="2s", help="analysis interval")
    d.add_argument("--pods", type=int, default=3)
    d.add_argument("--rate", type=float, default=1.0, help="client requests per second")
    d.add_argument("--warmup", type=float, default=15.0, help="seconds of traffic before the first rollout")
    d.add_argument("--timeout", type=float, default=240.0, help="seconds a rollout may take")
    d.add_argument("--scale-timeout", type=float, default=240.0,
                   help="seconds the pod added after the promotion may take to be Ready at the promoted revision")
    d.add_argument("--workdir", default=None, help="the dev cluster's kubeconfig and logs (default: OUT/cluster)")
    d.set_defaults(func=cmd_demo)

    p = sub.add_parser("patch", help="patch bundles: pack, sign, verify, keygen")
    from graft.engine.patches.bundle import add_cli_args
    add_cli_args(p)
    p.set_defaults(func=cmd_patch)

    o = sub.add_parser("operator", help="run the PatchRollout operator (kopf); `graft operator --help` for flags",
                       add_help=False)
    o.add_argument("rest", nargs=argparse.REMAINDER)
    o.set_defaults(func=cmd_operator)

    r = sub.add_parser("rollout", help="watch and steer PatchRollouts (list, status, pause, resume, promote, "
                                       "abort, retry, undo, history, lint, simulate); `graft rollout --help` for "
                                       "each", add_help=False)
    r.add_argument("rest", nargs=argparse.REMAINDER)
    r.set_defaults(func=cmd_rollout)

    c = sub.add_parser("dev-cluster", help="a local stand-in cluster: API server, engine pods, Prometheus")
    c.add_argument("--dir", default=".graft-dev")
    c.add_argument("--pods", type=int, default=3)
    c.add_argument("--traffic", type=float, default=0.0, metavar="RPS",
                   help="send BBH prompts through the cluster's router at this rate (default: none)")
    c.set_defaults(func=cmd_dev_cluster)
    return parser


PASSTHROUGH = {"operator": "cmd_operator", "rollout": "cmd_rollout"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PASSTHROUGH:  # these parse their own flags
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return int(globals()[PASSTHROUGH[argv[0]]](argparse.Namespace(rest=argv[1:])) or 0)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


def kubectl_plugin() -> int:
    """`kubectl graft ...` is `graft rollout ...`."""
    from graft.operator.cli import main_rollout
    return int(main_rollout(sys.argv[1:], admission=crd_admission) or 0)


if __name__ == "__main__":
    sys.exit(main())
