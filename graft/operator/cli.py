"""`graft rollout status [-w] | pause | resume | promote [--full] | abort | retry NAME | simulate -f FILE`, also
`kubectl graft ...`.

Each verb changes one field of the PatchRollout and the operator does the rest: `pause` sets
`spec.paused`, `resume` clears it and sets the annotation `graft.dev/resume: "true"` (which ends a
pause the analysis decided, kept in status.pauseConditions), `promote` sets the annotation `graft.dev/promote` (`step` or `full`), `abort`
sets `graft.dev/abort: "true"`. `status` shows the step, the weight, the pods and every metric
against its threshold (graft.operator.render, which `graft demo` shows too), with a warning when
pod-ratio routing cannot honour the first steps (CoarseSteps); `-w` keeps it on screen, updated,
until the rollout finishes, and exits 0 when it promoted, 2 when it rolled back or failed, and 3 when
the rollout was deleted before it finished. It follows the rollout with a watch, so it sees the final
phase even of a rollout deleted right after it (`ttlSecondsAfterFinished: 0`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from graft.api import FINAL_PHASES, GROUP, ROLLOUTS as PLURAL, VERSION
from graft.operator.render import render_status

NOT_PROMOTED = 2       # `status -w`: the rollout finished RolledBack or Failed
DELETED = 3            # `status -w`: the rollout was deleted before it finished


class CliError(Exception):
    pass


def main_rollout(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    """Entry point of `graft rollout ...` and of the kubectl plug-in `kubectl-graft`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:        # needs no cluster
        from graft.operator.simulate_cli import main as simulate_main
        return simulate_main(argv[1:], console)
    args = _parser().parse_args(argv)
    console = console or Console()
    try:
        api, namespace = _client(args.kubeconfig, args.context, args.namespace)
        return args.run(api, namespace, args, console)
    except CliError as e:
        console.print(f"[red]error:[/red] {e}")
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graft rollout", description="Watch and steer PatchRollouts.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("name", help="the PatchRollout")
    common.add_argument("-n", "--namespace", help="default: the kubeconfig context's namespace")
    common.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config (in a pod: its service account)")
    common.add_argument("--context", help="kubeconfig context")
    verbs = parser.add_subparsers(dest="verb", required=True)
    status = verbs.add_parser("status", parents=[common], help="show where the rollout stands")
    status.add_argument("-w", "--watch", action="store_true", help="keep showing it until it finishes")
    status.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    status.set_defaults(run=_status)
    verbs.add_parser("pause", parents=[common], help="hold at the current step").set_defaults(run=_pause)
    verbs.add_parser("resume", parents=[common], help="carry on from a pause").set_defaults(run=_resume)
    promote = verbs.add_parser("promote", parents=[common], help="skip the rest of the current step")
    promote.add_argument("--full", action="store_true", help="skip every remaining step and analysis")
    promote.set_defaults(run=_promote)
    verbs.add_parser("abort", parents=[common], help="roll back now").set_defaults(run=_abort)
    verbs.add_parser("retry", parents=[common], help="start a RolledBack or Failed rollout again").set_defaults(
        run=_retry)
    verbs.add_parser("simulate", help="run the rollout's decisions against a simulated fleet "
                                      "(graft rollout simulate -h)", add_help=False)
    return parser


def _client(kubeconfig: str | None, context: str | None, namespace: str | None):
    import kubernetes

    try:
        if kubeconfig is None and context is None and _in_cluster():
            kubernetes.config.load_incluster_config()
            default_ns = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
        else:
            kubernetes.config.load_kube_config(config_file=kubeconfig, context=context)
            _, active = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
            if context:
                contexts, _ = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
                active = next((c for c in contexts if c["name"] == context), active)
            default_ns = (active.get("context") or {}).get("namespace") or "default"
    except (kubernetes.config.ConfigException, OSError) as e:
        raise CliError(f"cannot load Kubernetes credentials: {e}") from None
    return kubernetes.client.CustomObjectsApi(), namespace or default_ns


def _in_cluster() -> bool:
    return "KUBERNETES_SERVICE_HOST" in os.environ and not os.environ.get("KUBECONFIG")


def _get(api, namespace: str, name: str) -> dict[str, Any]:
    obj = _read(api, namespace, name)
    if obj is None:
        raise CliError(f"PatchRollout {namespace}/{name} not found")
    return obj


def _read(api, namespace: str, name: str) -> dict[str, Any] | None:
    """The rollout, or None when there is none of that name."""
    from kubernetes.client.exceptions import ApiException

    try:
        return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise CliError(f"cannot read PatchRollout {namespace}/{name}: {e.status} {e.reason}") from None


def _patch(api, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    from kubernetes.client.exceptions import ApiException

    _get(api, namespace, name)
    try:
        return api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body)
    except ApiException as e:
        raise CliError(f"cannot change PatchRollout {namespace}/{name}: {e.status} {e.reason}") from None


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
    from kubernetes.client.exceptions import ApiException

    phase = (_get(api, namespace, args.name).get("status") or {}).get("phase")
    if phase not in ("RolledBack", "Failed"):
        raise CliError(f"PatchRollout {namespace}/{args.name} is {phase or 'Pending'}: only a RolledBack or "
                       "Failed rollout can be retried")
    _patch(api, namespace, args.name, {"metadata": {"annotations": {"graft.dev/abort": None,
                                                                    "graft.dev/promote": None,
                                                                    "graft.dev/resume": None}}})
    try:
        api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, args.name, {"status": None})
    except ApiException as e:
        raise CliError(f"cannot reset the status of PatchRollout {namespace}/{args.name}: {e.status} {e.reason}") \
            from None
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
    import kubernetes
    from kubernetes.client.exceptions import ApiException

    name = obj["metadata"]["name"]
    try:
        for event in kubernetes.watch.Watch().stream(
                api.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                field_selector=f"metadata.name={name}", resource_version=obj["metadata"]["resourceVersion"],
                timeout_seconds=max(1, round(seconds))):
            if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                obj = event["raw_object"]
            if event["type"] == "DELETED":
                return obj, True
    except ApiException as e:
        if e.status != 410:
            raise CliError(f"cannot watch PatchRollout {namespace}/{name}: {e.status} {e.reason}") from None
        fresh = _read(api, namespace, name)        # the watch fell too far behind: read it anew
        return (obj, True) if fresh is None else (fresh, False)
    return obj, False


def _context(api, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
    """The Events posted on the rollout and the pods its selector matches, as `render_status` takes
    them. Events or pods this user may not read are left out."""
    import kubernetes
    from kubernetes.client.exceptions import ApiException

    from graft.rollout.spec import SpecError, parse_selector

    name = obj["metadata"]["name"]
    core = kubernetes.client.CoreV1Api(api.api_client)
    try:
        events = _items(core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}",
                                                   _preload_content=False))
    except ApiException:
        events = []
    try:
        selector = parse_selector((obj.get("spec") or {}).get("selector")).to_query()
        pods = _items(core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False))
    except (ApiException, SpecError):
        pods = None
    return {"events": events, "pods": pods}


def _items(response) -> list[dict[str, Any]]:
    """The items of a list call made with `_preload_content=False`, as the API server sent them."""
    return json.loads(response.data).get("items") or []


if __name__ == "__main__":
    sys.exit(main_rollout())
