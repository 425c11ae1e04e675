"""`graft bench kernels` without a GPU: a smoke run in Triton's interpreter at tiny sizes."""
from __future__ import annotations

import json

import pytest
import torch

from graft.kernels.cpu_avx512 import cpu_supported
from graft.kernels.native_build import cpu_flags


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the suite times compiled kernels")
def test_bench_kernels_checks_every_kernel_in_the_interpreter(tmp_path):
    from graft.bench.kernels import run_kernels
    failed = run_kernels(tmp_path / "kernels.json", quick=True, case_ms=5)
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert data["mode"] == "interpreter"
    kernels = {r["kernel"] for r in data["results"]}
    layers = {"linear.avx512", "rms_norm.avx512", "rope.avx512", "silu_mul.avx512"}
    assert kernels == {"decode", "prefill.slot", "kv.store", "decode.cpu", "decode.avx512", "prefill.cpu"} | layers
    # the C attention kernels are timed for real, against their twins, in the dtypes they take
    rows = {name: [r for r in data["results"] if r["kernel"] == name] for name in kernels}
    assert {r["dtype"] for r in rows["decode.cpu"]} == {"bf16", "fp32"}
    assert {r["dtype"] for r in rows["decode.avx512"] + rows["prefill.cpu"]} == {"bf16"}
    avx512 = rows["decode.avx512"] + rows["prefill.cpu"] + [r for name in layers for r in rows[name]]
    timed = rows["decode.cpu"] + avx512
    if not cpu_supported(cpu_flags()):      # no AVX-512 BF16: those rows say so and fail
        timed = rows["decode.cpu"]
        failed -= len(avx512)
    # the small-row linear kernel at a decode step's rows, reading weights from memory
    assert {r["batch"] for r in rows["linear.avx512"]} == {1, 16} and {r["unit"] for r in rows["linear.avx512"]} <= {"GB/s"}
    assert all(r["kernel_ms"] > 0 and r["torch_ms"] > 0 for r in timed)
    assert {r["unit"] for r in rows["prefill.cpu"]} <= {"TFLOP/s"} and {r["unit"] for r in rows["decode.avx512"]} <= {"GB/s"}
    assert failed == 0, [r for r in data["results"] if not r["ok"]]
    assert all(r["max_err"] <= r["tolerance"] for r in data["results"] if r["max_err"] is not None)
