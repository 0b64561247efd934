"""Optimizer pieces of the engine: the LR schedule, which params decay, and AdamW on the
(ZeRO-1 sharded, or whole) flat optimizer state of one rank."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.optim._functional import adamw
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from rlhf.config.schema import OptimizerConfig
from rlhf.engine.zero import Partition, Piece, partition
from rlhf.errors import RLHFError
from rlhf.parallel.collectives import _all_gather_single as all_gather_single


def lr_at(step: int, optim: OptimizerConfig, total_steps: int) -> float:
    """Learning rate of the optimizer step with 0-based index `step`.

    Linear warmup: (step + 1) / warmup_steps * lr for step < warmup_steps (so the first step
    is not wasted at 0). Then constant, or linear / cosine decay from lr at step == warmup_steps
    to min_lr_ratio * lr at step == total_steps (and after).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be at least 1, got {total_steps}")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    peak, warmup = optim.lr, optim.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if optim.schedule == "constant":
        return peak
    floor = optim.min_lr_ratio * peak
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if optim.schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    if optim.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {optim.schedule!r}; use constant, linear or cosine")


def decays(param: Tensor) -> bool:
    """Weight decay applies to matrices (linears, embeddings, value head), not to 1-D params
    (norm scales, biases): decaying those pulls norms towards 0 and biases for no benefit."""
    return param.dim() >= 2


