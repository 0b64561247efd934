"""Per-sample batch container that moves between the driver and Ray workers.

`Ragged` stores variable-length per-sample tensors packed (one values tensor plus offsets,
never padded). `Batch` holds per-sample fields (dense tensors with dim 0 = batch, `Ragged`,
python lists or numpy arrays) and batch-level `meta`. Operations return new objects and
never mutate their inputs; tensors may be shared between the input and the result.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlhf.data.ragged import IndexLike, Ragged, as_index, compact

# ---- per-field helpers: every per-sample field is a Tensor, Ragged, list or np.ndarray ----


def _check_field(name: str, value: Any) -> Any:
    if not isinstance(name, str):
        raise TypeError(f"field names must be str, got {name!r}")
    if isinstance(value, Ragged) or (isinstance(value, (Tensor, np.ndarray)) and value.ndim >= 1):
        return value
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(
        f"field '{name}' is a {type(value).__name__}{' with no dims' * hasattr(value, 'ndim')}; "
        "per-sample fields are tensors (dim 0 = batch), Ragged, lists or numpy arrays; "
        "put batch-level values in meta"
    )


def _take(value: Any, idx: Tensor) -> Any:
    if isinstance(value, Tensor):
        return value[idx.to(value.device)]
    if isinstance(value, Ragged):
        return value.select(idx)
    if isinstance(value, np.ndarray):
        return value[idx.numpy()]
    return [value[i] for i in idx.tolist()]


def _slice_rows(value: Any, start: int, stop: int) -> Any:
    return value._rows(start, stop) if isinstance(value, Ragged) else value[start:stop]


def _kind(value: Any) -> str:
    kinds = ((Ragged, "Ragged"), (Tensor, "Tensor"), (np.ndarray, "ndarray"), (list, "list"))
    return next(k for t, k in kinds if isinstance(value, t))


def _cat_field(name: str, parts: list[Any]) -> Any:
    kinds = sorted({_kind(p) for p in parts})
    if len(kinds) > 1:
        mixed = " in some batches and a ".join(kinds)
        raise ValueError(f"field '{name}' is a {mixed} in others; convert it to one kind")
    first = parts[0]
    if isinstance(first, Ragged):
        try:
            return Ragged.concat(parts)
        except ValueError as e:
            raise ValueError(f"field '{name}': {e}") from e
    if isinstance(first, Tensor):
        for p in parts:
            if (p.shape[1:], p.dtype, p.device) != (first.shape[1:], first.dtype, first.device):
                raise ValueError(
                    f"field '{name}' is {tuple(p.shape)} {p.dtype} on {p.device} in one batch and "
                    f"{tuple(first.shape)} {first.dtype} on {first.device} in another; trailing "
                    "dims, dtype and device must match"
                )
        return torch.cat(parts)
    if isinstance(first, np.ndarray):
        return np.concatenate(parts)
    return list(itertools.chain.from_iterable(parts))


def _values_equal(a: Any, b: Any) -> bool:
    """Exact equality across tensors, Ragged, arrays and nested containers; never raises."""
    if a is b:
        return True
    if isinstance(a, Ragged) or isinstance(b, Ragged):
        return isinstance(a, Ragged) and a.equal(b)
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        both = isinstance(a, Tensor) and isinstance(b, Tensor)
        return both and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        return _values_equal(a.ravel().tolist(), b.ravel().tolist())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        same = type(a) is type(b) and len(a) == len(b)
        return same and all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


def _merge_meta(metas: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for meta in metas:
        for key, value in meta.items():
            if key in merged and not _values_equal(merged[key], value):
                raise ValueError(
                    f"meta key '{key}' has conflicting values {merged[key]!r:.60} and "
                    f"{value!r:.60}; make them agree or drop the key from one side first"
                )
            merged.setdefault(key, value)
    return merged


class Batch:
    """Per-sample fields (tensors with dim 0 = batch, `Ragged`, lists, numpy arrays) and `meta`.

    `size` gives the length of a batch without per-sample fields; otherwise it is inferred.
    """

    def __init__(
        self,
        fields: Mapping[str, Any] | None = None,
        *,
        meta: Mapping[str, Any] | None = None,
        size: int | None = None,
    ):
        checked = {name: _check_field(name, value) for name, value in (fields or {}).items()}
        lengths = {name: len(value) for name, value in checked.items()}
        if size is None:
            size = next(iter(lengths.values()), 0)
        bad = [name for name, n in lengths.items() if n != size]
        if bad:
            listing = ", ".join(f"{name}={n}" for name, n in lengths.items())
            raise ValueError(
                f"field '{bad[0]}' has {lengths[bad[0]]} samples but the batch has {size} "
                f"({listing}); every per-sample field needs exactly one entry per sample"
            )
        self._fields, self._meta, self._size = checked, dict(meta or {}), int(size)

    def _new(self, fields: dict[str, Any], size: int, meta: Mapping[str, Any] | None = None):
        out = Batch.__new__(Batch)
        out._fields, out._size = fields, size
        out._meta = dict(self._meta if meta is None else meta)
        return out

    @property
    def meta(self) -> Mapping[str, Any]:
        """Batch-level information (read-only view; use `with_meta` to change it)."""
        return MappingProxyType(self._meta)

    def with_meta(self, **updates: Any) -> Batch:
        """The same fields with `meta` updated (later values win)."""
        return self._new(dict(self._fields), self._size, {**self._meta, **updates})

    def keys(self) -> list[str]:
        """Names of the per-sample fields."""
        return list(self._fields)

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __len__(self) -> int:
        return self._size

    def _field(self, name: str) -> Any:
        if name not in self._fields:
            raise KeyError(f"no field '{name}' in batch; fields are {self.keys()}")
        return self._fields[name]

    def __getitem__(self, key: str | int | slice | IndexLike) -> Any:
        """`batch["name"]` -> field; `batch[i]` -> one sample (dict); slice, ints, mask -> Batch."""
        if isinstance(key, str):
            return self._field(key)
        if isinstance(key, Tensor) and key.dim() == 0:
            key = int(key)
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if not -self._size <= key < self._size:
                raise IndexError(f"sample {key} is out of range for a batch of {self._size}")
            return {name: value[int(key) % self._size] for name, value in self._fields.items()}
        if isinstance(key, bool):
            raise TypeError("a batch is indexed by a field name, a sample, a slice, sample "
                            "indices or a boolean mask, not by a bool")
        if isinstance(key, slice):
            start, stop, step = key.indices(self._size)
            if step == 1:
                return self._rows(start, max(start, stop))
            return self.select(range(start, stop, step))
        return self.select(key)

    def _rows(self, start: int, stop: int) -> Batch:
        fields = {n: _slice_rows(v, start, stop) for n, v in self._fields.items()}
        return self._new(fields, stop - start)

    def select(self, indices: IndexLike) -> Batch:
        """Samples at `indices` in that order (repeats allowed), or where a boolean mask is True."""
        idx = as_index(indices, self._size)
        return self._new({n: _take(v, idx) for n, v in self._fields.items()}, idx.numel())

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Contiguous pieces of the given sizes (views, no copies); sizes must sum to len(self)."""
        sizes = [operator.index(s) for s in sizes]
        if any(s < 0 for s in sizes) or sum(sizes) != self._size:
            raise ValueError(
                f"split sizes {sizes} must be non-negative and sum to the batch length {self._size}"
            )
        bounds = list(itertools.accumulate(sizes, initial=0))
        return [self._rows(a, b) for a, b in itertools.pairwise(bounds)]

    def chunk(self, n: int) -> list[Batch]:
        """`n` contiguous chunks; sizes differ by at most one, larger first."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"chunk needs a positive number of chunks, got {n!r}")
        q, r = divmod(self._size, int(n))
        return self.split([q + 1] * r + [q] * (int(n) - r))

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Samples of all batches in order; field sets must match, meta is merged (no conflicts)."""
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        names = batches[0].keys()
        for i, b in enumerate(batches[1:], start=1):
            if set(b.keys()) != set(names):
                missing = sorted(set(names) - set(b.keys()))
                extra = sorted(set(b.keys()) - set(names))
                raise ValueError(
                    f"Batch.concat: batch {i} lacks fields {missing} and has extra fields {extra} "
                    "compared with batch 0; all batches need the same fields"
                )
        meta = _merge_meta(b._meta for b in batches)
        fields = {name: _cat_field(name, [b._fields[name] for b in batches]) for name in names}
        return batches[0]._new(fields, sum(len(b) for b in batches), meta)

    def repeat_interleave(self, repeats: int) -> Batch:
        """Each sample `repeats` times in a row (n responses per prompt for group advantages)."""
        if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
            raise ValueError(f"repeat_interleave needs a positive int, got {repeats!r}")
        return self.select(torch.arange(self._size).repeat_interleave(int(repeats)))

    def union(self, other: Batch) -> Batch:
        """Fields of both batches (same samples); a field in both must be equal, meta must agree."""
        if len(other) != self._size:
            raise ValueError(
                f"Batch.union: lengths differ ({self._size} vs {len(other)}); "
                "union joins fields of the same samples"
            )
        fields = dict(self._fields)
        for name, value in other._fields.items():
            if name in fields and not _values_equal(fields[name], value):
                raise ValueError(
                    f"Batch.union: field '{name}' is in both batches with different values; "
                    "pop it from one side or rename it"
                )
            fields.setdefault(name, value)
        return self._new(fields, self._size, _merge_meta([self._meta, other._meta]))

    def pop(self, names: str | Iterable[str]) -> tuple[Batch, Batch]:
        """(batch of `names`, batch of the other fields), both with meta; self is unchanged."""
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            self._field(name)
        taken = {n: self._fields[n] for n in names}
        rest = {n: v for n, v in self._fields.items() if n not in taken}
        return self._new(taken, self._size), self._new(rest, self._size)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """Tensor and Ragged fields on `device`; other fields and meta unchanged."""
        fields = {
            n: v.to(device, non_blocking=non_blocking) if isinstance(v, (Tensor, Ragged)) else v
            for n, v in self._fields.items()
        }
        return self._new(fields, self._size)

    def equal(self, other: object) -> bool:
        """Same length, fields, values and meta (exact; for tests)."""
        if not isinstance(other, Batch) or (len(other), other.keys()) != (self._size, self.keys()):
            return False
        return _values_equal(self._fields, other._fields) and _values_equal(self._meta, other._meta)

    def __getstate__(self) -> dict[str, Any]:
        fields = {n: compact(v) if isinstance(v, Tensor) else v for n, v in self._fields.items()}
        return {"fields": fields, "meta": self._meta, "size": self._size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._fields, self._meta, self._size = state["fields"], state["meta"], state["size"]

    def __repr__(self) -> str:
        lines = [f"Batch(len={self._size},"]
        for name, v in self._fields.items():
            if isinstance(v, Ragged):
                desc = f"Ragged(total={len(v.values)}, feature_dims={tuple(v.values.shape[1:])})"
            else:
                desc = f"{_kind(v)}{tuple(v.shape) if isinstance(v, Tensor) else ''}"
            dtype = f" {v.dtype}" if isinstance(v, (Tensor, Ragged, np.ndarray)) else ""
            lines.append(f"  {name}: {desc}{dtype},")
        lines.append(f"  meta={sorted(self._meta)})")
        return "\n".join(lines)
