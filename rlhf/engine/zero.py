"""The ZeRO-1 partition of one rank's parameters over its data-parallel group: pure integers.

Parameters (in `model.parameters()` order, trainable ones) are laid end to end in one flat
buffer. The buffer is cut into buckets of whole parameters (at most `bucket_numel` elements,
a bigger parameter alone); each bucket is padded to a multiple of `shards` and split into
`shards` equal contiguous ranges, range r owned by DP rank r (Megatron's distributed
optimizer). A rank's shard is its range of every bucket, concatenated: the fp32 master copy
and the Adam moments hold only that. Grads are reduce-scattered and updated parameters
all-gathered bucket by bucket, so no collective moves more than one bucket.

`shards=1` is the non-distributed layout (no padding, one rank owns everything). The engine
and the memory planner both call `num_shards`, `partition` and `state_bytes`, so the
planner predicts exactly what the engine allocates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BUCKET_NUMEL = 2**24  # elements per bucket: 64 MiB of fp32 grads moved per collective
# The kinds of state a training engine holds (`TrainEngine.state_tensors()`); the offloader
# moves them and the memory planner counts them by these names.
STATE_KINDS = ("weights", "grads", "masters", "optimizer")


@dataclass(frozen=True)
class Bucket:
    """Parameters [first, stop) at flat offset `start`; `numel` is padded to a multiple of
    the shard count, so each rank owns `numel // shards` elements of it."""

    start: int
    numel: int
    first: int
    stop: int


@dataclass(frozen=True)
class Piece:
    """The part [start, stop) of parameter `param` (flattened) that a rank owns, stored at
    `shard_start` of that rank's shard buffer."""

    param: int
    start: int
    stop: int
    shard_start: int


@dataclass(frozen=True)
class Partition:
    """Where every parameter lives in the flat buffer and which rank owns which range."""

    numels: tuple[int, ...]
    shards: int
    offsets: tuple[int, ...]  # parameter i is flat[offsets[i] : offsets[i] + numels[i]]
    buckets: tuple[Bucket, ...]
    bucket_numel: int = BUCKET_NUMEL

    @property
    def total(self) -> int:
        """Elements of the flat buffer, padding included."""
        return sum(b.numel for b in self.buckets)

    @property
    def shard_size(self) -> int:
        """Elements each rank owns (the same on every rank)."""
        return self.total // self.shards

    def shard_ranges(self, rank: int) -> list[tuple[int, int]]:
        """[start, stop) in the flat buffer of `rank`'s range of each bucket, bucket order."""
        self._check_rank(rank)
        return [(b.start + rank * (b.numel // self.shards),
                 b.start + (rank + 1) * (b.numel // self.shards)) for b in self.buckets]

    def pieces(self, rank: int) -> list[Piece]:
        """The parameter parts `rank` owns, in shard order (padding is in no piece)."""
        out, shard_start = [], 0
        for bucket, (lo, hi) in zip(self.buckets, self.shard_ranges(rank)):
            for i in range(bucket.first, bucket.stop):
                a, b = max(lo, self.offsets[i]), min(hi, self.offsets[i] + self.numels[i])
                if a < b:
                    out.append(Piece(i, a - self.offsets[i], b - self.offsets[i],
                                     shard_start + a - lo))
            shard_start += hi - lo
        return out

    def owners(self, param: int) -> tuple[int, ...]:
        """The ranks that own part of parameter `param`'s optimizer state."""
        start, stop = self.offsets[param], self.offsets[param] + self.numels[param]
        if stop == start:
            return ()
        bucket = next(b for b in self.buckets if b.first <= param < b.stop)
        per = bucket.numel // self.shards
        first = (start - bucket.start) // per
        return tuple(range(first, (stop - 1 - bucket.start) // per + 1))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.shards:
            raise ValueError(f"rank must be in [0, {self.shards}), got {rank}")


def num_shards(dp: int, distributed: bool | None) -> int:
    """How many ways a role's optimizer state is split: its dp size with ZeRO-1, else 1.
    `distributed` is `optim.distributed` (None: ZeRO-1 on when dp > 1)."""
    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    on = dp > 1 if distributed is None else distributed
    return dp if on else 1


def partition(numels: Sequence[int], shards: int, *,
              bucket_numel: int = BUCKET_NUMEL) -> Partition:
    """Lay `numels` out in padded buckets split `shards` ways (see the module docstring)."""
    if shards < 1:
        raise ValueError(f"shards (the data-parallel size) must be at least 1, got {shards}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be at least 1, got {bucket_numel}")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be non-negative, got {list(numels)}")
    offsets, buckets = [], []
    start, first, filled = 0, 0, 0
    for i, n in enumerate(numels):
        if filled and filled + n > bucket_numel:
            buckets.append(_bucket(start, filled, first, i, shards))
            start, first, filled = buckets[-1].start + buckets[-1].numel, i, 0
        offsets.append(start + filled)
        filled += n
    if filled or len(numels) > first:
        buckets.append(_bucket(start, filled, first, len(numels), shards))
    return Partition(tuple(int(n) for n in numels), shards, tuple(offsets), tuple(buckets),
                     bucket_numel)


def _bucket(start: int, filled: int, first: int, stop: int, shards: int) -> Bucket:
    return Bucket(start=start, numel=-(-filled // shards) * shards, first=first, stop=stop)


def state_bytes(numels: Sequence[int], *, param_bytes: int, shards: int,
                bucket_numel: int = BUCKET_NUMEL) -> dict[str, int]:
    """Bytes of each `TrainEngine.state_tensors()` kind on one rank of a training engine: the
    sums of `state_tensor_bytes`."""
    sizes = state_tensor_bytes(numels, param_bytes=param_bytes, shards=shards,
                               bucket_numel=bucket_numel)
    return {kind: sum(sizes[kind]) for kind in STATE_KINDS}


def state_tensor_bytes(numels: Sequence[int], *, param_bytes: int, shards: int,
                       bucket_numel: int = BUCKET_NUMEL) -> dict[str, list[int]]:
    """Bytes of each tensor of each `TrainEngine.state_tensors()` kind, in its order.

    `numels`: the rank's trainable parameter sizes in `model.parameters()` order;
    `param_bytes`: bytes per model parameter element (4 for fp32, 2 for bf16);
    `shards`: the DP size with ZeRO-1, 1 without. Grads are one fp32 flat buffer (padded);
    masters an fp32 copy of the shard unless the model is fp32; optimizer two fp32 moments.
    """
    part = partition(numels, shards, bucket_numel=bucket_numel)
    return {"weights": [n * param_bytes for n in numels],
            "grads": [part.total * 4],
            "masters": [] if param_bytes == 4 else [part.shard_size * 4],
            "optimizer": [part.shard_size * 4] * 2}
