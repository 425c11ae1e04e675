"""The two families of attention patch points (plain 3.2.0, fast 3.2.1) give the same answers."""
from __future__ import annotations

import pytest
import torch

from graft.engine import attention as A
from graft.engine.config import EngineConfig
from graft.engine.loader import ModelConfig
from graft.engine.models.llama import Attention
from graft.engine.patches.slots import SLOT_NAMES
from graft.engine.sampler import sample_batched
from graft.kernels import dispatch
from graft.kernels import torch_attention as TA

BLOCK = 64
N_HEADS, N_KV, D = 6, 2, 16


def make_cache(num_blocks: int = 24, fill: float = 1e4) -> tuple[torch.Tensor, torch.Tensor]:
    # unused slots hold large values, so any read past a sequence's context shows up in the result
    shape = (num_blocks, BLOCK, N_KV, D)
    return torch.full(shape, fill), torch.full(shape, fill)


def fill_sequence(k_cache, v_cache, block_table: list[int], length: int, gen: torch.Generator):
    """Store `length` random tokens through `store_kv` at the slots the block table names."""
    k = torch.randn(length, N_KV, D, generator=gen)
    v = torch.randn(length, N_KV, D, generator=gen)
    slots = torch.tensor([block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
    A.store_kv(k, v, k_cache, v_cache, slots)
    return k, v


def shuffled_tables(lengths: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(free[:need])
        free = free[need:]
    return tables


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


@pytest.mark.parametrize("gather", [A.gather_per_block, A.gather_aligned])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 200, 320])
def test_gather_over_shuffled_block_table_returns_the_stored_tokens(gather, length):
    gen = torch.Generator().manual_seed(length)
    k_cache, v_cache = make_cache()
    (table,) = shuffled_tables([length], k_cache.shape[0], seed=length)
    k, v = fill_sequence(k_cache, v_cache, table, length, gen)
    got_k, got_v = gather(k_cache, v_cache, torch.tensor(table + [0, 0], dtype=torch.int32), length)
    assert got_k.shape == (length, N_KV, D)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 7), (64, 64), (5, 70), (1, 130), (33, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", [TA.prefill_attention_fused, A.prefill_attention_fast])
def test_prefill_naive_and_fused_agree(lq, lk, dtype, impl):
    gen = torch.Generator().manual_seed(lq * 1000 + lk)
    q = torch.randn(lq, N_HEADS, D, generator=gen).to(dtype)
    k = torch.randn(lk, N_KV, D, generator=gen).to(dtype)
    v = torch.randn(lk, N_KV, D, generator=gen).to(dtype)
    naive = A.prefill_attention_naive(q, k, v, D**-0.5)
    fused = impl(q, k, v, D**-0.5)
    assert naive.shape == fused.shape == (lq, N_HEADS, D)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(fused, naive, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", [A.prefill_attention_naive, TA.prefill_attention_fused, A.prefill_attention_fast])
def test_prefill_is_causal_with_the_query_offset(impl):
    """Query i of the last Lq tokens sees keys up to Lk - Lq + i, never a later one."""
    gen = torch.Generator().manual_seed(0)
    lq, lk = 6, 20
    q = torch.randn(lq, N_HEADS, D, generator=gen)
    k = torch.randn(lk, N_KV, D, generator=gen)
    v = torch.randn(lk, N_KV, D, generator=gen)
    out = impl(q, k, v, D**-0.5)
    for i in range(lq):
        seen = lk - lq + i + 1
        alone = impl(q[i : i + 1], k[:seen], v[:seen], D**-0.5)
        torch.testing.assert_close(out[i], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", [[1], [5, 64, 65, 130], [300, 1, 77, 128, 129, 2]])
def test_decode_per_seq_batched_and_varlen_agree_over_shuffled_blocks(lengths):
    gen = torch.Generator().manual_seed(len(lengths))
    k_cache, v_cache = make_cache()
    tables = shuffled_tables(lengths, k_cache.shape[0], seed=sum(lengths))
    contexts = [fill_sequence(k_cache, v_cache, t, n, gen) for t, n in zip(tables, lengths)]
    q = torch.randn(len(lengths), N_HEADS, D, generator=gen)
    block_tables, scale = padded(tables), D**-0.5

    plain = A.decode_attention_per_seq(q, k_cache, v_cache, block_tables, lengths, scale, A.gather_per_block)
    fast = TA.decode_attention_batched(q, k_cache, v_cache, block_tables, lengths, scale, A.gather_aligned)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
    varlen = TA.decode_attention_varlen(q, k_cache, v_cache, block_tables, lengths, scale, A.gather_aligned)
    torch.testing.assert_close(varlen, plain, atol=1e-5, rtol=1e-5)
    for i, (k, v) in enumerate(contexts):  # and both are attention over exactly that sequence's tokens
        expected = A.prefill_attention_naive(q[i : i + 1], k, v, scale)[0]
        torch.testing.assert_close(plain[i], expected, atol=1e-6, rtol=1e-6)


def tiny_attention(bias: bool) -> Attention:
    cfg = ModelConfig(
        vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=N_HEADS, num_kv_heads=N_KV,
        head_dim=D, rope_theta=10000.0, rms_eps=1e-5, max_position=128, tie_embeddings=True,
        bos_token_id=None, eos_token_id=None, name="tiny", qkv_bias=bias,
    )
    torch.manual_seed(0)
    return Attention(cfg)


@pytest.mark.parametrize("bias", [False, True])
def test_qkv_fused_matches_separate_and_falls_back_when_unfused(bias):
    attn = tiny_attention(bias)
    x = torch.randn(9, 48)
    separate = A.qkv_separate(attn, x)
    unfused = A.qkv_fused(attn, x)
    for a, b in zip(unfused, separate):
        assert torch.equal(a, b)
    attn.qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    if bias:
        attn.qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    fused = A.qkv_fused(attn, x)
    assert [t.shape for t in fused] == [(9, N_HEADS * D), (9, N_KV * D), (9, N_KV * D)]
    for a, b in zip(fused, separate):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


PLAIN_FAMILY = {"kv.store": A.store_kv, "kv.gather": A.gather_per_block, "attention.prefill": A.prefill_attention_naive,
                "attention.decode": A.decode_attention_per_seq, "linear.qkv": A.qkv_separate}
FAST_FAMILY = {"kv.store": A.store_kv, "kv.gather": A.gather_aligned, "attention.prefill": A.prefill_attention_fast,
               "attention.decode": A.decode_attention_fast, "linear.qkv": A.qkv_fused}


def test_the_plain_table_is_the_plain_family():
    policy, sampler = object(), object()
    table = A.default_slots(policy, sampler, "plain")
    assert set(PLAIN_FAMILY) | {"sampler", "scheduler.policy"} <= set(table) <= set(SLOT_NAMES)
    assert all(table[name] is impl for name, impl in PLAIN_FAMILY.items())
    assert table["scheduler.policy"] is policy and table["sampler"] is sampler


def test_a_fresh_engine_runs_the_fast_family_unless_asked_for_the_plain_one():
    policy, sampler = object(), object()
    fast = A.default_slots(policy, sampler, "fast")
    assert all(fast[name] is impl for name, impl in FAST_FAMILY.items())
    assert fast["sampler"] is sample_batched and fast["scheduler.policy"] is policy
    # the fast attention slots are the dispatch's choosers, under the names the 3.2.1 patches use
    assert A.prefill_attention_fast is dispatch.prefill_attention_fast
    assert A.decode_attention_fast is dispatch.decode_attention_fast
    assert A.default_slots(policy, sampler, "plain")["attention.decode"] is A.decode_attention_per_seq
    # one default, EngineConfig's: a table made without naming the paths is the fast one
    assert EngineConfig().paths == "fast" and A.default_slots(policy, sampler) == fast
    with pytest.raises(ValueError, match="fast or plain"):
        A.default_slots(policy, sampler, "3.2.0")


def test_the_builtin_patches_together_make_the_fast_family_of_the_plain_table():
    """What the 3.2.1 patches ship is what a fresh engine on the fast paths runs: so a patched
    plain engine and a fast one serve the same code, and `graft bench patches` compares like with like."""
    from graft.engine.patches.builtin import patches
    policy, sampler = object(), object()
    patched = A.default_slots(policy, sampler, "plain")
    for patch in patches():
        patched = patched.with_slots(patch.slots)
    fast = A.default_slots(policy, sampler, "fast")
    assert {name: patched[name] for name in patched} == {name: fast[name] for name in fast}


@pytest.mark.parametrize("paths", ["fast", "plain"])
def test_on_cuda_the_kernels_serve_the_store_and_attention_whatever_the_paths(paths):
    """The table of an engine on CUDA is its family's with `kv.store` and attention from the
    dispatch's kernels (their twins here: the tests run under the Triton interpreter, which is
    never served from); the family keeps the other slots."""
    policy, sampler = object(), object()
    on_cuda = A.default_slots(policy, sampler, paths, "cuda")
    on_cpu = A.default_slots(policy, sampler, paths, "cpu")
    kernels = dispatch.kernel_slots("cuda")
    assert set(kernels) == {"kv.store", "attention.prefill", "attention.decode"}
    assert all(on_cuda[name] is impl for name, impl in kernels.items())
    assert all(on_cuda[name] is on_cpu[name] for name in on_cpu if name not in kernels)


def test_weights_fused_at_load_survive_the_revert_of_a_patch_that_also_fuses():
    from graft.engine.models.llama import LlamaForCausalLM
    cfg = ModelConfig(
        vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=N_HEADS, num_kv_heads=N_KV,
        head_dim=D, rope_theta=10000.0, rms_eps=1e-5, max_position=128, tie_embeddings=True,
        bos_token_id=None, eos_token_id=None, name="tiny",
    )
    model = LlamaForCausalLM(cfg)

    def fused() -> list[bool]:          # per layer: whether `linear.qkv` finds the one-matmul weight
        return [layer.self_attn.qkv_weight is not None for layer in model.layers]

    model.fuse_qkv()
    model.unfuse_qkv()
    assert fused() == [False, False], "a patch's own fusion goes with its revert"
    model.fuse_qkv(pin=True)            # an engine on the fast paths
    model.fuse_qkv()                    # prefill-fusion@3.2.1 applied on top ...
    model.unfuse_qkv()                  # ... and reverted
    assert fused() == [True, True]


def test_fused_gate_up_is_the_same_mlp_without_a_second_copy_of_its_weights():
    from graft.engine.models.llama import MLP
    cfg = ModelConfig(
        vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=N_HEADS, num_kv_heads=N_KV,
        head_dim=D, rope_theta=10000.0, rms_eps=1e-5, max_position=128, tie_embeddings=True,
        bos_token_id=None, eos_token_id=None, name="tiny",
    )
    torch.manual_seed(0)
    mlp = MLP(cfg).requires_grad_(False)
    x = torch.randn(5, 48)
    separate = mlp(x)
    mlp.fuse()
    torch.testing.assert_close(mlp(x), separate, atol=1e-6, rtol=1e-6)
    assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr()


def test_the_native_layers_need_gate_and_up_fused():
    """The native forward runs the MLP as one gate-and-up matmul: a model not fused refuses it."""
    from graft.engine.models.llama import LlamaForCausalLM
    cfg = ModelConfig(
        vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=N_HEADS, num_kv_heads=N_KV,
        head_dim=D, rope_theta=10000.0, rms_eps=1e-5, max_position=128, tie_embeddings=True,
        bos_token_id=None, eos_token_id=None, name="tiny",
    )
    model = LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="fuse_mlp"):
        model.use_native_layers()
    assert not model.native_layers
    model.fuse_mlp()
    model.use_native_layers()
    assert model.native_layers
