"""Applying and reverting patches on a live engine.

A swap runs inside the step loop between two steps (`engine.between_steps`), so no forward pass
ever sees half a table. Before a swap the self-check runs the engine's probe plan (see
graft/engine/runner.py: a long context prefilled in chunks across block boundaries and decoded
across one, a prefix-cache hit on its first blocks, a short sequence, decodes of all three
together, and the operator's own probe prompts) under the tentative table, and compares the logits
of every position with those of the current table; it also calls the tentative `sampler`,
`scheduler.policy` and `request.outcome` slots on probe inputs and checks what they return. The
probe is split into pieces of one forward pass, each its own between-steps call, so requests keep
stepping while it runs; the tentative table is never installed before the verdict. Only when the
verdict is clean does one last between-steps call swap the table in and commit (beyond the patch's
tolerance, or when the probe or a slot raises or answers nonsense, the caller hears why: 422).
Probe and commit are one transaction: no request ever runs on a table that failed, and a refused
patch leaves no trace but its failure count.

A replace (`apply(..., replace=True)`) is the same transaction with the applied version of the
same-named patch taken out in the very swap that puts the new one in: every step runs either the
old version or the new one, never neither, and a failed self-check leaves the old one applied.

The manager keeps no engine state of its own: what is applied lives in the engine's `EngineState`
(its `patches`, beside the table and the revision they make), which the step loop replaces whole
through `engine.swap()`. The manager reaches the engine only through `swap()`, `probe()`,
`preempt_running()`, `between_steps()`, its metrics, and the engine handed to a patch's `migrate`.
One apply runs at a time (the manager's lock). A revert takes no lock: it is the way out, and must
not wait behind a bundle's load or another patch's self-check (a DELETE once waited 12 s behind an
apply, past the operator's call timeout). It swaps the patch out at the next step; a self-check
under way then finds the engine's state changed and starts again on the new one, and an apply of
the very patch being reverted (arrived before the revert, still loading or checking) is called
off with 409 instead of putting back what was just taken out.
"""
from __future__ import annotations

import asyncio
import logging
import math
import numbers
import operator
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence as Seq
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any

import torch

from graft.engine.patches import registry
from graft.api import config_digest, has_patch, revision_of
from graft.engine.patches.base import Patch, PatchError, parse_patch_list
from graft.engine.patches.bundle import BundleVerifier, describe
from graft.engine.patches.loading import load_checked, run_guarded
from graft.engine.engine import MAX_OUTCOME_DELAY, EngineState, LLMEngine
from graft.engine.patches.slots import SLOT_NAMES, SlotTable
from graft.engine.runner import ProbeRow
from graft.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

log = logging.getLogger(__name__)

REFERENCE_BYTES = 1 << 30   # probe logits remembered per revision, least recently used dropped first (the
                            # newest always kept): about 25 MiB a revision for the built-in plan in bf16
STATE_RETRIES = 3           # self-checks started over when the engine's state changed under one


@dataclass(slots=True)
class Applied:
    patch: Patch
    slots: Mapping[str, Any]
    applied_at: str
    apply_ms: float
    verify_ms: float
    config: Mapping[str, Any] = field(default_factory=dict)
    self_check: Mapping[str, Any] = field(default_factory=dict)   # the self-check's figures (describe())

    def describe(self) -> dict[str, Any]:
        return {"name": self.patch.name, "version": self.patch.version, "digest": self.patch.digest,
                "configDigest": config_digest(self.config),
                "appliedAt": self.applied_at, "applyMs": round(self.apply_ms, 3),
                "verifyMs": round(self.verify_ms, 3), "selfCheck": dict(self.self_check)}


LOW_PRECISION_MEAN_DIFF = 0.25   # bf16/fp16: reordered sums move logits by ~0.1 on average
LOW_PRECISION_ARGMAX = 0.9       # ... and rarely change the top token


