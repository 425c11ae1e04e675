"""Benchmark data read from a directory given by flag or GRAFT_DATA_DIR (never kept in the repo).

BBH with chain-of-thought prompts: `bbh/cot-prompts/<task>.txt` (a canary header, a `-----` line,
then the 3-shot prefix) and `bbh/bbh/<task>.json` (examples with `input` and `target`).

The workload suite adds two classes beside BBH's long few-shot prompts:

- GSM8K, `gsm8k/test.jsonl` (`question`, `answer` ending in `#### <number>`): zero-shot,
  `Question: <question>\\nAnswer:`, so its prompts stay short (31-133 tokens, 66 on average) and
  share no prefix, the opposite of BBH's; a few-shot prefix would make it a second BBH.
- HumanEval, `humaneval/HumanEval.jsonl.gz` (`task_id`, `prompt`, `canonical_solution`, ...): the
  code prompt as is (a signature and docstring to complete).
"""
from __future__ import annotations

import gzip
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


def mixed_bbh_prompts(n: int, data: str | os.PathLike | None = None, num_tasks: int | None = None) -> list[Prompt]:
    """n prompts taken round-robin over all tasks, or the first `num_tasks` of them (distinct examples
    while they last), deterministic."""
    root = resolve_data_dir(data)
    tasks = bbh_tasks(root)[:num_tasks]
    per_task = -(-n // len(tasks))
    by_task = [bbh_prompts(root, [t], per_task) for t in tasks]
    interleaved = [p for i in range(per_task) for ps in by_task if i < len(ps) for p in [ps[i]]]
    if not interleaved:
        raise FileNotFoundError(f"no BBH examples under {root}")
    return [interleaved[i % len(interleaved)] for i in range(n)]


WORKLOAD_CLASSES = ("bbh", "gsm8k", "humaneval")
GSM8K_FILE = ("gsm8k", "test.jsonl")
HUMANEVAL_FILE = ("humaneval", "HumanEval.jsonl.gz")


def dataset_file(root: Path, folder: str, name: str) -> Path:
    """`root/folder/name`, or a FileNotFoundError that names the missing folder or file."""
    if not (root / folder).is_dir():
        raise FileNotFoundError(f"{root} has no {folder}/ folder (expected {folder}/{name})")
    path = root / folder / name
    if not path.is_file():
        raise FileNotFoundError(f"{root / folder} has no {name}")
    return path


def require_workload_data(data: str | os.PathLike | None = None) -> Path:
    """The data folder, checked to hold every workload class (BBH, GSM8K, HumanEval)."""
    root = resolve_data_dir(data)
    for folder, name in (GSM8K_FILE, HUMANEVAL_FILE):
        dataset_file(root, folder, name)
    return root


def _first(n: int, rows: list[Prompt], what: str) -> list[Prompt]:
    """The first n rows, cycling when there are fewer (as `mixed_bbh_prompts` does)."""
    if not rows:
        raise FileNotFoundError(f"{what} holds no examples")
    return [rows[i % len(rows)] for i in range(n)]


def gsm8k_prompts(n: int, data: str | os.PathLike | None = None) -> list[Prompt]:
    """The first n GSM8K test questions as `Question: ...\\nAnswer:`; the target is the final number."""
    path = dataset_file(resolve_data_dir(data), *GSM8K_FILE)
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if len(rows) == n:
                break
            if line.strip():
                ex = json.loads(line)
                rows.append(Prompt("gsm8k", f"Question: {ex['question']}\nAnswer:",
                                   ex["answer"].rpartition("####")[2].strip()))
    return _first(n, rows, str(path))


def humaneval_prompts(n: int, data: str | os.PathLike | None = None) -> list[Prompt]:
    """The first n HumanEval problems, the code prompt as is; the target is the canonical solution."""
    path = dataset_file(resolve_data_dir(data), *HUMANEVAL_FILE)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [Prompt(ex["task_id"], ex["prompt"], ex["canonical_solution"])
                for ex in map(json.loads, filter(str.strip, f))]
    return _first(n, rows[:n], str(path))


def class_prompts(name: str, n: int, data: str | os.PathLike | None = None, *, num_bbh_tasks: int | None = None
                  ) -> list[Prompt]:
    """n prompts of a workload class; BBH's are round-robin over its first `num_bbh_tasks` tasks."""
    if name == "bbh":
        return mixed_bbh_prompts(n, data, num_bbh_tasks)
    if name == "gsm8k":
        return gsm8k_prompts(n, data)
    if name == "humaneval":
        return humaneval_prompts(n, data)
    raise ValueError(f"unknown workload class {name!r}: one of {', '.join(WORKLOAD_CLASSES)}")
