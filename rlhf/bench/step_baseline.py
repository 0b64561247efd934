"""The single-process baseline of `rlhf bench step`: GRPO with a k3 KL loss written with
transformers only, as a careful user would (batched `generate` with the KV cache and sampling,
reference forward and generation under no_grad, one padded policy forward and backward, AdamW).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from rlhf.rewards.arith import exact_match


class PhaseClock:
    """Wall and process CPU seconds per phase, summed over calls."""

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[phase] = self.wall.get(phase, 0.0) + time.perf_counter() - wall0
            self.cpu[phase] = self.cpu.get(phase, 0.0) + time.process_time() - cpu0


def run_baseline(*, model_path: str, prompts: list[list[list[int]]], answers: list[list],
                 samples: int, new_tokens: int, kl_coef: float, lr: float, threads: int,
                 warmup: int) -> dict:
    """Train `len(prompts)` steps (prompts[i]: step i's prompt ids); time those after `warmup`.

    Returns generated tokens, wall seconds per phase and CPU utilisation per phase (process
    CPU seconds over wall seconds and `threads`) summed over the timed steps.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ref.requires_grad_(False)
    optim = torch.optim.AdamW(policy.parameters(), lr=lr)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generated, steps = 0, []
    for step, (step_prompts, step_answers) in enumerate(zip(prompts, answers)):
        clock = PhaseClock()
        with clock("step"):
            tokens = _grpo_step(policy, ref, optim, tokenizer, step_prompts, step_answers,
                                samples=samples, new_tokens=new_tokens, kl_coef=kl_coef, pad=pad,
                                clock=clock)
        if step >= warmup:
            generated += tokens
            steps.append(clock)
    wall = {k: sum(c.wall[k] for c in steps) for k in steps[0].wall}
    cpu = {k: sum(c.cpu[k] for c in steps) for k in steps[0].cpu}
    return {"generated_tokens": generated, "seconds": wall,
            "cpu_util": {k: cpu[k] / (wall[k] * threads) for k in wall if wall[k] > 0}}


def _grpo_step(policy, ref, optim, tokenizer, prompts: list[list[int]], answers: list, *,
               samples: int, new_tokens: int, kl_coef: float, pad: int, clock) -> int:
    """One GRPO step; returns the number of generated tokens."""
    rows = [p for p in prompts for _ in range(samples)]
    width = max(len(p) for p in rows)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])  # left padding
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    with clock("generate"), torch.no_grad():
        out = policy.generate(input_ids=input_ids, attention_mask=prompt_mask, do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                              pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
                              use_cache=True)
    response = out[:, width:]
    response_mask = _response_mask(response, tokenizer.eos_token_id)
    with clock("reward"):
        texts = tokenizer.batch_decode(response, skip_special_tokens=True)
        scores = torch.tensor([exact_match(prompt="", response=t, ground_truth=a, extra={})["score"]
                               for t, a in zip(texts, [a for a in answers for _ in range(samples)])])
        grouped = scores.view(-1, samples)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6))
        adv = adv.reshape(-1)
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    with clock("ref"), torch.no_grad():
        ref_logp = _response_log_probs(ref, out, attention, positions, width)
    with clock("update_actor"):
        logp = _response_log_probs(policy, out, attention, positions, width)
        ratio = torch.exp(logp - logp.detach())  # on-policy: one epoch, one mini-batch
        pg = -adv[:, None] * ratio
        log_r = ref_logp - logp
        kl = torch.exp(log_r) - log_r - 1  # k3
        mask = response_mask.float()
        loss = ((pg + kl_coef * kl) * mask).sum() / mask.sum().clamp(min=1)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
    return int(response_mask.sum())


def _response_mask(response, eos: int):
    """1 up to and including the first EOS of each row, 0 after (generate pads finished rows)."""
    is_eos = (response == eos).int()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    return (~after_eos).long()


def _response_log_probs(model, ids, attention, positions, width: int):
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    logits = logits[:, width - 1:-1].float()  # the logits that predict each response token
    return torch.log_softmax(logits, -1).gather(-1, ids[:, width:, None]).squeeze(-1)
