"""Applying and reverting patches on a live engine.

A swap runs inside the step loop between two steps (`engine.call_between_steps`), so no forward
pass ever sees half a table. Right after a swap the self-check runs the probe prompt and compares
its logits with those recorded under the previous table; beyond the patch's tolerance the swap is
undone and the caller hears why (422).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from graft.engine.patches import registry
from graft.engine.patches.base import Patch, PatchError, parse_patch_list, revision_of
from graft.engine.patches.bundle import BundleVerifier, load_bundle

log = logging.getLogger(__name__)

PROBE_PROMPT = "The capital of France is Paris. The capital of Japan is Tokyo. The capital of Italy is"


@dataclass(slots=True)
class Applied:
    patch: Patch
    slots: Mapping[str, Any]
    applied_at: str
    apply_ms: float
    verify_ms: float
    config: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"name": self.patch.name, "version": self.patch.version, "digest": self.patch.digest,
                "appliedAt": self.applied_at, "applyMs": round(self.apply_ms, 3),
                "verifyMs": round(self.verify_ms, 3)}


LOW_PRECISION_MEAN_DIFF = 0.25   # bf16/fp16: reordered sums move logits by ~0.1 on average
LOW_PRECISION_ARGMAX = 0.9       # ... and rarely change the top token


def probe_verdict(before: torch.Tensor, after: torch.Tensor, tolerance: float, dtype: torch.dtype) -> str | None:
    """Why the probe logits after a swap are not the same model's, or None when they are.

    In fp32 every logit must stay within the patch's tolerance. In 16-bit floats a fused path
    legitimately moves logits by up to ~1.5 (a different summation order), so there the mean
    difference and the agreement of the top token decide.
    """
    if not torch.isfinite(after).all():
        return "probe logits are not finite"
    diff = (after - before).abs()
    if dtype == torch.float32:
        worst = float(diff.max())
        return None if worst <= tolerance else f"probe logits differ by {worst:.4g} (tolerance {tolerance:g})"
    mean = float(diff.mean())
    agree = float((after.argmax(-1) == before.argmax(-1)).float().mean())
    if mean <= max(tolerance, LOW_PRECISION_MEAN_DIFF) and agree >= LOW_PRECISION_ARGMAX:
        return None
    return (f"probe logits differ by {mean:.4g} on average, top token agrees on {agree:.0%} of positions "
            f"(limits {max(tolerance, LOW_PRECISION_MEAN_DIFF):g}, {LOW_PRECISION_ARGMAX:.0%})")


class PatchManager:
    def __init__(self, engine, *, enable_test_patches: bool = False, trusted_keys: list[str] | None = None):
        self.engine = engine
        self.available: dict[str, Patch] = registry.discover(include_test=enable_test_patches)
        self.verifier = BundleVerifier.from_files(trusted_keys or [])
        self.applied: dict[str, Applied] = {}      # by patch name
        self.base_slots = engine.slots
        self._lock = asyncio.Lock()
        self._probe_ids = engine.tokenizer.encode(PROBE_PROMPT)
        self._probe_cache: dict[str, torch.Tensor] = {}   # revision -> its probe logits

    @property
    def revision(self) -> str:
        return revision_of([a.patch.id for a in self.applied.values()])

    def describe(self) -> dict[str, Any]:
        return {"revision": self.revision,
                "applied": [a.describe() for a in sorted(self.applied.values(), key=lambda a: a.patch.name)],
                "available": [{"name": p.name, "version": p.version, "description": p.description,
                               "slots": sorted(p.slots), "liveSwitch": p.live_switch}
                              for p in sorted(self.available.values(), key=lambda p: p.id)]}

    # resolution
    def resolve(self, name: str, version: str, source: Mapping[str, Any]) -> Patch:
        if "builtin" in source:
            patch = self.available.get(f"{name}@{version}")
            if patch is None:
                known = sorted(self.available)
                raise PatchError(404, f"no built-in patch {name}@{version} (available: {', '.join(known) or 'none'})")
            return patch
        module, digest = source.get("module"), source.get("digest")
        if not isinstance(module, str) or not module.strip():
            raise PatchError(400, "source.module must hold the bundle's Python source")
        self.verifier.verify(module, digest, source.get("signature"))   # nothing runs before this passes
        for patch in load_bundle(module, digest.lower()):
            if patch.name == name and patch.version == version:
                return patch
        raise PatchError(404, f"the bundle provides no patch {name}@{version}")

    # apply / revert
    async def apply(self, name: str, version: str, source: Mapping[str, Any],
                    config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        async with self._lock:
            patch = self.resolve(name, version, source)
            current = self.applied.get(name)
            if current is not None:
                if current.patch.version == version and current.patch.digest == patch.digest:
                    return {"revision": self.revision, "applyMs": 0.0, "changed": False}
                raise PatchError(409, f"{current.patch.id} is applied; revert it before applying {patch.id}")
            try:
                slots = patch.configure(config or {}) if patch.configure else patch.slots
            except (ValueError, TypeError) as exc:
                raise PatchError(400, f"config: {exc}") from None
            clash = {s: a.patch.id for a in self.applied.values() for s in a.slots if s in slots}
            if clash:
                raise PatchError(409, f"{patch.id} replaces patch points already patched: {clash}")
            if patch.migrate:  # the costly part, off the step loop: the old table ignores what it adds
                await asyncio.to_thread(patch.migrate, self.engine)
            fut = self.engine.call_between_steps(lambda: self._swap_in(patch, slots, config or {}))
            try:
                applied, verdict = await asyncio.wrap_future(fut)
            except BaseException:
                if patch.unmigrate:
                    patch.unmigrate(self.engine)
                raise
            if verdict is not None:
                self.engine.metrics.patch_failures.labels(patch.name, "verify").inc()
                raise PatchError(422, f"{patch.id} failed its self-check and was reverted: {verdict}")
            log.info("applied %s in %.2f ms (self-check %.1f ms)", patch.id, applied.apply_ms, applied.verify_ms)
            return {"revision": self.revision, "applyMs": round(applied.apply_ms, 3),
                    "verifyMs": round(applied.verify_ms, 3), "changed": True}

    async def revert(self, name: str) -> dict[str, Any]:
        async with self._lock:
            current = self.applied.get(name)
            if current is None:
                raise PatchError(404, f"no patch named {name} is applied")
            ms = await asyncio.wrap_future(self.engine.call_between_steps(lambda: self._swap_out(current)))
            return {"revision": self.revision, "applyMs": round(ms, 3), "changed": True}

    async def apply_startup(self, spec: str) -> None:
        """Apply `name@version,...` (GRAFT_PATCHES) at start-up; a bad entry stops the process."""
        for name, version in parse_patch_list(spec):
            try:
                await self.apply(name, version, {"builtin": True})
            except PatchError as exc:
                raise SystemExit(f"GRAFT_PATCHES: cannot apply {name}@{version}: {exc.message}") from None

    # the step loop side
    def _table(self, extra: Mapping[str, Any] | None = None, without: str | None = None):
        table = self.base_slots
        for a in self.applied.values():
            if a.patch.name != without:
                table = table.with_slots(a.slots)
        return table.with_slots(extra) if extra else table

    def _probe(self, slots) -> torch.Tensor:
        return self.engine.runner.probe_logits(self._probe_ids, slots, self.engine.probe_blocks)

    def _reference(self) -> torch.Tensor:
        """The probe logits of the current revision: computed once per revision, then remembered."""
        rev = self.engine.revision
        if rev not in self._probe_cache:
            self._probe_cache[rev] = self._probe(self.engine.slots)
        return self._probe_cache[rev]

    def _set_revision(self) -> None:
        old, new = self.engine.revision, self.revision
        self.engine.revision = new
        self.engine.metrics.set_revision(old, new)

    def _swap_in(self, patch: Patch, slots: Mapping[str, Any], config: Mapping[str, Any]):
        engine = self.engine
        before = self._reference()
        t0 = time.perf_counter()
        if not patch.live_switch:
            engine.scheduler.preempt_all()
        engine.slots = self._table(slots)
        self.applied[patch.name] = applied = Applied(
            patch, slots, datetime.now(timezone.utc).isoformat(timespec="milliseconds"), 0.0, 0.0, config)
        self._set_revision()
        applied.apply_ms = (time.perf_counter() - t0) * 1000
        t1 = time.perf_counter()
        after = self._probe(engine.slots)
        applied.verify_ms = (time.perf_counter() - t1) * 1000
        verdict = probe_verdict(before, after, patch.tolerance, engine.dtype)
        if verdict is not None:
            self._swap_out(applied)
            return applied, verdict
        self._probe_cache[engine.revision] = after
        engine.metrics.patch_info.labels(patch.name, patch.version, patch.digest).set(1)
        engine.metrics.patch_apply.labels("apply").observe(applied.apply_ms / 1000)
        return applied, None

    def _swap_out(self, applied: Applied) -> float:
        engine = self.engine
        t0 = time.perf_counter()
        if not applied.patch.live_switch:
            engine.scheduler.preempt_all()
        self.applied.pop(applied.patch.name, None)
        engine.slots = self._table()
        if applied.patch.unmigrate:
            applied.patch.unmigrate(engine)
        self._set_revision()
        ms = (time.perf_counter() - t0) * 1000
        p = applied.patch
        try:
            engine.metrics.patch_info.remove(p.name, p.version, p.digest)
        except KeyError:
            pass
        engine.metrics.patch_apply.labels("revert").observe(ms / 1000)
        return ms
