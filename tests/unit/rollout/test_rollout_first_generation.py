"""A CPU engine's first generation compiles nothing: vLLM's sampler would otherwise compile its
token-rank count (dynamo, then a C++ kernel) in every new engine process, about 2 CPU-seconds
each (rlhf.rollout.compat.eager_rank_count). In the shared vLLM interpreter
(vllm_interpreter.py)."""

import sys
import types

import pytest

from rlhf.rollout import compat
from tests.unit.rollout.vllm_interpreter import vllm_interpreter  # noqa: F401 (a fixture)

SCRIPT = r"""
import sys, torch
from torch._dynamo.utils import counters
import vllm.v1.sample.sampler as vllm_sampler
from rlhf.config import RolloutConfig
from rlhf.rollout import VllmSampler, vllm_environment, sampling_params

cfg = RolloutConfig(max_new_tokens=3, cpu_kv_cache_gb=0.05, max_num_seqs=4)
with vllm_environment(device_type="cpu"):
    engine = VllmSampler(sys.argv[1], config=cfg, device_type="cpu", dtype=torch.float32,
                         max_model_len=32)
count = vllm_sampler.batched_count_greater_than
assert not hasattr(count, "_torchdynamo_orig_callable"), "the rank count is still compiled"
frames = sum(counters["frames"].values())
[done] = engine.generate([[5, 6, 7]], sampling_params(cfg, greedy=True, seeds=[0]))
assert len(done.log_probs) == 3 and all(lp <= 0 for lp in done.log_probs), done
assert sum(counters["frames"].values()) == frames, dict(counters["frames"])
# the eager count is vLLM's own body: log-probs at least each row's value, per row
x = torch.tensor([[0.0, -1.0, -2.0], [-3.0, -0.5, -0.1]])
assert count(x, torch.tensor([[-1.0], [-0.5]])).tolist() == [2, 2]
print("OK")
"""


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_the_first_generation_on_the_cpu_compiles_nothing(tmp_path, vllm_interpreter):
    from rlhf.config import TinyModelConfig
    from rlhf.demo.tiny_model import make_tiny_model

    model = make_tiny_model(TinyModelConfig(num_layers=1, hidden_size=64, num_heads=2,
                                            num_kv_heads=2, intermediate_size=96,
                                            max_position_embeddings=32), tmp_path / "m")
    ok, out = vllm_interpreter.run(SCRIPT, str(model), name="first_generation")
    assert ok and "OK" in out, out[-5000:]


def _compiled(function):
    wrapper = lambda *args: function(*args)  # what torch.compile's wrapper carries
    wrapper._torchdynamo_orig_callable = function
    return wrapper


def test_the_rank_count_is_unwrapped_only_where_vllm_compiles_it(monkeypatch):
    def count(x, values):
        return (x >= values).sum(-1)

    module = types.ModuleType("fake_sampler")
    monkeypatch.setitem(sys.modules, "fake_sampler", module)
    monkeypatch.setattr(compat, "RANK_COUNT", ("fake_sampler", "count"))
    assert compat.eager_rank_count() is False  # no such function: nothing to change
    module.count = _compiled(count)
    assert compat.eager_rank_count() is True and module.count is count
    assert compat.eager_rank_count() is True and module.count is count  # again: unchanged
    monkeypatch.setattr(compat, "RANK_COUNT", ("no_such_vllm_module", "count"))
    assert compat.eager_rank_count() is False
