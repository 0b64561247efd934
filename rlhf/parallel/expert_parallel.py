"""Expert parallelism: a MoE layer's token copies sent to the ranks holding their experts and back.

Each rank of an expert-parallel (ep) group holds `num_experts / ep` consecutive experts (rank r
holds experts [r * E_local, (r + 1) * E_local)). A layer routes every token to top-k experts;
`dispatch` sorts the T*k (token, expert) copies by expert, which also groups them by owning
rank, and exchanges them with one all-to-all of uneven splits over the ep group (gloo and NCCL
both take `all_to_all_single` with split sizes), after one small all-to-all of the per-expert
counts so every rank knows what it receives. Nothing is padded: a rank receives exactly the
copies routed to its experts. `combine` is the exact reverse. Both are differentiable; the
backward of an all-to-all is the all-to-all with the splits swapped.

The routing weights never travel: `combine` returns every copy's expert output in the
(token, k) order of the router, and the layer weights and sums them where the router ran, so
the router's gradient stays local.

Every rank of an ep group must call `dispatch` and `combine` as often as the others (an empty
micro-batch, T = 0, still takes part); the micro-batch planner keeps the counts equal.

Inside `timed_all_to_all(watch)` every all-to-all here, forward and backward, adds its time to
`watch` (a `timing.Stopwatch`): the engine scopes one around its calls, so benchmarks can report
the exchanges' share of a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from rlhf.parallel.collectives import group_rank, group_size
from rlhf.parallel.timing import Stopwatch
from rlhf.trace import span

# The stopwatch of the engine call in progress (`timed_all_to_all`). The exchanges run deep in
# a model's forward and in autograd's backward, which no argument reaches; a backward uses the
# stopwatch its forward saw (autograd may run it on another thread).
_WATCH: ContextVar[Stopwatch | None] = ContextVar("all_to_all_watch", default=None)


@contextmanager
def timed_all_to_all(watch: Stopwatch) -> Iterator[None]:
    """Within the block, every expert all-to-all of this thread adds its time to `watch`."""
    token = _WATCH.set(watch)
    try:
        yield
    finally:
        _WATCH.reset(token)


def _timed(watch: Stopwatch | None):
    return watch() if watch is not None else nullcontext()


@dataclass(frozen=True)
class ExpertPlacement:
    """Which of a MoE layer's `num_experts` experts this rank holds: the `ep_rank`-th run of
    num_experts / ep consecutive ones."""

    num_experts: int
    ep: int = 1
    ep_rank: int = 0

    def __post_init__(self):
        if self.num_experts % self.ep:
            raise ValueError(f"{self.num_experts} experts do not split over ep={self.ep} ranks; "
                             "choose an ep that divides the number of experts")
        if not 0 <= self.ep_rank < self.ep:
            raise ValueError(f"ep_rank {self.ep_rank} is outside 0..{self.ep - 1}")

    @property
    def local(self) -> range:
        """Global indices of the experts held here."""
        per = self.num_experts // self.ep
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)


@dataclass(frozen=True)
class DispatchPlan:
    """How one layer's copies moved, to send the expert outputs back the same way."""

    order: Tensor
    """(T*k,) the router's copies sorted by expert: copy `order[i]` went out i-th."""
    send_splits: list[int]
    """Copies sent to each ep rank."""
    recv_splits: list[int]
    """Copies received from each ep rank."""
    local_order: Tensor
    """(N,) the received copies regrouped by local expert (then by source rank)."""
    tokens_per_expert: Tensor
    """(E_local,) received copies for each local expert, in `local_order` (on the device)."""


def local_experts(num_experts: int, group: ProcessGroup | None) -> range:
    """The global indices of the experts this rank of the ep `group` holds."""
    return ExpertPlacement(num_experts, group_size(group), group_rank(group)).local


