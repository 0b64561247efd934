"""The expert all-to-alls add their time to the stopwatch of `timed_all_to_all` (what `rlhf
bench step` reports as their share): on 2 gloo ranks at ep=2, one layer's forward times the
counts exchange, dispatch and combine, its backward the two reverse exchanges (found through
the forward's context), and nothing is timed outside the block."""

from contextlib import contextmanager

import torch

from rlhf.parallel.expert_parallel import combine, dispatch, timed_all_to_all
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from rlhf.parallel.timing import Stopwatch

H, E, K = 4, 4, 2


class CountingWatch(Stopwatch):
    def __init__(self):
        super().__init__("cpu")
        self.blocks = 0

    @contextmanager
    def __call__(self):
        self.blocks += 1
        with super().__call__():
            yield


def _layer(x, ids, group):
    recv, plan = dispatch(x, ids, num_experts=E, group=group)
    return combine(recv * 2.0, plan, top_k=K, group=group).sum()


def _run(rank, world):
    mesh = ParallelMesh(range(world), ep=2, cache=ProcessGroupCache())
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(5, H, generator=gen, requires_grad=True)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(5)])
    watch, outside = CountingWatch(), CountingWatch()
    with timed_all_to_all(watch):
        loss = _layer(x, ids, mesh.ep_group)
    forward = (watch.blocks, watch.seconds)
    loss.backward()  # outside the block: the backward uses the forward's stopwatch
    _layer(x.detach(), ids, mesh.ep_group)  # no stopwatch in force: nothing is timed
    return forward, watch.blocks, watch.seconds, outside.blocks


def test_all_to_alls_are_timed_forward_and_backward():
    for (fwd_blocks, fwd_s), blocks, seconds, outside in run_distributed(_run, 2, timeout_s=60):
        assert fwd_blocks == 3 and fwd_s > 0  # counts, dispatch, combine
        assert blocks == 5 and seconds > fwd_s  # + the backward of combine and dispatch
        assert outside == 0
