"""The verify-model rule (ours within a factor of transformers' own fp32 error, plus a floor) on
hand numbers, and real bugs that it must catch: a wrong RoPE base, a wrong norm epsilon and one
tensor-parallel shard in the wrong place, each planted in a copy of a tiny model folder that is
compared with the intact folder as the reference."""

import json
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlhf.config.schema import TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.verify import judge, verify_model

SMALL: dict[str, Any] = dict(num_seqs=3, max_len=16, seed=1)


def _scalars(value):
    return {"logits": value, "log_probs": value, "entropy": value}


def test_ours_passes_within_factor_times_theirs_plus_floor():
    theirs = {**_scalars(1e-4), "grads": {"a": 1e-4, "b": 1e-7}}
    scales = {**_scalars(10.0), "grads": {"a": 1.0, "b": 1e-3}}
    ours = {**_scalars(3.9e-4), "grads": {"a": 3.9e-4, "b": 1e-6}}
    out = judge(ours, theirs, scales, factor=4.0, floor=1e-6)
    assert all(row["passed"] for row in out.values()), out
    assert out["logits"]["limit"] == pytest.approx(4.01e-4)
    assert out["logits"]["ours_rel"] == pytest.approx(3.9e-5)
    assert out["grads"]["worst"] == "a" and out["grads"]["ours"] == pytest.approx(3.9e-4)
    assert out["grads"]["max_transformers_fp32"] == pytest.approx(1e-4)


def test_a_small_grad_is_judged_on_its_own_scale():
    """b's error is far below a's, so a max over all grads would pass it; b alone does not."""
    theirs = {**_scalars(1e-4), "grads": {"a": 1e-4, "b": 1e-7}}
    scales = {**_scalars(10.0), "grads": {"a": 1.0, "b": 1e-3}}
    ours = {**_scalars(1e-4), "grads": {"a": 1e-4, "b": 5e-5}}
    out = judge(ours, theirs, scales, factor=4.0, floor=1e-6)
    assert out["logits"]["passed"] and not out["grads"]["passed"]
    assert out["grads"]["worst"] == "b"
    assert out["grads"]["ours_rel"] == pytest.approx(5e-2)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    spec = TinyModelConfig(arch="llama", num_layers=2, hidden_size=64, num_heads=4,
                           num_kv_heads=2, intermediate_size=96, vocab_size=384,
                           max_position_embeddings=64)
    return make_tiny_model(spec, tmp_path_factory.mktemp("m") / "good")


def _broken_copy(good, tmp_path, *, config=None, weights=None):
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    if config:
        cfg = json.loads((bad / "config.json").read_text())
        config(cfg)
        (bad / "config.json").write_text(json.dumps(cfg))
    if weights:
        tensors = load_file(bad / "model.safetensors")
        weights(tensors)
        save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


def _theta(cfg):
    cfg["rope_parameters"]["rope_theta"] *= 2


def _eps(cfg):
    cfg["rms_norm_eps"] *= 10


def _swap_q_shards(tensors):
    """Rank 0's query heads of layer 1 where rank 1's belong, and the other way round."""
    name = "model.layers.1.self_attn.q_proj.weight"
    first, second = tensors[name].chunk(2, dim=0)
    tensors[name] = torch.cat([second, first]).contiguous()


def test_the_intact_folder_passes_against_itself(good, tmp_path):
    copy = _broken_copy(good, tmp_path)
    report = verify_model(copy, reference=good, tp=2, **SMALL)
    assert report["passed"], report["errors"]
    assert report["reference"] == str(good)


@pytest.mark.parametrize("break_it, tp, failing", [
    (dict(config=_theta), 1, "logits"),
    (dict(config=_eps), 1, "logits"),
    (dict(weights=_swap_q_shards), 2, "logits"),
], ids=["rope_theta", "norm_eps", "swapped_q_shard"])
def test_a_real_bug_fails_clearly(good, tmp_path, break_it, tp, failing):
    bad = _broken_copy(good, tmp_path, **break_it)
    report = verify_model(bad, reference=good, tp=tp, **SMALL)
    assert not report["passed"]
    row = report["errors"][failing]
    assert not row["passed"] and row["ours"] > 10 * row["limit"], row
    assert not report["errors"]["grads"]["passed"]


@pytest.mark.parametrize("break_it,cp_attention", [
    (None, "all_gather"), (dict(config=_theta), "all_gather"), (None, "ulysses"),
], ids=["intact", "rope_theta", "intact-ulysses"])
def test_cp2_checks_the_engine_schedule_on_token_shards(good, tmp_path, break_it, cp_attention):
    """--cp 2: log-probs, entropy and grads of the engine on cp shards (no logits), against
    transformers, with either cp attention; a wrong RoPE base still fails there."""
    folder = _broken_copy(good, tmp_path, **(break_it or {}))
    report = verify_model(folder, reference=good, tp=1, cp=2, cp_attention=cp_attention, **SMALL)
    assert report["layout"] == {"tp": 1, "pp": 1, "dp": 1, "nproc": 2, "cp": 2,
                                "cp_attention": cp_attention, "sequence_parallel": False}
    assert "logits" not in report["errors"]
    if break_it is None:
        assert report["passed"], report["errors"]
        return
    row = report["errors"]["log_probs"]
    assert not report["passed"] and row["ours"] > 10 * row["limit"], row
