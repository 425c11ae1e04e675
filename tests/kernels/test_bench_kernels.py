"""`graft bench kernels` without a GPU: a smoke run in Triton's interpreter at tiny sizes."""
from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the suite times compiled kernels")
def test_bench_kernels_checks_every_kernel_in_the_interpreter(tmp_path):
    from graft.bench.kernels import run_kernels
    failed = run_kernels(tmp_path / "kernels.json")
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert data["mode"] == "interpreter"
    assert {r["kernel"] for r in data["results"]} == {"decode", "prefill.paged", "prefill.slot", "kv.store"}
    assert failed == 0, [r for r in data["results"] if not r["ok"]]
    assert all(r["max_err"] <= r["tolerance"] for r in data["results"])
