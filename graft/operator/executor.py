"""The one executor of pod actions (`graft.rollout.actions`), for the rollout and the fleet controllers.

An action goes out as one call: `ApplyPatch` and `RevertPatch` to the engine's admin API (at the
address `graft.operator.pods.Workloads` vetted, with the admin token; a bundle's source read once a
tick), `LabelPod` as one merge patch of the pod's label and annotation, `SetPatched` as a write of
the pod's status condition. Whatever happens comes back as data, an `Outcome`, never as an
exception the caller might forget:

- `revision`: what the engine answered it runs now;
- `error`: the engine refused or could not be reached (a `PodError`, about this pod only);
- `problem`: something outside the pod stops the controller from acting (the admin token's Secret,
  a bundle that cannot be sent: their own reasons), or something nobody planned for: Kubernetes
  refused a write, or the operator itself failed (a bug). Those two are `Reason.ACTION_FAILED`,
  with the action and the error in the message, and logged with their traceback; each controller
  shows them in its status and posts them as a Warning Event.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from graft.api import Reason
from graft.operator import pods as podsmod
from graft.operator.admin import AdminError
from graft.operator.bundles import load_source
from graft.operator.kube import Kube, KubeError, pods_path
from graft.operator.pods import AddressError, NoPodIP
from graft.operator.problems import ProblemError
from graft.operator.runtime import Runtime
from graft.rollout.actions import ApplyPatch, LabelPod, PodAction, RevertPatch, SetPatched, describe
from graft.rollout.fleet import PATCHED_CONDITION
from graft.rollout.observation import PodError, Problem
from graft.rollout.spec import PatchSpec
from graft.rollout.status import to_time

log = logging.getLogger("graft.operator.executor")


@dataclass(slots=True)
class Outcome:
    """What became of one action (see the module's docstring)."""

    action: PodAction
    revision: str | None = None
    error: PodError | None = None
    problem: Problem | None = None

    @property
    def pod(self) -> str:
        return self.action.pod

    @property
    def ok(self) -> bool:
        return self.error is None and self.problem is None

    @property
    def message(self) -> str:
        return self.error.message if self.error else self.problem.message if self.problem else ""


def _pod_error(pod: str, e: AdminError | AddressError) -> PodError:
    return PodError(e.kind, e.message)


class PodExecutor:
    """Carries out pod actions in one namespace for one controller's tick.

    `pods` (name -> the pod as last listed) are the engine pods `workloads` vetted; a controller that
    lists them again sets `pods` anew. `classify` turns an admin call's failure into the pod's
    error (the rollout's counts a refused token against its grace)."""

    def __init__(self, runtime: Runtime, namespace: str, workloads: podsmod.Workloads,
                 pods: Mapping[str, dict[str, Any]],
                 classify: Callable[[str, AdminError | AddressError], PodError] = _pod_error):
        self.runtime, self.namespace, self.workloads, self.pods = runtime, namespace, workloads, pods
        self.classify = classify
        self._sources: dict[str, asyncio.Future] = {}     # patch ref -> its POST body's source, read once

    async def run_all(self, actions: Iterable[PodAction]) -> list[Outcome]:
        """Every action at once (they are about different pods, or commute), each one's outcome in order."""
        return list(await asyncio.gather(*(self.run(a) for a in actions)))

    async def run(self, action: PodAction) -> Outcome:
        """Carry out one action; what happened comes back as an `Outcome`, whatever it was."""
        try:
            return await self._run(action)
        except ProblemError as e:
            return Outcome(action, problem=e.problem)
        except (AdminError, AddressError) as e:
            return Outcome(action, error=self.classify(action.pod, e))
        except KubeError as e:
            log.warning("%s: the API server answered %s", describe(action), e)
            return Outcome(action, problem=Problem(Reason.ACTION_FAILED,
                                                   f"{describe(action)}: the API server answered {e}"))
        except Exception as e:   # noqa: BLE001 - a bug must show in the status, not end the tick unseen
            log.exception("%s failed", describe(action))
            return Outcome(action, problem=Problem(Reason.ACTION_FAILED,
                                                   f"{describe(action)} failed: {type(e).__name__}: {e}"))

    async def _run(self, action: PodAction) -> Outcome:
        kube, namespace = self.runtime.kube, self.namespace
        match action:
            case ApplyPatch(pod, patch, replace):
                source = await self.source(patch)
                admin = await self.runtime.admin()
                revision = await admin.apply(*self.address(pod), patch.name, patch.version, source, patch.config,
                                             **({"replace": True} if replace else {}))
                self.runtime.unauthorized.pop(f"{namespace}/{pod}", None)
                return Outcome(action, revision=revision)
            case RevertPatch(pod, name):
                admin = await self.runtime.admin()
                revision = await admin.revert(*self.address(pod), name)
                self.runtime.unauthorized.pop(f"{namespace}/{pod}", None)
                return Outcome(action, revision=revision)
            case LabelPod(pod, track, revision):
                # the reply goes to the pod cache: the next round of this tick reads what it wrote
                self.runtime.pod_cache.saw(await podsmod.label_pod(kube, namespace, pod, track, revision))
            case SetPatched(pod, value, message):
                self.runtime.pod_cache.saw(await set_condition(
                    kube, namespace, self.pods[pod], PATCHED_CONDITION, value,
                    Reason.PATCHED if value else Reason.CONVERGING, message))
            case _:
                raise TypeError(f"not a pod action: {action!r}")
        return Outcome(action)

    def address(self, pod: str) -> tuple[str, int]:
        """The engine pod's admin address; NoPodIP when it has no IP yet."""
        address = self.workloads.address(self.pods[pod])
        if address is None:
            raise NoPodIP(f"pod {pod} has no IP yet")
        return address

    async def source(self, patch: PatchSpec) -> dict[str, Any]:
        """The patch's source as the POST body carries it (a bundle read from its ConfigMap), read once
        for every pod of the tick; BundleError when it cannot be sent."""
        if patch.ref not in self._sources:
            self._sources[patch.ref] = asyncio.ensure_future(load_source(self.runtime.kube, self.namespace, patch))
        return await asyncio.shield(self._sources[patch.ref])


async def set_condition(kube: Kube, namespace: str, pod: dict[str, Any], kind: str, value: bool,
                        reason: str, message: str) -> dict[str, Any] | None:
    """Set one condition in the pod's status, keeping every other condition as it is; the pod as
    the API server answered (None: gone)."""
    conditions = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") != kind]
    conditions.append({"type": kind, "status": "True" if value else "False", "reason": reason,
                       "message": message, "lastTransitionTime": to_time(time.time())})
    return await kube.merge_patch(pods_path(namespace, pod["metadata"]["name"]) + "/status",
                           {"status": {"conditions": conditions}})
