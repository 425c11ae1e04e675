"""Revisions: what an engine runs, as the `revision` metric label and the `graft.dev/patches` annotation spell it.

A revision is the sorted, comma-joined list of applied patches (`name@version`), or `base` when
none are applied; the engine computes it the same way.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

BASE = "base"


def patch_ref(name: str, version: str) -> str:
    return f"{name}@{version}"


def revision_of(refs: Iterable[str]) -> str:
    return ",".join(sorted(set(refs))) or BASE


def patches_of(revision: str) -> list[str]:
    """`a@1,b@2` -> ['a@1', 'b@2']; `base` or '' -> []."""
    return [p for p in (s.strip() for s in revision.split(",")) if p and p != BASE]


def has_patch(revision: str | None, ref: str) -> bool:
    return revision is not None and ref in patches_of(revision)


def with_patch(revision: str, ref: str) -> str:
    """The revision after applying `ref`, replacing any other version of the same patch."""
    name = ref.partition("@")[0]
    return revision_of([p for p in patches_of(revision) if p.partition("@")[0] != name] + [ref])


def without_patch(revision: str, ref: str) -> str:
    """The revision after reverting the patch named in `ref` (any version of it)."""
    name = ref.partition("@")[0]
    return revision_of(p for p in patches_of(revision) if p.partition("@")[0] != name)


def majority_stable(revisions: Iterable[str], ref: str) -> str:
    """The revision most pods run once `ref` is taken off: the stable side of a rollout."""
    counts = Counter(without_patch(r, ref) for r in revisions)
    if not counts:
        return BASE
    best = max(counts.values())
    return min(r for r, c in counts.items() if c == best)
