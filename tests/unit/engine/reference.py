"""Shared by the engine tests (unit and dist): tiny model folders, a random RL batch, the loss
functions handed to the engine, and a hand-written single-process reference of one training
step (per-sequence forward without packing, explicit PPO/value loss, clip_grad_norm_, AdamW).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.algorithms.losses import entropy_bonus, ppo_policy_loss, value_loss
from rlhf.config.schema import OptimizerConfig, TinyModelConfig
from rlhf.data.ragged import Ragged
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.models.config import ModelArgs
from rlhf.models.hf_io import load_hf_weights
from rlhf.models.transformer import CausalLM, ValueModel
from rlhf.parallel.launch import free_port

SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
             vocab_size=384, max_position_embeddings=64)
ENTROPY_COEF = 0.01
CLIP = 0.2
# Large eps: Adam's first update then depends on the gradient's scale, so clipping shows.
OPTIM = OptimizerConfig(lr=1e-3, weight_decay=0.1, eps=1e-3, grad_clip=0.05)


def tiny_folder(root: Path, *, arch: str = "llama", tied: bool = False) -> Path:
    return make_tiny_model(TinyModelConfig(arch=arch, tie_embeddings=tied, **SMALL),
                           Path(root) / f"{arch}-{tied}")


@dataclass
class RLBatch:
    prompts: Ragged
    responses: Ragged
    per_token: dict[str, Ragged]  # one entry per response token


def make_batch(seed: int, *, n: int = 6, vocab: int = SMALL["vocab_size"],
               group: int = 1) -> RLBatch:
    """Random prompts (2-6 tokens), responses (1-8) and per-response-token RL fields; with
    `group` > 1, n / group prompts, each repeated on `group` consecutive samples (rollout.n)."""
    gen = torch.Generator().manual_seed(seed)
    plens = torch.randint(2, 7, (n // group,), generator=gen).tolist()
    rlens = torch.randint(1, 9, (n,), generator=gen).tolist()
    distinct = [torch.randint(0, vocab, (k,), generator=gen) for k in plens]
    prompts = Ragged.from_list([p for p in distinct for _ in range(group)])
    responses = Ragged.from_list([torch.randint(0, vocab, (k,), generator=gen) for k in rlens])
    total = sum(rlens)

    def field(values):
        return Ragged(values, responses.offsets.clone())

    uniform_logp = -torch.log(torch.tensor(float(vocab)))
    per_token = {
        "old_log_probs": field(uniform_logp + 0.15 * torch.randn(total, generator=gen)),
        "advantages": field(torch.randn(total, generator=gen)),
        "loss_mask": field(torch.rand(total, generator=gen) < 0.8),
        "returns": field(torch.randn(total, generator=gen)),
        "old_values": field(torch.randn(total, generator=gen) * 0.1),
    }
    return RLBatch(prompts, responses, per_token)


def actor_loss_fn(global_tokens: int):
    """PPO clipped surrogate minus an entropy bonus, token-mean over `global_tokens`."""
    def loss_fn(outputs, mb):
        mask_T, cu = mb.tensors["loss_mask"].bool(), mb.packed.cu_seqlens
        pg, metrics = ppo_policy_loss(outputs["log_probs"], mb.tensors["old_log_probs"],
                                      mb.tensors["advantages"], mask_T, cu, clip_low=CLIP,
                                      clip_high=CLIP, global_tokens=global_tokens)
        ent = entropy_bonus(outputs["entropy"], mask_T, cu, global_tokens=global_tokens)
        return pg - ENTROPY_COEF * ent, {"clipfrac": metrics["clipfrac"], "entropy_sum": ent}
    return loss_fn


def critic_loss_fn(global_tokens: int):
    """Unclipped 0.5 (v - R)^2, token-mean over `global_tokens`."""
    def loss_fn(outputs, mb):
        loss, _ = value_loss(outputs["values"], mb.tensors["old_values"], mb.tensors["returns"],
                             mb.tensors["loss_mask"].bool(), mb.packed.cu_seqlens,
                             global_tokens=global_tokens)
        return loss, {}
    return loss_fn


def load_plain(folder: Path, head: str = "lm", value_head_seed: int = 0):
    """The unsharded model, loaded as the engine's tp=1 path would."""
    model = (CausalLM if head == "lm" else ValueModel)(ModelArgs.from_pretrained(folder))
    load_hf_weights(model, folder, value_head_seed=value_head_seed)
    return model


