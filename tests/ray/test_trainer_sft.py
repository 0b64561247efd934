"""`rlhf sft` end to end on Ray: the same losses and exported weights at dp=2 and tp=2, and the
exported folder loads in transformers."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf.errors import RLHFError
from rlhf.config import sft_output_path
from rlhf.trainer.sft import run_sft
from tests.unit.trainer.jobs import job_config, make_assets

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("sft-assets"))


def run(assets, out, **sft):
    cfg = job_config(assets, out, sft=sft)
    return cfg, run_sft(cfg, job_name=out.name, progress=False)


def test_sft_learns_the_same_at_dp2_and_tp2_and_exports_hf(ray_cluster, assets, tmp_path):
    cfg_dp, dp = run(assets, tmp_path / "sft-dp2")
    cfg_tp, tp = run(assets, tmp_path / "sft-tp2", parallel={"tp": 2})
    nll_dp, nll_tp = [r["sft/nll"] for r in dp], [r["sft/nll"] for r in tp]
    assert len(nll_dp) == 4 and nll_dp[-1] < nll_dp[0]  # it learns
    assert nll_dp == pytest.approx(nll_tp, abs=1e-4)
    w_dp = load_file(sft_output_path(cfg_dp) / "model.safetensors")
    w_tp = load_file(sft_output_path(cfg_tp) / "model.safetensors")
    w_init = load_file(f"{assets['model']}/model.safetensors")
    assert w_dp.keys() == w_tp.keys() == w_init.keys()
    for name in w_dp:
        torch.testing.assert_close(w_dp[name], w_tp[name], atol=1e-4, rtol=0, msg=name)
    assert not torch.equal(w_dp["model.embed_tokens.weight"], w_init["model.embed_tokens.weight"])
    hf = AutoModelForCausalLM.from_pretrained(sft_output_path(cfg_dp), dtype=torch.float32)
    torch.testing.assert_close(hf.model.embed_tokens.weight, w_dp["model.embed_tokens.weight"])
    with pytest.raises(RLHFError, match="already holds a model"):
        run_sft(cfg_dp, job_name="again", progress=False)
