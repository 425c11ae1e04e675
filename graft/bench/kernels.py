"""Suite `kernels`: each Graft Triton kernel against its torch twin, on SmolLM2-135M shapes.

    graft bench kernels [--quick] [--budget-s 100] [--out .graft-bench]  (writes kernels.json)

Shapes: 9 query heads, 3 KV heads, head dim 64, 64-token cache blocks; batches 1..64, contexts
128..4096, fp16 and bf16. Every case first checks the kernel against its twin (the twin computes
in fp32; the error is relative, |a - b| / (1 + |b|)), then times both with CUDA events over as many
repetitions as fit a short per-case budget (kernels get context lengths as device tensors, as
under CUDA graphs; the twins get lists). Prints one table per kernel and writes every number to
kernels.json. The Triton figures mean something on a CUDA GPU only. Without one the Triton part is
a smoke run: the kernels run in Triton's interpreter (TRITON_INTERPRET=1, about 1 ms per program
instance) on a few tiny fp16 shapes, checked against their twins, and those timings are not
figures. On a CPU the suite also measures, for real, the C attention kernels the engine runs there, on the
host clock: the portable decode attention (`decode.cpu`, graft/kernels/cpu_decode.py, bf16 and
fp32) and the AVX-512 BF16 one (`decode.avx512`, graft/kernels/cpu_avx512.py) against their torch
twin `decode_attention_varlen`, and the AVX-512 BF16 prefill attention (`prefill.cpu`) against
`prefill_attention_fused` (torch's SDPA); and the AVX-512 BF16 kernels around attention
(`linear.avx512` at a decode step's rows, `rms_norm.avx512`, `rope.avx512`, `silu_mul.avx512`)
against the torch expressions they replace. The attention kernels' caches are warm (the same tensors call after
call), so the decode ratios are smaller than inside a decode step, where every layer's weights
evict the cache between calls.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

N_HEADS, N_KV, HEAD_DIM, BLOCK = 9, 3, 64, 64
SCALE = HEAD_DIM**-0.5
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {"fp16": 5e-3, "bf16": 3e-2, "fp32": 1e-5}
Timer = Callable[[Callable[[], object], float], float]


@dataclass(slots=True)
class Case:
    kernel: str           # "decode", "prefill.slot", "kv.store", "decode.cpu",
                          # "decode.avx512", "prefill.cpu", and the LAYER_KERNELS
    dtype: str
    batch: int            # sequences; for kv.store, tokens stored
    context: int          # cached tokens per sequence before this step
    new_tokens: int       # new tokens per sequence in this step


@dataclass(slots=True)
class Result:
    kernel: str
    dtype: str
    batch: int
    context: int
    new_tokens: int
    kernel_ms: float | None = None
    torch_ms: float | None = None
    speedup: float | None = None
    throughput: float | None = None
    unit: str = ""
    max_err: float | None = None
    tolerance: float = 0.0
    ok: bool = False
    error: str | None = None


@dataclass(slots=True)
class Prepared:
    """One case ready to run: both implementations, how to read their answers, the work done."""

    run_kernel: Callable[[], object]
    run_torch: Callable[[], object]
    answers: Callable[[], tuple[torch.Tensor, torch.Tensor]]    # (the kernel's, the twin's)
    work: float                                                 # bytes or flops per call
    unit: str                                                   # "GB/s" or "TFLOP/s"


def cases(quick: bool) -> list[Case]:
    batches = [1, 64] if quick else [1, 8, 32, 64]
    contexts = [128, 4096] if quick else [128, 512, 1024, 4096]
    slot_prefills = [(3584, 512)] if quick else [(0, 512), (0, 2048), (3584, 512)]
    stores = [1, 4096] if quick else [1, 64, 512, 4096]
    out: list[Case] = []
    for dtype in ("fp16", "bf16"):
        out += [Case("decode", dtype, b, c - 1, 1) for b in batches for c in contexts]
        out += [Case("prefill.slot", dtype, 1, prior, new) for prior, new in slot_prefills]
        out += [Case("kv.store", dtype, t, 0, 1) for t in stores]
    return out


def paged_cache(batch: int, tokens: int, dtype: torch.dtype, device: torch.device):
    """A cache holding `tokens` tokens per sequence in shuffled blocks, plus one spare block."""
    per_seq = math.ceil(tokens / BLOCK)
    num_blocks = batch * per_seq + 1
    shape = (num_blocks, BLOCK, N_KV, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    return k_cache, v_cache, tables


def prepare(case: Case, device: torch.device) -> Prepared:
    from graft.kernels import reference
    from graft.kernels.kv_store import store_kv
    from graft.kernels.paged_decode import paged_decode_attention
    from graft.kernels.prefill import prefill_attention

    dtype = DTYPES[case.dtype]
    size = torch.finfo(dtype).bits // 8
    b, prior, new = case.batch, case.context, case.new_tokens
    total = prior + new
    if case.kernel == "decode":
        k_cache, v_cache, tables = paged_cache(b, total, dtype, device)
        q = torch.randn(b, N_HEADS, HEAD_DIM, dtype=dtype, device=device)
        lens = [total] * b
        lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
        got = lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens_t, SCALE)
        want = lambda: reference.decode_attention(q, k_cache, v_cache, tables, lens, SCALE)
        return Prepared(got, want, lambda: (got(), want()), 2 * b * total * N_KV * HEAD_DIM * size, "GB/s")
    if case.kernel == "decode.cpu":
        from graft.kernels.cpu_decode import paged_decode_attention_cpu, supports
        from graft.kernels.native_build import NativeKernelError
        from graft.kernels.torch_attention import decode_attention_varlen
        k_cache, v_cache, tables = paged_cache(b, total, dtype, device)
        q = torch.randn(b, N_HEADS, HEAD_DIM, dtype=dtype, device=device)
        if not supports(q, k_cache):
            raise NativeKernelError("the native decode kernel is not available here (see the log)")
        lens = [total] * b
        got = lambda: paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, SCALE)
        want = lambda: decode_attention_varlen(q, k_cache, v_cache, tables, lens, SCALE, None)
        return Prepared(got, want, lambda: (got(), want()), 2 * b * total * N_KV * HEAD_DIM * size, "GB/s")
    if case.kernel == "decode.avx512":
        from graft.kernels.cpu_avx512 import paged_decode_attention, supports_decode
        from graft.kernels.native_build import NativeKernelError
        from graft.kernels.torch_attention import decode_attention_varlen
        k_cache, v_cache, tables = paged_cache(b, total, dtype, device)
        q = torch.randn(b, N_HEADS, HEAD_DIM, dtype=dtype, device=device)
        if not supports_decode(q, k_cache, v_cache):
            raise NativeKernelError("the AVX-512 BF16 decode kernel is not available here (see the log)")
        lens = [total] * b
        got = lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, SCALE)
        want = lambda: decode_attention_varlen(q, k_cache, v_cache, tables, lens, SCALE, None)
        return Prepared(got, want, lambda: (got(), want()), 2 * b * total * N_KV * HEAD_DIM * size, "GB/s")
    if case.kernel == "prefill.cpu":
        from graft.kernels.cpu_avx512 import prefill_attention, supports_prefill
        from graft.kernels.native_build import NativeKernelError
        from graft.kernels.torch_attention import prefill_attention_fused
        q = torch.randn(new, N_HEADS, HEAD_DIM, dtype=dtype, device=device)
        k = torch.randn(total, N_KV, HEAD_DIM, dtype=dtype, device=device)
        v = torch.randn(total, N_KV, HEAD_DIM, dtype=dtype, device=device)
        if not supports_prefill(q, k, v):
            raise NativeKernelError("the AVX-512 BF16 prefill kernel is not available here (see the log)")
        got = lambda: prefill_attention(q, k, v, SCALE)
        want = lambda: prefill_attention_fused(q, k, v, SCALE)
        return Prepared(got, want, lambda: (got(), want()), _causal_flops(prior, new), "TFLOP/s")
    if case.kernel in LAYER_KERNELS:
        return _prepare_layer(case)
    if case.kernel == "prefill.slot":
        q = torch.randn(new, N_HEADS, HEAD_DIM, dtype=dtype, device=device)
        k = torch.randn(total, N_KV, HEAD_DIM, dtype=dtype, device=device)
        v = torch.randn(total, N_KV, HEAD_DIM, dtype=dtype, device=device)
        got = lambda: prefill_attention(q, k, v, SCALE)
        want = lambda: reference.prefill_attention(q, k, v, SCALE)
        return Prepared(got, want, lambda: (got(), want()), _causal_flops(prior, new), "TFLOP/s")
    if case.kernel == "kv.store":
        k_cache, v_cache, _ = paged_cache(1, b, dtype, device)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        k = torch.randn(b, N_KV, HEAD_DIM, dtype=dtype, device=device)
        v = torch.randn(b, N_KV, HEAD_DIM, dtype=dtype, device=device)
        slots = torch.randperm(k_cache.shape[0] * BLOCK, device=device)[:b]
        got = lambda: store_kv(k, v, k_cache, v_cache, slots)
        want = lambda: reference.store_kv(k, v, k_ref, v_ref, slots)

        def answers() -> tuple[torch.Tensor, torch.Tensor]:
            got(), want()
            return torch.stack([k_cache, v_cache]), torch.stack([k_ref, v_ref])

        return Prepared(got, want, answers, 2 * 2 * b * N_KV * HEAD_DIM * size, "GB/s")
    raise ValueError(f"unknown kernel {case.kernel!r}")


LAYER_KERNELS = ("linear.avx512", "rms_norm.avx512", "rope.avx512", "silu_mul.avx512")
LAYER_BYTES = 96 << 20
"""Each linear case spreads its calls over this many bytes of weights, more than a last-level
cache holds, as a decode step's thirty layers do: one layer's weights called again and again
would stay in the cache and show a bandwidth no step sees."""


def _prepare_layer(case: Case) -> Prepared:
    """The AVX-512 BF16 kernels around attention (graft/kernels/cpu_avx512.py) against the torch
    expressions they replace in the model, bf16. `linear.avx512`: batch rows, context output
    features, new input features, GB/s of weights read. The others: batch rows of SmolLM2's sizes
    (hidden 576, intermediate 1,536), GB/s of tensors read and written."""
    import torch.nn.functional as F

    from graft.engine.models.llama import apply_rope
    from graft.kernels import cpu_avx512
    from graft.kernels.native_build import NativeKernelError

    if not cpu_avx512.available():
        raise NativeKernelError("the AVX-512 BF16 kernels are not available here (see the log)")
    bf16, rows = torch.bfloat16, case.batch
    if case.kernel == "linear.avx512":
        n, k = case.context, case.new_tokens
        copies = max(1, LAYER_BYTES // (2 * n * k))
        weights = [torch.randn(n, k).mul_(0.05).to(bf16) for _ in range(copies)]
        x = torch.randn(rows, k, dtype=bf16)
        got = lambda: [cpu_avx512.linear(x, w) for w in weights]
        want = lambda: [F.linear(x, w) for w in weights]
        return Prepared(got, want, lambda: (got()[0], want()[0]), 2.0 * n * k * copies, "GB/s")
    hidden, inter, n_kv = N_HEADS * HEAD_DIM, 1536, N_KV
    if case.kernel == "rms_norm.avx512":
        x, delta = torch.randn(rows, hidden, dtype=bf16), torch.randn(rows, hidden, dtype=bf16)
        w = torch.randn(hidden, dtype=bf16)

        def twin():
            h = (x + delta).float()
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(bf16)

        got = lambda: cpu_avx512.rms_norm(x.clone(), w, 1e-5, delta=delta)
        return Prepared(got, twin, lambda: (got(), twin()), 2.0 * rows * hidden * 4, "GB/s")
    if case.kernel == "rope.avx512":
        qkv = torch.randn(rows, hidden + 2 * n_kv * HEAD_DIM, dtype=bf16)
        q, k, _ = (t.view(rows, -1, HEAD_DIM) for t in qkv.split([hidden, n_kv * HEAD_DIM, n_kv * HEAD_DIM], -1))
        pos = torch.arange(rows, dtype=torch.long)
        inv = 1.0 / (100000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        emb = torch.outer(torch.arange(max(rows, 2048)).float(), inv).repeat(1, 2)
        cos, sin = emb.cos(), emb.sin()

        def twin():
            c, s = cos[pos].to(bf16)[:, None], sin[pos].to(bf16)[:, None]
            return apply_rope(q, c, s), apply_rope(k, c, s)

        # the kernel rotates k in place: each call rotates a copy, as the twin reads the original
        got = lambda: cpu_avx512.rope(q, k.clone(), pos, cos, sin)
        answers = lambda: (got(), twin()[0])
        return Prepared(got, twin, answers, 2.0 * rows * (N_HEADS + n_kv) * HEAD_DIM * 2, "GB/s")
    gate_up = torch.randn(rows, 2 * inter, dtype=bf16)

    def twin():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    got = lambda: cpu_avx512.silu_mul(gate_up)
    return Prepared(got, twin, lambda: (got(), twin()), 2.0 * rows * inter * 3, "GB/s")


def _causal_flops(prior: int, new: int) -> float:
    # Each query sees the prior context and the new tokens up to itself; QK^T and PV, 2 flops a MAC.
    visible = new * prior + new * (new + 1) / 2
    return 4.0 * N_HEADS * HEAD_DIM * visible


def cuda_time_ms(fn: Callable[[], object], budget_ms: float) -> float:
    """Mean milliseconds per call, over as many calls (3..200) as fit `budget_ms`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = int(min(200, max(3, budget_ms / max(start.elapsed_time(end), 1e-3))))
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def run_case(case: Case, device: torch.device, timer: Timer, budget_ms: float) -> Result:
    result = Result(**asdict(case), tolerance=TOLERANCE[case.dtype])
    try:
        prepared = prepare(case, device)
        got, want = prepared.answers()
        result.max_err = float(((got.float() - want.float()).abs() / (1 + want.float().abs())).max())
        result.ok = result.max_err <= result.tolerance
        result.kernel_ms = timer(prepared.run_kernel, budget_ms)
        result.torch_ms = timer(prepared.run_torch, budget_ms)
        result.speedup = result.torch_ms / result.kernel_ms
        scale = 1e9 if prepared.unit == "GB/s" else 1e12
        result.throughput = prepared.work / (result.kernel_ms * 1e-3) / scale
        result.unit = prepared.unit
    except Exception as exc:  # one broken case must not hide the others
        result.ok = False
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


