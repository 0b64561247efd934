"""The decoder's per-family layer options against transformers' own modules, in fp32 and bf16:
the RMSNorm styles, the gated MLP's activations and the scaled embedding."""

import dataclasses

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm, GemmaTextScaledWordEmbedding
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from rlhf.errors import RLHFError
from rlhf.families import model_family
from rlhf.models.config import ACTIVATIONS, ModelArgs
from rlhf.models.transformer import RMSNorm, Transformer

DTYPES = [torch.float32, torch.bfloat16]


def _x(dtype, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).mul(3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style, reference", [("llama", LlamaRMSNorm), ("gemma", GemmaRMSNorm)])
def test_rms_norm_styles_equal_transformers(style, reference, dtype):
    ours, ref = RMSNorm(48, 1e-6, style), reference(48, eps=1e-6)
    assert torch.equal(ours.weight, ref.weight)  # same stored identity (ones / zeros)
    weight = torch.randn(48, generator=torch.Generator().manual_seed(1)) * 0.1
    with torch.no_grad():
        ours.weight.copy_(weight)
        ref.weight.copy_(weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = _x(dtype, 5, 48)
    assert torch.equal(ours(x), ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_equal_transformers(name, dtype):
    x = _x(dtype, 64)
    assert torch.equal(ACTIVATIONS[name](x), ACT2FN[name](x))


def test_unknown_activation_is_refused():
    with pytest.raises(RLHFError, match="hidden_act 'relu2' is not supported; supported: silu"):
        ModelArgs(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                  num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4, hidden_act="relu2")


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_embedding_equals_transformers(monkeypatch, dtype):
    llama = model_family("llama")
    monkeypatch.setattr(ModelArgs, "family",
                        property(lambda self: dataclasses.replace(llama, embed_scale=True)))
    args = ModelArgs(model_type="llama", vocab_size=16, hidden_size=40, intermediate_size=8,
                     num_layers=1, num_heads=2, num_kv_heads=2, head_dim=20)
    body = Transformer(args, layer_range=(0, 0), has_norm=False).to(dtype)  # no layer
    ref = GemmaTextScaledWordEmbedding(16, 40, padding_idx=None, embed_scale=40 ** 0.5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(body.embed_tokens.weight)
    tokens = torch.tensor([3, 0, 15, 7])
    ours = body(tokens, torch.arange(4), torch.tensor([0, 4], dtype=torch.int32), 4)
    assert torch.equal(ours, ref(tokens))
    assert not torch.equal(ours, body.embed_tokens(tokens))  # the scale is applied