class ShardedAdamW:
    """AdamW on the parameter pieces this rank owns under `part` (all of them when
    `part.shards == 1`), with "no decay on 1-D params" per piece.

    State, allocated here and updated in place: the Adam moments (two fp32 flat tensors of
    the shard size) and, for a low-precision model, an fp32 master copy of the shard; an fp32
    model is its own master. `copy_to_model` writes the updated shard back into the model
    parameters (all-gathered over DP bucket by bucket under ZeRO-1).

    The step is torch's own AdamW (`torch.optim._functional.adamw`) on the owned piece views:
    its fused kernel where the device has one (`fused=None`), else its foreach kernels.
    """

    def __init__(self, params: Sequence[nn.Parameter], part: Partition, *, rank: int,
                 config: OptimizerConfig, dp_group: ProcessGroup | None, device: torch.device,
                 fused: bool | None = None):
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"the model mixes parameter dtypes {sorted(map(str, dtypes))}; "
                             "build it in one dtype")
        self.params, self.part, self.rank, self.config = list(params), part, rank, config
        self.dp_group = dp_group
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.pieces = part.pieces(rank)
        self.fused = (torch.device(device).type in _get_fused_kernels_supported_devices()
                      if fused is None else fused)
        # Pieces of decayed and of undecayed params: torch's AdamW takes one decay per call.
        self._decay_groups = [
            ([k for k, p in enumerate(self.pieces) if decays(self.params[p.param]) == decay],
             config.weight_decay if decay else 0.0) for decay in (True, False)]
        size = part.shard_size
        self.master = (None if self.dtype == torch.float32
                       else torch.zeros(size, dtype=torch.float32, device=device))
        self.exp_avg = torch.zeros(size, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(size, dtype=torch.float32, device=device)
        self._shard_offsets = [0]
        for bucket in part.buckets:
            self._shard_offsets.append(self._shard_offsets[-1] + bucket.numel // part.shards)
        self.copy_from_model()

    def tensors(self) -> dict[str, list[Tensor]]:
        """{"masters": the fp32 shard ([] for an fp32 model), "optimizer": the moments}."""
        return {"masters": [] if self.master is None else [self.master],
                "optimizer": [self.exp_avg, self.exp_avg_sq]}

    def _values(self) -> list[Tensor]:
        """The fp32 values the step updates, one view per owned piece."""
        if self.master is not None:
            return [self.master[p.shard_start:p.shard_start + p.stop - p.start]
                    for p in self.pieces]
        return [self.params[p.param].detach().view(-1)[p.start:p.stop] for p in self.pieces]

    def _state(self, flat: Tensor) -> list[Tensor]:
        return [flat[p.shard_start:p.shard_start + p.stop - p.start] for p in self.pieces]

    @torch.no_grad()
    def step(self, grads: Tensor, *, lr: float, step: int) -> None:
        """One AdamW step (1-based `step`) from the synced flat fp32 `grads` buffer."""
        beta1, beta2 = self.config.betas
        values, moments = self._values(), self._state(self.exp_avg)
        squares = self._state(self.exp_avg_sq)
        offsets = self.part.offsets
        piece_grads = [grads[offsets[p.param] + p.start:offsets[p.param] + p.stop]
                       for p in self.pieces]
        for picks, weight_decay in self._decay_groups:
            if not picks:
                continue
            # torch's AdamW counts steps in tensors it increments first; the fused kernel
            # reads them on the device, the foreach one on the host.
            where = values[0].device if self.fused else torch.device("cpu")
            steps = list(torch.full((len(picks),), step - 1, dtype=torch.float32,
                                    device=where).unbind())
            adamw([values[k] for k in picks], [piece_grads[k] for k in picks],
                  [moments[k] for k in picks], [squares[k] for k in picks], [], steps,
                  foreach=not self.fused, fused=self.fused, amsgrad=False, beta1=beta1,
                  beta2=beta2, lr=lr, weight_decay=weight_decay, eps=self.config.eps,
                  maximize=False)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Write the updated shard into the model parameters (collective over DP when
        sharded: each bucket's shards are all-gathered)."""
        if self.part.shards == 1:
            if self.master is not None:
                for piece, value in zip(self.pieces, self._values()):
                    self.params[piece.param].detach().view(-1)[piece.start:piece.stop].copy_(value)
            return
        offsets = self.part.offsets
        for b, bucket in enumerate(self.part.buckets):
            lo, hi = self._shard_offsets[b], self._shard_offsets[b + 1]
            send = torch.zeros(hi - lo, dtype=self.dtype, device=self.exp_avg.device)
            if self.master is not None:
                send.copy_(self.master[lo:hi])
            else:
                for p in self.pieces:
                    if bucket.first <= p.param < bucket.stop:
                        send[p.shard_start - lo:p.shard_start - lo + p.stop - p.start].copy_(
                            self.params[p.param].detach().view(-1)[p.start:p.stop])
            full = torch.empty(bucket.numel, dtype=self.dtype, device=send.device)
            all_gather_single(full, send, group=self.dp_group)
            for i in range(bucket.first, bucket.stop):
                start = offsets[i] - bucket.start
                self.params[i].detach().view(-1).copy_(full[start:start + self.part.numels[i]])

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Re-read the master shard from the model (after loading model weights)."""
        if self.master is not None:
            for piece, value in zip(self.pieces, self._values()):
                value.copy_(self.params[piece.param].detach().view(-1)[piece.start:piece.stop])

    def state_dict(self) -> dict:
        """This rank's shard: masters (or None) and moments, with the layout they assume."""
        return {"shards": self.part.shards, "numels": list(self.part.numels),
                "bucket_numel": self.part.bucket_numel, "master": self.master,
                "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    @torch.no_grad()
    def load_state_dict(self, state: dict, *, where: str) -> None:
        """Copy a `state_dict` into this optimizer's own tensors (they stay the same objects).
        `state` may instead be {"shards": k, "all": [the k state dicts of another layout]}
        (another dp size, or with / without ZeRO-1): then this rank's pieces are cut from them."""
        states = state["all"] if "all" in state else [state]
        for saved in states:
            if list(saved["numels"]) != list(self.part.numels):
                raise RLHFError(f"{where} was saved for other parameter shapes; resume with the "
                                "same model and layout")
        if "all" not in state and state["shards"] == self.part.shards:
            if state["master"] is not None:
                torch._foreach_copy_(self._values(), self._state(state["master"]))
            self.exp_avg.copy_(state["exp_avg"])
            self.exp_avg_sq.copy_(state["exp_avg_sq"])
        elif len(states) != state["shards"]:
            raise RLHFError(
                f"{where} holds optimizer state sharded {state['shards']} ways (ZeRO-1 over a "
                f"data-parallel size of {state['shards']}, 1 = not sharded) but this engine "
                f"shards it {self.part.shards} ways and only this rank's shard was read; load "
                "it with `TrainEngine.load_checkpoint`, which reshards")
        else:
            self._reshard_from(states)
        if self.master is None and states[0]["master"] is not None:
            # A low-precision run resumed in fp32: its masters, not its rounded weights, are
            # the model now; the other ranks' pieces arrive by all-gather.
            self.copy_to_model()

    def _reshard_from(self, states: list[dict]) -> None:
        """Fill this rank's pieces from every shard of a layout with len(states) shards."""
        old = partition(self.part.numels, len(states), bucket_numel=states[0]["bucket_numel"])
        by_param: dict[int, list[tuple[int, Piece]]] = {}
        for rank in range(old.shards):
            for piece in old.pieces(rank):
                by_param.setdefault(piece.param, []).append((rank, piece))
        keys = ["exp_avg", "exp_avg_sq"] + (["master"] if states[0]["master"] is not None else [])
        for mine, value in zip(self.pieces, self._values()):
            targets = {"exp_avg": self.exp_avg[mine.shard_start:],
                       "exp_avg_sq": self.exp_avg_sq[mine.shard_start:], "master": value}
            for rank, theirs in by_param.get(mine.param, ()):
                lo, hi = max(mine.start, theirs.start), min(mine.stop, theirs.stop)
                if lo >= hi:
                    continue
                src = theirs.shard_start + lo - theirs.start
                for key in keys:
                    targets[key][lo - mine.start:hi - mine.start].copy_(
                        states[rank][key][src:src + hi - lo])
