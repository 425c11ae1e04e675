"""The roofline a throughput pass is judged against: its arithmetic, and that it is measured."""
from __future__ import annotations

import pytest
import torch

from graft.bench import roofline
from graft.engine.loader import ModelConfig, load_config


def tiny() -> ModelConfig:
    return ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_eps=1e-5, max_position=512,
                       tie_embeddings=True, bos_token_id=1, eos_token_id=2, name="tiny")


RATES = {"gemm_gflops": 100.0, "copy_gbps": 10.0}


def test_prefill_is_every_prompt_token_through_every_layer_plus_causal_attention():
    cfg = tiny()
    got = roofline.bound(cfg, [10, 20], 1, RATES)        # one new token: the prefill makes it
    linear = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 64 * 256 + 128 * 64) * 2     # flops per token, 2 layers
    attention = 4 * 4 * 16 * 2 * (10 * 11 / 2 + 20 * 21 / 2)
    vocab = 2 * 2 * 64 * 1000                                                   # the last token of each prompt
    assert got["prefill_tflop"] * 1e12 == pytest.approx(linear * 30 + attention + vocab)
    assert got["decode_s"] == 0 and got["output_tokens"] == 2
    assert got["output_tok_s"] == pytest.approx(2 / (got["prefill_tflop"] * 1e12 / 100e9))


def test_decode_steps_are_bound_by_memory_or_compute_whichever_is_slower():
    cfg = tiny()
    one = roofline.bound(cfg, [100], 3, RATES)
    weights = (roofline.block_params(cfg) * 2 + 64 * 1000) * 2
    kv = 2 * 2 * 2 * 16 * 2                    # bytes per cached token: K and V, 2 layers, 2 KV heads
    want = sum((weights + kv * (100 + step)) / 10e9 for step in (1, 2))
    assert one["decode_s"] == pytest.approx(want)
    # a memory so fast that the step's arithmetic binds it instead
    fast = roofline.bound(cfg, [100], 3, {"gemm_gflops": 100.0, "copy_gbps": 1e9})
    assert fast["decode_s"] > 0 and fast["decode_s"] < one["decode_s"]
    # short prompts, long answers: steps read the weights once for all sequences, so two go nearly twice as fast
    alone, two = roofline.bound(cfg, [10], 50, RATES), roofline.bound(cfg, [10, 10], 50, RATES)
    assert 1.8 * alone["output_tok_s"] < two["output_tok_s"] < 2 * alone["output_tok_s"]


def test_rates_are_measured_on_the_models_own_shapes():
    cfg = load_config()
    assert [s for s in roofline.linear_shapes(cfg)] == [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    rates = roofline.measure(cfg, torch.bfloat16, tokens=128, rounds=3)
    assert rates["gemm_gflops"] > 1 and rates["copy_gbps"] > 0.1 and rates["dtype"] == "bfloat16"
    # the machine's rate is its best: no round of the measurement beats it
    assert len(rates["gemm_gflops_rounds"]) == 3
    assert rates["gemm_gflops"] >= max(rates["gemm_gflops_rounds"]) - 0.1


def test_a_throughput_run_reports_the_engine_as_a_share_of_the_roofline_it_measured(tmp_path):
    """A real `graft serve` on two BBH prompts: the run measures this machine, costs the work the
    server counted, and the engine comes out below the bound (nothing serves faster than it)."""
    import json

    from graft.bench.throughput import ThroughputConfig, run_throughput
    from tests.support import data_dir

    cfg = ThroughputConfig(num_prompts=2, concurrency=2, max_tokens=4, workloads=["mixed"], baseline="none",
                           data_dir=str(data_dir()))
    result = run_throughput(cfg, tmp_path)
    roof = result["workloads"]["mixed"]["roofline"]
    assert roof["prompt_tokens"] > 500 and roof["output_tokens"] == 8
    assert roof["gemm_gflops"] > 1 and roof["copy_gbps"] > 0.1
    assert 0 < roof["engine_share"] < 1
    assert json.loads((tmp_path / "throughput.json").read_text())["workloads"]["mixed"]["roofline"] == roof
