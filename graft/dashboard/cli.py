"""`graft dashboard [--kubeconfig FILE] [--context NAME] [-n NAMESPACE] [--address ADDR] [--port PORT]`:
serve the dashboard (graft.dashboard.server) until interrupted; the first line printed is its
address. The parser's arguments are kept here, apart from the server, so that `graft --help` needs
no web framework."""
from __future__ import annotations

import argparse
import asyncio
import socket
import sys

DEFAULT_PORT = 8470


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config (in a pod: its service account)")
    parser.add_argument("--context", help="kubeconfig context")
    parser.add_argument("-n", "--namespace", help="default: the kubeconfig context's namespace")
    parser.add_argument("--address", default="127.0.0.1",
                        help="the address to serve on (default 127.0.0.1: the actions act as you, so think "
                             "twice before serving them to others)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0 picks a free one")


def main(args: argparse.Namespace) -> int:
    """`graft dashboard`: serve until interrupted. Prints the address on its first line."""
    import logging

    import uvicorn

    from graft.dashboard.cluster import Cluster, ClusterError, credentials
    from graft.dashboard.server import create_app

    logging.getLogger("httpx").setLevel(logging.WARNING)     # not a line per watch
    if not 0 <= args.port < 65536:
        print(f"error: --port {args.port}: not a port (0 to 65535)", file=sys.stderr)
        return 2
    try:
        cluster = Cluster(credentials(args.kubeconfig, args.context), args.namespace)
    except ClusterError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    family = socket.AF_INET6 if ":" in args.address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.address, args.port))
    except OSError as e:
        print(f"error: cannot listen on {args.address}:{args.port}: {e.strerror}", file=sys.stderr)
        return 1
    sock.listen(128)            # before the address is printed: a client that reads it may connect at once
    port = sock.getsockname()[1]
    host = f"[{args.address}]" if family == socket.AF_INET6 else args.address
    hosts = {"127.0.0.1", "localhost", "::1", "[::1]", args.address, host}
    if args.address in ("0.0.0.0", "::"):
        hosts = {"*"}       # any name the machine answers to; the token still guards the actions
    app = create_app(cluster, hosts=sorted(hosts))
    shown = "127.0.0.1" if args.address == "0.0.0.0" else host
    print(f"Graft dashboard for namespace {cluster.namespace}: http://{shown}:{port}/", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1))
    try:
        asyncio.run(server.serve(sockets=[sock]))
    except KeyboardInterrupt:
        pass
    return 0
