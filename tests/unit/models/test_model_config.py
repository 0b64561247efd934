"""ModelArgs from HF config dicts: option fields, RoPE keys, and what is refused."""

import pytest

from rlhf.errors import RLHFError
from rlhf.models.config import ModelArgs


def _base_config(**overrides):
    config = {"model_type": "llama", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64}
    return {**config, **overrides}


def test_legacy_and_transformers5_rope_keys_agree():
    new = ModelArgs.from_hf_config(_base_config(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    legacy = ModelArgs.from_hf_config(_base_config(rope_theta=500000.0, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert new == legacy and new.rope_theta == 500000.0 and new.rope_scaling.factor == 8.0
    plain = ModelArgs.from_hf_config(_base_config(rope_scaling=None, rope_theta=1e6))
    assert plain.rope_scaling is None and plain.rope_theta == 1e6


def test_option_fields():
    llama = ModelArgs.from_hf_config(_base_config(attention_bias=True, mlp_bias=True))
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias
    qwen2 = ModelArgs.from_hf_config(_base_config(model_type="qwen2", attention_bias=True))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.mlp_bias
    qwen3 = ModelArgs.from_hf_config(_base_config(model_type="qwen3"))
    assert qwen3.head_dim == 128 and qwen3.qk_norm  # Qwen3Config's default head_dim
    assert ModelArgs.from_hf_config(_base_config(head_dim=32)).head_dim == 32
    mistral = ModelArgs.from_hf_config(_base_config(model_type="mistral", attention_bias=True,
                                                    sliding_window=None))
    assert not mistral.qkv_bias and not mistral.o_bias
    assert ModelArgs.from_hf_config(_base_config(num_key_value_heads=None)).num_kv_heads == 4
    # A window no shorter than max positions, or switched off, never applies.
    ModelArgs.from_hf_config(_base_config(model_type="mistral", sliding_window=64))
    ModelArgs.from_hf_config(_base_config(model_type="qwen2", use_sliding_window=False,
                                          sliding_window=8))


@pytest.mark.parametrize("overrides, match", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (dict(hidden_act="relu2"), "hidden_act 'relu2'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"},
                           "sliding_attention": {"rope_type": "default"}}), "per-layer-type"),
    (dict(model_type="mistral", max_position_embeddings=32768),  # Mistral's default window
     r"sliding_window=4096 is active \(mistral, all layers\)"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
     r"sliding_window=16 is active \(qwen2, layers \[1\]\)"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    (dict(vocab_size=None), "vocab_size"),
])
def test_unsupported_configs_are_refused(overrides, match):
    with pytest.raises(RLHFError, match=match):
        ModelArgs.from_hf_config(_base_config(**overrides))


def test_from_pretrained_without_config(tmp_path):
    with pytest.raises(RLHFError, match="config.json not found"):
        ModelArgs.from_pretrained(tmp_path)
