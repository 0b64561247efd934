"""Reducing the per-micro-batch loss and metrics of one `forward_backward` with tensor
collectives only (no pickled objects on the hot path). The schedules leave every loss and
metric on the device; they are summed there and read back once, here, per call.

DP ranks may report different metric names (a rank may have no micro-batches at all), so the
names are agreed first: each rank's sorted names, joined as bytes, are all-gathered as uint8
tensors padded to the longest. With pp > 1 the results exist on the last stage; it
broadcasts the names and the reduced values over the pipeline group as one float64 tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from rlhf.engine.schedule import MicroBatchResult
from rlhf.parallel.collectives import group_size
from rlhf.parallel.mesh import ParallelMesh

_SEP = b"\0"


def reduce_metrics(results: Sequence[MicroBatchResult], mesh: ParallelMesh, *,
                   device: torch.device) -> dict[str, float]:
    """Loss summed; each metric averaged over the micro-batches that report it (all DP);
    "num_micro_batches" counted over all DP ranks. The same dict on every rank."""
    keys = sorted({k for r in results for k in r.metrics})
    dp_group = mesh.dp_group
    if group_size(dp_group) > 1:  # a rank may lack a key (or micro-batches altogether)
        keys = _union(keys, dp_group, device)
    # Values stay on the device until the one read below; counts are host ints.
    sums = [_sum([r.loss for r in results], device)]
    sums += [_sum([r.metrics[k] for r in results if k in r.metrics], device) for k in keys]
    counts = [len(results)] + [sum(k in r.metrics for r in results) for k in keys]
    counts_t = torch.tensor(counts, dtype=torch.float64, device=device)
    totals = torch.stack([torch.stack(sums), counts_t], dim=1).reshape(-1)  # sum, count, ...
    if group_size(dp_group) > 1:
        dist.all_reduce(totals, group=dp_group)
    if mesh.pp_size > 1:  # results exist on the last stage only
        last = mesh.rank_at(dp=mesh.dp_rank, pp=mesh.pp_size - 1, tp=mesh.tp_rank)
        keys, totals = _broadcast(keys, totals, src=last, group=mesh.pp_group, device=device)
    values = totals.tolist()
    out = {"loss": values[0], "num_micro_batches": values[1]}
    for i, k in enumerate(keys):
        out[k] = values[2 + 2 * i] / max(values[3 + 2 * i], 1.0)
    return out


def _sum(values, device: torch.device) -> torch.Tensor:
    """float64 0-d sum on `device`: tensors added there, Python floats on the host."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    tensors = [v.reshape(()) for v in values if isinstance(v, torch.Tensor)]
    if tensors:
        total = total + torch.stack(tensors).to(device=device, dtype=torch.float64).sum()
    return total + math.fsum(float(v) for v in values if not isinstance(v, torch.Tensor))


def _encode(keys: Sequence[str]) -> bytes:
    for key in keys:
        if not key or _SEP.decode() in key:
            raise ValueError(f"metric name {key!r} is empty or contains a NUL character; "
                             "rename it")
    return _SEP.join(k.encode() for k in keys)


def _decode(data: bytes) -> list[str]:
    return [k.decode() for k in data.split(_SEP)] if data else []


def _union(keys: list[str], group: ProcessGroup, device: torch.device) -> list[str]:
    mine = _encode(keys)
    longest = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    if int(longest) == 0:
        return []
    padded = torch.zeros(int(longest), dtype=torch.uint8, device=device)
    padded[:len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    everyone = [torch.empty_like(padded) for _ in range(group_size(group))]
    dist.all_gather(everyone, padded, group=group)
    return sorted({k for row in everyone for k in _decode(bytes(row.tolist()).rstrip(_SEP))})


def _broadcast(keys: list[str], totals: torch.Tensor, *, src: int, group: ProcessGroup,
               device: torch.device) -> tuple[list[str], torch.Tensor]:
    """The last stage's (keys, totals), on every stage: a size header, then one payload."""
    names = _encode(keys)
    header = torch.tensor([len(names), totals.numel()], dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    num_bytes, num_values = header.tolist()
    payload = torch.zeros(num_bytes + num_values, dtype=torch.float64, device=device)
    if dist.get_rank() == src:
        payload[:num_bytes] = torch.tensor(list(names), dtype=torch.float64)
        payload[num_bytes:] = totals
    dist.broadcast(payload, src=src, group=group)
    data = bytes(int(b) for b in payload[:num_bytes].tolist())
    return _decode(data), payload[num_bytes:]