def row_stats(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Per row of logits [rows, vocab]: largest and mean |difference|, whether the top token agrees,
    whether `after` is finite; [rows, 4] float32 on the CPU. A NaN difference counts as infinite."""
    before, after = before.float(), after.float()
    diff = (after - before).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    return torch.stack([diff.amax(-1), diff.mean(-1), (after.argmax(-1) == before.argmax(-1)).float(),
                        torch.isfinite(after).all(-1).float()], dim=1).cpu()


def _num(x: float, digits: int = 6) -> float | None:
    return float(f"{x:.{digits}g}") if math.isfinite(x) else None


@dataclass(slots=True)
class PartFigures:
    part: str
    positions: int
    worst: float
    mean: float
    agreement: float

    def describe(self) -> dict[str, Any]:
        return {"part": self.part, "positions": self.positions, "worst": _num(self.worst),
                "mean": _num(self.mean), "agreement": round(self.agreement, 4)}


@dataclass(slots=True)
class ProbeFigures:
    """How the probe logits under a tentative table compare with the current table's."""

    positions: int
    worst: float            # the largest |logit difference| anywhere
    mean: float             # the mean |logit difference| over every logit compared
    agreement: float        # the share of positions whose top token agrees
    worst_at: str           # the position of the largest difference, e.g. "decode A at context 196"
    parts: list[PartFigures]
    not_finite_at: str | None = None
    verify_ms: float = 0.0
    longest_pause_ms: float = 0.0
    pieces: int = 0

    @classmethod
    def of(cls, stats: torch.Tensor, rows: Seq[ProbeRow] | None = None) -> "ProbeFigures":
        """From `row_stats` rows, labelled by `rows` (each row its own position when None)."""
        n = stats.shape[0]
        if rows is None:
            rows = [ProbeRow("all positions", f"position {i}") for i in range(n)]
        if len(rows) != n:
            raise ValueError(f"{n} rows of figures for {len(rows)} probe positions")
        worst_row = int(stats[:, 0].argmax())
        bad = (stats[:, 3] == 0).nonzero()
        by_part: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            by_part.setdefault(row.part, []).append(i)
        parts = []
        for part, idx in by_part.items():
            sub = stats[idx]
            parts.append(PartFigures(part, len(idx), float(sub[:, 0].max()), float(sub[:, 1].mean()),
                                     float(sub[:, 2].mean())))
        return cls(n, float(stats[:, 0].max()), float(stats[:, 1].mean()), float(stats[:, 2].mean()),
                   rows[worst_row].where, parts, rows[int(bad[0])].where if len(bad) else None)

    @property
    def worst_part(self) -> PartFigures:
        return max(self.parts, key=lambda p: (p.worst, p.mean))

    def describe(self) -> dict[str, Any]:
        return {"positions": self.positions, "worst": _num(self.worst), "worstAt": self.worst_at,
                "mean": _num(self.mean), "agreement": round(self.agreement, 4),
                "verifyMs": round(self.verify_ms, 3), "longestPauseMs": round(self.longest_pause_ms, 3),
                "pieces": self.pieces, "parts": [p.describe() for p in self.parts]}

    def words(self) -> str:
        return (f"{self.positions} positions compared, the largest |logit difference| {self.worst:.4g} "
                f"({self.worst_at}), mean {self.mean:.4g}, top token agreeing on {self.agreement:.1%}")


def judge(figures: ProbeFigures, tolerance: float, dtype: torch.dtype) -> str | None:
    """Why the probe logits under a tentative table are not the same model's, or None when they are.

    In fp32 every logit must stay within the patch's tolerance. In 16-bit floats a fused path
    legitimately moves logits by up to ~1.5 (a different summation order), so there the mean
    difference and the agreement of the top token decide: the mean in every part of the probe on
    its own (a patch wrong only in long decodes must not hide behind the many positions it gets
    right), the agreement over all positions and in every part (see `_allowed`).
    """
    if figures.not_finite_at is not None:
        return f"probe logits are not finite ({figures.not_finite_at})"
    if dtype == torch.float32:
        if figures.worst <= tolerance:
            return None
        return f"probe logits differ by {figures.worst:.4g} at {figures.worst_at} (tolerance {tolerance:g})"
    limit = max(tolerance, LOW_PRECISION_MEAN_DIFF)
    for part in [*figures.parts, PartFigures("all positions", figures.positions, figures.worst, figures.mean,
                                             figures.agreement)]:
        if part.mean > limit or _disagreements(part.agreement, part.positions) > _allowed(part.positions):
            return (f"probe logits of {part.part} differ by {part.mean:.4g} on average (the most {part.worst:.4g}) "
                    f"and their top token agrees on {part.agreement:.0%} of {part.positions} positions "
                    f"(limits {limit:g}, {LOW_PRECISION_ARGMAX:.0%})")
    return None


def _disagreements(agreement: float, positions: int) -> int:
    return round((1 - agreement) * positions)


def _allowed(positions: int) -> int:
    """Top-token disagreements a part of `positions` may have in 16 bits: LOW_PRECISION_ARGMAX's
    share, and at least one (a near-tie that rounding flips; a part of eight decodes would
    otherwise fail on it)."""
    return max(1, math.floor((1 - LOW_PRECISION_ARGMAX) * positions + 1e-9))


def probe_verdict(before: torch.Tensor, after: torch.Tensor, tolerance: float, dtype: torch.dtype,
                  rows: Seq[ProbeRow] | None = None) -> str | None:
    """`judge` of the logits `after` against `before` ([positions, vocab]), labelled by `rows`."""
    return judge(ProbeFigures.of(row_stats(before, after), rows), tolerance, dtype)


# ---- the slots a request meets outside the forward pass, checked on probe inputs ----

PROBE_SEED = 1234


def check_sampler(sampler: Callable[..., Any], logits: torch.Tensor, vocab_size: int) -> str | None:
    """Call `sampler` on two rows of probe logits, a greedy one and a seeded sampling one: one valid
    token id per row, and the greedy row's top token."""
    logits = logits[:2].float()
    params = [SamplingParams(max_tokens=1, temperature=0.0),
              SamplingParams(max_tokens=1, temperature=0.8, top_p=0.95, top_k=50, seed=PROBE_SEED)]
    gen = torch.Generator(device=logits.device)
    gen.manual_seed(PROBE_SEED)
    try:
        tokens = list(sampler(logits, params, [None, gen]))
    except Exception as exc:
        return f"the sampler raised {describe(exc)}"
    if len(tokens) != len(params):
        return f"the sampler returned {len(tokens)} token ids for {len(params)} rows"
    for i, token in enumerate(tokens):
        try:
            token = operator.index(token)
        except TypeError:
            return f"the sampler returned {token!r} for row {i}, not a token id"
        if not 0 <= token < vocab_size:
            return f"the sampler returned {token} for row {i}, outside the vocabulary (0-{vocab_size - 1})"
        tokens[i] = token
    top = int(logits[0].argmax())
    if tokens[0] != top:
        return f"the sampler returned {tokens[0]} for a greedy row whose top token is {top}"
    return None


def probe_waiting(now: float) -> list[Sequence]:
    """Waiting sequences of different priorities, tenants and ages, for `check_policy`."""
    specs = [(0, "alpha", 3.0), (1, "beta", 2.0), (0, "alpha", 1.0), (-1, "gamma", 0.5), (0, "beta", 0.1)]
    return [Sequence(prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=1), priority=p, tenant=t,
                     arrival=now - age) for p, t, age in specs]


