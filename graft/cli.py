"""The one `graft` command. Each subcommand imports only what it needs, so the operator image
(no torch) can run `graft operator` and `graft rollout`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def cmd_serve(args: argparse.Namespace) -> int:
    from graft.engine.config import config_from_args
    from graft.engine.options import serve_options
    from graft.engine.serve import serve
    asyncio.run(serve(config_from_args(args), serve_options(args)))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from graft.bench.cli import main as bench_main
    return bench_main(args)


def cmd_eval(args: argparse.Namespace) -> int:
    from graft.evals.cli import main as eval_main
    return eval_main(args)


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


def cmd_dashboard(args: argparse.Namespace) -> int:
    from graft.dashboard.cli import main as dashboard_main
    return dashboard_main(args)


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
    from graft.engine.options import add_serve_args
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks: BBH throughput, patch apply latency, ...")
    from graft.bench.args import add_bench_args
    add_bench_args(b)
    b.set_defaults(func=cmd_bench)

    e = sub.add_parser("eval", help="quality evaluations of an OpenAI-compatible endpoint (bbh), against a baseline's")
    from graft.evals.cli import add_eval_args
    add_eval_args(e)
    e.set_defaults(func=cmd_eval)

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

    w = sub.add_parser("dashboard", help="the rollouts and fleets of a namespace, live in the browser, with the "
                                         "rollout verbs (promote, pause, resume, abort, retry, undo)",
                       description="Serve a live dashboard of a namespace's PatchRollouts and PatchFleets on "
                                   "127.0.0.1 (by default), with your kubeconfig's credentials and rights.")
    from graft.dashboard.cli import add_arguments as add_dashboard_args
    add_dashboard_args(w)
    w.set_defaults(func=cmd_dashboard)

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
    """`kubectl graft ...` is `graft rollout ...`; `kubectl graft dashboard` is `graft dashboard`."""
    if sys.argv[1:2] == ["dashboard"]:
        return main(sys.argv[1:])
    from graft.operator.cli import main_rollout
    return int(main_rollout(sys.argv[1:], admission=crd_admission) or 0)


if __name__ == "__main__":
    sys.exit(main())
