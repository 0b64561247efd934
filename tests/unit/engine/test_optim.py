"""ShardedAdamW on torch's AdamW kernels: fused and foreach, whole and split over ranks, equal
to `torch.optim.AdamW` with the "no decay on 1-D params" groups."""

import pytest
import torch
from torch import nn

from rlhf.config.schema import OptimizerConfig
from rlhf.engine.optim import ShardedAdamW, decays
from rlhf.engine.zero import partition

CONFIG = OptimizerConfig(lr=1e-2, weight_decay=0.1, eps=1e-6)
SHAPES = [(7, 5), (5,), (3, 4, 2), (11,), (6, 6)]


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _reference(steps):
    params = _params()
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if decays(p)], "weight_decay": CONFIG.weight_decay},
         {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}],
        lr=CONFIG.lr, betas=CONFIG.betas, eps=CONFIG.eps, foreach=False)
    for step in range(steps):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("shards,bucket", [(1, 1000), (2, 1000), (3, 40)])
def test_sharded_adamw_equals_torch_adamw(fused, shards, bucket, monkeypatch):
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(1), real(*a, **k)))
    steps = 3
    part = partition([p.numel() for p in _params()], shards, bucket_numel=bucket)
    # Each rank steps its own copy of the model; the pieces it owns are its result.
    ranks = []
    for rank in range(shards):
        params = _params()
        opt = ShardedAdamW(params, part, rank=rank, config=CONFIG, dp_group=None,
                           device=torch.device("cpu"), fused=fused)
        for step in range(steps):
            flat = torch.zeros(part.total)
            for i, g in enumerate(_grads(step)):
                flat[part.offsets[i]:part.offsets[i] + g.numel()] = g.reshape(-1)
            opt.step(flat, lr=CONFIG.lr, step=step + 1)
        ranks.append((opt, params))
    got = [p.detach().reshape(-1).clone() for p in _params()]
    for opt, params in ranks:
        for piece in opt.pieces:
            got[piece.param][piece.start:piece.stop] = params[piece.param].detach().reshape(
                -1)[piece.start:piece.stop]
    torch.testing.assert_close(torch.cat(got), _reference(steps), rtol=0, atol=1e-6)
    assert (len(calls) > 0) == fused
    assert ranks[0][0].fused == fused


def test_the_fused_kernel_is_the_default_where_the_device_has_one():
    part = partition([p.numel() for p in _params()], 1)
    opt = ShardedAdamW(_params(), part, rank=0, config=CONFIG, dp_group=None,
                       device=torch.device("cpu"))
    assert opt.fused  # torch has a fused AdamW on the CPU
