"""Our packed decoder against transformers, sequence by sequence: logits, log-probs, gradients."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from rlhf.config.schema import TinyModelConfig
from rlhf.data.packing import pack, shifted_targets
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.families import FAMILIES
from rlhf.models import attention
from rlhf.models.attention import (
    flash_varlen,
    pick_kernel,
    sdpa_split,
    sdpa_varlen,
    varlen_attention,
)
from rlhf.models.config import ModelArgs
from rlhf.models.hf_io import load_hf_weights
from rlhf.models.transformer import Attention, CausalLM, rope_inv_freq

ARCHS = [f.name for f in FAMILIES if not f.is_moe]  # MoE: tests/unit/models/test_moe.py
# Head size 16: fine for transformers (only vLLM on CPU needs >= 32).
SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
             vocab_size=384, max_position_embeddings=64)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # 32 puts head_dim 16's frequencies in all three bands (kept, interpolated, divided)
               "original_max_position_embeddings": 32}
TOL = 1e-5
VARIANTS = [(arch, tied) for arch in ARCHS for tied in (False, True)] + [
    ("llama3", False), ("llama-bias", False)]


def _write_llama_with_biases(folder):
    """A Llama with attention_bias and mlp_bias, all weights random (HF would zero the biases)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.05, generator=gen)
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch, tied in VARIANTS:
        path = root / f"{arch}-{tied}"
        if arch == "llama-bias":
            out[arch, tied] = _write_llama_with_biases(path)
            continue
        spec = TinyModelConfig(arch="llama" if arch == "llama3" else arch, tie_embeddings=tied,
                               **SMALL)
        out[arch, tied] = make_tiny_model(spec, path)
        if arch == "llama3":
            config = json.loads((path / "config.json").read_text())
            config["rope_parameters"] = LLAMA3_ROPE
            (path / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def packed():
    gen = torch.Generator().manual_seed(0)
    lengths = [1] + torch.randint(1, 21, (4,), generator=gen).tolist()
    seqs = [torch.randint(0, SMALL["vocab_size"], (n,), generator=gen) for n in lengths]
    return seqs, pack(seqs)


@pytest.fixture(scope="module")
def models(folders):
    """(ours, HF) per variant, loaded once."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(variant):
        if variant not in cache:
            folder = folders[variant]
            ours = CausalLM(ModelArgs.from_pretrained(folder))
            load_hf_weights(ours, folder)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            cache[variant] = (ours.eval(), hf.eval())
        return cache[variant]

    return get


def _ours(model, p):
    return model(p.tokens, p.position_ids, p.cu_seqlens, p.max_seqlen)


def _token_logprobs(logits_TV, p):
    targets_T, valid_T = shifted_targets(p)
    logp_T = torch.log_softmax(logits_TV, -1).gather(-1, targets_T[:, None])[:, 0]
    return logp_T, valid_T


@pytest.mark.parametrize("variant", VARIANTS, ids=[f"{a}-{'tied' if t else 'untied'}"
                                                   for a, t in VARIANTS])
def test_logits_and_logprobs_match_hf(models, packed, variant):
    seqs, p = packed
    ours, hf = models(variant)
    with torch.no_grad():
        logits_TV = _ours(ours, p)
        ref_TV = torch.cat([hf(s[None]).logits[0] for s in seqs])
    assert logits_TV.shape == ref_TV.shape == (p.tokens.numel(), SMALL["vocab_size"])
    assert (logits_TV - ref_TV).abs().max() < TOL
    logp_T, valid_T = _token_logprobs(logits_TV, p)
    ref_logp_T, _ = _token_logprobs(ref_TV, p)
    assert (logp_T - ref_logp_T)[valid_T].abs().max() < TOL


@pytest.mark.parametrize("variant", VARIANTS, ids=[f"{a}-{'tied' if t else 'untied'}"
                                                   for a, t in VARIANTS])
def test_gradients_match_hf(models, packed, variant):
    seqs, p = packed
    ours, hf = models(variant)
    weights_T = torch.randn(p.tokens.numel(), generator=torch.Generator().manual_seed(1))

    def loss(logits_TV):  # a weighted sum of next-token log-probs plus a logit penalty
        logp_T, valid_T = _token_logprobs(logits_TV, p)
        return (weights_T * logp_T * valid_T).sum() + 1e-2 * logits_TV.square().mean()

    ours.zero_grad(), hf.zero_grad()
    loss(_ours(ours, p)).backward()
    loss(torch.cat([hf(s[None]).logits[0] for s in seqs])).backward()
    ours_grads = {n: q.grad for n, q in ours.named_parameters()}
    hf_grads = {n: q.grad for n, q in hf.named_parameters()}
    assert ours_grads.keys() == hf_grads.keys()
    for name, grad in ours_grads.items():
        assert grad is not None and hf_grads[name] is not None, name
        assert (grad - hf_grads[name]).abs().max() < TOL, name
    assert any(g.abs().max() > 1e-3 for g in ours_grads.values())  # the loss does reach the weights


def test_llama3_scaling_is_applied(folders, models, packed):
    """The llama3 variant differs from plain RoPE by far more than the tolerance."""
    seqs, p = packed
    args = ModelArgs.from_pretrained(folders["llama3", False])
    assert args.rope_scaling is not None and args.rope_scaling.factor == 8.0
    plain = CausalLM(ModelArgs.from_pretrained(folders["llama", False]))
    load_hf_weights(plain, folders["llama3", False])
    _, hf = models(("llama3", False))
    with torch.no_grad():
        ref_TV = torch.cat([hf(s[None]).logits[0] for s in seqs])
        assert (_ours(plain.eval(), p) - ref_TV).abs().max() > 100 * TOL
    hf_inv_freq = hf.model.rotary_emb.inv_freq
    assert torch.equal(rope_inv_freq(args), hf_inv_freq)
    assert not torch.equal(rope_inv_freq(plain.args), hf_inv_freq)


def _naive_attention(q_SHD, k_SHD, v_SHD, scale):
    n_rep = q_SHD.shape[1] // k_SHD.shape[1]
    k_SHD, v_SHD = k_SHD.repeat_interleave(n_rep, 1), v_SHD.repeat_interleave(n_rep, 1)
    scores_HSS = torch.einsum("shd,thd->hst", q_SHD, k_SHD) * scale
    seq = q_SHD.shape[0]
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    probs_HSS = scores_HSS.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hst,thd->shd", probs_HSS, v_SHD)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_varlen_equals_causal_attention_per_sequence(kv_heads):
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 0, 1, 9, 5]  # an empty sequence keeps its slot
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T = sum(lengths)
    q = torch.randn(T, 4, 8, generator=gen)
    k, v = torch.randn(T, kv_heads, 8, generator=gen), torch.randn(T, kv_heads, 8, generator=gen)
    out = varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=9, scale=0.3)
    assert out.shape == (T, 4, 8)
    for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if stop > start:
            ref = _naive_attention(q[start:stop], k[start:stop], v[start:stop], 0.3)
            assert (out[start:stop] - ref).abs().max() < 1e-6


def test_kernel_dispatch_is_a_function_of_device_dtype_and_availability():
    assert pick_kernel("cuda", torch.bfloat16, flash_available=True) is flash_varlen
    assert pick_kernel("cuda", torch.float16, flash_available=True) is flash_varlen
    assert pick_kernel("cuda", torch.float32, flash_available=True) is sdpa_split  # half only
    assert pick_kernel("cuda", torch.bfloat16, flash_available=False) is sdpa_split
    assert pick_kernel("cpu", torch.bfloat16, flash_available=True) is sdpa_split


def test_attention_heads_come_from_attributes(models, packed):
    """Heads split the way apply_tp will (q/k/v rows, o columns), o outputs summed: same result."""
    _, p = packed
    ours, _ = models(("qwen2", False))  # qkv bias; checks the column split of biases too
    attn = ours.model.layers["0"].self_attn
    args = ours.args
    gen = torch.Generator().manual_seed(2)
    hidden_TH = torch.randn(p.tokens.numel(), args.hidden_size, generator=gen)
    cos, sin = ours.model.rotary_emb(p.position_ids, torch.float32)
    with torch.no_grad():
        full = attn(hidden_TH, cos, sin, p.cu_seqlens, p.max_seqlen)
        total = torch.zeros_like(full)
        for rank in range(2):
            part = Attention(args)
            part.num_heads, part.num_kv_heads = args.num_heads // 2, args.num_kv_heads // 2
            for name in ("q_proj", "k_proj", "v_proj"):
                src, rows = getattr(attn, name), getattr(attn, name).weight.shape[0] // 2
                sl = slice(rank * rows, (rank + 1) * rows)
                setattr(part, name, torch.nn.Linear(args.hidden_size, rows, bias=True))
                getattr(part, name).weight.copy_(src.weight[sl])
                getattr(part, name).bias.copy_(src.bias[sl])
            cols = attn.o_proj.weight.shape[1] // 2
            part.o_proj = torch.nn.Linear(cols, args.hidden_size, bias=False)
            part.o_proj.weight.copy_(attn.o_proj.weight[:, rank * cols:(rank + 1) * cols])
            total += part(hidden_TH, cos, sin, p.cu_seqlens, p.max_seqlen)
    assert (total - full).abs().max() < 1e-6


def test_module_names_are_hf_names(models):
    ours, hf = models(("qwen3", False))
    assert dict(ours.named_parameters()).keys() == dict(hf.named_parameters()).keys()
    assert isinstance(ours.model.embed_tokens, torch.nn.Embedding)
    assert isinstance(ours.model.layers["1"].self_attn.q_proj, torch.nn.Linear)
    tied, _ = models(("qwen3", True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_layer_range_is_validated():
    args = ModelArgs.from_hf_config({"model_type": "llama", "vocab_size": 384, "hidden_size": 64,
                                     "intermediate_size": 96, "num_hidden_layers": 2,
                                     "num_attention_heads": 4})
    with pytest.raises(ValueError, match="layer_range"):
        CausalLM(args, layer_range=(1, 3))
    stage = CausalLM(args, layer_range=(1, 2), has_embedding=False)
    assert list(stage.model.layers) == ["1"] and not stage.is_complete
    assert CausalLM(args).is_complete


def test_interleaved_chunks_compose_to_the_full_model():
    """A rank's non-contiguous chunks (vpp) keep HF names; running every chunk in order through
    `Transformer.run` and the head gives the full model's logits, tied head copy included."""
    args = ModelArgs.from_hf_config({"model_type": "llama", "vocab_size": 384, "hidden_size": 64,
                                     "intermediate_size": 96, "num_hidden_layers": 4,
                                     "num_attention_heads": 4, "tie_word_embeddings": True})
    torch.manual_seed(0)
    full = CausalLM(args)
    first = CausalLM(args, layer_ranges=[(0, 1), (2, 3)], has_head=False)
    last = CausalLM(args, layer_ranges=[(1, 2), (3, 4)], has_embedding=False)
    assert list(first.model.layers) == ["0", "2"] and list(last.model.layers) == ["1", "3"]
    assert first.model.layer_range is None and not last.is_complete
    assert last.shared_parameters() == {"lm_head.weight": "model.embed_tokens.weight"}
    params = dict(full.named_parameters())
    for stage in (first, last):
        stage.load_state_dict({n: params[n if n != "lm_head.weight"
                                         else "model.embed_tokens.weight"]
                               for n, _ in stage.named_parameters()})
    packed = pack([torch.randint(0, 384, (n,)) for n in (5, 3, 7)])
    inputs = (packed.position_ids, packed.cu_seqlens, packed.max_seqlen)
    hidden = packed.tokens
    for stage, name, embed, norm in ((first, "0", True, False), (last, "1", False, False),
                                     (first, "2", False, False), (last, "3", False, True)):
        hidden = stage.model.run(hidden, *inputs, layers=[name], embed=embed, norm=norm)
    torch.testing.assert_close(last.head(hidden), full(packed.tokens, *inputs), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="overlap"):
        CausalLM(args, layer_ranges=[(0, 2), (1, 3)])


def _gpu_inputs():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 33, 17]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lengths), 8, 64, generator=gen)
    k, v = (torch.randn(sum(lengths), 2, 64, generator=gen) for _ in range(2))
    return q, k, v, cu, max(lengths)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention_on_cuda_matches_cpu_reference(dtype):
    """bf16 runs flash-attn's varlen kernel where it is installed, fp32 the SDPA loop on CUDA."""
    q, k, v, cu, max_len = _gpu_inputs()
    ref = sdpa_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max_len, causal=True,
                      scale=1 / math.sqrt(64))
    out = varlen_attention(*(x.to("cuda", dtype) for x in (q, k, v)), cu_seqlens=cu.cuda(),
                           max_seqlen=max_len, scale=1 / math.sqrt(64))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float().cpu() - ref).abs().max() < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or attention._flash_fn() is None,
                    reason="needs CUDA and flash-attn")
def test_flash_path_is_taken_and_matches_reference():
    q, k, v, cu, max_len = _gpu_inputs()
    ref = sdpa_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max_len, causal=True, scale=0.125)
    half = [x.to("cuda", torch.bfloat16) for x in (q, k, v)]
    assert pick_kernel("cuda", torch.bfloat16, flash_available=True) is flash_varlen
    out = flash_varlen(*half, cu_seqlens=cu.cuda(), max_seqlen=max_len, causal=True, scale=0.125)
    assert (out.float().cpu() - ref).abs().max() < 2e-2
