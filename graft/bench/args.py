"""`graft bench` arguments (kept free of heavy imports: the CLI builds its parser eagerly).

The engine's own flags come from `graft.engine.config.add_engine_args`, the very flags of
`graft serve` with the same defaults: `graft bench` given no engine flags measures the engine a
user gets out of the box.
"""
from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Mapping

from graft.bench.data import WORKLOAD_CLASSES
from graft.engine.config import add_engine_args

PATCH_SET = "kv-align@3.2.1,prefill-fusion@3.2.1,sync-free@3.2.1"
ONE_TASK = "logical_deduction_five_objects"   # ~830 prompt tokens with its 3-shot CoT prefix
MAX_LOAD = 1.5          # 1-minute load average above which a run is refused (see --allow-load)
BASELINES = ("transformers", "llama-server", "engine", "none")
# workload suite: short GSM8K prompts get more streams than long BBH and HumanEval ones; together 16
# in flight, the concurrency the other suites measure at
CLASS_CONCURRENCY = {"bbh": 4, "gsm8k": 8, "humaneval": 4}
CLASS_PROMPTS = {name: 16 for name in WORKLOAD_CLASSES}
SWEEP = (1, 2, 4, 8, 16, 32, 64)


def class_values(defaults: Mapping[str, int]) -> Callable[[str], dict[str, int]]:
    """An argparse type: `N` for every workload class, or `bbh=4,gsm8k=8` (others keep `defaults`)."""
    def parse(text: str) -> dict[str, int]:
        if "=" not in text:
            return {name: _positive(text) for name in WORKLOAD_CLASSES}
        values = dict(defaults)
        for part in filter(None, (x.strip() for x in text.split(","))):
            name, _, value = part.partition("=")
            if name.strip() not in WORKLOAD_CLASSES:
                raise argparse.ArgumentTypeError(
                    f"unknown workload class {name.strip()!r}: one of {', '.join(WORKLOAD_CLASSES)}")
            values[name.strip()] = _positive(value)
        return values
    return parse


