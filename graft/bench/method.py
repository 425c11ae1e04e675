"""How a comparison is measured honestly on a shared machine.

- Refuse to start on a busy machine: at a load average of 3-4 the engine once measured 2.5x
  transformers, on a quiet machine the same work gave 1.05-1.25x. The 1-minute load average is
  read before the run (`check_load`) and recorded before and after every pass.
- Alternate: A/B/A/B, one fresh process per pass, so a slow drift of the machine (another job
  starting, thermal limits) moves both sides rather than one.
- Report the median of the per-round ratios with their spread (min..max), never one pass.
"""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass


class MachineBusy(RuntimeError):
    """The machine is too busy for figures that mean anything."""


def load_average() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0


def check_load(limit: float, allow: bool, read: Callable[[], float] | None = None) -> float:
    """The current load (`read()`, default `load_average()`); MachineBusy above `limit` unless `allow`."""
    load = (read or load_average)()
    if load > limit and not allow:
        raise MachineBusy(f"the 1-minute load average is {load:.2f}, above {limit:g}: other work on this machine "
                          f"would distort the figures. Wait for a quiet machine, or pass --allow-load to measure "
                          f"anyway (the load is recorded with every pass)")
    return load


def alternation(rounds: int, sides: tuple[str, ...] = ("engine", "baseline")) -> Iterator[tuple[int, str]]:
    """(round, side) in the order passes run: every side once per round, rounds one after another."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    for r in range(rounds):
        for side in sides:
            yield r, side


@dataclass(frozen=True, slots=True)
class Spread:
    """The median of per-round ratios A/B, with the smallest and largest."""

    median: float
    low: float
    high: float
    ratios: tuple[float, ...]

    def as_dict(self) -> dict[str, float | list[float]]:
        return {"median": self.median, "min": self.low, "max": self.high, "per_round": list(self.ratios)}

    def __str__(self) -> str:
        if len(self.ratios) == 1:
            return f"{self.median:.2f}x (one round)"
        return f"{self.median:.2f}x (min {self.low:.2f}, max {self.high:.2f}, {len(self.ratios)} rounds)"


def ratio_spread(a: list[float], b: list[float]) -> Spread:
    """Per-round ratios a[i] / b[i] (rounds paired as they ran), summarised."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same number (> 0) of passes on each side, got {len(a)} and {len(b)}")
    if any(x <= 0 for x in b):
        raise ValueError("a baseline pass measured no throughput")
    ratios = tuple(x / y for x, y in zip(a, b))
    return Spread(statistics.median(ratios), min(ratios), max(ratios), ratios)