def check_policy(policy: Callable[..., Any], now: float | None = None) -> str | None:
    """Call `policy` on probe waiting sequences: it must return a permutation of them."""
    now = time.monotonic() if now is None else now
    waiting = probe_waiting(now)
    try:
        ordered = list(policy(list(waiting), now))
    except Exception as exc:
        return f"the scheduler policy raised {describe(exc)}"
    given = {id(s) for s in waiting}
    got = [id(s) for s in ordered]
    if any(i not in given for i in got):
        return "the scheduler policy returned something that was not among the waiting sequences"
    if len(set(got)) != len(got):
        return "the scheduler policy returned a waiting sequence more than once"
    if len(got) != len(waiting):
        return f"the scheduler policy returned {len(got)} of {len(waiting)} waiting sequences"
    return None


def probe_finished() -> Sequence:
    """A finished request, for `check_outcome`."""
    seq = Sequence(prompt_token_ids=[1, 2, 3, 4], params=SamplingParams(max_tokens=2), tenant="probe")
    seq.output_token_ids = [5, 6]
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.LENGTH
    seq.num_computed_tokens = len(seq)
    return seq


def check_outcome(outcome: Callable[..., Any]) -> str | None:
    """Call `outcome` on a finished probe request: (delay within [0, 60] s, failed: a bool)."""
    try:
        result = outcome(probe_finished())
    except Exception as exc:
        return f"request.outcome raised {describe(exc)}"
    try:
        delay, failed = result
    except (TypeError, ValueError):
        return f"request.outcome returned {result!r:.80}, not (delay, failed)"
    if isinstance(delay, bool) or not isinstance(delay, numbers.Real) \
            or not 0 <= float(delay) <= MAX_OUTCOME_DELAY:   # NaN fails the comparison too
        return f"request.outcome returned a delay of {delay!r:.40} (a number of seconds within [0, {MAX_OUTCOME_DELAY:g}])"
    if not isinstance(failed, (bool, int)):
        return f"request.outcome returned failed={failed!r:.40}, not a bool"
    return None