def concurrency_list(text: str) -> list[int]:
    """An argparse type: `1,2,4,8` -> [1, 2, 4, 8] (sorted, each once, every one at least 1)."""
    values = sorted({_positive(x) for x in text.split(",") if x.strip()})
    if not values:
        raise argparse.ArgumentTypeError("the sweep names no concurrency")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text.strip()!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _spec(values: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in values.items())


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", nargs="?", default="all",
                   choices=["all", "throughput", "patches", "apply", "kernels", "workload", "shadow", "operator"],
                   help="throughput: the engine against a baseline on BBH CoT prompts; patches: the 3.2.1 set vs "
                        "the plain 3.2.0 paths; apply: hot-patch apply latency under load; kernels: the Triton "
                        "kernels against their torch twins (a GPU; on a CPU a small smoke run in the interpreter); "
                        "workload: BBH, GSM8K and HumanEval alone vs mixed, and a concurrency sweep (not in all: "
                        "it runs for many minutes); shadow: what the shadow comparison of a patched engine costs "
                        "its clients, off vs on (not in all; -n 48 and --rounds 2 make a useful run); operator: "
                        "the real operator against the API server emulator and engine stand-ins, by fleet size "
                        "and concurrent rollouts (not in all; no model is loaded)")
    p.add_argument("--data-dir", default=None,
                   help="folder holding bbh/ (and gsm8k/, humaneval/ for the workload suite; default: "
                        "$GRAFT_DATA_DIR)")
    p.add_argument("-n", "--num-prompts", type=int, default=16, help="BBH prompts per pass")
    p.add_argument("-c", "--concurrency", type=int, default=16,
                   help="requests in flight (and the transformers batch size)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes of each side, alternating A/B/A/B (a fresh engine per pass); the report gives "
                        "the median ratio and its spread")
    p.add_argument("--baseline", default="transformers", choices=BASELINES,
                   help="throughput: what the engine is compared with: transformers generate (same model file "
                        "and dtype), llama-server (same GGUF; `make llama-server` builds it), another engine started with "
                        "--baseline-engine-args, or none")
    p.add_argument("--baseline-engine-args", default="", type=shlex.split, metavar="FLAGS",
                   help="with --baseline engine: its `graft serve` flags on top of this run's, e.g. "
                        "'--no-prefix-caching' or '--paths plain'")
    p.add_argument("--baseline-patches", default="", metavar="LIST",
                   help="with --baseline engine: its GRAFT_PATCHES (name@version,...), e.g. sync-free@3.2.1 "
                        "for the padded batched decode; the measured engine gets none")
    p.add_argument("--no-baseline", dest="baseline", action="store_const", const="none",
                   help="same as --baseline none")
    p.add_argument("--llama-slots", type=concurrency_list, default=[4, 16], metavar="N,N",
                   help="with --baseline llama-server: its parallel slot counts (-np) to sweep before the rounds; "
                        "the fastest setting is the one measured")
    p.add_argument("--llama-ubatch", type=concurrency_list, default=[512], metavar="N,N",
                   help="with --baseline llama-server: its micro-batch sizes (-ub) to sweep with the slot counts")
    p.add_argument("--allow-load", action="store_true",
                   help=f"run even when the 1-minute load average is above {MAX_LOAD} (figures then say little)")
    p.add_argument("--out", default=".graft-bench",
                   help="folder for JSON results and PNG plots (docs/bench/... to refresh the committed figures)")
    p.add_argument("--workload", default="both", choices=["mixed", "one-task", "both"],
                   help="throughput prompts: round-robin over all BBH tasks (no shared prefix), one task "
                        "(shared 3-shot prefix), or both")
    p.add_argument("--task", default=ONE_TASK, help="the BBH task of the one-task workload")
    p.add_argument("--patches", default=PATCH_SET,
                   help="what the patches and apply suites apply on the plain 3.2.0 paths")
    p.add_argument("--cycles", type=int, default=200, help="apply/revert cycles for the apply suite")
    p.add_argument("--light-concurrency", type=int, default=2, help="apply suite: requests in flight meanwhile")
    p.add_argument("--quick", action="store_true", help="kernels: a few shapes only")
    p.add_argument("--budget-s", type=float, default=100.0, help="kernels: skip the cases left after this long")
    p.add_argument("--class-prompts", type=class_values(CLASS_PROMPTS), default=dict(CLASS_PROMPTS),
                   metavar="N|CLASS=N,...",
                   help=f"workload: requests each class completes per pass, alone and mixed (default "
                        f"{_spec(CLASS_PROMPTS)}); BBH takes them round-robin over that many tasks")
    p.add_argument("--class-concurrency", type=class_values(CLASS_CONCURRENCY), default=dict(CLASS_CONCURRENCY),
                   metavar="N|CLASS=N,...",
                   help=f"workload: each class's requests in flight, alone and in the mixed pass (default "
                        f"{_spec(CLASS_CONCURRENCY)})")
    p.add_argument("--sweep", type=concurrency_list, default=list(SWEEP), metavar="C1,C2,...",
                   help=f"workload: the concurrencies of the sweep (default {','.join(map(str, SWEEP))})")
    p.add_argument("--sweep-waves", type=int, default=2,
                   help="workload: requests per sweep point, in multiples of its concurrency")
    o = p.add_argument_group("operator suite")
    o.add_argument("--fleet-sizes", type=size_list, default=[10, 100, 1000], metavar="N,N",
                   help="operator: pods of the one fleet of each case ('' for none)")
    o.add_argument("--concurrent-rollouts", type=size_list, default=[1, 10, 50], metavar="R,R",
                   help="operator: rollouts at once, each over a fleet of its own ('' for none)")
    o.add_argument("--rollout-fleet-size", type=_positive, default=10, metavar="N",
                   help="operator: pods of each fleet in the concurrent-rollouts cases")
    o.add_argument("--tick", type=float, default=5.0, help="operator: its tick (GRAFT_TICK_SECONDS)")
    o.add_argument("--ticks", type=_positive, default=4, help="operator: ticks sampled at rest and while rolling")
    o.add_argument("--standin-latency", type=float, default=0.0, metavar="S",
                   help="operator: seconds an engine stand-in takes to answer an admin call")
    o.add_argument("--standin-failure-rate", type=float, default=0.0, metavar="P",
                   help="operator: share of admin calls the stand-ins answer 503")
    o.add_argument("--operator-source", default=None, metavar="DIR",
                   help="operator: run the operator from this source tree (holding graft/), e.g. an exported "
                        "earlier commit, to compare before and after")
    o.add_argument("--operator-env", action="append", default=[], metavar="NAME=VALUE",
                   help="operator: a further setting for the operator process (repeatable), e.g. "
                        "GRAFT_FLEET_RESYNC_SECONDS=60")
    add_engine_args(p)


def size_list(text: str) -> list[int]:
    """An argparse type: `10,100,1000` -> [10, 100, 1000]; an empty text -> [] (the sweep skipped)."""
    return sorted({_positive(x) for x in text.split(",") if x.strip()})
