"""The rollout sampler's sleep and two-part wake, and the vLLM internals check, against a fake
`vllm` module whose LLM records every call (no GPU and no real engine needed)."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from rlhf.config import RolloutConfig
from rlhf.data.ragged import Ragged
from rlhf.rollout import compat
from rlhf.rollout import weights as weights_module
from rlhf.rollout.compat import VLLMVersionError, check_vllm_internals
from rlhf.rollout.replica import ReplicaSpec, RolloutReplica
from rlhf.rollout.vllm_sampler import VllmSampler
from tests.unit.rollout.vllm_fakes import install_fake_reload


class FakeLLM:
    """Records calls; generates token 7 with log-prob -0.5 for every request."""

    def __init__(self, model, **kwargs):
        self.calls = [("LLM", kwargs.get("enable_sleep_mode", False))]
        self.workers = [SimpleNamespace(model_runner=SimpleNamespace(model=object()))]
        self.received = []

    def collective_rpc(self, fn, args=()):
        self.calls.append(("rpc", fn.__name__))
        if fn.__name__ == "reload_weights":
            self.received += [name for name, _ in args[0]]  # consume the stream
            return [[] for _ in self.workers]  # each worker's receipts
        return [fn(worker, *args) for worker in self.workers]

    def generate(self, requests, params, use_tqdm, lora_request=None):
        self.calls.append(("generate", len(requests)) if lora_request is None else
                          ("generate", len(requests), lora_request.lora_int_id))
        token = SimpleNamespace(logprob=-0.5)
        sample = SimpleNamespace(token_ids=[7], logprobs=[{7: token}], finish_reason="length")
        return [SimpleNamespace(outputs=[sample]) for _ in requests]

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags is not None else None))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.__version__ = FakeLLM, lambda **kw: kw, "0.99.fake"
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    reload = install_fake_reload(monkeypatch)
    # a sleeping engine reads the device's free memory (no GPU here)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (40 * 2**30, 80 * 2**30))
    return SimpleNamespace(vllm=vllm, reload=reload)


def _engine(device_type):
    return VllmSampler("unused", config=RolloutConfig(max_new_tokens=4),
                       device_type=device_type, dtype=torch.bfloat16, max_model_len=32)


def _replica(monkeypatch, device_type):
    spec = ReplicaSpec(model_path="unused", config=RolloutConfig(max_new_tokens=4, n=1),
                       device=torch.device(device_type), dtype=torch.bfloat16, max_model_len=32,
                       world_group=None, replica_group=None)
    return RolloutReplica(spec)


def _export():
    yield [("model.embed_tokens.weight", torch.zeros(2, 2))]
    yield [("lm_head.weight", torch.zeros(2, 2))]


def test_cuda_sleeps_at_level_2_and_wakes_weights_for_the_sync_then_the_kv_cache(
        fake_vllm, monkeypatch):
    replica = _replica(monkeypatch, "cuda")
    prompts = Ragged.from_list([[1, 2], [3]], dtype=torch.int64)
    replica.generate(prompts, greedy=False, seed=0)
    llm = replica.sampler.llm
    assert replica.stale  # the level-2 sleep discarded the weights: the sync must re-send them
    replica.sync(_export)
    assert not replica.stale and llm.received == ["model.embed_tokens.weight", "lm_head.weight"]
    replica.generate(prompts, greedy=False, seed=1)
    assert llm.calls == [
        ("LLM", True), ("rpc", "_has_runner_model"),
        ("generate", 2), ("sleep", 2),
        ("wake_up", ("weights",)), ("rpc", "reload_weights"),  # no KV cache during the sync
        ("wake_up", ("kv_cache",)), ("generate", 2), ("sleep", 2),
    ]


def test_cuda_engine_refuses_to_generate_from_discarded_weights(fake_vllm):
    engine = _engine("cuda")
    engine.sleep()
    assert not engine.awake
    with pytest.raises(RuntimeError, match="sync the weights"):
        engine.generate([[1, 2]], [{}])
    engine.load_weights(iter([("lm_head.weight", torch.zeros(1))]))
    assert engine.generate([[1, 2]], [{}])[0].token_ids == [7] and engine.awake


def test_cpu_never_sleeps_so_a_sync_is_skipped_until_the_policy_changes(fake_vllm, monkeypatch):
    replica = _replica(monkeypatch, "cpu")
    prompts = Ragged.from_list([[1, 2]], dtype=torch.int64)
    replica.generate(prompts, greedy=True, seed=0)
    assert not replica.stale
    assert replica.sync(_export)["sync/skipped"] == 1.0
    replica.mark_stale()
    replica.sync(_export)
    replica.generate(prompts, greedy=True, seed=0)
    assert replica.sampler.llm.calls == [
        ("LLM", False), ("rpc", "_has_runner_model"), ("generate", 1),
        ("rpc", "reload_weights"), ("reset_prefix_cache",), ("generate", 1)]


def test_internals_check_names_the_installed_version_and_what_is_missing(fake_vllm):
    del fake_vllm.reload.finalize_layerwise_reload
    with pytest.raises(VLLMVersionError, match=r"vLLM 0\.99\.fake lacks "
                       r"vllm\.model_executor\.model_loader\.reload\.finalize_layerwise_reload"):
        _engine("cpu")
    llm = FakeLLM("unused")
    llm.workers[0].model_runner = SimpleNamespace()  # a runner that keeps its model elsewhere
    fake_vllm.reload.finalize_layerwise_reload = lambda *a: None
    with pytest.raises(VLLMVersionError, match="worker.model_runner.model.*>=0.32.0,<0.33"):
        check_vllm_internals(llm)
    llm.workers[0].model_runner.model = object()
    check_vllm_internals(llm)


def test_the_installed_vllm_has_the_internals_the_sync_uses():
    pytest.importorskip("vllm")
    assert compat.missing_reload_functions() == []
    for name in compat.RELOAD_FUNCTIONS:  # the functions the check looks for are those used
        assert name in weights_module._layerwise_reload.__code__.co_names
    assert compat.missing_reload_internals() == []


def test_the_start_up_check_names_a_missing_reload_internal(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader.reload import types

    monkeypatch.delattr(types.LayerReloadingInfo, "can_load")
    assert compat.missing_reload_internals() == [
        f"{compat.RELOAD_MODULE}.types.LayerReloadingInfo.can_load"]

    class FakeLLM:
        def collective_rpc(self, fn):
            return [True]

    with pytest.raises(compat.VLLMVersionError, match="LayerReloadingInfo.can_load"):
        compat.check_vllm_internals(FakeLLM())


def test_the_gpu_extra_pins_the_tested_vllm_range():
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert f"vllm{compat.TESTED_VLLM}" in extras["gpu"]