def check_slots(slots: SlotTable, logits: torch.Tensor, vocab_size: int) -> str | None:
    """The `sampler`, `scheduler.policy` and `request.outcome` of `slots` on probe inputs; the first
    problem, or None."""
    return (check_sampler(slots["sampler"], logits, vocab_size) or check_policy(slots["scheduler.policy"])
            or check_outcome(slots["request.outcome"]))


class _StateChanged(Exception):
    """The engine's state is no longer the one a self-check started from."""


class _Pieces:
    """Runs functions between two steps of the engine, one at a time, timing each; each first
    checks that the engine still runs `state` (else `_StateChanged`)."""

    def __init__(self, engine: LLMEngine, state: EngineState):
        self.engine, self.state = engine, state
        self.pauses: list[float] = []

    async def run(self, fn: Callable[[], Any]) -> Any:
        def timed() -> Any:
            t0 = time.perf_counter()
            try:
                if self.engine.state is not self.state:
                    raise _StateChanged
                return fn()
            finally:
                self.pauses.append((time.perf_counter() - t0) * 1000)
        return await self.engine.between_steps(timed)

    @property
    def longest(self) -> float:
        return max(self.pauses, default=0.0)


class PatchManager:
    """The engine's applied patches, and the only way to change them (one apply at a time; a revert never waits).

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
        self._reverts: dict[str, int] = {}          # name -> reverts asked for: calls off applies begun before
        self._bundles: dict[str, list[Patch]] = {}  # digest -> the patches of a bundle loaded once
        self._references: OrderedDict[str, torch.Tensor] = OrderedDict()  # revision -> its probe logits
        self.faults: deque[dict[str, Any]] = deque(maxlen=16)   # patches taken out for a failing slot
        self._loop: asyncio.AbstractEventLoop | None = None
        engine.on_slot_fault = self._slot_fault

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
                              for p in sorted(self.available.values(), key=lambda p: p.id)],
                "shadow": self.engine.shadow.describe(),
                "faults": list(self.faults),
                # start-up entries (GRAFT_PATCHES) from a bundle, not applied again yet: /ready is 503
                "awaiting": [ref for ref in self.engine.awaiting if not has_patch(state.revision, ref)]}

    def _settled(self, name: str) -> None:
        """The operator has decided about `name` (applied a version of it, or reverted it): a
        start-up entry of that name no longer holds /ready."""
        self.engine.awaiting = tuple(ref for ref in self.engine.awaiting if ref.partition("@")[0] != name)

    # resolution
    def admit(self, name: str, version: str, source: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> str:
        """The digest of what the request may apply (`builtin` for a built-in); nothing runs before this.

        A bundle's signature must cover `config`; `--min-patch-version` refuses built-ins too."""
        if "builtin" in source:
            self.verifier.revocations.check(name, version, None)
            return "builtin"
        module = source.get("module")
        if not isinstance(module, str) or not module.strip():
            raise PatchError(400, "source.module must hold the bundle's Python source")
        return self.verifier.verify(module, source.get("digest"), source.get("signature"), name=name, version=version,
                                    config=config)

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
        self._loop = asyncio.get_running_loop()
        asked = self._reverts.get(name, 0)
        digest = self.admit(name, version, source, config)   # refused at once: no wait behind another apply
        async with self._lock:
            self._still_wanted(name, version, asked)
            current = self.applied.get(name)
            if current is not None:  # answered before any code of the request runs
                same_code = current.patch.version == version and current.patch.digest == digest
                if same_code and config_digest(current.config) == config_digest(config):
                    return {"revision": self.revision, "applyMs": 0.0, "changed": False}
                if same_code and not replace:
                    raise PatchError(409, f"{current.patch.id} is applied with another config; apply it with "
                                          "\"replace\": true to swap the new config in atomically")
                if not replace:
                    raise PatchError(409, f"{current.patch.id} is applied; apply {name}@{version} with "
                                          f"\"replace\": true to swap it in atomically (or revert {name} first)")
            patch = await self.resolve(name, version, source, digest)
            slots = await self._slots_for(patch, config or {})
            clash = {s: a.patch.id for a in self.applied.values() if a.patch.name != name
                     for s in a.slots if s in slots}
            if clash:
                raise PatchError(409, f"{patch.id} replaces patch points already patched: {clash}")
            self._still_wanted(name, version, asked)
            await self._migrate(patch, current)
            try:
                applied, verdict, figures, current = await self._check_and_swap(patch, slots, config or {}, asked)
            except Exception:
                await self._unmigrate(patch, keep=self.applied.get(name))
                raise
            if verdict is not None:
                await self._unmigrate(patch, keep=current)
                self.engine.metrics.patch_failures.labels(patch.name, "verify").inc()
                kept = f"; {current.patch.id} stays applied" if current is not None else " and was reverted"
                said = f" ({figures.words()})" if figures is not None else ""
                raise PatchError(422, f"{patch.id} failed its self-check{kept}: {verdict}{said}")
            if current is not None:
                await self._unmigrate(current.patch, keep=applied)
                log.info("replaced %s with %s in %.2f ms (self-check %.1f ms, longest pause %.1f ms: %s)",
                         current.patch.id, patch.id, applied.apply_ms, applied.verify_ms,
                         figures.longest_pause_ms, figures.words())
            else:
                log.info("applied %s in %.2f ms (self-check %.1f ms, longest pause %.1f ms: %s)", patch.id,
                         applied.apply_ms, applied.verify_ms, figures.longest_pause_ms, figures.words())
            self._settled(name)
            return {"revision": self.revision, "applyMs": round(applied.apply_ms, 3),
                    "verifyMs": round(applied.verify_ms, 3), "changed": True, "selfCheck": figures.describe()}

    def _still_wanted(self, name: str, version: str, asked: int) -> None:
        """PatchError 409 when `name` was reverted after this apply of it arrived."""
        if self._reverts.get(name, 0) != asked:
            raise PatchError(409, f"{name} was reverted while {name}@{version} was being applied: not applied")

    async def revert(self, name: str) -> dict[str, Any]:
        """Take `name` out at the next step, without waiting for an apply under way (see the module)."""
        self._reverts[name] = self._reverts.get(name, 0) + 1
        self._settled(name)       # a restarted pod the operator wants without it: ready without it
        current = self.applied.get(name)
        if current is None:
            raise PatchError(404, f"no patch named {name} is applied")
        # a stuck step loop never runs it: answer within the engine's stall timeout instead
        limit = self.engine.config.stall_timeout
        future = self.engine.call_between_steps(lambda: self._swap_out_named(name))
        try:
            ms = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), limit)
        except asyncio.TimeoutError:
            raise PatchError(503, f"the step loop did not come round within {limit:g}s to revert {name} "
                                  f"({self.engine.health() or 'it is busy'}); the revert runs when it does") from None
        if ms is None:      # taken out between the two (another revert, a slot fault): nothing left to do
            return {"revision": self.revision, "applyMs": 0.0, "changed": False}
        await self._unmigrate(current.patch)
        return {"revision": self.revision, "applyMs": round(ms, 3), "changed": True}

    def _swap_out_named(self, name: str) -> float | None:
        """Step loop side of a revert: the patch applied under `name` now, if any, goes out."""
        applied = self.applied.get(name)
        return None if applied is None else self._swap_out(applied)

    def _slot_fault(self, slot: str, error: BaseException) -> bool:
        """The engine's `on_slot_fault` (step loop, between steps): a slot of an applied patch failed
        on live traffic; the patch that provides it (the last applied, whose slot the table runs)
        is taken out at once, and what its `migrate` added is dropped on the event loop after."""
        owners = [a for a in self.applied.values() if slot in a.slots]
        if not owners:
            return False
        applied = owners[-1]
        self._swap_out(applied)
        fault = {"patch": applied.patch.id, "slot": slot, "error": describe(error)[:300],
                 "at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                 "revision": self.engine.revision}
        self.faults.append(fault)
        log.error("took %s out: its %s failed on live traffic (%s); the engine runs %s",
                  applied.patch.id, slot, fault["error"], fault["revision"])
        if applied.patch.unmigrate and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._unmigrate(applied.patch)))
        return True

    async def warm_up(self) -> None:
        """Compute the current revision's probe logits ahead of the first apply (in pieces between
        steps, as a self-check does), so that apply pays only for the tentative table's probe; what
        goes wrong here is logged and left to the first apply to meet."""
        async with self._lock:
            state = self.engine.state
            try:
                t0 = time.perf_counter()
                pieces = _Pieces(self.engine, state)
                await self._reference(state, pieces)
                log.info("self-check reference of %s: %d positions in %.0f ms (longest pause %.0f ms)",
                         state.revision, len(self.engine.probe_plan.rows), (time.perf_counter() - t0) * 1000,
                         pieces.longest)
            except _StateChanged:
                pass
            except Exception:
                log.exception("computing the self-check reference of %s failed", state.revision)

    async def apply_startup(self, spec: str) -> tuple[str, ...]:
        """Apply `name@version,...` (GRAFT_PATCHES, the pod's `graft.dev/patches`) at start-up.

        Built-in entries are applied now; one that fails stops the process. An entry that is not
        built in came from a bundle, which only the operator can hand back (the engine keeps no
        code it was sent): it is left for it, and the engine answers /ready with 503 until every
        such entry is applied again (`LLMEngine.awaiting`), so a restarted pod serves neither
        `base` nor half its patches. Returns the entries left waiting.
        """
        waiting = []
        for name, version in parse_patch_list(spec):
            ref = f"{name}@{version}"
            if ref not in self.available:
                waiting.append(ref)
                continue
            try:
                await self.apply(name, version, {"builtin": True})
            except PatchError as exc:
                raise SystemExit(f"GRAFT_PATCHES: cannot apply {name}@{version}: {exc.message}") from None
        self.engine.awaiting = tuple(waiting)
        if waiting:
            log.warning("GRAFT_PATCHES names %s, not built in: a bundle's, which the operator applies again; "
                        "not ready until it has", ", ".join(waiting))
        return self.engine.awaiting

    def _state(self, applied: Mapping[str, Applied]) -> EngineState:
        """The engine state that runs `applied`: the base table with their slots, and its revision."""
        table = self.engine.base_slots
        for a in applied.values():
            table = table.with_slots(a.slots)
        return EngineState(table, revision_of([a.patch.id for a in applied.values()]), MappingProxyType(applied))

    # the self-check (event loop side; each piece runs in the step loop between two steps)
    async def _probe(self, slots: SlotTable, pieces: _Pieces,
                     before: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The probe plan's logits under `slots` ([positions, vocab], kept on the CPU in the engine's
        dtype, which holds them exactly), one forward pass per piece; with `before`, also each
        position's `row_stats` against it, computed in the same piece."""
        engine = self.engine
        run = engine.probe(slots)
        logits: list[torch.Tensor] = []
        stats: list[torch.Tensor] = []
        done = 0

        def piece() -> None:
            nonlocal done
            out = run.step().to("cpu", engine.dtype)
            if before is not None:
                stats.append(row_stats(before[done:done + out.shape[0]], out))
            logits.append(out)
            done += out.shape[0]

        while not run.done:
            await pieces.run(piece)
        return torch.cat(logits), (torch.cat(stats) if before is not None else None)

    async def _reference(self, state: EngineState, pieces: _Pieces) -> torch.Tensor:
        """The probe logits of `state`'s revision: computed once per revision, then remembered."""
        if state.revision in self._references:
            self._references.move_to_end(state.revision)
            return self._references[state.revision]
        logits, _ = await self._probe(state.slots, pieces)
        self._remember(state.revision, logits)
        return logits

    def _remember(self, revision: str, logits: torch.Tensor) -> None:
        self._references[revision] = logits
        self._references.move_to_end(revision)
        held = sum(t.nbytes for t in self._references.values())
        while len(self._references) > 1 and held > REFERENCE_BYTES:
            held -= self._references.popitem(last=False)[1].nbytes

    async def _check_and_swap(self, patch: Patch, slots: Mapping[str, Any], config: Mapping[str, Any],
                              asked: int) -> tuple[Applied, str | None, ProbeFigures | None, Applied | None]:
        """Self-check `patch` (with the applied version of its name, if any, out), then swap it in;
        also returns that version (what the swap took out). Each attempt starts from the engine's
        state as it is then: a revert during one changes it.

        The probe runs piece by piece while requests keep stepping on the current table; the
        tentative table is installed only by the last piece, once the verdict is clean, and nothing
        (revision, metrics) changes before that, so a refused patch leaves no trace. Returns the
        record, the verdict (None: applied) and the figures (None when the probe itself raised).
        """
        for _ in range(STATE_RETRIES):
            self._still_wanted(patch.name, patch.version, asked)
            state = self.engine.state
            current = state.patches.get(patch.name)
            try:
                return (*await self._attempt(patch, slots, config, current, state, asked), current)
            except _StateChanged:
                log.info("the engine's state changed during the self-check of %s: starting it again", patch.id)
        raise PatchError(409, f"the engine's state changed during each of {STATE_RETRIES} self-checks of "
                              f"{patch.id}; try again")

    async def _attempt(self, patch: Patch, slots: Mapping[str, Any], config: Mapping[str, Any],
                       current: Applied | None, state: EngineState, asked: int):
        engine = self.engine
        applied = Applied(patch, slots, "", 0.0, 0.0, config)
        tentative = self._state({**state.patches, patch.name: applied})   # `current` goes out in the same stroke
        pieces = _Pieces(engine, state)
        t0 = time.perf_counter()
        before = await self._reference(state, pieces)
        figures = None
        try:
            # the slots outside the forward pass first (cheap), on real logits: the reference's
            verdict = await pieces.run(lambda: check_slots(
                tentative.slots, before[-2:].to(engine.device, torch.float32), engine.model_config.vocab_size))
            if verdict is None:
                after, stats = await self._probe(tentative.slots, pieces, before)
                figures = ProbeFigures.of(stats, engine.probe_plan.rows)
                verdict = judge(figures, patch.tolerance, engine.dtype)
        except _StateChanged:
            raise
        except (Exception, SystemExit) as exc:   # a probe that raises is a failed self-check: the old table stays
            verdict = f"the probe raised {describe(exc)}"
        applied.verify_ms = (time.perf_counter() - t0) * 1000
        if figures is not None:
            figures.verify_ms, figures.pieces = applied.verify_ms, len(pieces.pauses)
            figures.longest_pause_ms = pieces.longest
        if verdict is not None:   # no step ran on the new table: its KV entries are the old table's
            return applied, verdict, figures
        await pieces.run(lambda: self._commit(tentative, applied, current, after, asked))
        figures.longest_pause_ms, figures.pieces = pieces.longest, len(pieces.pauses)
        applied.self_check = MappingProxyType(figures.describe())
        return applied, None, figures

    # the step loop side
    def _commit(self, tentative: EngineState, applied: Applied, current: Applied | None,
                after: torch.Tensor, asked: int) -> None:
        """Install `tentative`, its patch's metrics and its probe logits (the piece checked that the
        engine still runs the state `tentative` was built on, and this checks that no revert of the
        patch came since the apply arrived)."""
        engine = self.engine
        t0 = time.perf_counter()
        patch = applied.patch
        self._still_wanted(patch.name, patch.version, asked)
        if not patch.live_switch or (current is not None and not current.patch.live_switch):
            engine.preempt_running()
        applied.applied_at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        engine.swap(tentative)
        applied.apply_ms = (time.perf_counter() - t0) * 1000
        self._remember(tentative.revision, after)
        if current is not None:
            self._forget(current.patch)
        engine.metrics.patch_info.labels(patch.name, patch.version, patch.digest).set(1)
        engine.metrics.patch_apply.labels("apply" if current is None else "replace").observe(applied.apply_ms / 1000)

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
