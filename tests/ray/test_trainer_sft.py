"""`rlhf sft` end to end on Ray: the same losses and exported weights at dp=2, tp=2 and cp=2,
and the exported folder loads in transformers."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf.config import sft_output_path
from rlhf.errors import RLHFError
from rlhf.trainer.sft import run_sft
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("sft-assets"))


def run(assets, out, **sft):
    cfg = job_config(assets, out, sft=sft)
    return cfg, run_sft(cfg, job_name=out.name, progress=False)


def test_sft_learns_the_same_at_dp2_tp2_and_cp2_and_exports_hf(ray_cluster, assets, tmp_path):
    cfg_dp, dp = run(assets, tmp_path / "sft-dp2")
    nll_dp = [r["sft/nll"] for r in dp]
    assert len(nll_dp) == 4 and nll_dp[-1] < nll_dp[0]  # it learns
    w_dp = load_file(sft_output_path(cfg_dp) / "model.safetensors")
    w_init = load_file(f"{assets['model']}/model.safetensors")
    # cp=2: both ranks hold one replica and each half of every sequence (dp=1); a sequence
    # split over cp ranks cannot share its prompt with another's
    for name, sft in (("tp2", {"parallel": {"tp": 2}}),
                      ("cp2", {"parallel": {"cp": 2}, "share_prompts": False})):
        cfg, other = run(assets, tmp_path / f"sft-{name}", **sft)
        assert [r["sft/nll"] for r in other] == pytest.approx(nll_dp, abs=1e-4), name
        w = load_file(sft_output_path(cfg) / "model.safetensors")
        assert w.keys() == w_dp.keys() == w_init.keys()
        for key in w_dp:
            torch.testing.assert_close(w[key], w_dp[key], atol=1e-4, rtol=0, msg=f"{name} {key}")
    assert not torch.equal(w_dp["model.embed_tokens.weight"], w_init["model.embed_tokens.weight"])
    hf = AutoModelForCausalLM.from_pretrained(sft_output_path(cfg_dp), dtype=torch.float32)
    torch.testing.assert_close(hf.model.embed_tokens.weight, w_dp["model.embed_tokens.weight"])
    with pytest.raises(RLHFError, match="already holds a model"):
        run_sft(cfg_dp, job_name="again", progress=False)


def test_sft_of_an_moe_model_at_ep2_equals_ep1(ray_cluster, assets, tmp_path):
    # At ep=2 the driver splits each batch so both ranks of the ep group run as many
    # micro-batches (the experts' all-to-all); the losses and weights equal the ep=1 run's.
    from dataclasses import replace

    from rlhf.demo.tiny_model import make_tiny_model
    from tests.unit.trainer.jobs import TINY

    spec = replace(TINY, arch="qwen3_moe", num_experts=4, moe_intermediate_size=32)
    folder = make_tiny_model(spec, tmp_path / "moe")
    # Without the load-balancing loss: its per-rank statistics depend on which rows a rank gets,
    # and the ep=1 workers split their own chunks, not the driver's way.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "router_aux_loss_coef": 0.0}))
    moe = {**assets, "model": str(folder)}
    runs = {}
    for ep in (1, 2):
        cfg = job_config(moe, tmp_path / f"sft-ep{ep}",
                         sft={"total_steps": 2, "log_every": 1, "parallel": {"ep": ep}})
        runs[ep] = (cfg, [r["sft/nll"] for r in run_sft(cfg, job_name=f"moe-ep{ep}",
                                                         progress=False)])
    assert runs[2][1] == pytest.approx(runs[1][1], abs=1e-5)
    w1, w2 = (load_file(sft_output_path(runs[ep][0]) / "model.safetensors") for ep in (1, 2))
    assert w1.keys() == w2.keys()
    # 1e-4, as dp against tp above: Adam divides each gradient by its own size, so an element
    # whose gradient is near zero turns fp32 summation-order noise into a step of up to the
    # learning rate (one q_proj element moved 1.1e-5 when the data order changed); a wrong
    # expert's or rank's gradients move many elements by about lr = 1e-3.
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-4, rtol=0, msg=name)