def dispatch(x_TH: Tensor, experts_TK: Tensor, *, num_experts: int,
             group: ProcessGroup | None) -> tuple[Tensor, DispatchPlan]:
    """Send each token's copy to the rank of each expert it was routed to.

    `x_TH`: this rank's tokens; `experts_TK`: the k global expert ids of each token.
    Returns (N, H) copies of tokens routed to this rank's experts, grouped by local expert
    (`plan.tokens_per_expert` rows each), and the plan `combine` needs. Collective over
    `group` (the ep group; None or size 1: no communication).
    """
    ep = group_size(group)
    num_local = len(local_experts(num_experts, group))
    T, K = experts_TK.shape
    if x_TH.shape[0] != T:
        raise ValueError(f"x has {x_TH.shape[0]} tokens but the routing has {T}; pass the "
                         "routing of the same tokens")
    flat = experts_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    copies_NH = x_TH.index_select(0, torch.div(order, K, rounding_mode="floor"))
    counts_E = torch.bincount(flat, minlength=num_experts)
    if counts_E.numel() != num_experts:
        raise ValueError(f"routing names expert {int(flat.max())} but the layer has "
                         f"{num_experts} experts")
    if ep == 1:
        return copies_NH, DispatchPlan(order, [len(flat)], [len(flat)],
                                       torch.arange(len(flat), device=flat.device), counts_E)
    # received[s, e]: copies source rank s sends to this rank's local expert e
    received = torch.empty_like(counts_E)
    with _timed(_WATCH.get()):
        dist.all_to_all_single(received, counts_E, group=group)
    received_SE = received.view(ep, num_local)
    send_splits = counts_E.view(ep, num_local).sum(1).tolist()  # the step's one host read
    recv_splits = received_SE.sum(1).tolist()
    recv_NH = _AllToAll.apply(copies_NH, recv_splits, send_splits, group)
    local_order = _group_by_expert(received_SE)
    plan = DispatchPlan(order, send_splits, recv_splits, local_order, received_SE.sum(0))
    return recv_NH.index_select(0, local_order), plan


def combine(y_NH: Tensor, plan: DispatchPlan, *, top_k: int,
            group: ProcessGroup | None) -> Tensor:
    """The reverse of `dispatch`: every copy's expert output back on the rank that routed it,
    as (T, k, H) in the router's (token, k) order. Collective over `group`."""
    if group_size(group) > 1:
        back_NH = torch.empty_like(y_NH).index_copy(0, plan.local_order, y_NH)
        y_NH = _AllToAll.apply(back_NH, plan.send_splits, plan.recv_splits, group)
    out = torch.empty_like(y_NH).index_copy(0, plan.order, y_NH)
    return out.view(-1, top_k, y_NH.shape[-1])


def experts_forward(x_TH: Tensor, experts_TK: Tensor, weights_TK: Tensor, *,
                    run: Callable[[Tensor, Tensor], Tensor],
                    placement: ExpertPlacement, group: ProcessGroup | None) -> Tensor:
    """sum_k weights_TK[t, k] * expert[experts_TK[t, k]](x_TH[t]) with the experts spread over
    the ep `group` (None or size 1: all here): `run(copies_NH, tokens_per_expert)` applies this
    rank's experts (`placement.local`) to copies grouped by expert. Collective over `group`;
    every rank of it calls this once per layer forward."""
    recv_NH, plan = dispatch(x_TH, experts_TK, num_experts=placement.num_experts, group=group)
    y_TKH = combine(run(recv_NH, plan.tokens_per_expert), plan, top_k=experts_TK.shape[1],
                    group=group)
    return (weights_TK.unsqueeze(-1) * y_TKH).sum(1)


def _group_by_expert(received_SE: Tensor) -> Tensor:
    """Row order taking the received copies (source-major, expert-minor) to expert-major."""
    ep, num_local = received_SE.shape
    expert_N = torch.arange(num_local, device=received_SE.device).repeat(ep).repeat_interleave(
        received_SE.reshape(-1))
    return torch.argsort(expert_N, stable=True)


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows with uneven splits; backward sends the grads back (splits swapped)."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int],
                group: ProcessGroup) -> Tensor:
        ctx.splits, ctx.group, ctx.watch = (out_splits, in_splits), group, _WATCH.get()
        with _timed(ctx.watch):
            return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        with _timed(ctx.watch):
            grad = _all_to_all(grad.contiguous(), in_splits, out_splits, ctx.group)
        return grad, None, None, None


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int],
                group: ProcessGroup) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with span("all_to_all", bytes=x.numel() * x.element_size(), out_bytes=out.numel()
              * out.element_size()):  # a span on the step timeline when tracing
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=group)
    return out