def run_all(todo: list[Case], device: torch.device, timer: Timer, budget_ms: float, deadline_s: float) -> list[Result]:
    started = time.monotonic()
    results = []
    for case in todo:
        if time.monotonic() - started > deadline_s:
            results.append(Result(**asdict(case), tolerance=TOLERANCE[case.dtype], error="skipped: time budget spent"))
            continue
        results.append(run_case(case, device, timer, budget_ms))
    return results


def render(results: list[Result]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    # Piped output (a log, a remote run) would otherwise be squeezed to 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=130)
    for kernel in dict.fromkeys(r.kernel for r in results):
        rows = [r for r in results if r.kernel == kernel]
        unit = next((r.unit for r in rows if r.unit), "")
        what = "C" if kernel.endswith((".cpu", ".avx512")) else "Triton"
        shape = f"{N_HEADS} heads / {N_KV} KV heads / dim {HEAD_DIM}"
        if kernel == "linear.avx512":
            shape = "batch: rows, context: out features, new: in features"
        elif kernel in LAYER_KERNELS:
            shape = "batch: rows of SmolLM2's hidden 576 / intermediate 1,536"
        table = Table(title=f"{kernel}: {what} vs torch twin ({shape})", box=box.SIMPLE_HEAD)
        for column in ("dtype", "batch", "context", "new", f"{what.lower()} ms", "torch ms", "speedup", unit,
                       "max err", ""):
            table.add_column(column, justify="right")
        for r in rows:
            table.add_row(
                r.dtype, str(r.batch), str(r.context), str(r.new_tokens),
                _fmt(r.kernel_ms, ".4f"), _fmt(r.torch_ms, ".4f"), _fmt(r.speedup, ".1f", "x"),
                _fmt(r.throughput, ".1f"), _fmt(r.max_err, ".1e"),
                "[green]ok[/]" if r.ok else "[red]FAIL[/]",
            )
        console.print(table)
        for r in rows:
            if not r.ok:
                console.print(f"  [red]{r.dtype} batch {r.batch} context {r.context} new {r.new_tokens}:[/] "
                              f"{r.error or f'error {r.max_err:.1e} over tolerance {r.tolerance:.0e}'}", markup=True)


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def environment(device: torch.device) -> dict[str, str]:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
    }


