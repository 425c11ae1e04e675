"""Which finished PatchRollouts to delete, so that they do not pile up forever.

Two limits, both optional, decided here as plain code (the operator's `graft.operator.history`
lists the rollouts and deletes what `plan` returns):

- a rollout's own `spec.ttlSecondsAfterFinished`: deleted that many seconds after it finished;
- its fleet's `spec.revisionHistoryLimit`: the fleet keeps at most that many finished rollouts,
  the oldest finished ones go first.

A rollout is *finished* in a final phase (Promoted, RolledBack, Failed), except one refused for an
invalid spec: fixing its spec starts it again, so it waits for a person rather than being history.
An active rollout is never deleted. Within the limit, the rollouts that promoted the patches the
fleet runs now are kept first (they tell how its current revision came about), then the newest
others; only a limit smaller than their number deletes one of them. A TTL is the rollout's own
explicit request and is honoured whatever the fleet keeps.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from graft.api import FINAL_PHASES, Reason
from graft.rollout.spec import REVERT, SpecError, parse_selector, parse_ttl
from graft.rollout.status import FAILED, PROMOTED, from_time



@dataclass(slots=True, frozen=True)
class RolloutRecord:
    """What the decision needs of one PatchRollout."""

    name: str
    uid: str
    phase: str
    finished: bool
    finished_at: float | None          # when it reached its final phase; None: not known
    created_at: float
    ttl: int | None = None             # spec.ttlSecondsAfterFinished
    keeps_stable: bool = False         # it promoted a patch its fleet runs now

    @property
    def order(self) -> tuple[float, float, str]:
        """Oldest first: by finish time (creation when it is not known), then creation, then name."""
        done = self.finished_at if self.finished_at is not None else self.created_at
        return done, self.created_at, self.name


@dataclass(slots=True, frozen=True)
class Deletion:
    rollout: RolloutRecord
    reason: str                        # Reason.TTL_EXPIRED or Reason.HISTORY_PRUNED
    message: str


def expired(rollout: RolloutRecord, now: float) -> bool:
    """Whether the rollout's own TTL has run out. A finish time that is not known never expires."""
    return (rollout.finished and rollout.ttl is not None and rollout.finished_at is not None
            and now >= rollout.finished_at + rollout.ttl)


def plan(rollouts: Iterable[RolloutRecord], *, limit: int | None, now: float) -> list[Deletion]:
    """The rollouts to delete now, each with why: those whose TTL ran out, then those beyond
    `limit` finished ones (None: no limit), oldest first in each group."""
    rollouts = list(rollouts)
    out = [Deletion(r, Reason.TTL_EXPIRED, f"deleted {now - r.finished_at:.1f}s after it finished {r.phase} "
                                    f"(ttlSecondsAfterFinished: {r.ttl})")
           for r in sorted(rollouts, key=lambda r: r.order) if expired(r, now)]
    if limit is None:
        return out
    newest_first = sorted((r for r in rollouts if r.finished and not expired(r, now)), key=lambda r: r.order,
                          reverse=True)
    preferred = sorted(newest_first, key=lambda r: not r.keeps_stable)    # stable: each group newest first
    out += [Deletion(r, Reason.HISTORY_PRUNED, f"deleted PatchRollout {r.name} ({r.phase}): the fleet keeps "
                                        f"{_kept(limit)} (revisionHistoryLimit)"
                                        + (", fewer than the rollouts that promoted its patches" if r.keeps_stable
                                           else ""))
            for r in sorted(preferred[limit:], key=lambda r: r.order)]
    return out


def _kept(n: int) -> str:
    return "no finished rollout" if n == 0 else f"{n} finished rollout" + ("s" if n > 1 else "")


# from the objects as stored

def finished(status: Mapping[str, Any] | None) -> bool:
    """Whether a rollout with this `status` is finished (see the module's docstring)."""
    status = status or {}
    return status.get("phase") in FINAL_PHASES and not (status.get("phase") == FAILED and status.get("reason") == Reason.INVALID_SPEC)


def finished_at(status: Mapping[str, Any] | None) -> float | None:
    """When the rollout reached its final phase: the transition of its Completed condition to True."""
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == "Completed" and c.get("status") == "True":
            return from_time(c.get("lastTransitionTime"))
    return None


def record(rollout: Mapping[str, Any], fleet_patches: Iterable[str] = ()) -> RolloutRecord:
    """A PatchRollout as the decision sees it; `fleet_patches`: the refs (name@version) its fleet
    runs now. A malformed TTL counts as none (the API server refuses it; the operator does not guess)."""
    meta, spec, status = rollout["metadata"], rollout.get("spec") or {}, rollout.get("status") or {}
    try:
        ttl = parse_ttl(spec)
    except SpecError:
        ttl = None
    promoted = (status.get("phase") == PROMOTED and spec.get("action") != REVERT
                and status.get("patch") in set(fleet_patches))
    return RolloutRecord(meta["name"], meta.get("uid", ""), status.get("phase") or "", finished(status),
                         finished_at(status), from_time(meta.get("creationTimestamp")) or 0.0, ttl, promoted)


def targets(rollout: Mapping[str, Any], fleet: str, selector_query: str) -> bool:
    """Whether the rollout belongs to the fleet `fleet`: its status names it, or, for one that never
    started (so names none), its selector is the fleet's."""
    named = (rollout.get("status") or {}).get("fleet")
    if named:
        return named == fleet
    try:
        return parse_selector((rollout.get("spec") or {}).get("selector")).to_query() == selector_query
    except SpecError:
        return False


__all__ = ["RolloutRecord", "Deletion", "plan", "expired", "finished", "finished_at", "record", "targets"]
