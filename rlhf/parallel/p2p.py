"""Point-to-point transfer of activations and their gradients between pipeline stages.

No shape handshake: every stage receives the same micro-batch list, so the receiver computes
the exact buffer shape (`activation_shape`). Sends and receives go out together in one
`exchange` (torch's batch_isend_irecv) that returns once all of them are done; the schedule
decides what to pair so that no two stages wait on each other (`rlhf.engine.pipeline_order`).
Each message carries its own tag (micro-batch, virtual stage, direction) where the backend
uses tags (gloo); pp = 2, where next and previous stage are one rank, needs no special case.
NCCL ignores tags and matches the messages between two ranks in the order they are posted:
`exchange(..., tagged=False)` posts them untagged, so gloo checks that order too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

ACTIVATION, GRADIENT = 0, 1


def activation_shape(num_tokens: int, hidden_size: int, *, tp: int,
                     sequence_parallel: bool) -> tuple[int, int]:
    """(tokens, hidden) a stage boundary carries for a micro-batch of `num_tokens` tokens:
    under sequence parallelism this rank's chunk of the stream padded to a multiple of tp."""
    if not sequence_parallel:
        return num_tokens, hidden_size
    padded = num_tokens + (-num_tokens % tp)
    return padded // tp, hidden_size


def message_tag(micro_batch: int, virtual_stage: int, direction: int, *,
                num_virtual_stages: int) -> int:
    """A tag unique to one message of one schedule run."""
    return (micro_batch * num_virtual_stages + virtual_stage) * 2 + direction


@dataclass(frozen=True)
class Send:
    tensor: Tensor
    dst: int  # global rank
    tag: int


@dataclass(frozen=True)
class Recv:
    shape: tuple[int, ...]
    dtype: torch.dtype
    src: int  # global rank
    tag: int


def exchange(sends: list[Send], recvs: list[Recv], *, device: torch.device,
             group: ProcessGroup, tagged: bool = True) -> list[Tensor]:
    """Post every send and receive at once, wait for all; return the received tensors.
    `tagged=False`: every message goes with tag 0, matched by posting order as NCCL does."""
    buffers = [torch.empty(r.shape, dtype=r.dtype, device=device) for r in recvs]
    ops = [dist.P2POp(dist.isend, s.tensor.detach().contiguous(), peer=s.dst, group=group,
                      tag=s.tag if tagged else 0) for s in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer=r.src, group=group, tag=r.tag if tagged else 0)
            for buf, r in zip(buffers, recvs)]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return buffers
