"""`graft rollout list [-n NS | -A] | status [-w] | pause | resume | promote [--full] | abort | retry | undo |
history NAME | lint -f FILE | simulate -f FILE`, also `kubectl graft ...`.

Each steering verb changes one field of the PatchRollout and the operator does the rest: `pause` sets
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

from graft.api import API_VERSION, FINAL_PHASES, Reason
from graft.operator.kube import (Kube, KubeError, SyncKube, events_path, fleet_path, fleets_path, pods_path,
                                 rollout_path, rollouts_path)
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
UNDO_OF = "graft.dev/undo-of"   # on a rollout `graft rollout undo` created: the rollout it undoes


class CliError(Exception):
    pass


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
    except CliError as e:
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


def _refusal(e: KubeError) -> str:
    return f"{e.status} {e.reason or 'refused'}: {e.message}" if e.message else f"{e.status} {e.reason}"


def _get(api, namespace: str, name: str) -> dict[str, Any]:
    obj = _read(api, namespace, name)
    if obj is None:
        raise CliError(f"PatchRollout {namespace}/{name} not found")
    return obj


def _read(api, namespace: str, name: str) -> dict[str, Any] | None:
    """The rollout, or None when there is none of that name."""
    try:
        return api.get(rollout_path(namespace, name))
    except KubeError as e:
        raise CliError(f"cannot read PatchRollout {namespace}/{name}: {_refusal(e)}") from None


def _patch(api: SyncKube, namespace: str, name: str, body: dict[str, Any], subresource: str = "") -> dict[str, Any]:
    """A merge patch of the rollout (or of its `subresource`); CliError when it is gone or refused."""
    _get(api, namespace, name)
    what = f"the {subresource} of " if subresource else ""
    try:
        patched = api.merge_patch(rollout_path(namespace, name) + (f"/{subresource}" if subresource else ""), body)
    except KubeError as e:
        raise CliError(f"cannot change {what}PatchRollout {namespace}/{name}: {_refusal(e)}") from None
    if patched is None:
        raise CliError(f"PatchRollout {namespace}/{name} not found")
    return patched


def _annotate(api, namespace: str, name: str, key: str, value: str) -> None:
    _patch(api, namespace, name, {"metadata": {"annotations": {key: value}}})


def _pause(api, namespace, args, console) -> int:
    _patch(api, namespace, args.name, {"spec": {"paused": True}})
    console.print(f"PatchRollout {namespace}/{args.name} paused")
    return 0


def _resume(api, namespace, args, console) -> int:
    status = _get(api, namespace, args.name).get("status") or {}
    _patch(api, namespace, args.name, {"spec": {"paused": False},
                                       "metadata": {"annotations": {"graft.dev/resume": "true"}}})
    ended = ", ".join(str(c.get("reason")) for c in status.get("pauseConditions") or [])
    console.print(f"PatchRollout {namespace}/{args.name} resumed" + (f" (ends its {ended} pause)" if ended else ""))
    return 0


def _promote(api, namespace, args, console) -> int:
    phase = (_get(api, namespace, args.name).get("status") or {}).get("phase")
    if phase in FINAL_PHASES:
        raise CliError(f"PatchRollout {namespace}/{args.name} is {phase}: nothing to promote")
    how = "full" if args.full else "step"
    _annotate(api, namespace, args.name, "graft.dev/promote", how)
    console.print(f"PatchRollout {namespace}/{args.name}: "
                  + ("full promotion requested" if args.full else "promotion of the current step requested"))
    return 0


def _abort(api, namespace, args, console) -> int:
    phase = (_get(api, namespace, args.name).get("status") or {}).get("phase")
    if phase in FINAL_PHASES:
        raise CliError(f"PatchRollout {namespace}/{args.name} is {phase}: nothing to abort")
    _annotate(api, namespace, args.name, "graft.dev/abort", "true")
    console.print(f"PatchRollout {namespace}/{args.name}: abort requested")
    return 0


def _retry(api, namespace, args, console) -> int:
    """Start a RolledBack or Failed rollout again from its first step: its controls and status cleared."""
    phase = (_get(api, namespace, args.name).get("status") or {}).get("phase")
    if phase not in ("RolledBack", "Failed"):
        raise CliError(f"PatchRollout {namespace}/{args.name} is {phase or 'Pending'}: only a RolledBack or "
                       "Failed rollout can be retried")
    _patch(api, namespace, args.name, {"metadata": {"annotations": {"graft.dev/abort": None,
                                                                    "graft.dev/promote": None,
                                                                    "graft.dev/resume": None}}})
    _patch(api, namespace, args.name, {"status": None}, subresource="status")
    console.print(f"PatchRollout {namespace}/{args.name}: retrying from its first step (was {phase})")
    return 0


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
    except CliError as e:
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


def _list_of(api: SyncKube, namespace: str | None, path, what: str) -> list[dict[str, Any]]:
    """The objects at `path(namespace)` (None: every namespace); CliError when refused or when the
    API server knows no such kind (its CRD is not installed)."""
    where = "" if namespace is None else f" in {namespace}"
    try:
        got = api.get(path(namespace))
    except KubeError as e:
        raise CliError(f"cannot list {what}{where}: {_refusal(e)}") from None
    if got is None:
        raise CliError(f"cannot list {what}{where}: 404 NotFound (is its CRD installed?)")
    return got.get("items") or []


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


def _ref(patch: dict[str, Any]) -> str:
    return f"{patch.get('name')}@{patch.get('version')}" if patch.get("name") else ""


# -- undo -------------------------------------------------------------------------------------------

def _undo(api, namespace, args, console) -> int:
    """Create the rollout that undoes a Promoted one: its spec with the other action (apply <-> revert),
    not paused, named NAME-undo (NAME-undo-2, -3, ... when taken), annotated with the rollout it
    undoes. Refused: a rollout that is not Promoted (abort stops one in flight; one that rolled back
    left nothing to undo), an upgrade (a revert would leave the pods with neither version), a fleet
    that no longer runs what the rollout left (a later rollout changed it), and a rollout that an
    earlier undo is still undoing."""
    obj = _get(api, namespace, args.name)
    where = f"PatchRollout {namespace}/{args.name}"
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    phase = status.get("phase") or "Pending"
    if phase != "Promoted":
        why = ("nothing of it stays on the pods" if phase in FINAL_PHASES
               else f"graft rollout abort {args.name} rolls it back")
        raise CliError(f"{where} is {phase}: only a Promoted rollout can be undone ({why})")
    action = spec.get("action", "apply")
    ref = _ref(spec.get("patch") or {})
    if action == "apply" and status.get("stablePatch"):
        raise CliError(f"{where} replaced {status['stablePatch']} with {ref}: a revert would leave the pods with "
                       f"neither; roll {status['stablePatch']} out again with a PatchRollout of its own")
    _fleet_still_runs(api, namespace, status.get("fleet"), ref, action, where, console)
    rollouts = _list_of(api, namespace, rollouts_path, "PatchRollouts")
    busy = next((o for o in rollouts if (o["metadata"].get("annotations") or {}).get(UNDO_OF) == args.name
                 and _phase(o) not in FINAL_PHASES), None)
    if busy is not None:
        raise CliError(f"{where} is being undone already by PatchRollout {namespace}/{busy['metadata']['name']} "
                       f"({_phase(busy) or 'Pending'})")
    undo = "apply" if action == "revert" else "revert"
    body = {"apiVersion": API_VERSION, "kind": "PatchRollout",
            "metadata": {"annotations": {UNDO_OF: args.name}},
            "spec": {**{k: v for k, v in spec.items() if k not in ("paused", "action")}, "action": undo}}
    taken = {o["metadata"]["name"] for o in rollouts}
    for name in _undo_names(args.name):
        if name in taken:
            continue
        body["metadata"]["name"] = name
        try:
            api.create(rollouts_path(namespace), body)
        except KubeError as e:
            if e.status == 409:        # created meanwhile: the next name
                continue
            raise CliError(f"cannot create PatchRollout {namespace}/{name}: {_refusal(e)}") from None
        if args.output == "name":
            console.out(name, highlight=False)
        else:
            console.print(f"PatchRollout {namespace}/{name} created: it {'reverts' if undo == 'revert' else 'applies'}"
                          f" {ref} step by step, undoing {args.name}", highlight=False)
        return 0
    raise CliError(f"no free name for the undo of {where}")


def _undo_names(name: str):
    yield f"{name}-undo"
    for i in range(2, 1000):
        yield f"{name}-undo-{i}"


def _fleet_still_runs(api, namespace: str, fleet: str | None, ref: str, action: str, where: str, console) -> None:
    """Refuse when the rollout's PatchFleet runs something else now than what the rollout left: undoing
    it would take out (or put back) what a later rollout decided. A fleet that cannot be read is not
    checked (said so)."""
    if not fleet:
        return
    try:
        obj = api.get(fleet_path(namespace, fleet))
    except KubeError as e:
        obj, why = None, _refusal(e)
    else:
        why = "404 NotFound"
    if obj is None:
        console.print(f"[yellow]note:[/yellow] PatchFleet {namespace}/{fleet} not checked ({why})", highlight=False)
        return
    running = {p.get("name"): _ref(p) for p in (obj.get("spec") or {}).get("patches") or []}
    name = ref.partition("@")[0]
    runs = f"PatchFleet {namespace}/{fleet} runs {running[name]}" if name in running else \
        f"PatchFleet {namespace}/{fleet} runs no version of {name}"
    if action == "apply" and running.get(name) != ref:
        raise CliError(f"{runs} now, not the {ref} that {where} applied: a later rollout changed it, undo that one")
    if action == "revert" and name in running:
        raise CliError(f"{runs} again since {where} reverted it: nothing to apply again")


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
