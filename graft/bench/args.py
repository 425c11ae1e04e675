"""`graft bench` arguments (kept free of heavy imports: the CLI builds its parser eagerly)."""
from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", nargs="?", default="all", choices=["all", "throughput", "patches", "apply"],
                   help="throughput: BBH CoT vs transformers; patches: the 3.2.1 set vs 3.2.0; "
                        "apply: hot-patch apply latency under load")
    p.add_argument("--data-dir", default=None, help="folder holding bbh/ (default: $GRAFT_DATA_DIR)")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("-n", "--num-prompts", type=int, default=16)
    p.add_argument("-c", "--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cycles", type=int, default=200, help="apply/revert cycles for the apply suite")
    p.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    p.add_argument("--out", default="docs/bench", help="folder for JSON results and PNG plots")
