"""The router aux loss in training: which coefficient a role uses, and each micro-batch's
token-weighted share of it in the loss and the metrics."""

import dataclasses

import pytest
import torch

from rlhf.config.schema import TrainRoleConfig
from rlhf.engine import make_micro_batches
from rlhf.engine.router_aux import AUX_KEY, router_aux_coef, with_router_aux
from rlhf.errors import ConfigError
from rlhf.models.config import ModelArgs

MOE = ModelArgs.from_hf_config(dict(
    model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=2, head_dim=16, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.01))


def test_the_coefficient_defaults_to_the_checkpoint_and_is_refused_under_pp():
    assert router_aux_coef(MOE, None, pp=1) == 0.01
    assert router_aux_coef(MOE, 0.5, pp=1) == 0.5
    assert router_aux_coef(dataclasses.replace(MOE, num_experts=0), 0.5, pp=1) == 0.0  # dense
    assert router_aux_coef(MOE, 0.0, pp=2) == 0.0
    with pytest.raises(ConfigError, match="router_aux_loss_coef: 0"):
        router_aux_coef(MOE, None, pp=2)
    with pytest.raises(ConfigError, match="router_aux_loss_coef"):
        TrainRoleConfig(router_aux_loss_coef=-1.0)


def test_each_micro_batch_adds_its_token_share_and_reports_the_aux_loss():
    prompts = [torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([4, 5, 6])]
    responses = [torch.tensor([7]), torch.tensor([8, 9]), torch.tensor([10])]
    mbs = make_micro_batches(prompts, responses, max_tokens=4, max_seqs=1)
    assert [mb.num_tokens for mb in mbs] == [3, 3, 4]

    def base(out, mb):
        assert AUX_KEY not in out  # the user's loss never sees the aux loss
        return out["x"], {"m": 1.0}

    wrapped = with_router_aux(base, coef=0.1, total_tokens=20)  # 10 here, 10 on another rank
    losses = []
    for mb, aux in zip(mbs, (1.0, 2.0, 4.0)):
        loss, metrics = wrapped({"x": torch.tensor(0.0), AUX_KEY: torch.tensor(aux)}, mb)
        assert metrics == {"m": 1.0, AUX_KEY: aux}
        losses.append(float(loss))
    assert losses == pytest.approx([0.1 * 3 / 20 * 1.0, 0.1 * 3 / 20 * 2.0, 0.1 * 4 / 20 * 4.0])
    # A dense model's outputs carry no aux loss: the loss function is unchanged.
    assert wrapped({"x": torch.tensor(3.0)}, mbs[0]) == (torch.tensor(3.0), {"m": 1.0})
