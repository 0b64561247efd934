"""Weight transfer from the actor's ranks to separate rollout ranks (rollout.placement separate).

A standalone process group, created once at start, spans the actor's rank 0 (transfer rank 0,
the sender) and every rollout rank (transfer ranks 1..R). It is not part of either worker
group's torch.distributed world, so neither world changes; gloo on the CPU, NCCL on GPUs.

Every actor rank runs the export (it is collective over TP/PP), and actor rank 0, which sees
every full tensor, broadcasts each bucket: first a header (names, dtypes, shapes), then the
bucket's bytes as one flat buffer. Every rollout rank receives each tensor exactly once and
hands the buckets to the same reload path as the colocated sync (RolloutReplica.sync). An
empty header ends a transfer. Only actor rank 0 joins: the other actor ranks would only
receive tensors they never use.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

Buckets = Iterable[list[tuple[str, Tensor]]]
SENDER = 0  # transfer rank of actor rank 0


@dataclass(frozen=True)
class TransferAddress:
    """Where the transfer group meets: the sender's store, and the group's size and backend."""

    host: str
    port: int
    world_size: int  # 1 sender + the rollout ranks
    backend: str  # "gloo" or "nccl"


class TransferGroup:
    """One member of the transfer group; broadcasts from SENDER only."""

    def __init__(self, store: dist.Store, *, rank: int, address: TransferAddress,
                 device: torch.device, timeout_s: float):
        self.rank, self.size, self.device = rank, address.world_size, device
        prefix = dist.PrefixStore("weight_transfer", store)
        # A broadcast whose peer never comes (a rank that died mid-sync) fails after timeout_s
        # instead of hanging the job: gloo raises; NCCL's watchdog aborts the communicator
        # (and, by PyTorch's default error handling, the process) once the timeout passes.
        timeout = datetime.timedelta(seconds=timeout_s)
        if address.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # what init_process_group(timeout=) sets
            self.pg = dist.ProcessGroupNCCL(prefix, rank, address.world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefix, rank, address.world_size, timeout=timeout)
        self._store = store  # the sender's store must outlive the group's rendezvous

    @classmethod
    def host_store(cls, timeout_s: float) -> tuple[dist.TCPStore, int]:
        """The sender's store on a port the OS picks (kept, so the port cannot be lost)."""
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return store, store.port

    @classmethod
    def join(cls, address: TransferAddress, *, rank: int, device: torch.device,
             timeout_s: float, store: dist.Store | None = None) -> TransferGroup:
        """Join as `rank` (collective: every member calls it at the same time). The sender
        passes the store it hosts; the others connect to it."""
        if store is None:
            store = dist.TCPStore(address.host, address.port, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        return cls(store, rank=rank, address=address, device=device, timeout_s=timeout_s)

    def _broadcast(self, tensor: Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = SENDER
        self.pg.broadcast([tensor], opts).wait()

    def _header(self, header: list | None) -> list | None:
        """Broadcast a picklable header (None ends the transfer) from the sender."""
        if self.rank == SENDER:
            payload = b"" if header is None else pickle.dumps(header)
            size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size)
        if int(size) == 0:
            return None
        if self.rank == SENDER:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        self._broadcast(data)
        return pickle.loads(data.cpu().numpy().tobytes())

    def send(self, buckets: Buckets) -> dict[str, float]:
        """Broadcast every bucket of HF-named full tensors; transfer/bytes and /seconds."""
        assert self.rank == SENDER, "only transfer rank 0 sends"
        start, moved = time.perf_counter(), 0
        for bucket in buckets:
            if not bucket:
                continue
            self._header([(name, t.dtype, tuple(t.shape)) for name, t in bucket])
            flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8).to(self.device)
                              for _, t in bucket])
            self._broadcast(flat)
            moved += flat.numel()
        self._header(None)
        return {"bytes": float(moved), "seconds": time.perf_counter() - start}

    def receive(self) -> Iterator[list[tuple[str, Tensor]]]:
        """The sender's buckets, one at a time, as (name, full tensor) views of one buffer."""
        assert self.rank != SENDER, "transfer rank 0 sends"
        while (header := self._header(None)) is not None:
            sizes = [_nbytes(dtype, shape) for _, dtype, shape in header]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            bucket, offset = [], 0
            for (name, dtype, shape), size in zip(header, sizes):
                bucket.append((name, flat[offset:offset + size].view(dtype).view(shape)))
                offset += size
            yield bucket


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