def _sequence_outputs(model, prompt, response, head):
    """Outputs at the positions predicting each response token of one sequence: (R,) each."""
    seq = torch.cat([prompt, response])
    n, p, r = seq.numel(), prompt.numel(), response.numel()
    out = model(seq, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n)
    pred = slice(p - 1, p + r - 1)
    if head == "value":
        return {"values": out[pred]}
    logp_RV = F.log_softmax(out[pred].float(), dim=-1)
    return {"log_probs": logp_RV.gather(-1, response[:, None])[:, 0],
            "entropy": -(logp_RV.exp() * logp_RV).sum(-1)}


def reference_loss(model, batch: RLBatch, head: str) -> torch.Tensor:
    """The whole mini-batch's loss, written out token by token from the formulas."""
    terms, count = [], 0
    for i in range(len(batch.prompts)):
        out = _sequence_outputs(model, batch.prompts[i], batch.responses[i], head)
        f = {k: v[i] for k, v in batch.per_token.items()}
        mask = f["loss_mask"]
        count += int(mask.sum())
        if head == "value":
            terms.append((0.5 * (out["values"] - f["returns"]).square())[mask].sum())
            continue
        ratio = torch.exp(out["log_probs"] - f["old_log_probs"])
        adv = f["advantages"]
        surr = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
        terms.append((surr - ENTROPY_COEF * out["entropy"])[mask].sum())
    return torch.stack(terms).sum() / count


def reference_step(folder: Path, batch: RLBatch, optim: OptimizerConfig = OPTIM, *,
                   head: str = "lm") -> dict:
    """One training step by hand (see `reference_steps`)."""
    return reference_steps(folder, [batch], optim, head=head)


def reference_steps(folder: Path, batches: list[RLBatch], optim: OptimizerConfig = OPTIM, *,
                    head: str = "lm") -> dict:
    """Training steps by hand, one per batch: loss, backward, clip_grad_norm_, torch AdamW
    with 1-D params (norms, biases) undecayed, constant lr. Returns params by HF name after
    the last step, and grad_norm and loss of every step (lists; floats for one batch)."""
    model = load_plain(folder, head)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps)
    max_norm = optim.grad_clip if optim.grad_clip is not None else float("inf")
    norms, losses = [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = reference_loss(model, batch, head)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        losses.append(float(loss.detach()))
        opt.step()
    named = {name: p.detach().clone() for name, p in model.named_parameters()}
    if len(batches) == 1:
        return {"params": named, "grad_norm": norms[0], "loss": losses[0]}
    return {"params": named, "grad_norm": norms, "loss": losses}


def exported(engine) -> dict[str, torch.Tensor]:
    """Full HF-named tensors of an engine's model (collective over its model group)."""
    return {name: t.detach().float().clone()
            for bucket in engine.export_hf_weights(bucket_bytes=1 << 20) for name, t in bucket}


def assert_same_export(engine, reference, *, start: dict[str, torch.Tensor],
                       moved: str) -> None:
    """`engine` exports what `reference` does (the same names in order, so export and weight
    sync are unchanged, and the same values within fp32 tolerance), and its `moved` tensor
    differs from `start` (the steps did update it)."""
    got, want = exported(engine), exported(reference)
    assert list(got) == list(want)
    assert not torch.equal(got[moved], start[moved])
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def assert_kept_through_offload_and_checkpoint(engine, fresh_engine, kept, train_step,
                                               tmp_path: Path) -> None:
    """A storage layout of the engine's weights (`kept(engine)`: one bool per place, e.g. the
    MLPs' paired gate and up) comes back from a full offload with the same values, lasts a
    training step and the offload phases after it, and is there again, with the same values,
    in `fresh_engine()` after loading the engine's checkpoint."""
    from rlhf.config.schema import OffloadConfig
    from rlhf.engine.offload import Offloader

    want = exported(engine)
    offloader = Offloader(engine.state_tensors,  # enters idle: weights away
                          config=OffloadConfig(params=True, grads=True, optimizer=True))
    assert not any(kept(engine))  # emptied
    offloader.enter("update")
    assert all(kept(engine))  # back as pieces of one allocation
    got = exported(engine)
    assert all(torch.equal(got[k], want[k]) for k in want)
    train_step(engine)
    for phase in ("idle", "forward", "idle", "checkpoint"):
        offloader.enter(phase)
    assert all(kept(engine))
    engine.save_checkpoint(tmp_path / "ckpt")
    want = exported(engine)
    fresh = fresh_engine()
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert all(kept(fresh))
    got = exported(fresh)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def max_param_error(got: dict, want: dict) -> float:
    missing = set(want) ^ set(got)
    if missing:
        raise AssertionError(f"parameter names differ: {sorted(missing)}")
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


class GlooWorld:
    """A gloo world of one process inside the test process (for tp=1 dp=1 engines)."""

    def __enter__(self):
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60))
            self.owner = True
        else:
            self.owner = False
        return self

    def __exit__(self, *exc):
        if self.owner:
            dist.destroy_process_group()
