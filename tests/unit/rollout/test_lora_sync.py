"""Adapter-only sync (rlhf.rollout.lora_sync): vLLM's engine arguments, the coverage check on
vLLM's own adapter loader, and the versions a sleeping CUDA engine serves (a fake LLM)."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from rlhf.config import RolloutConfig
from rlhf.config.schema import LoraConfig
from rlhf.data.ragged import Ragged
from rlhf.errors import ConfigError
from rlhf.models.lora import param_name, peft_config
from rlhf.rollout import vllm_sampler
from rlhf.rollout.compat import VLLMVersionError
from rlhf.rollout.lora_sync import (
    ADAPTER_VERSIONS,
    add_adapter,
    check_lora_internals,
    max_lora_rank,
)
from rlhf.rollout.replica import ReplicaSpec, RolloutReplica
from rlhf.rollout.vllm_sampler import vllm_args
from rlhf.rollout.weights import IncompleteSyncError
from tests.unit.rollout.test_rollout_sleep import fake_vllm  # noqa: F401 (a fixture)

LORA = LoraConfig(r=4, lora_alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def test_engine_arguments_round_the_rank_up_to_one_vllm_accepts():
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ConfigError, match="actor.lora.r=513"):
        max_lora_rank(513)
    args = vllm_args(RolloutConfig(), on_cuda=False, dtype=torch.float32, max_model_len=64,
                     lora=LORA)
    assert args["enable_lora"] and args["max_lora_rank"] == 8
    assert args["max_loras"] == args["max_cpu_loras"] == ADAPTER_VERSIONS
    plain = vllm_args(RolloutConfig(), on_cuda=False, dtype=torch.float32, max_model_len=64,
                      lora=LoraConfig())  # r = 0: LoRA off
    assert "enable_lora" not in plain


class FakeCache:
    """vLLM's adapter cache of a one-layer Llama: its LoRA modules, packed q/k/v and gate/up."""

    modules = {f"model.layers.0.{m}": None
               for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                         "mlp.down_proj")}
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}
    model = object()

    def __init__(self):
        self.added = []

    def add_adapter(self, lora):
        self.added.append(lora)


def _worker():
    from vllm.config.lora import LoRAConfig

    manager = SimpleNamespace(max_position_embeddings=64, vocab_size=32,
                              lora_config=LoRAConfig(max_lora_rank=8, lora_dtype=torch.float32),
                              _adapter_manager=FakeCache())
    return SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager))


def _factors(modules=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")):
    out = {}
    for module in modules:
        key = f"base_model.model.model.layers.0.{module}"
        out[f"{key}.lora_A.weight"] = torch.randn(4, 16)
        out[f"{key}.lora_B.weight"] = torch.randn(16, 4)
    return out


def test_add_adapter_registers_a_complete_adapter_and_refuses_gaps():
    worker, config = _worker(), peft_config(LORA)
    check_lora_internals(SimpleNamespace(collective_rpc=lambda fn: [fn(worker)]))
    bare = SimpleNamespace(model_runner=SimpleNamespace(lora_manager=None))
    with pytest.raises(VLLMVersionError, match="lora_manager._adapter_manager"):
        check_lora_internals(SimpleNamespace(collective_rpc=lambda fn: [fn(bare)]))
    assert add_adapter(worker, _factors(), config, 3) == 3
    (lora,) = worker.model_runner.lora_manager._adapter_manager.added
    assert lora.id == 3 and lora.rank == 4
    q = lora.loras["model.layers.0.self_attn.q_proj"]
    assert q.scaling == pytest.approx(2.0)  # lora_alpha / r reached vLLM

    missing = _factors()
    del missing["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    with pytest.raises(IncompleteSyncError, match="without both factors.*down_proj"):
        add_adapter(_worker(), missing, config, 4)
    with pytest.raises(IncompleteSyncError, match="without both factors.*v_proj"):
        add_adapter(_worker(), _factors(("self_attn.q_proj", "mlp.down_proj")), config, 5)
    stray = _factors(("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj", "mlp.fc9"))
    with pytest.raises(IncompleteSyncError, match="vLLM does not adapt.*fc9"):
        add_adapter(_worker(), stray, config, 6)


def _lora_replica(monkeypatch):
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    spec = ReplicaSpec(model_path="unused", config=RolloutConfig(max_new_tokens=4, n=1),
                       device=torch.device("cuda"), dtype=torch.bfloat16, max_model_len=32,
                       world_group=None, replica_group=None, lora=LORA)
    return RolloutReplica(spec)


def test_a_sleeping_cuda_engine_keeps_its_base_and_serves_the_newest_adapter(
        fake_vllm, monkeypatch):
    monkeypatch.setattr(vllm_sampler, "check_lora_internals", lambda llm: None)  # fake vllm
    replica = _lora_replica(monkeypatch)
    prompts = Ragged.from_list([[1, 2]], dtype=torch.int64)
    replica.generate(prompts, greedy=False, seed=0)
    llm = replica.sampler.llm
    removed = []
    llm.llm_engine = SimpleNamespace(remove_lora=removed.append)
    llm.collective_rpc = lambda fn, args=(): (llm.calls.append(("rpc", fn.__name__, args[2]))
                                              or [3])
    assert not replica.stale  # level 1: the base survived the sleep; nothing to re-send
    for _ in range(3):
        replica.mark_stale()
        ours = [(param_name(key), t) for key, t in _factors().items()]  # the export's names
        metrics = replica.sync(lambda ours=ours: iter([ours]))
        assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in _factors().values())
        replica.generate(prompts, greedy=False, seed=1)
    assert removed == [1]  # the third version pushed out the first; two stay registered
    assert llm.calls[2:] == [
        ("generate", 1), ("sleep", 1),  # before any sync: the base, no adapter
        ("wake_up", ("weights",)), ("rpc", "add_adapter", 1),
        ("wake_up", ("kv_cache",)), ("generate", 1, 1), ("sleep", 1),
        ("wake_up", ("weights",)), ("rpc", "add_adapter", 2),
        ("wake_up", ("kv_cache",)), ("generate", 1, 2), ("sleep", 1),
        ("wake_up", ("weights",)), ("rpc", "add_adapter", 3),
        ("wake_up", ("kv_cache",)), ("generate", 1, 3), ("sleep", 1),
    ]
