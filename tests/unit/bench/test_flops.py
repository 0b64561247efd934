"""rlhf.bench.flops: the model FLOPs a step must do and MFU against a measured matmul rate."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf.bench.flops import PASSES, MatmulRate, linear_flops_per_token, step_mfu


def test_linear_flops_count_every_projection_and_the_head_but_not_embeddings():
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    head_dim = 64 // 4
    per_layer = (64 * 64 + 2 * 64 * 2 * head_dim + 64 * 64  # q, k, v (2 kv heads), o
                 + 3 * 64 * 96)  # gate, up, down
    assert linear_flops_per_token(model) == 2 * (3 * per_layer + 64 * 100)
    tied = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": True}))
    assert linear_flops_per_token(tied) == linear_flops_per_token(model)  # the head still runs


def test_step_mfu_is_model_flops_over_seconds_cores_and_rate():
    seconds = {"step": 10.0, "generate": 2.0, "ref": 1.0, "update_actor": 4.0, "reward": 0.1}
    mfu = step_mfu(flops_per_token=1e6, tokens=2000, seconds=seconds, cores=2,
                   gflops_per_core=50.0)
    peak = 2 * 50e9
    assert set(mfu) == {"step", *PASSES}
    assert mfu["step"] == pytest.approx(5 * 1e6 * 2000 / (10.0 * peak))
    assert mfu["update_actor"] == pytest.approx(3 * 1e6 * 2000 / (4.0 * peak))
    assert mfu["generate"] == pytest.approx(1e6 * 2000 / (2.0 * peak))
    assert "ref" in step_mfu(flops_per_token=1, tokens=1, seconds={"ref": 1.0}, cores=1,
                             gflops_per_core=1.0)
    with pytest.raises(ValueError, match="positive matmul rate"):
        step_mfu(flops_per_token=1, tokens=1, seconds=seconds, cores=2, gflops_per_core=0.0)


def test_matmul_rate_keeps_the_best_and_restores_the_thread_count():
    threads = torch.get_num_threads()
    rate = MatmulRate(n=128)
    first = rate.measure(repeats=2)
    assert first > 0
    assert rate.measure(repeats=2) >= first
    assert torch.get_num_threads() == threads
