"""Running the operator: `graft operator` on a cluster, `run()` in a test's event loop."""
from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Mapping, Sequence

import kopf

from graft.operator.handlers import build_registry
from graft.operator.runtime import Runtime
from graft.operator.settings import OperatorSettings, add_setting_args, variable_only


async def run(settings: OperatorSettings, *, stop_flag: asyncio.Event | None = None,
              ready_flag: asyncio.Event | None = None, priority: int = 0,
              liveness: str | None = None) -> None:
    """Run the operator until `stop_flag` is set (or forever)."""
    runtime = Runtime(settings)
    if settings.metrics_port:
        runtime.metrics.serve(settings.metrics_port)
    registry = build_registry(runtime)
    await kopf.operator(
        registry=registry,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        standalone=settings.peering is None,
        peering_name=settings.peering,
        priority=priority,
        liveness_endpoint=liveness,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


def main_operator(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """`graft operator [--namespace NS]... [--tick S] [--kube-server URL | --kubeconfig PATH] [--peering NAME] ...`.

    A flag for every setting of graft.operator.settings, each falling back to its environment
    variable; a value either way that the operator cannot run with is refused at once (exit 2).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.namespaces and args.all_namespaces:
        parser.error("--namespace and --all-namespaces exclude each other")
    if args.all_namespaces:
        args.namespaces = [""]          # GRAFT_NAMESPACES empty: every namespace
    try:
        settings = OperatorSettings.from_args(args, env)
    except ValueError as e:
        parser.error(str(e))     # a setting the operator cannot run with: said at once, exit 2
    kopf.configure(verbose=args.verbose)
    logging.getLogger("httpx").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    asyncio.run(run(settings, priority=args.priority, liveness=args.liveness))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`graft operator`'s flags: the settings' (graft.operator.settings), then how this replica runs."""
    parser = argparse.ArgumentParser(prog="graft operator", description="Run the PatchRollout operator.",
                                     epilog="Every setting may also be given by its environment variable; "
                                            "these only so (secrets, or what holds them): "
                                            + ", ".join(variable_only()) + ".")
    add_setting_args(parser.add_argument_group("settings"))
    parser.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    parser.add_argument("--priority", type=int, default=0,
                        help="peering priority: of several replicas, the highest live one works")
    parser.add_argument("--liveness", default=None, help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--verbose", "-v", action="store_true")
    return parser
