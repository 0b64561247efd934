"""`rlhf bench fixed-memory`: its flat-buffer layout and shard list, and its CPU answer."""

import pytest
import torch

from rlhf.bench.fixed_memory import qwen7b_shard_numels


def test_qwen7b_shards_match_the_model_size():
    # 28 layers plus untied embedding and head is Qwen2.5-7B's 7.62e9 parameters.
    assert sum(qwen7b_shard_numels(28)) == pytest.approx(7.62e9, rel=2e-3)
    assert len(qwen7b_shard_numels(2)) == 1 + 12 * 2 + 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_cpu_says_why_it_measures_nothing(bench_lines):
    line = bench_lines("fixed-memory")[-1]
    assert line["kind"] == "skipped" and "CUDA" in line["reason"]
