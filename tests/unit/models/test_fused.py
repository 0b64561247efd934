"""The compiled (fused) elementwise bodies against eager and transformers, and their recompiles.

One model family per case, since each compile on the CPU costs seconds: Qwen3 (per-head q/k
norms, SwiGLU) and Gemma ((1 + w) norms, GeGLU, tied head) between them reach every fused
body. Exact means fp32 tolerance: inductor may reorder a reduction, nothing more.
"""

import dataclasses

import pytest
import torch

from rlhf.config.schema import TinyModelConfig
from rlhf.data.packing import pack
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.models.config import ModelArgs
from rlhf.models.fused import apply_compile, is_fused
from rlhf.models.hf_io import load_hf_weights
from rlhf.models.outputs import model_outputs
from rlhf.models.transformer import CausalLM, pair_gate_up
from rlhf.parallel.fusion import compile_enabled
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache

SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
             vocab_size=384, max_position_embeddings=64)
TOL = 1e-5


def _packed(seed, lengths):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, SMALL["vocab_size"], (n,), generator=gen) for n in lengths]
    return seqs, pack(seqs)


@pytest.fixture(scope="module", params=["qwen3", "gemma"])
def models(request, tmp_path_factory, single_process_world):
    """(eager, fused and paired, transformers) copies of one tiny model."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(TinyModelConfig(arch=request.param, tie_embeddings=True, **SMALL),
                             tmp_path_factory.mktemp(request.param) / "model")
    eager, fused = (CausalLM(ModelArgs.from_pretrained(folder)) for _ in range(2))
    for model in (eager, fused):
        load_hf_weights(model, folder)
    apply_compile(fused, True)
    # As the engine runs it: gate and up as one GEMM (rlhf.models.gate_up), feeding the
    # compiled activation their strided halves; the eager copy keeps the two linears.
    assert pair_gate_up(fused) == SMALL["num_layers"]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return eager, fused, hf


def _run(model, packed, temperature=0.7):
    """log-probs and entropy at `temperature`, and the grads of a loss using both."""
    model.zero_grad()
    mesh = ParallelMesh([0], cache=ProcessGroupCache())
    out = model_outputs(model, packed, mesh=mesh, temperature=temperature)
    weights_T = torch.randn(packed.tokens.numel(), generator=torch.Generator().manual_seed(1))
    weights_T = weights_T.to(packed.tokens.device)
    (weights_T * out["log_probs"] + 0.1 * out["entropy"]).sum().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_apply_compile_sets_every_flag(models):
    eager, fused, _ = models
    assert is_fused(fused) and not is_fused(eager)
    flagged = [m for m in fused.modules() if hasattr(m, "fused")]
    assert flagged and all(m.fused for m in flagged)
    assert not any(m.fused for m in eager.modules() if hasattr(m, "fused"))


def test_fused_logits_match_transformers(models):
    eager, fused, hf = models
    seqs, packed = _packed(0, [1, 9, 17, 5])
    with torch.no_grad():
        ref_TV = torch.cat([hf(s[None]).logits[0] for s in seqs])
        for model in (eager, fused):
            logits_TV = model(packed.tokens, packed.position_ids, packed.cu_seqlens,
                              packed.max_seqlen)
            assert (logits_TV - ref_TV).abs().max() < TOL


def test_fused_outputs_and_grads_match_eager(models):
    eager, fused, _ = models
    _, packed = _packed(1, [3, 14, 8])
    out_e, grads_e = _run(eager, packed)
    out_f, grads_f = _run(fused, packed)
    for name in ("log_probs", "entropy"):
        assert (out_f[name] - out_e[name]).abs().max() < TOL, name
    assert grads_f.keys() == grads_e.keys() and len(grads_e) == len(list(eager.parameters()))
    for name, grad in grads_e.items():
        assert (grads_f[name] - grad).abs().max() < TOL, name
    assert any(g.abs().max() > 1e-3 for g in grads_e.values())


def test_packs_of_other_lengths_do_not_recompile(models):
    """Dynamic shapes: a new token count (every packed micro-batch has its own) reuses the
    graphs; `error_on_recompile` raises if any body is compiled again."""
    _, fused, _ = models
    _run(fused, _packed(2, [4, 6])[1])  # compiled for this case's dtypes and flags
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, lengths in ((3, [11, 2, 7]), (4, [30]), (5, [1, 1, 2, 19, 5])):
            _run(fused, _packed(seed, lengths)[1])


def test_compile_setting_per_device():
    assert compile_enabled("auto", "cuda") and not compile_enabled("auto", "cpu")
    assert compile_enabled("on", "cpu") and not compile_enabled("off", "cuda")
    with pytest.raises(ValueError, match="compile must be one of auto, on, off"):
        compile_enabled("yes", "cpu")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_bf16_on_cuda_agrees_with_eager(tmp_path, single_process_world):
    """On CUDA in bf16 (what `compile: auto` turns on): the compiled bodies' log-probs and
    grads against eager's, within bf16's rounding (inductor keeps fp32 between fused ops
    where eager rounds to bf16)."""
    folder = make_tiny_model(TinyModelConfig(arch="qwen3", **SMALL), tmp_path / "model")
    runs = []
    for fused in (False, True):
        model = CausalLM(ModelArgs.from_pretrained(folder))
        load_hf_weights(model, folder)
        model = model.to("cuda", torch.bfloat16)
        apply_compile(model, fused)
        _, packed = _packed(6, [5, 40, 17])
        runs.append(_run(model, dataclasses.replace(packed, **{
            f.name: getattr(packed, f.name).to("cuda") for f in dataclasses.fields(packed)
            if isinstance(getattr(packed, f.name), torch.Tensor)})))
    (out_e, grads_e), (out_f, grads_f) = runs
    assert (out_f["log_probs"] - out_e["log_probs"]).abs().max() < 0.05
    for name, grad in grads_e.items():
        scale = grad.float().abs().max().clamp(min=1e-6)
        assert ((grads_f[name] - grad).float().abs().max() / scale) < 0.05, name
