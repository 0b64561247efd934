"""`Ragged`: variable-length per-sample tensors stored packed (one values tensor plus offsets).

Never padded: row i is values[offsets[i]:offsets[i + 1]]. Also the index and copy helpers that
`Batch` shares with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

IndexLike = Sequence[int] | Sequence[bool] | Tensor | np.ndarray | range


def offsets_from_lengths(lengths: Tensor) -> Tensor:
    """Row lengths (B,) -> offsets (B+1,) starting at 0."""
    return F.pad(lengths.cumsum(0), (1, 0))  # (B+1,) int64


def compact(t: Tensor) -> Tensor:
    """A detached tensor owning exactly its bytes: pickling a view would write its whole storage."""
    t = t.detach()
    owns = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if owns and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def as_index(indices: IndexLike, n: int) -> Tensor:
    """Ints (negatives allowed) or a boolean mask of length n -> int64 CPU tensor in [0, n)."""
    if isinstance(indices, Tensor):
        idx = indices.detach().cpu()
    else:
        arr = np.asarray(indices)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "biu":
            raise IndexError(f"indices must be ints or a boolean mask, got an array of {arr.dtype}")
        idx = torch.from_numpy(arr)
    if idx.dtype == torch.bool:
        if tuple(idx.shape) != (n,):
            raise IndexError(f"boolean mask has shape {tuple(idx.shape)}, expected ({n},)")
        return idx.nonzero().flatten()
    if idx.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype.is_complex:
        raise IndexError(f"indices must be 1-D ints, got {idx.dtype} of shape {tuple(idx.shape)}")
    idx = idx.to(torch.int64)
    lo, hi = int(idx.min()), int(idx.max())
    if lo < -n or hi >= n:
        raise IndexError(f"index {lo if lo < -n else hi} is out of range for {n} samples")
    return torch.where(idx < 0, idx + n, idx)


class Ragged:
    """Variable-length rows stored packed: row i is `values[offsets[i]:offsets[i+1]]`."""

    __slots__ = ("values", "offsets")

    def __init__(self, values: Tensor, offsets: Tensor):
        _check_ragged(values, offsets)
        self.values = values  # (total, *feature_dims)
        self.offsets = offsets  # (B+1,) int64, offsets[0] == 0, non-decreasing

    @classmethod
    def _trusted(cls, values: Tensor, offsets: Tensor) -> Ragged:
        obj = cls.__new__(cls)
        obj.values, obj.offsets = values, offsets
        return obj

    @classmethod
    def from_list(cls, seqs: Iterable[Any], *, dtype: torch.dtype | None = None) -> Ragged:
        """Pack rows (tensors or lists, each (len_i, *feature_dims)); no rows gives int64 values."""
        seqs = list(seqs)
        rows = [torch.as_tensor(s, dtype=dtype) for s in seqs]
        if dtype is None:  # `[]` becomes float32: give empty python rows the others' dtype
            typed = [isinstance(s, Tensor) or r.numel() > 0 for s, r in zip(seqs, rows)]
            ref = next((r.dtype for r, t in zip(rows, typed) if t), None)
            rows = [r if t or ref is None else r.to(ref) for r, t in zip(rows, typed)]
        if not rows:
            values = torch.empty(0, dtype=dtype or torch.int64)
            return cls._trusted(values, torch.zeros(1, dtype=torch.int64))
        r0 = rows[0]
        for i, r in enumerate(rows):
            same = (r.shape[1:], r.dtype, r.device) == (r0.shape[1:], r0.dtype, r0.device)
            if r.dim() < 1 or not same:
                raise ValueError(
                    f"Ragged.from_list: row {i} is {tuple(r.shape)} {r.dtype} on {r.device} but "
                    f"row 0 is {tuple(r0.shape)} {r0.dtype} on {r0.device}; rows need at least one "
                    "dim and the same trailing dims, dtype and device (cast them or pass dtype=)"
                )
        lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
        return cls._trusted(torch.cat(rows), offsets_from_lengths(lengths).to(r0.device))

    def to_list(self) -> list[Tensor]:
        """The rows as a list of tensors (views into `values`)."""
        return list(self.values.split(self.lengths.tolist())) if len(self) else []

    @property
    def lengths(self) -> Tensor:
        """Row lengths, (B,) int64."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, i: int) -> Tensor:
        if isinstance(i, Tensor) and i.dim() == 0:
            i = int(i)
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"Ragged[i] takes an int, got {type(i).__name__}; use .select(indices)")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} is out of range for a Ragged of {n} rows")
        start, stop = self.offsets[int(i) % n : int(i) % n + 2].tolist()
        return self.values[start:stop]

    def select(self, indices: IndexLike) -> Ragged:
        """Gather rows in any order (repeats allowed); indices are ints or a boolean mask."""
        idx = as_index(indices, len(self)).to(self.offsets.device)
        lengths = self.lengths[idx]
        offsets = offsets_from_lengths(lengths)
        total = int(offsets[-1])
        # Token j of output row k comes from input position starts[k] + (j - offsets[k]).
        shift = self.offsets[:-1][idx] - offsets[:-1]
        token_idx = torch.arange(total, device=idx.device) + shift.repeat_interleave(
            lengths, output_size=total
        )
        return Ragged._trusted(self.values[token_idx], offsets)

    def _rows(self, start: int, stop: int) -> Ragged:
        """Contiguous rows [start, stop) without copying `values`."""
        offsets = self.offsets[start : stop + 1]
        lo, hi = offsets[[0, -1]].tolist()
        return Ragged._trusted(self.values[lo:hi], offsets - lo)

    @classmethod
    def concat(cls, parts: Sequence[Ragged]) -> Ragged:
        """Rows of all parts in order; parts must share trailing dims, dtype and device."""
        parts = list(parts)
        if not parts:
            raise ValueError("Ragged.concat needs at least one part (it sets dtype, feature dims)")
        v0 = parts[0].values
        for i, p in enumerate(parts):
            if not isinstance(p, Ragged):
                raise TypeError(f"Ragged.concat: part {i} is a {type(p).__name__}, not a Ragged")
            v = p.values
            if (v.shape[1:], v.dtype, v.device) != (v0.shape[1:], v0.dtype, v0.device):
                raise ValueError(
                    f"Ragged.concat: part {i} has trailing dims {tuple(v.shape[1:])} {v.dtype} on "
                    f"{v.device}, part 0 {tuple(v0.shape[1:])} {v0.dtype} on {v0.device}; "
                    "make them match"
                )
        lengths = torch.cat([p.lengths for p in parts])
        return cls._trusted(torch.cat([p.values for p in parts]), offsets_from_lengths(lengths))

    def equal(self, other: object) -> bool:
        """Same rows, dtype and values (exact comparison; for tests and `Batch.union`)."""
        if not isinstance(other, Ragged) or self.values.dtype != other.values.dtype:
            return False
        same_rows = torch.equal(self.offsets.cpu(), other.offsets.cpu())
        return same_rows and torch.equal(self.values.cpu(), other.values.cpu())

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Ragged:
        """Both tensors on `device`."""
        move = {"device": device, "non_blocking": non_blocking}
        return Ragged._trusted(self.values.to(**move), self.offsets.to(**move))

    def __getstate__(self) -> tuple[Tensor, Tensor]:
        return compact(self.values), compact(self.offsets)

    def __setstate__(self, state: tuple[Tensor, Tensor]) -> None:
        self.values, self.offsets = state

    def __repr__(self) -> str:
        v = self.values
        dims = tuple(v.shape[1:])
        return f"Ragged(rows={len(self)}, total={v.shape[0]}, feature_dims={dims}) {v.dtype}"


