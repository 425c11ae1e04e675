"""`graft bench` arguments (kept free of heavy imports: the CLI builds its parser eagerly).

The engine's own flags come from `graft.engine.config.add_engine_args`, the very flags of
`graft serve` with the same defaults: `graft bench` given no engine flags measures the engine a
user gets out of the box.
"""
from __future__ import annotations

import argparse
import shlex

from graft.engine.config import add_engine_args

PATCH_SET = "kv-align@3.2.1,prefill-fusion@3.2.1,sync-free@3.2.1"
ONE_TASK = "logical_deduction_five_objects"   # ~830 prompt tokens with its 3-shot CoT prefix
MAX_LOAD = 1.5          # 1-minute load average above which a run is refused (see --allow-load)
BASELINES = ("transformers", "llama-server", "engine", "none")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", nargs="?", default="all", choices=["all", "throughput", "patches", "apply", "kernels"],
                   help="throughput: the engine against a baseline on BBH CoT prompts; patches: the 3.2.1 set vs "
                        "the plain 3.2.0 paths; apply: hot-patch apply latency under load; kernels: the Triton "
                        "kernels against their torch twins (a GPU; on a CPU a small smoke run in the interpreter)")
    p.add_argument("--data-dir", default=None, help="folder holding bbh/ (default: $GRAFT_DATA_DIR)")
    p.add_argument("-n", "--num-prompts", type=int, default=16, help="BBH prompts per pass")
    p.add_argument("-c", "--concurrency", type=int, default=16,
                   help="requests in flight (and the transformers batch size, llama-server's slots)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes of each side, alternating A/B/A/B (a fresh engine per pass); the report gives "
                        "the median ratio and its spread")
    p.add_argument("--baseline", default="transformers", choices=BASELINES,
                   help="throughput: what the engine is compared with: transformers generate (same model file "
                        "and dtype), llama-server on PATH (same GGUF), another engine started with "
                        "--baseline-engine-args, or none")
    p.add_argument("--baseline-engine-args", default="", type=shlex.split, metavar="FLAGS",
                   help="with --baseline engine: its `graft serve` flags on top of this run's, e.g. "
                        "'--no-prefix-caching' or '--paths plain'")
    p.add_argument("--baseline-patches", default="", metavar="LIST",
                   help="with --baseline engine: its GRAFT_PATCHES (name@version,...), e.g. sync-free@3.2.1 "
                        "for the padded batched decode; the measured engine gets none")
    p.add_argument("--no-baseline", dest="baseline", action="store_const", const="none",
                   help="same as --baseline none")
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
    add_engine_args(p)
