"""`graft eval bbh`: score one endpoint (and optionally a baseline) on a seeded BBH sample.

The last line of stdout is the result as one JSON object, so a Job's last log line is the
measurement (the job metric provider reads `$.difference`, say); progress goes to stderr before it.
Exit codes: 0 scored (engine errors are counted in the result, as wrong answers); 2 bad input, an
unreachable endpoint or a request the endpoint refused as malformed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from graft.evals import bbh
from graft.evals.endpoint import Endpoint, Refused, Unreachable

EXIT_BAD_INPUT = 2
# a Job's log is no terminal: wide enough that a line stays one line there
console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval", required=True)
    b = sub.add_parser("bbh", help="BIG-Bench Hard accuracy of an OpenAI-compatible endpoint, against a baseline's",
                       description="Send a seeded sample of BBH questions, greedy, to --url (and --baseline-url), "
                                   "read each answer from its chain of thought (\"So the answer is X.\"), score "
                                   "exact match, and print the result as one JSON line, the last of stdout.")
    b.add_argument("--url", required=True, help="the endpoint to score (http://HOST:PORT, /v1 optional)")
    b.add_argument("--baseline-url", default=None,
                   help="an endpoint to compare with: adds baseline_accuracy, difference (baseline minus this) "
                        "and changed (questions whose answers differ)")
    b.add_argument("--tasks", default=None,
                   help="comma-separated BBH tasks (default: all 27)")
    b.add_argument("--per-task", type=int, default=3, help="questions drawn from each task (default 3)")
    b.add_argument("--seed", type=int, default=0, help="the draw of questions (default 0)")
    b.add_argument("--shots", type=int, default=bbh.MAX_SHOTS,
                   help="worked CoT examples before each question, 0-3 (default 3: BBH's CoT prompt whole)")
    b.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (default 256)")
    b.add_argument("-c", "--concurrency", type=int, default=4,
                   help="questions in flight per endpoint (default 4)")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds one answer may take (default 600)")
    b.add_argument("--data-dir", default=None,
                   help="the folder holding bbh/ (default: GRAFT_DATA_DIR, else ../shared/data)")
    b.set_defaults(eval_func=main_bbh)


def say(message: str) -> None:
    """One line of progress on stderr, stamped with the time (a Job's log has no other clock)."""
    console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {message}", highlight=False)


def main(args: argparse.Namespace) -> int:
    return args.eval_func(args)


def _check(args: argparse.Namespace) -> None:
    for name in ("max_tokens", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout:g}")


def main_bbh(args: argparse.Namespace) -> int:
    """Run `graft eval bbh`; see the module docstring for its output and exit codes."""
    try:
        _check(args)
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
        questions = bbh.sample(args.data_dir, tasks, args.per_task, args.seed, args.shots)
    except (ValueError, FileNotFoundError) as e:
        console.print(f"graft eval bbh: {e}", style="red", markup=False, highlight=False)
        return EXIT_BAD_INPUT
    logging.getLogger("httpx").setLevel(logging.WARNING)   # a line per request would bury the progress
    try:
        result = asyncio.run(_evaluate(args, questions))
    except (Unreachable, Refused) as e:
        console.print(f"graft eval bbh: {e}", style="red", markup=False, highlight=False)
        return EXIT_BAD_INPUT
    sys.stderr.flush()
    print(json.dumps(result), flush=True)
    return 0


async def _evaluate(args: argparse.Namespace, questions: list[bbh.Question]) -> dict:
    limits = httpx.Limits(max_connections=2 * args.concurrency + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        endpoints = [await Endpoint.open(client, args.url)]
        if args.baseline_url:
            endpoints.append(await Endpoint.open(client, args.baseline_url))
        tasks = len(dict.fromkeys(q.task for q in questions))
        say(f"BBH: {len(questions)} questions ({tasks} tasks, {args.per_task} each, seed {args.seed}, "
                    f"{args.shots} shots), at most {args.max_tokens} tokens each, "
                    f"to {' and '.join(e.url for e in endpoints)} ({endpoints[0].model})")
        started = time.monotonic()
        results: list[list[str | None]] = [[None] * len(questions) for _ in endpoints]
        with _progress(len(questions) * len(endpoints)) as advance:
            gates = [asyncio.Semaphore(args.concurrency) for _ in endpoints]

            async def ask(e: int, i: int) -> None:
                async with gates[e]:
                    results[e][i] = await endpoints[e].complete(questions[i].prompt, args.max_tokens, bbh.STOP,
                                                                args.timeout)
                advance()
            # question by question, both endpoints alike: each sees the questions in the same order
            jobs = [asyncio.create_task(ask(e, i)) for i in range(len(questions)) for e in range(len(endpoints))]
            try:
                await asyncio.gather(*jobs)
            finally:
                for job in jobs:
                    job.cancel()
        result = bbh.score(questions, results[0], results[1] if len(endpoints) > 1 else None)
        say(f"scored in {time.monotonic() - started:.0f} s: accuracy {result['accuracy']}"
                    + (f", baseline {result['baseline_accuracy']}, {result['changed']} answers changed"
                       if len(endpoints) > 1 else "")
                    + (f", engine errors {result['errors']}" if result["errors"] else "")
                    + (f", baseline engine errors {result['baseline_errors']}" if result["baseline_errors"] else ""))
        return result


@contextmanager
def _progress(total: int) -> Iterator[Callable[[], None]]:
    """A bar on a terminal; elsewhere (a Job's log) a line at each tenth done, so the log stays short."""
    if console.is_terminal:
        with Progress(TextColumn("answers"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            task = bar.add_task("answers", total=total)
            yield lambda: bar.advance(task)
        return
    done = 0
    step = max(1, total // 10)

    def advance() -> None:
        nonlocal done
        done += 1
        if done % step == 0 or done == total:
            say(f"{done}/{total} answers")
    yield advance
