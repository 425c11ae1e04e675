"""Benchmark data read from a directory given by flag or GRAFT_DATA_DIR (never kept in the repo).

BBH with chain-of-thought prompts: `bbh/cot-prompts/<task>.txt` (a canary header, a `-----` line,
then the 3-shot prefix) and `bbh/bbh/<task>.json` (examples with `input` and `target`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Prompt:
    task: str
    text: str
    target: str


def resolve_data_dir(path: str | os.PathLike | None = None) -> Path:
    candidates = [path, os.environ.get("GRAFT_DATA_DIR")]
    for c in candidates:
        if c:
            p = Path(c)
            if not (p / "bbh").is_dir():
                raise FileNotFoundError(f"{p} has no bbh/ folder (expected bbh/cot-prompts and bbh/bbh)")
            return p
    here = Path(__file__).resolve().parents[3] / "shared" / "data"
    if (here / "bbh").is_dir():
        return here
    raise FileNotFoundError("no benchmark data: pass --data-dir or set GRAFT_DATA_DIR to the folder holding bbh/")


def cot_prefix(data: Path, task: str) -> str:
    text = (data / "bbh" / "cot-prompts" / f"{task}.txt").read_text(encoding="utf-8")
    _, sep, rest = text.partition("-----\n")
    return (rest if sep else text).strip()


def bbh_tasks(data: Path) -> list[str]:
    return sorted(p.stem for p in (data / "bbh" / "cot-prompts").glob("*.txt"))


def bbh_prompts(data: str | os.PathLike | None = None, tasks: list[str] | None = None,
                per_task: int = 1) -> list[Prompt]:
    """3-shot CoT prompts: the task's prefix, then `Q: <input>\\nA: Let's think step by step.`"""
    root = resolve_data_dir(data)
    out = []
    for task in tasks or bbh_tasks(root):
        prefix = cot_prefix(root, task)
        examples = json.loads((root / "bbh" / "bbh" / f"{task}.json").read_text(encoding="utf-8"))["examples"]
        for ex in examples[:per_task]:
            out.append(Prompt(task, f"{prefix}\n\nQ: {ex['input']}\nA: Let's think step by step.", ex["target"]))
    return out


def mixed_bbh_prompts(n: int, data: str | os.PathLike | None = None) -> list[Prompt]:
    """n prompts taken round-robin over all tasks (distinct examples while they last), deterministic."""
    root = resolve_data_dir(data)
    tasks = bbh_tasks(root)
    per_task = -(-n // len(tasks))
    by_task = [bbh_prompts(root, [t], per_task) for t in tasks]
    interleaved = [p for i in range(per_task) for ps in by_task if i < len(ps) for p in [ps[i]]]
    if not interleaved:
        raise FileNotFoundError(f"no BBH examples under {root}")
    return [interleaved[i % len(interleaved)] for i in range(n)]
