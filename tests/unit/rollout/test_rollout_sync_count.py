"""The weight sync's completeness check (rlhf/rollout/weights.py) on the layer-wise path that
CUDA takes: vLLM's own reload functions run on a small stand-in of a vLLM model (stacked
q/k/v loaded in pieces, a vocabulary padded to more rows than the checkpoint has, a tied LM
head, a rotary table with nothing to load), so no engine or GPU is needed. The CPU path is
checked on a real engine in test_rollout_weights.py."""

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rlhf.rollout.weights import (
    IncompleteSyncError,
    Receipt,
    _layerwise_reload,
    check_complete,
    incomplete,
)

VOCAB, PADDED, HIDDEN = 10, 16, 4


def _param(*shape, **attrs) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(*shape), requires_grad=False)
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


class Embedding(nn.Module):
    """vLLM's VocabParallelEmbedding at tp 1: rows padded past the vocabulary, zero-filled."""

    def __init__(self):
        super().__init__()
        self.shard_indices = SimpleNamespace(num_org_elements=VOCAB, num_elements_padded=PADDED)
        self.weight = _param(PADDED, HIDDEN, output_dim=0, weight_loader=self.weight_loader)

    def weight_loader(self, param, loaded_weight):
        param[:loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0]:].data.fill_(0)


class QKV(nn.Module):
    """vLLM's QKVParallelLinear: one weight, loaded as three pieces named q, k and v."""

    SHARDS = {"q": (0, 4), "k": (4, 2), "v": (6, 2)}

    def __init__(self):
        super().__init__()
        self.weight = _param(8, HIDDEN, weight_loader=self.weight_loader)

    def weight_loader(self, param, loaded_weight, shard_id):
        start, rows = self.SHARDS[shard_id]
        param.data.narrow(0, start, rows).copy_(loaded_weight)


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(3, 2), persistent=False)


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = _param(HIDDEN)  # vLLM's default loader


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj, self.rotary_emb, self.input_layernorm = QKV(), Rotary(), Norm()


class Model(nn.Module):
    """Llama's shape in vLLM: stacked q/k/v, and an LM head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = Embedding()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.lm_head = Embedding()
        self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())  # the tied head's name is not listed
        for name, tensor in weights:
            stacked = next((s for s in "qkv" if f".{s}_proj." in name), None)
            if stacked is not None:
                param = params[name.replace(f".{stacked}_proj.", ".qkv_proj.")]
                param.weight_loader(param, tensor, stacked)
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)


def hf_weights(seed=0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [("embed_tokens.weight", torch.randn(VOCAB, HIDDEN, generator=g))]
    for i in range(2):
        out += [(f"layers.{i}.q_proj.weight", torch.randn(4, HIDDEN, generator=g)),
                (f"layers.{i}.k_proj.weight", torch.randn(2, HIDDEN, generator=g)),
                (f"layers.{i}.v_proj.weight", torch.randn(2, HIDDEN, generator=g)),
                (f"layers.{i}.input_layernorm.weight", torch.randn(HIDDEN, generator=g))]
    return out


@pytest.fixture
def model():
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    model = Model()
    record_metadata_for_reloading(model)  # what vLLM does when it builds a model
    return model


@pytest.fixture
def vllm_warnings():
    """vLLM's "Failed to load weights" lines, caught at the logger that prints them."""
    from vllm.model_executor.model_loader.reload import layerwise

    records = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    layerwise.logger.addHandler(handler)
    yield records
    layerwise.logger.removeHandler(handler)


def test_a_complete_sync_loads_every_tensor_and_vllm_warns_of_nothing(model, vllm_warnings):
    weights = hf_weights()
    kernel = model.layers[1].qkv_proj.weight
    _layerwise_reload(model, iter(weights), model_config=None)
    got = dict(weights)
    assert torch.equal(model.embed_tokens.weight[:VOCAB], got["embed_tokens.weight"])
    assert model.lm_head.weight is model.embed_tokens.weight  # the tie survives
    assert model.layers[1].qkv_proj.weight is kernel  # copied into vLLM's own tensor
    assert torch.equal(kernel, torch.cat([got[f"layers.1.{s}_proj.weight"]
                                          for s in "qkv"]))
    assert torch.equal(model.layers[0].input_layernorm.weight,
                       got["layers.0.input_layernorm.weight"])
    # the rotary tables and the tied head's copy had nothing to receive: no warning for them
    assert vllm_warnings == []


def test_a_stacked_piece_missing_stops_the_sync_naming_the_module(model, vllm_warnings):
    weights = [w for w in hf_weights() if w[0] != "layers.1.k_proj.weight"]
    with pytest.raises(IncompleteSyncError, match=r"layers\.1\.qkv_proj 24/32") as e:
        _layerwise_reload(model, iter(weights), model_config=None)
    assert "layers.0" not in str(e.value)


