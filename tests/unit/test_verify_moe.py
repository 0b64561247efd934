"""`rlhf verify-model` on a tiny Qwen3-MoE, in this process (tp = 1): the routers' grads and the
load-balancing loss are compared, and a wrong routing rule fails. Then in 4 gloo processes at
cp = 2 x ep = 2: the engine on token shards, the aux loss pooled over the cp ranks."""

import json
import shutil

import pytest
import torch

from rlhf.config.schema import ParallelConfig, TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.models.config import ModelArgs
from rlhf.verify import (
    DEFAULT_FACTOR,
    MOE_AUX_WEIGHT,
    _compare,
    _scales,
    distances,
    hf_reference,
    judge,
    random_batch,
    verify_model,
)

SPEC = TinyModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=64, num_heads=2,
                       num_kv_heads=1, intermediate_size=96, vocab_size=384,
                       max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, seed=1)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_tiny_model(SPEC, tmp_path_factory.mktemp("moe") / "good")


@pytest.fixture(scope="module")
def reference(good):
    """The batch, transformers' float64 reference and its own float32 distance to it."""
    seqs = random_batch(ModelArgs.from_pretrained(good), None, num_seqs=4, max_len=24, seed=0)
    ref = hf_reference(good, seqs, dtype=torch.float64, aux_weight=MOE_AUX_WEIGHT)
    theirs = distances(hf_reference(good, seqs, dtype=torch.float32,
                                    aux_weight=MOE_AUX_WEIGHT), ref)
    return seqs, ref, theirs


def _report(folder, reference):
    seqs, ref, theirs = reference
    ours = _compare(str(folder), ParallelConfig(), dict(ref), seqs, world=1,
                    device=torch.device("cpu"), aux_weight=MOE_AUX_WEIGHT)
    return judge(ours, theirs, _scales(ref), factor=DEFAULT_FACTOR, floor=1e-6), ours


def test_moe_passes_with_router_grads_and_aux_loss(good, reference, single_process_world):
    errors, ours = _report(good, reference)
    assert all(e["passed"] for e in errors.values()), errors
    assert "aux_loss" in errors and errors["aux_loss"]["scale"] > 1.0
    assert "model.layers.1.mlp.gate.weight" in ours["grads"]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in ours["grads"]


def test_a_wrong_routing_rule_fails(good, reference, tmp_path, single_process_world):
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    config = json.loads((bad / "config.json").read_text())
    config["norm_topk_prob"] = False
    (bad / "config.json").write_text(json.dumps(config))
    errors, _ = _report(bad, reference)
    assert not errors["logits"]["passed"] and not errors["grads"]["passed"]


def test_cp2_ep2_passes_with_the_aux_loss_over_token_shards(good):
    report = verify_model(good, tp=1, cp=2, ep=2, num_seqs=4, max_len=24, seed=0)
    assert report["layout"] == {"tp": 1, "pp": 1, "dp": 2, "nproc": 4, "ep": 2, "cp": 2,
                                "cp_attention": "all_gather",
                                "sequence_parallel": False}
    errors = report["errors"]
    assert report["passed"], errors
    assert "logits" not in errors and errors["aux_loss"]["scale"] > 1.0
