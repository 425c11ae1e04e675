"""What a hot patch is: a named, versioned set of slot replacements with its own checks."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from graft.api import NAME_RE, VERSION_RE, parse_revision
from graft.engine.patches.slots import SLOT_NAMES

if TYPE_CHECKING:
    from graft.engine.engine import LLMEngine



class PatchError(Exception):
    """A patch could not be applied; `status` is the admin API's answer for it."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Patch:
    """A named, versioned set of slot replacements.

    `migrate(engine)` prepares live state for the patched form (e.g. builds fused weights); it runs
    before the swap, off the step loop, while the old table still serves, so it may only add state
    the old table ignores. `unmigrate(engine)` drops it after a revert. When one version replaces
    another, the new one's `migrate` runs while the old one serves, and the old one's `unmigrate`
    runs after the swap unless both versions share the same `unmigrate` (then they share the state
    and it stays). `tolerance` is the largest absolute logit difference the self-check accepts on
    the probe prompt. A patch with `live_switch=False` cannot take over sequences mid-flight: the
    engine preempts (recomputes) running work around the swap.
    """

    name: str
    version: str
    slots: Mapping[str, Callable[..., Any]]
    description: str = ""
    tolerance: float = 1e-3
    live_switch: bool = True
    migrate: Callable[["LLMEngine"], None] | None = None
    unmigrate: Callable[["LLMEngine"], None] | None = None
    configure: Callable[[Mapping[str, Any]], Mapping[str, Callable[..., Any]]] | None = None
    test_only: bool = False
    digest: str = "builtin"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not NAME_RE.fullmatch(self.name):
            raise ValueError(f"patch name {self.name!r} must be a DNS label (a-z, 0-9, '-')")
        if not VERSION_RE.fullmatch(self.version):
            raise ValueError(f"patch version {self.version!r} is not a valid version")
        unknown = set(self.slots) - set(SLOT_NAMES)
        if unknown:
            raise ValueError(f"patch {self.id} replaces unknown patch point(s) {sorted(unknown)}")

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"


def parse_patch_list(text: str) -> list[tuple[str, str]]:
    """`kv-align@3.2.1,sync-free@3.2.1` -> [("kv-align", "3.2.1"), ("sync-free", "3.2.1")]; "" or "base" -> []."""
    return [(ref.name, ref.version) for ref in parse_revision(text)]