def test_a_layer_missing_stops_the_sync_and_vllms_warning_is_kept(model, vllm_warnings):
    weights = [w for w in hf_weights() if not w[0].startswith("layers.1.")]
    with pytest.raises(IncompleteSyncError) as e:
        _layerwise_reload(model, iter(weights), model_config=None)
    message = str(e.value)
    assert "2 vLLM module(s)" in message
    assert "layers.1.qkv_proj 0/32" in message and "layers.1.input_layernorm 0/4" in message
    assert sorted(vllm_warnings) == ["Norm: Failed to load weights",
                                     "QKV: Failed to load weights"]


def test_the_embedding_short_of_its_vocabulary_is_caught_through_the_padding(model):
    weights = [(n, t[:VOCAB - 1] if n == "embed_tokens.weight" else t) for n, t in hf_weights()]
    with pytest.raises(IncompleteSyncError, match=r"embed_tokens 36/40"):
        _layerwise_reload(model, iter(weights), model_config=None)


def test_a_name_sent_twice_is_refused(model):
    from rlhf.rollout.weights import reload_weights

    weights = hf_weights()
    runner = SimpleNamespace(model=model, model_config=None)
    with pytest.raises(IncompleteSyncError, match="sent layers.0.q_proj.weight twice"):
        reload_weights(SimpleNamespace(model_runner=runner), iter(weights + weights[1:2]))


def test_a_tied_copy_is_complete_only_through_a_complete_sibling():
    shared = frozenset({1})
    head = Receipt("lm_head", expected=40, received=0, tensors=shared)
    assert incomplete([Receipt("embed", expected=40, received=40, tensors=shared), head]) == []
    short = Receipt("embed", expected=40, received=36, tensors=shared)
    assert incomplete([short, head]) == [short, head]
    check_complete([Receipt("rotary", expected=0)])  # nothing to receive


@pytest.fixture
def norm_not_set_up(monkeypatch):
    """vLLM's layer-wise set-up, but leaving layer 0's norm as later vLLMs leave a
    "runtime-mapped" layer: its live tensor loaded straight into, `can_load()` false."""
    from vllm.model_executor.model_loader import reload
    from vllm.model_executor.model_loader.reload import layerwise

    vllm_init = reload.initialize_layerwise_reload

    def init_but_one(model):
        vllm_init(model)
        norm = model.layers[0].input_layernorm
        info = layerwise.get_layerwise_info(norm)
        layerwise._place_kernel_tensors(norm, info)
        norm.weight.weight_loader = layerwise._get_original_loader(norm.weight)
        info.reset()
        assert not info.can_load()

    monkeypatch.setattr(reload, "initialize_layerwise_reload", init_but_one)


def test_a_module_vllm_does_not_count_is_counted_by_the_sync(model, norm_not_set_up):
    weights = hf_weights()
    receipts = _layerwise_reload(model, iter(weights), model_config=None)
    norm = next(r for r in receipts if r.name == "layers.0.input_layernorm")
    assert (norm.received, norm.expected) == (HIDDEN, HIDDEN)
    assert torch.equal(model.layers[0].input_layernorm.weight,
                       dict(weights)["layers.0.input_layernorm.weight"])
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    assert model.layers[0].input_layernorm.weight.weight_loader is default_weight_loader


def test_a_module_vllm_does_not_count_is_refused_when_withheld(model, norm_not_set_up):
    weights = [w for w in hf_weights() if w[0] != "layers.0.input_layernorm.weight"]
    with pytest.raises(IncompleteSyncError, match=r"layers\.0\.input_layernorm 0/4"):
        _layerwise_reload(model, iter(weights), model_config=None)


def test_receipts_of_a_complete_sync_are_reported(model):
    from rlhf.rollout.weights import receipt_metrics

    receipts = [r for r in _layerwise_reload(model, iter(hf_weights()), model_config=None)
                if r.expected]
    # embedding, its tied head, two qkv and two norms
    assert sorted(r.name for r in receipts) == sorted(
        ["embed_tokens", "lm_head", "layers.0.qkv_proj", "layers.1.qkv_proj",
         "layers.0.input_layernorm", "layers.1.input_layernorm"])
    assert receipt_metrics(receipts) == {"sync/receipts": 6.0, "sync/receipts_complete": 6.0}
    short = Receipt("layers.1.qkv_proj", expected=32, received=24)
    assert receipt_metrics(receipts[:1] + [short]) == {"sync/receipts": 2.0,
                                                       "sync/receipts_complete": 1.0}
