"""The one dispatch (graft/kernels/dispatch.py): what an engine's table takes from it at load, and
what its choosers run per call, by device, dtype, paths and what the CPU offers."""
from __future__ import annotations

import pytest
import torch

from graft.kernels import cpu_avx512, dispatch, reference

SMOLLM2 = {"hidden_size": 576, "head_dim": 64, "intermediate_size": 1536}


@pytest.mark.parametrize("fast", [True, False])
def test_on_cuda_the_kernels_serve_whatever_the_paths(fast):
    chosen = dispatch.engine_kernels("cuda", fast)
    assert chosen == dispatch.kernel_slots("cuda")
    # under the interpreter (as the tests run) the automatic choice is the twins, never Python kernels
    assert chosen["attention.decode"] is reference.decode_attention


def test_on_a_cpu_the_fast_paths_take_the_choosers_and_the_plain_ones_nothing():
    assert dispatch.engine_kernels("cpu", True) == {"attention.prefill": dispatch.prefill_attention_fast,
                                                   "attention.decode": dispatch.decode_attention_fast}
    assert dispatch.engine_kernels(torch.device("cpu"), False) == {}


@pytest.mark.parametrize("built", [True, False])
def test_native_layers_only_on_the_fast_paths_in_bf16_on_a_cpu_that_built_them(monkeypatch, built):
    monkeypatch.setattr(cpu_avx512, "available", lambda: built)
    assert dispatch.native_layers("cpu", torch.bfloat16, True, **SMOLLM2) is built
    assert not dispatch.native_layers("cpu", torch.bfloat16, False, **SMOLLM2)      # the plain paths
    assert not dispatch.native_layers("cpu", torch.float32, True, **SMOLLM2)
    assert not dispatch.native_layers("cuda", torch.bfloat16, True, **SMOLLM2)
    assert not dispatch.native_layers("cpu", torch.bfloat16, True, **{**SMOLLM2, "hidden_size": 72})
    assert not dispatch.native_layers("cpu", torch.bfloat16, True, **{**SMOLLM2, "head_dim": 48})


def test_off_a_cpu_the_choosers_run_torch_and_never_a_c_kernel(monkeypatch):
    """A patch that ships the fast paths' attention (prefill-fusion, sync-free) on a GPU engine runs
    torch's SDPA there: the C kernels are never asked (meta tensors stand in for a device)."""
    calls = []

    def record(name):
        return lambda *args: calls.append(name) or args[0]

    monkeypatch.setattr(dispatch, "decode_attention_batched", record("batched"))
    monkeypatch.setattr(dispatch, "prefill_attention_fused", record("fused"))
    for name in ("paged_decode_attention", "prefill_attention"):
        monkeypatch.setattr(cpu_avx512, name, record(f"avx512 {name}"))
    monkeypatch.setattr(dispatch.cpu_decode, "paged_decode_attention_cpu", record("portable"))
    q = torch.empty(2, 9, 64, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(4, 64, 3, 64, dtype=torch.bfloat16, device="meta")
    dispatch.decode_attention_fast(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32), [3, 5], 0.125, None)
    dispatch.prefill_attention_fast(q, cache[0], cache[0], 0.125)
    assert calls == ["batched", "fused"]
