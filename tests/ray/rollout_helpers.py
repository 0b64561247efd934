"""Shared set-up of the rollout tests: a tiny vLLM-compatible policy, a job config, prompts,
greedy decoding with transformers, and a PPO-style update that moves the policy."""

import dataclasses

import torch
from transformers import AutoModelForCausalLM

from rlhf.config import ParallelConfig, TinyModelConfig
from rlhf.controller import ResourcePool, WorkerGroup
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.demo.tiny_model import make_tiny_model
from tests.unit.test_worker_roles import make_config
from workers.actor import ActorWorker

MAX_NEW = 8
GAP_TOL = 2e-4  # fp32: vLLM's and the trainer's kernels differ in summation order only
# Below this top-2 logit gap, fp32 rounding differences between vLLM and transformers may
# flip the greedy choice, so the comparison of one prompt stops there.
NEAR_TIE = 1e-4
TINY = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=192,
            vocab_size=384, max_position_embeddings=128)  # head size 32: a vLLM CPU size


def actor_group(cfg, name: str):
    """A 2-rank WorkerGroup holding only the actor role; yields its view, then shuts down."""
    group = WorkerGroup(ResourcePool(f"{name}-pool", ranks_per_node=2, use_gpu=False),
                        {"actor": (ActorWorker, {"config": cfg})}, job_name=f"{name}-test")
    yield group.role_views()["actor"]
    group.shutdown()


def make_policy(root) -> str:
    return str(make_tiny_model(TinyModelConfig(**TINY), root / "policy"))


def rollout_config(policy, *, ranks=2, tp=1, pp=1, n=2, temperature=0.8):
    """Actor on `ranks` ranks with the given training layout, n samples at `temperature`."""
    cfg = make_config(
        policy, ranks=ranks,
        rollout={"n": n, "temperature": temperature, "max_new_tokens": MAX_NEW,
                 "cpu_kv_cache_gb": 0.25, "max_num_seqs": 16},
        actor={"parallel": ParallelConfig(tp=tp, pp=pp), "ppo_mini_batch_size": 2,
               "max_tokens_per_micro_batch": 64})
    actor = dataclasses.replace(cfg.actor, optim=dataclasses.replace(cfg.actor.optim, lr=3e-2))
    return dataclasses.replace(cfg, actor=actor,
                               data=dataclasses.replace(cfg.data, max_prompt_length=24))


def prompts(count=5, seed=0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, TINY["vocab_size"], (int(k),), generator=gen)
            for k in torch.randint(2, 9, (count,), generator=gen)]
    return Batch({"prompt_ids": Ragged.from_list(rows)})


@torch.no_grad()
def hf_greedy(folder, batch: Batch) -> list[tuple[list[int], list[float]]]:
    """Per prompt: greedy ids (stopping at EOS) and each step's top-2 logit gap."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = []
    for prompt in batch["prompt_ids"].to_list():
        ids, gaps = prompt.tolist(), []
        for _ in range(MAX_NEW):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2).values
            gaps.append(float(top[0] - top[1]))
            ids.append(int(logits.argmax()))
            if ids[-1] in eos:
                break
        out.append((ids[len(prompt):], gaps))
    return out


def assert_greedy_equal(responses: Ragged, want) -> int:
    """vLLM's greedy rows equal transformers' up to the first near-tie; returns tokens compared."""
    compared = 0
    for i, (got, (ids, gaps)) in enumerate(zip(responses.to_list(), want, strict=True)):
        got = got.tolist()
        stop = next((k for k, g in enumerate(gaps) if g < NEAR_TIE), len(ids))
        assert got[:stop] == ids[:stop], f"prompt {i}: vLLM {got} vs transformers {ids}"
        if stop == len(ids):
            assert got == ids, f"prompt {i}: vLLM {got} vs transformers {ids}"
        compared += stop
    return compared


def ppo_batch(actor, rollout: Batch, prompts_batch: Batch, n: int) -> Batch:
    """Sampled rows scored by the actor, with advantages +1 on even samples and -1 on odd."""
    batch = prompts_batch.repeat_interleave(n).union(
        Batch({k: rollout[k] for k in rollout.keys()}))
    batch = batch.union(actor.compute_log_prob(batch))
    lengths = batch["response_ids"].lengths
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(batch))])
    adv = Ragged(sign.repeat_interleave(lengths), batch["response_ids"].offsets.clone())
    return batch.union(Batch({"advantages": adv}))
