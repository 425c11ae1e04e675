"""`graft rollout list [-n NS | -A] | status [-w] | pause | resume | promote [--full] | abort | retry | undo |
history NAME | lint -f FILE | simulate -f FILE`, also `kubectl graft ...`.

Each steering verb changes one field of the PatchRollout and the operator does the rest (the verbs
themselves live in graft.operator.verbs, which the dashboard calls too): `pause` sets
`spec.paused`, `resume` clears it and sets the annotation `graft.dev/resume: "true"` (which ends a
pause the analysis decided, kept in status.pauseConditions), `promote` sets the annotation `graft.dev/promote` (`step` or `full`), `abort`
sets `graft.dev/abort: "true"`. `status` shows the step, the weight, the pods and every metric
against its threshold (graft.operator.render, which `graft demo` shows too), with a warning when
pod-ratio routing cannot honour the first steps (CoarseSteps); `-w` keeps it on screen, updated,
until the rollout finishes, and exits 0 when it promoted, 3 when it rolled back or failed, and 4 when
the rollout was deleted before it finished. It follows the rollout with a watch, so it sees the final
phase even of a rollout deleted right after it (`ttlSecondsAfterFinished: 0`).

`list` shows every PatchRollout and PatchFleet of a namespace (`-A`: of all), as a table on a
terminal and as kubectl's plain columns otherwise (`-o json`: the rows as JSON). `undo` creates the
rollout that takes a Promoted rollout's patch out again, step by step with the same selector, steps
and analysis (`action: revert`; the undo of a revert applies the patch again); `history` shows the
analysis runs kept in `status.analysisHistory` (`spec.analysis.measurementRetention` of them).
`lint` (graft.operator.lint_cli) and `simulate` (graft.operator.simulate_cli) read files and need
no cluster.

Exit codes, the same for every verb (EXIT_CODES): 0 done; 1 refused or failed (the rollout is not
found or not in a phase the verb applies to, the API server refused, lint found errors); 2 usage
(argparse: an unknown verb or flag, a missing argument; a flag's value out of range). `status -w`
alone adds 3 and 4 above, so that a script tells "the rollout did not promote" from "the command was
wrong".
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
from rich.console import Console

from graft.api import FINAL_PHASES, Reason
from graft.operator import verbs
from graft.operator.verbs import ActionError, Done, list_of as _list_of, ref as _ref
from graft.operator.verbs import get as _get, read as _read, refusal as _refusal
from graft.operator.kube import Kube, KubeError, SyncKube, events_path, fleets_path, pods_path, rollouts_path
from graft.operator.kubeconfig import KubeconfigError, load_credentials
from graft.operator.podview import condition
from graft.operator.render import (HISTORY_COLUMNS, PHASE_STYLE, age, history_rows, print_table, render_status,
                                   steps_of)

FAILED = 1             # refused or failed: not found, a phase the verb does not apply to, the API server's no
USAGE = 2              # argparse's own exit code for a command line it cannot parse (and simulate's bad flags)
NOT_PROMOTED = 3       # `status -w`: the rollout finished RolledBack or Failed
DELETED = 4            # `status -w`: the rollout was deleted before it finished
EXIT_CODES = ("exit codes: 0 done; 1 refused or failed (not found, a phase the verb does not apply to, "
              "the API server's refusal, lint errors); 2 usage (an unknown verb or flag, a missing or bad "
              "argument); `status -w` also 3 when the rollout finished RolledBack or Failed and 4 when it "
              "was deleted before it finished")


class CliError(ActionError):
    """The command cannot go on; the message says why (a verb's own refusals are ActionErrors)."""


def main_rollout(argv: Sequence[str] | None = None, console: Console | None = None, admission=None) -> int:
    """Entry point of `graft rollout ...` and of the kubectl plug-in `kubectl-graft`.

    `admission` (`lint` only): a callable that takes the folder of the CRDs and answers a reviewer of
    manifests as the API server admits them, or None where none can be made (graft.cli passes the
    dev cluster's, which the operator's own modules may not import)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:        # needs no cluster
        from graft.operator.simulate_cli import main as simulate_main
        return simulate_main(argv[1:], console)
    if argv[:1] == ["lint"]:            # nor does this
        from graft.operator.lint_cli import main as lint_main
        return lint_main(argv[1:], console, admission)
    args = _parser().parse_args(argv)
    console = console or Console()
    try:
        api, namespace = _client(args.kubeconfig, args.context, args.namespace)
        with api:
            return args.run(api, namespace, args, console)
    except ActionError as e:
        console.print(f"[red]error:[/red] {e}")
        return FAILED
    except httpx.TransportError as e:        # the API server did not answer at all
        console.print(f"[red]error:[/red] cannot reach the API server: {type(e).__name__}: {e}")
        return FAILED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graft rollout", description="Watch and steer PatchRollouts.",
                                     epilog=EXIT_CODES)
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--kubeconfig",
                            help="default: $KUBECONFIG or ~/.kube/config (in a pod: its service account)")
    connection.add_argument("--context", help="kubeconfig context")
    common = argparse.ArgumentParser(add_help=False, parents=[connection])
    common.add_argument("name", help="the PatchRollout")
    common.add_argument("-n", "--namespace", help="default: the kubeconfig context's namespace")
    verbs = parser.add_subparsers(dest="verb", required=True)

    def verb(name: str, help: str, **kwargs) -> argparse.ArgumentParser:
        return verbs.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", epilog=EXIT_CODES,
                                **kwargs)

    listing = verb("list", "list the PatchRollouts and PatchFleets of a namespace (-A: of all)",
                   parents=[connection])
    where = listing.add_mutually_exclusive_group()
    where.add_argument("-n", "--namespace", help="default: the kubeconfig context's namespace")
    where.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    listing.add_argument("-o", "--output", choices=("table", "json"), default="table",
                         help="table (plain columns when not a terminal) or json")
    listing.set_defaults(run=_list)
    status = verb("status", "show where the rollout stands", parents=[common])
    status.add_argument("-w", "--watch", action="store_true", help="keep showing it until it finishes")
    status.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    status.set_defaults(run=_status)
    verb("pause", "hold at the current step", parents=[common]).set_defaults(run=_pause)
    verb("resume", "carry on from a pause", parents=[common]).set_defaults(run=_resume)
    promote = verb("promote", "skip the rest of the current step", parents=[common])
    promote.add_argument("--full", action="store_true", help="skip every remaining step and analysis")
    promote.set_defaults(run=_promote)
    verb("abort", "roll back now", parents=[common]).set_defaults(run=_abort)
    verb("retry", "start a RolledBack or Failed rollout again", parents=[common]).set_defaults(run=_retry)
    undo = verb("undo", "create the rollout that undoes a Promoted one, step by step: the revert of its patch "
                        "(of a revert rollout: the patch applied again)", parents=[common])
    undo.add_argument("-o", "--output", choices=("text", "name"), default="text",
                      help="name: print the new rollout's name alone")
    undo.set_defaults(run=_undo)
    history = verb("history", "show the rollout's past analysis runs (status.analysisHistory)", parents=[common])
    history.add_argument("-o", "--output", choices=("table", "json"), default="table",
                         help="table (plain columns when not a terminal) or json")
    history.set_defaults(run=_history)
    verbs.add_parser("lint", help="check PatchRollout, PatchFleet and analysis template manifests offline, as "
                                  "the operator and the API server read them (graft rollout lint -h)", add_help=False)
    verbs.add_parser("simulate", help="run the rollout's decisions against a simulated fleet "
                                      "(graft rollout simulate -h)", add_help=False)
    return parser


def _client(kubeconfig: str | None, context: str | None, namespace: str | None) -> tuple[SyncKube, str]:
    """Graft's Kubernetes client, logged in as kubectl would be (graft.operator.kubeconfig), and the
    namespace: `-n`, else the context's (in a pod: its own)."""
    try:
        creds = load_credentials(kubeconfig, context)
    except KubeconfigError as e:
        raise CliError(f"cannot load Kubernetes credentials: {e}") from None
    return SyncKube(lambda: Kube.from_credentials(creds)), namespace or creds.namespace


def _say(console: Console, done: Done) -> int:
    for note in done.notes:
        console.print(f"[yellow]note:[/yellow] {note}", highlight=False)
    console.print(done.message, highlight=False)
    return 0


def _pause(api, namespace, args, console) -> int:
    return _say(console, verbs.pause(api, namespace, args.name))


def _resume(api, namespace, args, console) -> int:
    return _say(console, verbs.resume(api, namespace, args.name))


def _promote(api, namespace, args, console) -> int:
    return _say(console, verbs.promote(api, namespace, args.name, full=args.full))


def _abort(api, namespace, args, console) -> int:
    return _say(console, verbs.abort(api, namespace, args.name))


def _retry(api, namespace, args, console) -> int:
    """Start a RolledBack or Failed rollout again from its first step: its controls and status cleared."""
    return _say(console, verbs.retry(api, namespace, args.name))


def _status(api, namespace, args, console) -> int:
    obj = _get(api, namespace, args.name)
    if not args.watch:
        console.print(render_status(obj, **_context(api, namespace, obj)))
        return 0
    from rich.live import Live

    deleted = False
    with Live(render_status(obj, **_context(api, namespace, obj)), console=console, auto_refresh=False) as live:
        while _phase(obj) not in FINAL_PHASES and not deleted:
            obj, deleted = _follow(api, namespace, obj, args.interval)
            live.update(render_status(obj, **_context(api, namespace, obj)), refresh=True)
    where, phase = f"PatchRollout {namespace}/{args.name}", _phase(obj)
    if deleted and phase not in FINAL_PHASES:
        console.print(f"[red]{where} was deleted before it finished (last seen {phase or 'Pending'})[/red]")
        return DELETED
    if deleted:
        ttl = (obj.get("spec") or {}).get("ttlSecondsAfterFinished")
        console.print(f"{where} was deleted after it finished {phase}"
                      + (f" (ttlSecondsAfterFinished: {ttl})" if ttl is not None else ""))
    return 0 if phase == "Promoted" else NOT_PROMOTED


def _phase(obj: dict[str, Any]) -> str | None:
    return (obj.get("status") or {}).get("phase")


def _follow(api, namespace: str, obj: dict[str, Any], seconds: float) -> tuple[dict[str, Any], bool]:
    """Watch the rollout from `obj` on, for about `seconds` (whole seconds, at least one: the API's
    unit); answer it as last seen, and whether it was deleted. Every change comes in order, so a
    final phase is seen even when the rollout is deleted right after it (the DELETED event carries
    the object as it last was)."""
    name = obj["metadata"]["name"]

    async def follow(last: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        events = api.kube.watch(rollouts_path(namespace), field_selector=f"metadata.name={name}",
                                resource_version=last["metadata"]["resourceVersion"],
                                timeout_seconds=max(1, round(seconds)))
        async with contextlib.aclosing(events):
            async for event in events:
                if event.type in ("ADDED", "MODIFIED", "DELETED"):
                    last = event.object
                if event.type == "DELETED":
                    return last, True
        return last, False

    try:
        return api.run(follow(obj))
    except KubeError as e:
        if e.status != 410:
            raise CliError(f"cannot watch PatchRollout {namespace}/{name}: {_refusal(e)}") from None
        fresh = _read(api, namespace, name)        # the watch fell too far behind: read it anew
        return (obj, True) if fresh is None else (fresh, False)


def _context(api, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
    """The Events posted on the rollout and the pods its selector matches, as `render_status` takes
    them. Events or pods this user may not read are left out."""
    from graft.rollout.spec import SpecError, parse_selector

    name = obj["metadata"]["name"]
    try:
        events = api.list(events_path(namespace), field_selector=f"involvedObject.name={name}")
    except KubeError:
        events = []
    try:
        selector = parse_selector((obj.get("spec") or {}).get("selector")).to_query()
        pods = api.list(pods_path(namespace), label_selector=selector)
    except (KubeError, SpecError):
        pods = None
    return {"events": events, "pods": pods}


# -- list -------------------------------------------------------------------------------------------

LIST_COLUMNS = ("Name", "Kind", "Phase", "Step", "Weight", "Canary", "Stable", "Age")


def _list(api, namespace, args, console) -> int:
    """Every PatchRollout and PatchFleet of the namespace (or of all), rollouts first, each kind by name."""
    where = None if args.all_namespaces else namespace
    now = time.time()
    rollouts = _list_of(api, where, rollouts_path, "PatchRollouts")
    try:
        fleets = _list_of(api, where, fleets_path, "PatchFleets")
        left_out = ""
    except ActionError as e:
        fleets, left_out = [], str(e)
    rows = sorted([_rollout_row(o, now) for o in rollouts] + [_fleet_row(o, now) for o in fleets],
                  key=lambda r: (r["namespace"], r["kind"] != "PatchRollout", r["name"]))
    if args.output == "json":
        console.out(json.dumps(rows, indent=2), highlight=False)
    elif not rows:
        console.print(f"No PatchRollouts or PatchFleets {'in any namespace' if where is None else f'in {where}'}",
                      highlight=False)
    else:
        columns = (("Namespace",) if where is None else ()) + LIST_COLUMNS
        cells = [([r["namespace"]] if where is None else []) + [
            r["name"], r["kind"], r["phase"], r["step"], r["weight"], r["canary"] or "-", r["stable"] or "-",
            r["age"]] for r in rows]
        phase_at = columns.index("Phase")
        print_table(console, columns, cells, [{phase_at: PHASE_STYLE.get(r["phase"], "")} for r in rows])
    if left_out:
        console.print(f"[yellow]note:[/yellow] PatchFleets left out: {left_out}", highlight=False)
    return 0


def _age(obj: dict[str, Any], now: float) -> str:
    from graft.rollout.status import from_time

    try:
        created = from_time(obj["metadata"].get("creationTimestamp"))
    except ValueError:
        created = None
    return "-" if created is None else age(now - created)


def _rollout_row(obj: dict[str, Any], now: float) -> dict[str, Any]:
    meta, status = obj["metadata"], obj.get("status") or {}
    steps = len(steps_of(obj))
    index = status.get("stepIndex")
    return {"namespace": meta.get("namespace", ""), "name": meta["name"], "kind": "PatchRollout",
            "phase": status.get("phase") or "Pending",
            "step": f"{min(int(index) + 1, steps) if isinstance(index, int) else 0}/{steps}",
            "weight": f"{status.get('weight', 0)}%", "canary": status.get("canaryRevision") or "",
            "stable": status.get("stableRevision") or "", "age": _age(obj, now),
            "created": meta.get("creationTimestamp"), "action": (obj.get("spec") or {}).get("action", "apply"),
            "patch": status.get("patch") or _ref((obj.get("spec") or {}).get("patch") or {})}


def _fleet_row(obj: dict[str, Any], now: float) -> dict[str, Any]:
    """A fleet has no steps and no weight: its phase is its Converged condition (Converged, or the
    reason it is not: Converging, FleetOverlap), its revision what every pod runs (its stable side)."""
    meta, status = obj["metadata"], obj.get("status") or {}
    converged = condition(obj, "Converged")
    phase = ("Pending" if converged is None else "Converged" if converged.true
             else converged.reason or Reason.CONVERGING)
    return {"namespace": meta.get("namespace", ""), "name": meta["name"], "kind": "PatchFleet", "phase": phase,
            "step": "-", "weight": "-", "canary": "", "stable": status.get("revision") or "", "age": _age(obj, now),
            "created": meta.get("creationTimestamp"), "pods": status.get("pods"),
            "converged": status.get("converged"), "activeRollout": status.get("activeRollout")}


# -- undo -------------------------------------------------------------------------------------------

def _undo(api, namespace, args, console) -> int:
    """Create the rollout that undoes a Promoted one (graft.operator.verbs.undo); `-o name` prints
    the new rollout's name alone."""
    done = verbs.undo(api, namespace, args.name)
    if args.output == "name":
        for note in done.notes:
            console.print(f"[yellow]note:[/yellow] {note}", highlight=False)
        console.out(done.name, highlight=False)
        return 0
    return _say(console, done)


# -- history ----------------------------------------------------------------------------------------

def _history(api, namespace, args, console) -> int:
    """The analysis runs kept in status.analysisHistory, oldest first: a row per check."""
    obj = _get(api, namespace, args.name)
    runs = (obj.get("status") or {}).get("analysisHistory") or []
    if args.output == "json":
        console.out(json.dumps(runs, indent=2), highlight=False)
        return 0
    retention = ((obj.get("spec") or {}).get("analysis") or {}).get("measurementRetention", 10)
    where = f"PatchRollout {namespace}/{args.name}"
    if not runs:
        console.print(f"{where}: no analysis run kept (measurementRetention {retention})", highlight=False)
        return 0
    console.print(f"{where}: the last {len(runs)} analysis run{'s' if len(runs) != 1 else ''}, oldest first "
                  f"(measurementRetention {retention})", highlight=False)
    rows, styles, starts = history_rows(obj)
    print_table(console, HISTORY_COLUMNS, rows, styles, starts)
    return 0

if __name__ == "__main__":
    sys.exit(main_rollout())