def _check_ragged(values: Tensor, offsets: Tensor) -> None:
    if not isinstance(values, Tensor) or values.dim() < 1:
        got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(f"Ragged values must be a tensor shaped (total, *feature_dims), got {got}")
    o = offsets
    if not isinstance(o, Tensor) or o.dtype != torch.int64 or o.dim() != 1 or o.numel() < 1:
        got = f"{o.dtype} {tuple(o.shape)}" if isinstance(o, Tensor) else type(o).__name__
        raise ValueError(f"Ragged offsets must be a 1-D int64 tensor of length B+1, got {got}")
    if o.device != values.device:
        raise ValueError(f"Ragged offsets are on {o.device} but values on {values.device}")
    if int(offsets[0]) != 0:
        raise ValueError(f"Ragged offsets must start at 0, got offsets[0] = {int(offsets[0])}")
    drops = (offsets[1:] < offsets[:-1]).nonzero()
    if drops.numel():
        i = int(drops[0])
        raise ValueError(
            f"Ragged offsets must be non-decreasing, but offsets[{i + 1}] = {int(offsets[i + 1])} "
            f"< offsets[{i}] = {int(offsets[i])}"
        )
    if int(offsets[-1]) != values.shape[0]:
        raise ValueError(
            f"Ragged offsets end at {int(offsets[-1])} but values has {values.shape[0]} rows on "
            "dim 0; offsets[-1] must equal values.shape[0]"
        )
