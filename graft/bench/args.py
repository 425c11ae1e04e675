"""`graft bench` arguments (kept free of heavy imports: the CLI builds its parser eagerly)."""
from __future__ import annotations

import argparse

PATCH_SET = "kv-align@3.2.1,prefill-fusion@3.2.1,sync-free@3.2.1"
ONE_TASK = "logical_deduction_five_objects"   # ~830 prompt tokens with its 3-shot CoT prefix


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", nargs="?", default="all", choices=["all", "throughput", "patches", "apply"],
                   help="throughput: BBH CoT vs transformers; patches: the 3.2.1 set vs 3.2.0; "
                        "apply: hot-patch apply latency under load")
    p.add_argument("--data-dir", default=None, help="folder holding bbh/ (default: $GRAFT_DATA_DIR)")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="engine and transformers dtype (bf16 is the faster one on AVX-512 CPUs)")
    p.add_argument("--device", default="auto", help="the engine's device: auto, cpu or cuda")
    p.add_argument("-n", "--num-prompts", type=int, default=16, help="BBH prompts per pass")
    p.add_argument("-c", "--concurrency", type=int, default=16,
                   help="requests in flight (and the transformers batch size)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    p.add_argument("--cycles", type=int, default=200, help="apply/revert cycles for the apply suite")
    p.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    p.add_argument("--out", default="docs/bench", help="folder for JSON results and PNG plots")
    p.add_argument("--workload", default="both", choices=["mixed", "one-task", "both"],
                   help="throughput prompts: round-robin over all BBH tasks, one task (shared 3-shot "
                        "prefix), or both")
    p.add_argument("--task", default=ONE_TASK, help="the BBH task of the one-task workload")
    p.add_argument("--patches", default=PATCH_SET,
                   help="the patch set: GRAFT_PATCHES of the throughput engine ('base' for none), and what "
                        "the patches and apply suites apply")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="the engine's token budget per step (512 measured best on 2 CPU cores)")
    p.add_argument("--kv-cache-memory", default="2G", help="the engine's KV cache budget")
    p.add_argument("--rounds", type=int, default=1,
                   help="patches suite: plain/patched passes alternate this many times")
    p.add_argument("--light-concurrency", type=int, default=2, help="apply suite: requests in flight meanwhile")
