"""The dense MLP's gate and up as one GEMM (rlhf.models.gate_up): the paired path against the
two linears (outputs and grads), and the fallback wherever the pairing does not hold."""

import dataclasses

import pytest
import torch

from rlhf.config import LoraConfig
from rlhf.data.packing import pack
from rlhf.models import lora as L
from rlhf.models.gate_up import paired_weight
from rlhf.models.transformer import MLP, CausalLM, pair_gate_up
from tests.unit.engine.reference import SMALL, load_plain, tiny_folder

RTOL = ATOL = 1e-6


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate_up")
    # qwen2: biases in attention only, so its MLPs pair too.
    return {arch: tiny_folder(root, arch=arch) for arch in ("llama", "qwen2")}


def _mlps(model):
    return [m for m in model.modules() if isinstance(m, MLP)]


def _paired(model):
    return [paired_weight(m.gate_proj.weight, m.up_proj.weight) is not None for m in _mlps(model)]


def _run(model, seed=0):
    """Logits of a packed batch, and every parameter's grad of a loss on them."""
    gen = torch.Generator().manual_seed(seed)
    p = pack([torch.randint(0, SMALL["vocab_size"], (k,), generator=gen) for k in (5, 9, 3)])
    model.zero_grad(set_to_none=True)
    logits = model(p.tokens, p.position_ids, p.cu_seqlens, p.max_seqlen)
    (logits.float().square().mean() + logits.sum() * 1e-3).backward()
    return logits.detach(), {n: q.grad.clone() for n, q in model.named_parameters()
                             if q.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_gemm_computes_what_the_two_linears_compute(folders, arch):
    separate, merged = load_plain(folders[arch]), load_plain(folders[arch])
    assert pair_gate_up(merged) == SMALL["num_layers"]
    assert all(_paired(merged)) and not any(_paired(separate))
    # The names and values a checkpoint, an export or a weight sync reads are unchanged.
    want, got = separate.state_dict(), merged.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    logits_s, grads_s = _run(separate)
    logits_m, grads_m = _run(merged)
    torch.testing.assert_close(logits_m, logits_s, rtol=RTOL, atol=ATOL)
    assert grads_m.keys() == grads_s.keys()
    for name in grads_s:
        torch.testing.assert_close(grads_m[name], grads_s[name], rtol=RTOL, atol=ATOL, msg=name)
    # A second pairing finds them paired and moves nothing.
    before = _mlps(merged)[0].gate_proj.weight.data_ptr()
    assert pair_gate_up(merged) == SMALL["num_layers"]
    assert _mlps(merged)[0].gate_proj.weight.data_ptr() == before


def test_a_broken_pairing_falls_back_to_the_two_linears(folders):
    separate, merged = load_plain(folders["llama"]), load_plain(folders["llama"])
    pair_gate_up(merged)
    mlp = _mlps(merged)[0]
    mlp.up_proj.weight.data = mlp.up_proj.weight.data.clone()  # what a reload may do
    assert _paired(merged) == [False, True]
    logits_s, grads_s = _run(separate)
    logits_m, grads_m = _run(merged)
    torch.testing.assert_close(logits_m, logits_s, rtol=RTOL, atol=ATOL)
    for name in grads_s:
        torch.testing.assert_close(grads_m[name], grads_s[name], rtol=RTOL, atol=ATOL, msg=name)


def test_lora_and_mlp_bias_keep_the_two_linears(folders):
    lora = load_plain(folders["qwen2"])
    L.apply_lora(lora, LoraConfig(r=4, lora_alpha=8.0, target_modules=("gate_proj",)), seed=3)
    assert pair_gate_up(lora) == 0 and not any(_paired(lora))
    reference = load_plain(folders["qwen2"])
    torch.testing.assert_close(_run(lora)[0], _run(reference)[0], rtol=RTOL, atol=ATOL)  # B = 0: a no-op
    args = dataclasses.replace(lora.args, mlp_bias=True)
    biased = CausalLM(args)
    assert pair_gate_up(biased) == 0 and not any(_paired(biased))
    assert _run(biased)[0].isfinite().all()
