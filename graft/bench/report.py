"""Benchmark reports: rich tables on the terminal, JSON files and matplotlib PNG plots.

Everything here takes plain numbers (lists, dicts, `loadgen.Summary`), so suites stay free of
presentation code and the plots can be redrawn from the JSON alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from graft.bench.loadgen import Summary

# wide enough for the tables when the output goes to a file or a pipe rather than a terminal
console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)


# ---- progress ----

@contextlib.contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """`with progress_bar("engine", 16) as advance: ... advance(1)`; drawn on stderr."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner while something without steps runs (an engine starting, a model loading)."""
    with console.status(message):
        yield
    console.log(message.rstrip(". ") + ": done")


# ---- metadata ----

def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU, core count, load, library versions, date."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    info["load_average"] = load_average()
    info["engine_source_sha256"] = source_digest()
    try:
        import torch
        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def source_digest() -> str:
    """A short digest of the engine's source files, its kernels' (Python and C) among them: which
    engine code a result was measured on."""
    package = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    paths = [*(package / "engine").rglob("*.py"), *(package / "kernels").rglob("*.py"),
             *(package / "kernels").rglob("*.c")]
    for path in sorted(paths):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages: how busy the (shared) machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def command_line() -> str:
    """The command as typed, for a report to say exactly what produced it."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("cli.py", "graft")):
        argv[0] = "graft"
    return shlex.join(argv)


# ---- files ----

def plain(obj: Any) -> Any:
    """Plain JSON data from results: dataclasses and `as_dict()` objects unfolded, NaN as None."""
    return _clean(obj)


def _clean(obj: Any) -> Any:
    """JSON has no NaN: write null for missing measurements."""
    if hasattr(obj, "as_dict"):
        return _clean(obj.as_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _clean(dataclasses.asdict(obj))
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike, data: Mapping[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_clean(data), indent=2) + "\n", encoding="utf-8")
    return p


# ---- tables ----

def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1000:,.0f}"


def summary_table(title: str, rows: Mapping[str, Summary], ratio_to: str | None = None) -> Table:
    """One row per run; `ratio_to` names the row every throughput is divided by."""
    t = Table(title=title, title_justify="left")
    for col in ("run", "requests", "errors", "out tok", "tok/s", "ratio", "TTFT p50 ms", "TTFT p99 ms",
                "TPOT p50 ms", "TPOT p99 ms", "lat p99 s"):
        t.add_column(col, justify="left" if col == "run" else "right")
    base = rows[ratio_to].output_tok_s if ratio_to in rows else None
    for name, s in rows.items():
        ratio = f"{s.output_tok_s / base:.2f}x" if base else "-"
        lat = "-" if math.isnan(s.latency_p99) else f"{s.latency_p99:.1f}"
        t.add_row(name, str(s.requests), str(s.errors), str(s.output_tokens), f"{s.output_tok_s:.1f}", ratio,
                  _ms(s.ttft_p50), _ms(s.ttft_p99), _ms(s.tpot_p50), _ms(s.tpot_p99), lat)
    return t


def kv_table(title: str, rows: Sequence[tuple[str, str]]) -> Table:
    t = Table(title=title, title_justify="left", show_header=False)
    t.add_column("key")
    t.add_column("value", justify="right")
    for k, v in rows:
        t.add_row(k, v)
    return t


def show(table: Table) -> None:
    console.print(table)


# ---- plots ----

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_throughput(path: str | os.PathLike, bars: Mapping[str, float], *, baseline: str, title: str,
                    ylabel: str = "output tokens/s") -> Path:
    """Bars of throughput, each labelled with its value and its ratio to `baseline`."""
    if baseline not in bars:
        raise ValueError(f"baseline {baseline!r} is not one of the bars {list(bars)}")
    plt = _pyplot()
    names, values = list(bars), [bars[n] for n in bars]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(names) + 2), 4))
    colors = ["#9aa5b1" if n == baseline else "#2f6fb0" for n in names]
    rects = ax.bar(names, values, color=colors)
    base = bars[baseline]
    for rect, v in zip(rects, values):
        label = f"{v:.3g}\n({v / base:.2f}x)" if base else f"{v:.3g}"
        ax.annotate(label, (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center", va="bottom",
                    fontsize=9, xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel(ylabel)
    ax.set_title(_wrap(title, 60), fontsize=10)
    ax.set_ylim(0, max(values) * 1.25 if values and max(values) > 0 else 1)
    ax.tick_params(axis="x", labelsize=8)
    return _save(fig, plt, path)


def plot_passes(path: str | os.PathLike, passes: Sequence[Mapping[str, Any]], ratio: Mapping[str, Any] | None, *,
                names: Mapping[str, str], title: str, roofline: float | None = None) -> Path:
    """Every pass in the order it ran, one colour per side, each labelled with its throughput and
    the load average before it; the title carries the median ratio and its spread, and a dashed
    line the roofline when there is one."""
    plt = _pyplot()
    width = max(5.0, 0.9 * len(passes) + 2)
    fig, ax = plt.subplots(figsize=(width, 4))
    colors = {"engine": "#2f6fb0", "baseline": "#9aa5b1"}
    xs = list(range(1, len(passes) + 1))
    values = [p["output_tok_s"] for p in passes]
    rects = ax.bar(xs, values, color=[colors.get(p["side"], "#d08030") for p in passes])
    for rect, p in zip(rects, passes):
        ax.annotate(f"{p['output_tok_s']:.3g}\nload {p['load_before']:.1f}",
                    (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    for side, color in colors.items():
        if any(p["side"] == side for p in passes):
            ax.bar([0], [0], color=color, label=names.get(side, side))
    ax.set_xticks(xs, [f"{i}\nround {p['round'] + 1}" for i, p in zip(xs, passes)], fontsize=8)
    ax.set_xlim(0.4, len(passes) + 0.6)
    top = max([*values, roofline or 0.0], default=1.0)
    if roofline:
        ax.axhline(roofline, color="#c0392b", linestyle="--", linewidth=1, label=f"roofline {roofline:.0f} tok/s")
    ax.set_ylim(0, top * 1.3 or 1.0)
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=8, loc="best", framealpha=0.9)
    if ratio:
        title += (f" | engine / {names.get('baseline', 'baseline')}: median {ratio['median']:.2f}x "
                  f"(min {ratio['min']:.2f}, max {ratio['max']:.2f})")
    ax.set_title(_wrap(title, min(70, int(11 * width))), fontsize=9)    # about 11 characters an inch
    return _save(fig, plt, path)


def plot_cdf(path: str | os.PathLike, series: Mapping[str, Sequence[float]], *, xlabel: str, title: str,
             scale: float = 1.0) -> Path:
    """Empirical CDF of each series (values multiplied by `scale`, e.g. 1000 for ms)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in series.items():
        xs = sorted(v * scale for v in values)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{name} (n={len(xs)})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(_wrap(title), fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def plot_histogram(path: str | os.PathLike, series: Mapping[str, Sequence[float]], *, xlabel: str, title: str,
                   bins: int = 40, limit: float | None = None) -> Path:
    """Overlaid histograms on log-spaced bins (latencies span decades); `limit` draws a dashed target line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    values = [v for vs in series.values() for v in vs if v > 0]
    if values:
        lo = min(values) / 1.2
        hi = max(max(values), limit or 0.0) * 1.2
        edges = [lo * (hi / lo) ** (i / bins) for i in range(bins + 1)]
        for name, vs in series.items():
            if vs:
                ax.hist([v for v in vs if v > 0], bins=edges, alpha=0.6, label=f"{name} (n={len(vs)})")
        ax.set_xscale("log")
    if limit is not None:
        ax.axvline(limit, color="#b03030", linestyle="--", linewidth=1, label=f"target {limit:g}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")
    ax.set_title(_wrap(title), fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def _wrap(title: str, width: int = 70) -> str:
    import textwrap
    return "\n".join(textwrap.wrap(title, width))


def _save(fig, plt, path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
