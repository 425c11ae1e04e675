"""Running the operator: `graft operator` on a cluster, `run()` in a test's event loop."""
from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

import kopf

from graft.operator.handlers import build_registry
from graft.operator.runtime import Runtime
from graft.operator.settings import OperatorSettings


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


def main_operator(argv: Sequence[str] | None = None) -> int:
    """`graft operator [--namespace NS]... [--tick S] [--kube-server URL | --kubeconfig PATH] [--peering NAME]`.

    Every flag falls back to its environment variable (see graft.operator.settings).
    """
    parser = argparse.ArgumentParser(prog="graft operator", description="Run the PatchRollout operator.")
    parser.add_argument("--namespace", "-n", action="append", default=None,
                        help="watch only this namespace (repeatable); default: every namespace")
    parser.add_argument("--tick", type=float, help="seconds between reconciliations of a rollout")
    parser.add_argument("--kube-server", help="API server URL without credentials (local dev cluster)")
    parser.add_argument("--kubeconfig", help="kubeconfig file to log in with")
    parser.add_argument("--context", help="kubeconfig context")
    parser.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    parser.add_argument("--peering", help="kopf peering name (several replicas); default: standalone")
    parser.add_argument("--priority", type=int, default=0,
                        help="peering priority: of several replicas, the highest live one works")
    parser.add_argument("--liveness", default=None, help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(argv)
    try:
        settings = OperatorSettings.from_env()
    except ValueError as e:
        parser.error(str(e))     # a setting the operator cannot run with: said at once, exit 2
    if args.namespace and args.all_namespaces:
        parser.error("--namespace and --all-namespaces exclude each other")
    if args.namespace:
        settings.namespaces = args.namespace
    elif args.all_namespaces:
        settings.namespaces = []
    for flag, attr in (("tick", "tick"), ("kube_server", "kube_server"), ("kubeconfig", "kubeconfig"),
                       ("context", "kube_context"), ("peering", "peering")):
        if getattr(args, flag) is not None:
            setattr(settings, attr, getattr(args, flag))
    kopf.configure(verbose=args.verbose)
    logging.getLogger("httpx").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    asyncio.run(run(settings, priority=args.priority, liveness=args.liveness))
    return 0
