"""The native CPU decode attention (graft/kernels/cpu_decode.py) against its torch twin, and how it is built.

The kernel reads the paged cache in place through the block tables; its twin,
`decode_attention_varlen`, gathers each sequence's blocks and attends with torch. Both must give
the same attention over exactly each sequence's tokens, whatever the lengths (one token, a block
boundary, a partial last block), the grouping of query heads, the dtype and the order of the blocks.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

from graft.engine import attention as A
from graft.kernels import cpu_decode, dispatch, native_build
from graft.kernels.torch_attention import decode_attention_varlen


@pytest.fixture(autouse=True)
def fresh_library():
    """Each test decides for itself whether the library can be had (env, compiler)."""
    cpu_decode.library.cache_clear()
    yield
    cpu_decode.library.cache_clear()


def paged(lengths, n_kv, d, dtype, block_size=64, seed=0, spare=5):
    """A cache holding `lengths` tokens in shuffled blocks, with spare blocks full of other data."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + spare
    k_cache = torch.randn(num_blocks, block_size, n_kv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, n_kv, d, generator=gen).to(dtype)
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n])
        at += n
    width = max(need)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, block_tables


CASES = [
    # lengths, query heads, KV heads, head dim
    ([1], 9, 3, 64),
    ([5, 64, 65, 130], 9, 3, 64),
    ([300, 1, 77, 128, 129, 2], 4, 4, 32),       # no grouping
    ([63, 640, 1], 8, 1, 16),                    # one KV head for all
    ([2517, 559, 997], 9, 3, 64),                # the lengths of BBH prompts
]


@pytest.mark.parametrize("lengths,heads,n_kv,d", CASES)
def test_native_decode_matches_its_torch_twin_in_float32(lengths, heads, n_kv, d):
    assert cpu_decode.available(), "the native decode kernel did not build on this machine"
    k_cache, v_cache, tables = paged(lengths, n_kv, d, torch.float32, seed=len(lengths))
    q = torch.randn(len(lengths), heads, d, generator=torch.Generator().manual_seed(1))
    scale = d ** -0.5
    native = cpu_decode.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lengths, scale)
    twin = decode_attention_varlen(q, k_cache, v_cache, tables, lengths, scale, A.gather_aligned)
    torch.testing.assert_close(native, twin, atol=2e-6, rtol=1e-5)
    # and each row is attention over exactly that sequence's tokens, nothing of its neighbours
    for i, n in enumerate(lengths):
        k, v = A.gather_per_block(k_cache, v_cache, tables[i], n)
        expected = A.prefill_attention_naive(q[i:i + 1], k, v, scale)[0]
        torch.testing.assert_close(native[i], expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("lengths,heads,n_kv,d", CASES[1:3])
def test_native_decode_matches_its_torch_twin_in_bfloat16(lengths, heads, n_kv, d):
    k_cache, v_cache, tables = paged(lengths, n_kv, d, torch.bfloat16, seed=7)
    q = torch.randn(len(lengths), heads, d, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    native = cpu_decode.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lengths, d ** -0.5)
    # the reference in float32 from the same bf16 inputs: the kernel computes in float32 and
    # rounds once, so it sits within one bf16 rounding of it
    exact = decode_attention_varlen(q.float(), k_cache.float(), v_cache.float(), tables, lengths, d ** -0.5,
                                      A.gather_aligned)
    assert native.dtype == torch.bfloat16
    torch.testing.assert_close(native.float(), exact, atol=1e-2, rtol=1e-2)


def test_peaked_scores_keep_their_weight_and_drop_nothing_that_counts():
    """Scores hundreds apart (a sharply peaked softmax, where weights underflow): the kernel's own
    exp and its cut-off below e^-69 give torch's softmax."""
    lengths = [200, 70]
    k_cache, v_cache, tables = paged(lengths, 3, 64, torch.float32, seed=3)
    q = 40 * torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(4))
    native = cpu_decode.paged_decode_attention_cpu(q, k_cache, v_cache, tables, lengths, 0.125)
    twin = decode_attention_varlen(q, k_cache, v_cache, tables, lengths, 0.125, A.gather_aligned)
    torch.testing.assert_close(native, twin, atol=1e-5, rtol=1e-5)


def test_the_fast_slot_uses_a_native_kernel_on_a_cpu_in_bf16_and_the_twin_in_fp32(monkeypatch):
    """bf16: the AVX-512 BF16 kernel where the CPU has it, else this portable one; fp32: the twin."""
    from graft.kernels import cpu_avx512
    lengths = [65, 3]
    calls = []
    portable, avx512 = cpu_decode.paged_decode_attention_cpu, cpu_avx512.paged_decode_attention
    monkeypatch.setattr(cpu_decode, "paged_decode_attention_cpu", lambda *a: calls.append("portable") or portable(*a))
    monkeypatch.setattr(cpu_avx512, "paged_decode_attention", lambda *a: calls.append("avx512") or avx512(*a))
    for dtype in (torch.bfloat16, torch.float32):
        k_cache, v_cache, tables = paged(lengths, 3, 64, dtype)
        q = torch.randn(2, 9, 64).to(dtype)
        out = dispatch.decode_attention_fast(q, k_cache, v_cache, tables, lengths, 0.125, A.gather_aligned)
        twin = decode_attention_varlen(q, k_cache, v_cache, tables, lengths, 0.125, None)
        torch.testing.assert_close(out.float(), twin.float(), atol=1e-2, rtol=1e-2)
    # fp32: the twin's matmuls are the faster ones
    assert calls == (["avx512"] if cpu_avx512.available() else ["portable"])
    calls.clear()
    monkeypatch.setenv("GRAFT_NATIVE_KERNELS", "0")
    cpu_avx512.library.cache_clear()
    cpu_decode.library.cache_clear()
    try:
        k_cache, v_cache, tables = paged(lengths, 3, 64, torch.bfloat16)
        dispatch.decode_attention_fast(torch.randn(2, 9, 64).bfloat16(), k_cache, v_cache, tables, lengths, 0.125, None)
    finally:
        cpu_avx512.library.cache_clear()
    assert calls == []                    # switched off: both native kernels, not just one


