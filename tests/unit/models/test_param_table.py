"""The per-parameter table `build_model` returns: HF names, TP splits, partial grads, ties."""

import pytest
import torch

from rlhf.engine.zero import partition
from rlhf.models.config import ModelArgs
from rlhf.models.param_table import param_table
from rlhf.models.tp_sharding import TPState
from rlhf.models.transformer import CausalLM

QWEN3 = {"model_type": "qwen3", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "tie_word_embeddings": True}


def _model(**kw):
    with torch.device("meta"):
        return CausalLM(ModelArgs.from_hf_config(QWEN3), **kw)


def test_tied_pair_at_pp2_first_stage_shares_and_the_last_stage_holds_the_copy():
    first = param_table(_model(layer_ranges=[(0, 2)], has_head=False), tp=TPState())
    last = param_table(_model(layer_ranges=[(2, 4)], has_embedding=False), tp=TPState())
    embed = first["model.embed_tokens.weight"]
    assert embed.shared and not embed.tied_copy and embed.hf_name == embed.name
    head = last["lm_head.weight"]
    assert head.shared and head.tied_copy and head.hf_name == "model.embed_tokens.weight"
    assert not any(e.shared for e in first if e.name != "model.embed_tokens.weight")
    assert not any(e.shared for e in last if e.name != "lm_head.weight")


def test_a_whole_tied_model_holds_the_pair_once_and_shares_nothing():
    table = param_table(_model(), tp=TPState())
    names = [e.name for e in table]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert not any(e.shared or e.tied_copy for e in table)
    assert all(e.hf_name == e.name and e.shard is None for e in table)


def test_qwen3_qk_norms_are_tp_partial_and_sequence_parallel_adds_every_norm():
    model = _model()
    tp = TPState(tp=2, sequence_parallel=False)  # what apply_tp returns
    partial = {e.name for e in param_table(model, tp=tp) if e.tp_partial_grad}
    assert partial == {f"model.layers.{i}.self_attn.{n}.weight"
                       for i in range(4) for n in ("q_norm", "k_norm")}
    tp = TPState(tp=2, sequence_parallel=True)
    partial = {e.name for e in param_table(model, tp=tp) if e.tp_partial_grad}
    norms = {name for name, _ in model.named_parameters() if "norm" in name}
    assert partial == norms and "model.norm.weight" in partial


def test_with_partition_fills_flat_ranges_and_owners():
    model = _model(layer_ranges=[(0, 1)], has_head=False)
    table = param_table(model, tp=TPState())
    numels = [p.numel() for p in model.parameters()]
    part = partition(numels, 4, bucket_numel=10_000)
    filled = table.with_partition(part)
    assert [e.flat_range[1] - e.flat_range[0] for e in filled] == numels
    embed = filled["model.embed_tokens.weight"]
    assert embed.flat_range == (0, numels[0]) and embed.zero_owners == (0, 1, 2, 3)
    assert all(e.zero_owners for e in filled)
    assert all(not e.zero_owners for e in table.with_partition(partition(numels, 1)))
    with pytest.raises(ValueError, match="partition"):
        table.with_partition(partition(numels[:-1], 4))
    with pytest.raises(KeyError, match="not a parameter"):
        table["lm_head.weight"]
