"""The family registry against transformers, and everyone who lists families reading it."""

import pytest
import transformers

from rlhf.cli import build_parser
from rlhf.config.schema import TinyModelConfig
from rlhf.errors import ConfigError, RLHFError
from rlhf.families import FAMILIES, FAMILY_NAMES, find_family, model_family
from rlhf.models.config import ModelArgs

IDS = [f.name for f in FAMILIES]


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_spec_defaults_are_transformers_defaults(family):
    config_cls = getattr(transformers, f"{family.hf_prefix}Config")
    default = config_cls()
    assert default.model_type == family.name
    assert default.max_position_embeddings == family.max_position_embeddings
    assert default.tie_word_embeddings == family.tie_word_embeddings
    assert default.hidden_act == family.hidden_act
    small = config_cls(hidden_size=64, num_attention_heads=4)  # head_dim left to the class
    assert (getattr(small, "head_dim", None) or 16) == (family.head_dim or 16)
    for key, value in (family.moe_defaults or {}).items():
        assert getattr(default, key) == value, key
    for suffix in ("ForCausalLM", "ForSequenceClassification", "ForTokenClassification"):
        assert hasattr(transformers, family.hf_prefix + suffix), family.hf_prefix + suffix


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_model_args_read_the_spec(family):
    config = {"model_type": family.name, "vocab_size": 384, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "attention_bias": True, "mlp_bias": True, "sliding_window": None}
    args = ModelArgs.from_hf_config(config)
    assert args.family is family
    assert args.max_position_embeddings == family.max_position_embeddings
    assert args.tie_word_embeddings == family.tie_word_embeddings
    assert args.head_dim == (family.head_dim or 16)
    assert args.qkv_bias == (family.attention_bias != "none")
    assert args.o_bias == (family.attention_bias == "config")
    assert args.mlp_bias == family.reads_mlp_bias
    assert args.qk_norm == family.qk_norm and args.is_moe == family.is_moe


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.hidden_act_aliases],
                         ids=lambda f: f.name)
def test_activation_aliases_are_what_the_config_class_does(family):
    config_cls = getattr(transformers, f"{family.hf_prefix}Config")
    for legacy, act in family.hidden_act_aliases.items():
        assert config_cls(hidden_act=legacy).hidden_act == act
        config = {"model_type": family.name, "vocab_size": 8, "hidden_size": 8,
                  "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "head_dim": 4, "hidden_act": legacy}
        assert ModelArgs.from_hf_config(config).hidden_act == act


def test_gguf_architectures_are_ones_transformers_reads():
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    named = [f.gguf_architecture for f in FAMILIES if f.gguf_architecture]
    assert named and set(named) <= set(GGUF_SUPPORTED_ARCHITECTURES)


def test_cli_choices_are_the_registry():
    parser = build_parser()
    tiny = parser._subparsers._group_actions[0].choices["make-tiny-model"]
    arch = next(a for a in tiny._actions if a.dest == "arch")
    assert tuple(arch.choices) == FAMILY_NAMES
    for name in FAMILY_NAMES:
        assert parser.parse_args(["make-tiny-model", "out", "--arch", name]).arch == name


def test_unknown_family_is_refused_with_a_hint():
    with pytest.raises(ConfigError, match=r"arch 'lama' is not supported \(did you mean "
                                          r"'llama'\?\); supported: llama, qwen2"):
        TinyModelConfig(arch="lama")
    with pytest.raises(RLHFError, match="model_type 'gpt2' is not supported; supported: "):
        model_family("gpt2")
    assert find_family("gpt2") is None and find_family(None) is None
    assert [TinyModelConfig(arch=name).arch for name in FAMILY_NAMES] == list(FAMILY_NAMES)
