"""rlhf.bench.flops: the model FLOPs a step must do and MFU against a measured matmul rate."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf.bench.flops import PASSES, MatmulRate, forward_flops_per_token, step_mfu
from rlhf.models.config import ModelArgs


def test_forward_flops_by_hand():
    args = ModelArgs.from_hf_config(dict(
        model_type="llama", vocab_size=10, hidden_size=4, intermediate_size=6,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
    # per layer: q 4x4, k and v 4x2 each, o 4x4, gate/up/down 4x6 each = 16+16+16+72 = 120
    # weights = 2 * 120 + 4 * 10 (head) = 280; attention 2 layers * seq 8 * q_dim 4 = 64
    assert forward_flops_per_token(args, seq_len=8) == 2.0 * (280 + 64)
    tied = ModelArgs.from_hf_config(dict(
        model_type="llama", vocab_size=10, hidden_size=4, intermediate_size=6,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        tie_word_embeddings=True))
    assert forward_flops_per_token(tied, seq_len=8) == 2.0 * (280 + 64)  # the head still runs


def test_forward_flops_match_the_linear_layers_of_a_transformers_model():
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    linear = sum(m.weight.numel() for m in LlamaForCausalLM(config).modules()
                 if isinstance(m, torch.nn.Linear))
    args = ModelArgs.from_hf_config(config.to_dict())
    assert forward_flops_per_token(args, seq_len=0) == 2.0 * linear


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
