"""`graft bench kernels` without a GPU: a smoke run in Triton's interpreter at tiny sizes."""
from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the suite times compiled kernels")
def test_bench_kernels_checks_every_kernel_in_the_interpreter(tmp_path):
    from graft.bench.kernels import run_kernels
    failed = run_kernels(tmp_path / "kernels.json", quick=True, case_ms=5)
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert data["mode"] == "interpreter"
    kernels = {r["kernel"] for r in data["results"]}
    assert kernels == {"decode", "prefill.paged", "prefill.slot", "kv.store", "decode.cpu"}
    # the C decode attention is timed for real, against its twin, in both dtypes it takes
    cpu = [r for r in data["results"] if r["kernel"] == "decode.cpu"]
    assert {r["dtype"] for r in cpu} == {"bf16", "fp32"}
    assert all(r["kernel_ms"] > 0 and r["torch_ms"] > 0 and r["unit"] == "GB/s" for r in cpu)
    assert failed == 0, [r for r in data["results"] if not r["ok"]]
    assert all(r["max_err"] <= r["tolerance"] for r in data["results"])
