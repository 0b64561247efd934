"""Model FLOPs and the CPU's matmul rate: the one definition of MFU of `rlhf bench`.

`forward_flops_per_token` is one token's forward: 2 FLOPs per weight of every matmul (the
attention projections, the MLP and the LM head, tied or not; embeddings excluded) plus causal
attention's QK^T and AV. A training step's forward and backward is 3x that (`PASSES`). On the
CPU the peak is `MatmulRate` (one core's best fp32 matmul rate, measured in the same run, so a
slower or faster machine moves MFU only as far as the trainer itself gets slower or faster)
times the cores. `rlhf bench engine` and `rlhf bench step` both use these.

`rlhf bench step` counts the FLOPs a step must do, the same for any trainer of the same model
and samples: one forward of the rollout, one of the reference and a forward and backward of
the policy update, over each distinct prompt once and each response once. Padding, prompts
computed once per sample and separate old-log-prob passes are work a trainer chooses to do, so
they lower its MFU.
"""

from __future__ import annotations

import time

import torch

from rlhf.models.config import ModelArgs

PASSES = {"generate": 1, "ref": 1, "update_actor": 3}  # forward passes' worth per phase
RATE_SHAPE = 1024  # the rate's matmul: (n x n) @ (n x n) in fp32
RATE_REPEATS = 3


def forward_flops_per_token(args: ModelArgs, *, seq_len: float) -> float:
    """One token's forward FLOPs (module docstring), in sequences of `seq_len` tokens."""
    hidden, q = args.hidden_size, args.num_heads * args.head_dim
    kv = args.num_kv_heads * args.head_dim
    attention_proj = hidden * (q + 2 * kv) + q * hidden
    # An MoE layer runs its router and top-k of its experts per token (active parameters).
    mlps = sum(hidden * (args.num_experts + 3 * args.num_experts_per_tok
                         * args.moe_intermediate_size) if args.is_moe_layer(i)
               else 3 * hidden * args.intermediate_size for i in range(args.num_layers))
    matmul_weights = (args.num_layers * attention_proj + mlps
                      + hidden * args.vocab_size)  # with the LM head
    attention = args.num_layers * seq_len * q  # causal: QK^T and AV, ~ seq_len / 2 * q MACs each
    return 2.0 * (matmul_weights + attention)


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


def cpu_peak_flops(cores: int) -> float:
    """FLOP/s of `cores` CPU cores: one core's matmul rate (a fresh MatmulRate) times cores."""
    return MatmulRate().measure() * 1e9 * cores


def step_mfu(*, flops_per_token: float, tokens: int, seconds: dict[str, float], cores: int,
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
