"""Applying and reverting patches on a live engine.

A swap runs inside the step loop between two steps (`engine.between_steps`), so no forward pass
ever sees half a table. Right after a swap the self-check runs the probe prompt and compares
its logits with those recorded under the previous table; beyond the patch's tolerance, or when the
probe raises, the swap is undone before the step loop runs another step, and the caller hears why
(422). Swap, probe and commit are one transaction: no request ever runs on a table that failed.

A replace (`apply(..., replace=True)`) is the same transaction with the applied version of the
same-named patch taken out in the very swap that puts the new one in: every step runs either the
old version or the new one, never neither, and a failed self-check leaves the old one applied.

The manager keeps no engine state of its own: what is applied lives in the engine's `EngineState`
(its `patches`, beside the table and the revision they make), which the step loop replaces whole
through `engine.swap()`. The manager reaches the engine only through `swap()`, `probe()`,
`preempt_running()`, `between_steps()`, its metrics, and the engine handed to a patch's `migrate`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any

import torch

from graft.engine.patches import registry
from graft.api import revision_of
from graft.engine.patches.base import Patch, PatchError, parse_patch_list
from graft.engine.patches.bundle import BundleVerifier, describe
from graft.engine.patches.loading import load_checked, run_guarded
from graft.engine.engine import EngineState, LLMEngine
from graft.engine.patches.slots import SLOT_NAMES, SlotTable

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
    """The engine's applied patches, and the only way to change them (one change at a time).

    `verifier` decides which bundles may run; `bundle_timeout` bounds, in seconds, each run of
    bundle code outside the step loop (its import, `configure`, `migrate`).
    """

    def __init__(self, engine: LLMEngine, *, enable_test_patches: bool = False,
                 verifier: BundleVerifier | None = None, bundle_timeout: float = 10.0):
        self.engine = engine
        self.available: dict[str, Patch] = registry.discover(include_test=enable_test_patches)
        self.verifier = verifier or BundleVerifier([])
        self.bundle_timeout = bundle_timeout
        self._lock = asyncio.Lock()
        self._bundles: dict[str, list[Patch]] = {}  # digest -> the patches of a bundle loaded once
        self._probe_ids = engine.tokenizer.encode(PROBE_PROMPT)
        self._probe_cache: dict[str, torch.Tensor] = {}   # revision -> its probe logits

    @property
    def applied(self) -> Mapping[str, Applied]:
        """The applied patches by name, as the step loop last published them."""
        return self.engine.state.patches

    @property
    def revision(self) -> str:
        return self.engine.revision

    def describe(self) -> dict[str, Any]:
        state = self.engine.state   # one snapshot: the revision and the patches that make it
        return {"revision": state.revision,
                "applied": [a.describe() for a in sorted(state.patches.values(), key=lambda a: a.patch.name)],
                "available": [{"name": p.name, "version": p.version, "description": p.description,
                               "slots": sorted(p.slots), "liveSwitch": p.live_switch}
                              for p in sorted(self.available.values(), key=lambda p: p.id)]}

    # resolution
    def admit(self, name: str, version: str, source: Mapping[str, Any]) -> str:
        """The digest of what the request may apply (`builtin` for a built-in); nothing runs before this."""
        if "builtin" in source:
            return "builtin"
        module = source.get("module")
        if not isinstance(module, str) or not module.strip():
            raise PatchError(400, "source.module must hold the bundle's Python source")
        return self.verifier.verify(module, source.get("digest"), source.get("signature"), name=name, version=version)

    async def resolve(self, name: str, version: str, source: Mapping[str, Any], digest: str) -> Patch:
        if "builtin" in source:
            patch = self.available.get(f"{name}@{version}")
            if patch is None:
                known = sorted(self.available)
                raise PatchError(404, f"no built-in patch {name}@{version} (available: {', '.join(known) or 'none'})")
            return patch
        patches = self._bundles.get(digest)
        if patches is None:
            try:
                patches = await load_checked(source["module"], digest, self.bundle_timeout)
            except PatchError:
                self.engine.metrics.patch_failures.labels(name, "load").inc()
                raise
            self._bundles[digest] = patches
        for patch in patches:
            if patch.name == name and patch.version == version:
                return patch
        raise PatchError(404, f"the bundle provides no patch {name}@{version} "
                              f"(it provides: {', '.join(p.id for p in patches) or 'none'})")

    def _time_limit(self, patch: Patch) -> float | None:
        return None if patch.digest == "builtin" else self.bundle_timeout

    async def _slots_for(self, patch: Patch, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The slots `patch` replaces under `config` (its `configure`, run off the event loop)."""
        if patch.configure is None:
            return patch.slots
        try:
            slots = await run_guarded(patch.configure, config, timeout=self._time_limit(patch),
                                      what=f"{patch.id} configure()")
        except (ValueError, TypeError) as exc:
            raise PatchError(400, f"config: {exc}") from None
        except PatchError:
            raise
        except Exception as exc:
            raise PatchError(422, f"{patch.id} configure() failed: {describe(exc)}") from None
        if not isinstance(slots, Mapping) or not set(slots) <= set(SLOT_NAMES) \
                or not all(callable(f) for f in slots.values()):
            raise PatchError(422, f"{patch.id} configure() must return callables for known patch points "
                                  f"({', '.join(SLOT_NAMES)})")
        return slots

    async def _migrate(self, patch: Patch, current: Applied | None) -> None:
        """Run `patch.migrate` off the step loop: the costly part, while the current table serves."""
        if not patch.migrate:
            return
        try:
            await run_guarded(patch.migrate, self.engine, timeout=self._time_limit(patch), what=f"{patch.id} migrate()")
        except Exception as exc:
            await self._unmigrate(patch, keep=current)
            if isinstance(exc, PatchError):
                raise
            raise PatchError(422, f"{patch.id} migrate() failed: {describe(exc)}") from None

    async def _unmigrate(self, patch: Patch, keep: Applied | None = None) -> None:
        """Drop what `migrate` added, off the step loop, once the table no longer uses it.

        `keep` is the version of the same patch that stays (or comes) in: when both versions share
        one `unmigrate`, they share the state it drops, which the version that stays still uses.
        """
        if patch.unmigrate and (keep is None or keep.patch.unmigrate is not patch.unmigrate):
            try:
                await run_guarded(patch.unmigrate, self.engine, timeout=self._time_limit(patch),
                                  what=f"{patch.id} unmigrate()")
            except Exception:  # the table is back already: what unmigrate() leaves, it ignores
                log.exception("%s unmigrate() failed", patch.id)

    # apply / revert
    async def apply(self, name: str, version: str, source: Mapping[str, Any],
                    config: Mapping[str, Any] | None = None, *, replace: bool = False) -> dict[str, Any]:
        """Apply `name@version`; with `replace`, in place of the applied version of `name`, if any.

        Without `replace` another applied version of `name` is a conflict (409), so a caller that
        did not ask for a swap never gets one.
        """
        async with self._lock:
            digest = self.admit(name, version, source)
            current = self.applied.get(name)
            if current is not None:  # answered before any code of the request runs
                if current.patch.version == version and current.patch.digest == digest:
                    return {"revision": self.revision, "applyMs": 0.0, "changed": False}
                if not replace:
                    raise PatchError(409, f"{current.patch.id} is applied; apply {name}@{version} with "
                                          f"\"replace\": true to swap it in atomically (or revert {name} first)")
            patch = await self.resolve(name, version, source, digest)
            slots = await self._slots_for(patch, config or {})
            clash = {s: a.patch.id for a in self.applied.values() if a.patch.name != name
                     for s in a.slots if s in slots}
            if clash:
                raise PatchError(409, f"{patch.id} replaces patch points already patched: {clash}")
            await self._migrate(patch, current)
            try:
                applied, verdict = await self.engine.between_steps(
                    lambda: self._swap_in(patch, slots, config or {}, current))
            except Exception:
                await self._unmigrate(patch, keep=current)
                raise
            if verdict is not None:
                await self._unmigrate(patch, keep=current)
                self.engine.metrics.patch_failures.labels(patch.name, "verify").inc()
                kept = f"; {current.patch.id} stays applied" if current is not None else " and was reverted"
                raise PatchError(422, f"{patch.id} failed its self-check{kept}: {verdict}")
            if current is not None:
                await self._unmigrate(current.patch, keep=applied)
                log.info("replaced %s with %s in %.2f ms (self-check %.1f ms)", current.patch.id, patch.id,
                         applied.apply_ms, applied.verify_ms)
            else:
                log.info("applied %s in %.2f ms (self-check %.1f ms)", patch.id, applied.apply_ms, applied.verify_ms)
            return {"revision": self.revision, "applyMs": round(applied.apply_ms, 3),
                    "verifyMs": round(applied.verify_ms, 3), "changed": True}

    async def revert(self, name: str) -> dict[str, Any]:
        async with self._lock:
            current = self.applied.get(name)
            if current is None:
                raise PatchError(404, f"no patch named {name} is applied")
            ms = await self.engine.between_steps(lambda: self._swap_out(current))
            await self._unmigrate(current.patch)
            return {"revision": self.revision, "applyMs": round(ms, 3), "changed": True}

    async def apply_startup(self, spec: str) -> None:
        """Apply `name@version,...` (GRAFT_PATCHES) at start-up; a bad entry stops the process."""
        for name, version in parse_patch_list(spec):
            try:
                await self.apply(name, version, {"builtin": True})
            except PatchError as exc:
                raise SystemExit(f"GRAFT_PATCHES: cannot apply {name}@{version}: {exc.message}") from None

    # the step loop side
    def _state(self, applied: Mapping[str, Applied]) -> EngineState:
        """The engine state that runs `applied`: the base table with their slots, and its revision."""
        table = self.engine.base_slots
        for a in applied.values():
            table = table.with_slots(a.slots)
        return EngineState(table, revision_of([a.patch.id for a in applied.values()]), MappingProxyType(applied))

    def _probe(self, slots: SlotTable) -> torch.Tensor:
        return self.engine.probe(self._probe_ids, slots)

    def _reference(self) -> torch.Tensor:
        """The probe logits of the current revision: computed once per revision, then remembered."""
        state = self.engine.state
        if state.revision not in self._probe_cache:
            self._probe_cache[state.revision] = self._probe(state.slots)
        return self._probe_cache[state.revision]

    def _swap_in(self, patch: Patch, slots: Mapping[str, Any], config: Mapping[str, Any],
                 current: Applied | None):
        """Swap `patch` in (and `current`, the applied version of its name, out), probe, then commit or undo.

        One call between two steps: no step runs on the new table before the probe passed, and
        nothing (revision, metrics) changes until it has, so a refused swap leaves no trace but
        its failure count.
        """
        engine = self.engine
        before = self._reference()
        t0 = time.perf_counter()
        if not patch.live_switch or (current is not None and not current.patch.live_switch):
            engine.preempt_running()
        applied = Applied(patch, slots, datetime.now(timezone.utc).isoformat(timespec="milliseconds"), 0.0, 0.0,
                          config)
        # `current`, if any, goes out in the same stroke
        tentative = self._state({**self.applied, patch.name: applied})
        applied.apply_ms = (time.perf_counter() - t0) * 1000
        t1 = time.perf_counter()
        try:
            after = self._probe(tentative.slots)
            verdict = probe_verdict(before, after, patch.tolerance, engine.dtype)
        except BaseException as exc:  # a probe that raises is a failed self-check: the old table stays
            verdict = f"the probe raised {describe(exc)}"
        applied.verify_ms = (time.perf_counter() - t1) * 1000
        if verdict is not None:  # no step ran on the new table: its KV entries are the old table's
            return applied, verdict
        engine.swap(tentative)
        self._probe_cache[tentative.revision] = after
        if current is not None:
            self._forget(current.patch)
        engine.metrics.patch_info.labels(patch.name, patch.version, patch.digest).set(1)
        engine.metrics.patch_apply.labels("apply" if current is None else "replace").observe(applied.apply_ms / 1000)
        return applied, None

    def _swap_out(self, applied: Applied) -> float:
        engine = self.engine
        t0 = time.perf_counter()
        if not applied.patch.live_switch:
            engine.preempt_running()
        engine.swap(self._state({name: a for name, a in self.applied.items() if name != applied.patch.name}))
        ms = (time.perf_counter() - t0) * 1000
        self._forget(applied.patch)
        engine.metrics.patch_apply.labels("revert").observe(ms / 1000)
        return ms

    def _forget(self, patch: Patch) -> None:
        """Drop the `graft_patch_info` series of a patch no longer applied."""
        try:
            self.engine.metrics.patch_info.remove(patch.name, patch.version, patch.digest)
        except KeyError:
            pass