def tiny_cases() -> list[Case]:
    """Shapes small enough for the interpreter: correctness of every kernel in seconds."""
    return [Case("decode", "fp16", 2, 100, 1), Case("prefill.slot", "fp16", 1, 32, 16),
            Case("kv.store", "fp16", 8, 0, 1)]


def cpu_cases(quick: bool) -> list[Case]:
    """The C attention kernels on SmolLM2 shapes: the batches and contexts of a CPU decode step for
    the decode kernels (the portable one in bf16 and fp32, the AVX-512 BF16 one in bf16), and one
    sequence's prefill chunk (new tokens after cached ones) for the prefill kernel."""
    batches = [1, 16] if quick else [1, 4, 16, 32]
    contexts = [512, 2048] if quick else [256, 1024, 2048, 4096]
    chunks = [(0, 512), (512, 512)] if quick else [(0, 256), (0, 1024), (1024, 1024), (0, 2048), (3072, 1024)]
    rows = [1, 16] if quick else [1, 4, 16, 32, 64]
    shapes = [(960, 576), (3072, 576)] if quick else [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
    return ([Case("decode.cpu", dtype, b, c - 1, 1) for dtype in ("bf16", "fp32") for b in batches for c in contexts]
            + [Case("decode.avx512", "bf16", b, c - 1, 1) for b in batches for c in contexts]
            + [Case("prefill.cpu", "bf16", 1, prior, new) for prior, new in chunks]
            + [Case("linear.avx512", "bf16", m, n, k) for m in rows for n, k in shapes]
            + [Case(name, "bf16", t, 0, 0) for name in LAYER_KERNELS[1:] for t in ([16, 1024] if quick else [1, 16, 1024])])


def wall_time_ms(fn: Callable[[], object], budget_ms: float) -> float:
    """Mean milliseconds per call on the host clock (interpreter runs: not a figure of merit)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def host_time_ms(fn: Callable[[], object], budget_ms: float) -> float:
    """Mean milliseconds per call on the host clock, over as many calls (3..200) as fit `budget_ms`,
    after one call to warm up: the timer of the CPU kernel."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = (time.perf_counter() - t0) * 1000
    reps = int(min(200, max(3, budget_ms / max(once, 1e-3))))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1000 / reps


def run_kernels(out: Path, quick: bool = False, budget_s: float = 100.0, case_ms: float = 100.0) -> int:
    """Run the cases, print the tables, write `out`; returns how many cases failed or were skipped."""
    if torch.cuda.is_available():
        if os.environ.pop("TRITON_INTERPRET", None) not in (None, "", "0"):
            # the interpreter would run the kernels as Python on the host: nothing worth timing
            print("note: TRITON_INTERPRET ignored: a GPU is here and this times compiled kernels", file=sys.stderr)
        torch.backends.cuda.matmul.allow_tf32 = False     # the twins' fp32 math stays fp32
        device, timer, todo, mode = torch.device("cuda"), cuda_time_ms, cases(quick), "gpu"
    else:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("graft bench kernels on a CPU needs TRITON_INTERPRET=1 before Triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        print("no CUDA GPU: a smoke run of the kernels in Triton's interpreter at tiny sizes; the timings are "
              "not figures", file=sys.stderr)
        device, timer, todo, mode = torch.device("cpu"), wall_time_ms, tiny_cases(), "interpreter"
    torch.manual_seed(0)
    started = time.monotonic()
    with torch.inference_mode():
        results = run_all(todo, device, timer, case_ms, budget_s)
        if device.type == "cpu":      # the kernel a CPU engine really runs, timed for real
            results += run_all(cpu_cases(quick), device, host_time_ms, case_ms,
                               max(0.0, budget_s - (time.monotonic() - started)))
    elapsed = time.monotonic() - started
    render(results)
    report = {"mode": mode, "environment": environment(device), "elapsed_s": round(elapsed, 2),
              "shape": {"n_heads": N_HEADS, "n_kv": N_KV, "head_dim": HEAD_DIM, "block_size": BLOCK},
              "results": [asdict(r) for r in results]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    bad = [r for r in results if not r.ok]
    print(f"{len(results)} cases in {elapsed:.1f} s, {len(bad)} failed or skipped; results in {out}")
    return len(bad)
