"""Model FLOPs utilisation (MFU) of a whole PPO/GRPO step on the CPU.

MFU is the FLOPs a step must do over its wall seconds times the cores times one core's fp32
matmul rate. The rate is measured in the same run (`MatmulRate`: the best of several one-thread
matmuls of `RATE_SHAPE`), so a slower or faster machine moves MFU only as far as the trainer
itself gets slower or faster.

The FLOPs a step must do are the same for any trainer of the same model and samples: 2 per
weight of every linear layer (the LM head included, embeddings excluded) per token, for every
token of one forward of the rollout, one of the reference and one forward and backward (3x) of
the policy update (`PASSES`), with each distinct prompt counted once and each response once.
Padding, prompts computed once per sample and separate old-log-prob passes are work a trainer
chooses to do, so they lower its MFU. Attention scores are left out: under 2 % of the linear
FLOPs at the bench's sequence lengths.
"""

from __future__ import annotations

import time

import torch
from torch import nn

PASSES = {"generate": 1, "ref": 1, "update_actor": 3}  # forward passes' worth per phase
RATE_SHAPE = 1024  # the rate's matmul: (n x n) @ (n x n) in fp32
RATE_REPEATS = 3


def linear_flops_per_token(model: nn.Module) -> int:
    """One token's forward FLOPs in the linear layers: 2 x the weights of every nn.Linear."""
    return 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


class MatmulRate:
    """The best one-thread fp32 matmul rate seen over `measure()` calls, in GFLOP/s."""

    def __init__(self, n: int = RATE_SHAPE):
        self.n, self.best = n, 0.0
        self._a, self._b = torch.randn(n, n), torch.randn(n, n)

    def measure(self, repeats: int = RATE_REPEATS) -> float:
        """Time `repeats` matmuls on one thread (the caller's thread count is restored);
        returns the best rate so far."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            torch.mm(self._a, self._b)  # warm the kernel
            for _ in range(repeats):
                start = time.perf_counter()
                torch.mm(self._a, self._b)
                seconds = time.perf_counter() - start
                self.best = max(self.best, 2 * self.n ** 3 / seconds / 1e9)
        finally:
            torch.set_num_threads(threads)
        return self.best


def step_mfu(*, flops_per_token: int, tokens: int, seconds: dict[str, float], cores: int,
             gflops_per_core: float) -> dict[str, float]:
    """MFU of the whole step ("step", all PASSES) and of each phase in PASSES that `seconds`
    has, for `tokens` forward tokens (distinct prompts plus responses) over those seconds."""
    if gflops_per_core <= 0 or cores < 1:
        raise ValueError(f"need a positive matmul rate and at least one core, got "
                         f"{gflops_per_core} GFLOP/s and {cores} cores")
    peak = gflops_per_core * 1e9 * cores
    passes = {"step": sum(PASSES.values()), **PASSES}
    return {phase: n * flops_per_token * tokens / (seconds[phase] * peak)
            for phase, n in passes.items() if seconds.get(phase, 0) > 0}