def test_a_block_outside_the_cache_is_refused_not_read():
    k_cache, v_cache, tables = paged([100], 3, 64, torch.float32, spare=0)
    tables[0, 1] = k_cache.shape[0]                # one past the last block
    with pytest.raises(native_build.NativeKernelError, match="outside the cache"):
        cpu_decode.paged_decode_attention_cpu(torch.randn(1, 9, 64), k_cache, v_cache, tables, [100], 0.125)
    tables[0, 1] = -1
    with pytest.raises(native_build.NativeKernelError, match="outside the cache"):
        cpu_decode.paged_decode_attention_cpu(torch.randn(1, 9, 64), k_cache, v_cache, tables, [100], 0.125)


def test_a_length_beyond_the_block_table_is_refused():
    k_cache, v_cache, tables = paged([100], 3, 64, torch.float32)
    with pytest.raises(native_build.NativeKernelError, match="length"):
        cpu_decode.paged_decode_attention_cpu(torch.randn(1, 9, 64), k_cache, v_cache, tables, [129], 0.125)


def test_tensors_it_does_not_take_go_to_the_twin():
    k_cache, v_cache, tables = paged([10], 3, 64, torch.float16)
    q = torch.randn(1, 9, 64).half()
    assert not cpu_decode.supports(q, k_cache)          # no float16 kernel
    out = dispatch.decode_attention_fast(q, k_cache, v_cache, tables, [10], 0.125, A.gather_aligned)
    torch.testing.assert_close(out, decode_attention_varlen(q, k_cache, v_cache, tables, [10], 0.125, None))
    k32, _, _ = paged([10], 3, 64, torch.float32)
    assert not cpu_decode.supports(torch.randn(1, 64, 9).transpose(1, 2), k32)   # not contiguous


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("GRAFT_NATIVE_KERNELS", "0")
    assert cpu_decode.library() is None and not cpu_decode.available()


def test_a_failed_build_leaves_the_torch_path_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")            # a "compiler" that fails
    monkeypatch.setenv("GRAFT_KERNEL_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="graft.kernels.native_build"):
        assert cpu_decode.library() is None
    assert "could not build the native decode kernel" in caplog.text
    assert list(tmp_path.iterdir()) == []        # no half-written library left behind


def test_built_once_per_machine_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAFT_KERNEL_CACHE", str(tmp_path))
    assert cpu_decode.library() is not None
    (built,) = tmp_path.glob("paged_decode_cpu-*.so")
    stamp = built.stat().st_mtime_ns
    cpu_decode.library.cache_clear()
    assert cpu_decode.library() is not None
    assert [p.name for p in tmp_path.iterdir()] == [built.name] and built.stat().st_mtime_ns == stamp


def test_isa_flags_never_ask_for_the_native_march():
    assert cpu_decode.isa_flags({"avx2", "fma", "avx512f"}) == ("-mavx2", "-mfma")
    assert cpu_decode.isa_flags({"sse4_2"}) == ()
    assert not any("march" in f for f in native_build.BASE_FLAGS)


def test_the_cpu_flags_are_the_first_cpus_and_none_without_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu sse4_2\n")
    assert native_build.cpu_flags(cpuinfo) == {"fpu", "avx2", "fma", "avx512_bf16"}
    assert native_build.cpu_flags(tmp_path / "missing") == set()


@pytest.mark.parametrize("kernel", ["portable", "fast slot"])
def test_the_model_in_bf16_gives_the_same_logits_through_the_kernel_as_through_its_twin(kernel):
    """SmolLM2 in bf16, a 3-shot BBH prompt: the last token decoded through a native kernel (this
    portable one, and whatever the fast slot runs here: the AVX-512 BF16 one on a CPU that has it)
    and through the twin (everything else the same) give the same next-token logits, to bf16
    precision, and the same most likely token."""
    from graft.bench.data import bbh_prompts
    from graft.engine.config import EngineConfig
    from graft.engine.engine import LLMEngine
    from tests.support import data_dir

    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_memory=64 << 20))
    assert engine.slots["attention.decode"] is dispatch.decode_attention_fast and cpu_decode.available()
    impl = cpu_decode.paged_decode_attention_cpu if kernel == "portable" else dispatch.decode_attention_fast
    prompt = bbh_prompts(data_dir(), ["date_understanding"])[0].text
    ids = engine.tokenizer.encode(prompt)[:700]
    blocks = list(range(11))            # the engine is idle: any 11 blocks hold the 700 tokens
    native = engine.runner.probe_logits(ids, engine.slots.with_slots({"attention.decode": impl}), blocks)[-1]
    twin = engine.runner.probe_logits(
        ids, engine.slots.with_slots({"attention.decode": decode_attention_varlen}), blocks)[-1]
    # bf16 rounds every hidden state; over 30 layers that is an absolute error of a few hundredths
    # of the logits' range, on small logits as on large ones
    assert native.topk(5).indices.tolist() == twin.topk(5).indices.tolist()
    assert (native - twin).abs().max() <= 0.02 * twin.abs().max()
