"""Durations as the PatchRollout spells them: `30s`, `5m`, `1h30m`, `250ms` (Go style, no spaces)."""
from __future__ import annotations

import re

DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in `text`; raises ValueError naming the accepted form."""
    if not isinstance(text, str) or not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{text!r} is not a duration like 30s, 5m, 1h30m or 250ms")
    return sum(float(n) * _UNIT[u] for n, u in _PART.findall(text))


def format_duration(seconds: float) -> str:
    """The shortest spelling of `seconds`: 300 -> '5m', 90 -> '1m30s', 0.25 -> '250ms'."""
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    if seconds < 1 and seconds != int(seconds):
        return f"{round(seconds * 1000)}ms"
    out, rest = "", seconds
    for unit, size in (("h", 3600), ("m", 60)):
        count = int(rest // size)
        if count:
            out += f"{count}{unit}"
            rest -= count * size
    if rest or not out:
        out += f"{rest:g}s"
    return out


def promql_duration(seconds: float) -> str:
    """`seconds` as PromQL accepts it inside a range selector (no decimals): 60 -> '60s', 1.5 -> '1500ms'."""
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"
