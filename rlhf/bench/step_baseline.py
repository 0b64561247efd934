"""The single-process baseline of `rlhf bench step`: GRPO with a k3 KL loss written with
transformers only, as a careful user would (batched `generate` with the KV cache and sampling,
reference forward and generation under no_grad, one padded policy forward and backward, AdamW).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from rlhf.rewards.arith import exact_match


class SectionClock:
    """Wall and process CPU seconds per phase, summed over calls."""

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    @contextmanager
    def __call__(self, section: str):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[section] = self.wall.get(section, 0.0) + time.perf_counter() - wall0
            self.cpu[section] = self.cpu.get(section, 0.0) + time.process_time() - cpu0


class BaselineTrainer:
    """The baseline's models, optimizer and settings; `step` trains on one batch of prompts.

    `rlhf bench step` calls `step` between our trainer's steps, so that both systems see the
    same state of the machine.
    """

    def __init__(self, *, model_path: str, samples: int, new_tokens: int, kl_coef: float,
                 lr: float, threads: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.threads, self.samples = threads, samples
        self.new_tokens, self.kl_coef = new_tokens, kl_coef
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.ref.requires_grad_(False)
        self.optim = torch.optim.AdamW(self.policy.parameters(), lr=lr)
        eos = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos

    def step(self, prompts: list[list[int]], answers: list) -> tuple[int, SectionClock]:
        """One GRPO step on `prompts` (ids); returns its generated tokens and phase times."""
        torch.set_num_threads(self.threads)  # set per step: the driver runs other work between
        clock = SectionClock()
        with clock("step"):
            tokens = _grpo_step(self.policy, self.ref, self.optim, self.tokenizer, prompts,
                                answers, samples=self.samples, new_tokens=self.new_tokens,
                                kl_coef=self.kl_coef, pad=self.pad, clock=clock)
        return tokens, clock


def summarise(steps: list[tuple[int, SectionClock]], threads: int) -> dict:
    """Generated tokens, wall seconds per phase and CPU utilisation per phase (process CPU
    seconds over wall seconds and `threads`) summed over `steps` (BaselineTrainer.step's)."""
    clocks = [clock for _, clock in steps]
    wall = {k: sum(c.wall[k] for c in clocks) for k in clocks[0].wall}
    cpu = {k: sum(c.cpu[k] for c in clocks) for k in clocks[0].cpu}
    return {"generated_tokens": sum(tokens for tokens, _ in steps), "seconds": wall,
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
