"""The vocabulary every part of Graft shares: the engine, the operator, the CLI, the demo and the tests.

It names the custom resources, the phases and verdicts a rollout reports, and how a patch and an
engine's revision are written (`name@version`, sorted and comma-joined, `base` when nothing is
applied). It imports neither torch nor kopf, so any process may use it.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# -- the custom resources --------------------------------------------------------------------------

GROUP = "graft.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
ROLLOUTS = "patchrollouts"
FLEETS = "patchfleets"
TEMPLATES = "patchanalysistemplates"
CLUSTER_TEMPLATES = "clusterpatchanalysistemplates"


class Phase(StrEnum):
    """Where a PatchRollout stands (`status.phase`)."""

    PENDING = "Pending"
    PROGRESSING = "Progressing"
    PAUSED = "Paused"
    PROMOTED = "Promoted"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"
    FAILED = "Failed"

    @property
    def final(self) -> bool:
        """A final phase never changes again (short of `graft rollout retry`)."""
        return self in (Phase.PROMOTED, Phase.ROLLED_BACK, Phase.FAILED)


FINAL_PHASES = frozenset(p.value for p in Phase if p.final)


class Verdict(StrEnum):
    """The outcome of one check, or of one analysis run."""

    SUCCESSFUL = "Successful"
    FAILED = "Failed"
    INCONCLUSIVE = "Inconclusive"
    ERROR = "Error"
    SKIPPED = "Skipped"


class Track(StrEnum):
    """Which side of a rollout a pod serves (the `graft.dev/track` label)."""

    CANARY = "canary"
    STABLE = "stable"


# -- patches and revisions -------------------------------------------------------------------------

# Patterns for `re.fullmatch` only: `re.match` with `$` would accept a trailing newline.
NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
VERSION_RE = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")
DIGEST_RE = re.compile(r"sha256:[0-9a-fA-F]{64}")
DIGEST_PREFIX = "sha256:"
BASE = "base"


def digest_of(source: str) -> str:
    """The pinned digest of a bundle's source, as a rollout's `spec.patch.digest` writes it."""
    return DIGEST_PREFIX + hashlib.sha256(source.encode("utf-8")).hexdigest()


def config_digest(config: Mapping[str, Any] | None) -> str:
    """The digest of a patch's `config` (canonical JSON: sorted keys, no spaces; none is `{}`): how
    an engine's answer and a PatchFleet tell one config of the same `name@version` from another."""
    text = json.dumps(dict(config or {}), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return DIGEST_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True, order=True)
class PatchRef:
    """One patch at one version: `kv-align@3.2.1`."""

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    @classmethod
    def parse(cls, text: str) -> "PatchRef":
        name, sep, version = text.strip().partition("@")
        if not sep or not NAME_RE.fullmatch(name) or not VERSION_RE.fullmatch(version):
            raise ValueError(f"{text!r} is not of the form name@version")
        return cls(name, version)


def patch_ref(name: str, version: str) -> str:
    return str(PatchRef(name, version))


def revision_of(refs: Iterable[str]) -> str:
    """An engine's revision: its applied patches, sorted and comma-joined; `base` when none."""
    return ",".join(sorted(set(refs))) or BASE


def patches_of(revision: str) -> list[str]:
    """`a@1,b@2` -> ['a@1', 'b@2']; `base` or '' -> []."""
    return [p for p in (s.strip() for s in revision.split(",")) if p and p != BASE]


def parse_revision(text: str) -> list[PatchRef]:
    """A revision or a `GRAFT_PATCHES` list as validated references; raises ValueError naming the bad item."""
    return [PatchRef.parse(p) for p in patches_of(text)]


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
