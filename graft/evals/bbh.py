"""BIG-Bench Hard as a quality check: a fixed, seeded sample of questions, their prompts, and the
answer read out of a chain-of-thought completion the way BBH's CoT format states it.

The data is read where `graft bench` reads it (`graft.bench.data`: `--data-dir`, GRAFT_DATA_DIR, or
`../shared/data`), never copied. A prompt is the task's CoT prompt (its description, then up to
three worked examples ending "So the answer is X.") cut to `shots` examples, then
`Q: <input>\\nA: Let's think step by step.`; with 3 shots the prompts run from about 240 to 1,500
tokens (most past 500), with 0 they are the question alone (tens of tokens).
"""
from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from graft.bench.data import bbh_tasks, cot_prefix, resolve_data_dir

MAX_SHOTS = 3                 # BBH's CoT prompts hold three worked examples
STOP = ["\n\nQ:"]             # a completion that goes on to invent the next question ends there
_ANSWER = re.compile(r"the answer is[ \t]*(.*)", re.IGNORECASE)
_OPTION = re.compile(r"\(([A-R])\)")


@dataclass(frozen=True, slots=True)
class Question:
    task: str
    index: int                # the example's position in the task's file: the sample is reproducible
    prompt: str
    target: str


def prompt_prefix(prefix: str, shots: int) -> str:
    """A task's CoT prompt cut to its first `shots` worked examples (its description kept)."""
    parts = prefix.split("\n\nQ: ")
    return "\n\nQ: ".join(parts[:1 + shots])


def sample(data: str | os.PathLike | None = None, tasks: Sequence[str] | None = None, per_task: int = 3,
           seed: int = 0, shots: int = MAX_SHOTS) -> list[Question]:
    """`per_task` examples of each task drawn with `seed` (the same draw on every machine and run),
    in task order then file order. Raises ValueError naming an unknown task or a bad number."""
    if per_task < 1:
        raise ValueError(f"--per-task must be at least 1, got {per_task}")
    if not 0 <= shots <= MAX_SHOTS:
        raise ValueError(f"--shots must be within [0, {MAX_SHOTS}], got {shots}")
    root = resolve_data_dir(data)
    known = bbh_tasks(root)
    chosen = list(tasks) if tasks else known
    unknown = [t for t in chosen if t not in known]
    if unknown:
        raise ValueError(f"--tasks: unknown BBH task {unknown[0]!r} (known: {', '.join(known)})")
    out = []
    for task in chosen:
        examples = json.loads((Path(root) / "bbh" / "bbh" / f"{task}.json").read_text(encoding="utf-8"))["examples"]
        # one generator per task, seeded by the task's name too: adding a task leaves the others' draws alone
        picked = sorted(random.Random(f"{seed}:{task}").sample(range(len(examples)), min(per_task, len(examples))))
        head = prompt_prefix(cot_prefix(root, task), shots)
        for i in picked:
            ex = examples[i]
            out.append(Question(task, i, f"{head}\n\nQ: {ex['input']}\nA: Let's think step by step.", ex["target"]))
    return out


def extract_answer(completion: str) -> str | None:
    """The answer a CoT completion states ("... So the answer is X."): the rest of that line without
    its final period; None when it states none (a completion cut short, or off the format)."""
    m = _ANSWER.search(completion)
    if not m:
        return None
    answer = m.group(1).strip()
    if answer.endswith("."):
        answer = answer[:-1].rstrip()
    return answer or None


def is_correct(answer: str | None, target: str) -> bool:
    """Exact match with the target; for a multiple-choice target such as "(B)" the option the answer
    opens with ("(B) 04/12/1986" is "(B)")."""
    if answer is None:
        return False
    if _OPTION.fullmatch(target):
        m = _OPTION.match(answer)
        return m is not None and m.group(0) == target
    return answer == target


def _share(k: int, n: int) -> float | None:
    return round(k / n, 4) if n else None


def score(questions: Sequence[Question], completions: Sequence[str | None],
          baseline: Sequence[str | None] | None = None) -> dict:
    """The evaluation's result from each question's completion (None: the engine failed it, counted
    in `errors` and wrong), and the baseline endpoint's when there is one: `difference` is the
    baseline's accuracy minus this one's (positive: worse than the baseline), `changed` the questions
    whose stated answers differ between the two."""
    answers = [extract_answer(c) if c is not None else None for c in completions]
    right = [is_correct(a, q.target) for a, q in zip(answers, questions)]
    out: dict = {"accuracy": _share(sum(right), len(questions)), "baseline_accuracy": None, "difference": None,
                 "n": len(questions), "per_task": {}, "changed": None,
                 "errors": sum(c is None for c in completions), "baseline_errors": None}
    base_right: list[bool] = []
    if baseline is not None:
        base_answers = [extract_answer(c) if c is not None else None for c in baseline]
        base_right = [is_correct(a, q.target) for a, q in zip(base_answers, questions)]
        out["baseline_accuracy"] = _share(sum(base_right), len(questions))
        out["difference"] = round((sum(base_right) - sum(right)) / len(questions), 4) if questions else None
        out["changed"] = sum(a != b for a, b in zip(answers, base_answers))
        out["baseline_errors"] = sum(c is None for c in baseline)
    for task in dict.fromkeys(q.task for q in questions):
        rows = [i for i, q in enumerate(questions) if q.task == task]
        entry = {"n": len(rows), "accuracy": _share(sum(right[i] for i in rows), len(rows))}
        if baseline is not None:
            entry["baseline_accuracy"] = _share(sum(base_right[i] for i in rows), len(rows))
        out["per_task"][task] = entry
    return out
