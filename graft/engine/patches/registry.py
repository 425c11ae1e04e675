"""Where built-in patches come from: the `graft.patches` entry-point group.

An entry point names a callable returning an iterable of Patch objects, so a separate package can
ship patches by declaring `[project.entry-points."graft.patches"]`.
"""
from __future__ import annotations

import logging
from importlib.metadata import entry_points

from graft.engine.patches.base import Patch

log = logging.getLogger(__name__)

GROUP = "graft.patches"


def discover(include_test: bool = False) -> dict[str, Patch]:
    found: dict[str, Patch] = {}
    for ep in entry_points(group=GROUP):
        try:
            patches = list(ep.load()())
        except Exception:  # a broken plug-in must not take the engine down
            log.exception("patch entry point %s failed to load; skipping it", ep.name)
            continue
        for patch in patches:
            if patch.test_only and not include_test:
                continue
            if patch.id in found:
                log.warning("patch %s registered twice; keeping the first", patch.id)
                continue
            found[patch.id] = patch
    return found
