"""Several datasets mixed with weights, as Megatron-LM's blended datasets mix them.

A blend of N samples gives dataset d round(w_d * N) of them (largest remainders, so the counts
sum to N) in one block of the index space per dataset; the loader's per-epoch permutation
interleaves the blocks. Sample j of d's block is row (a_d * j + b_d) mod rows_d, a_d coprime to
rows_d and both drawn from the seed: a dataset given more samples than rows repeats every row
evenly (each floor or ceil times), one given fewer contributes a spread of its rows (the same
ones every epoch, as in Megatron), never just its first. N defaults to the rows summed. No
table grows with N: a sample's dataset is a bisection of the block starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from rlhf.data.batch import Batch
from rlhf.data.indexed import is_indexed
from rlhf.errors import RLHFError


class Rows(Protocol):
    """What the loader asks of a dataset."""

    def __len__(self) -> int: ...

    def batch(self, indices: Tensor) -> Batch: ...


def split_by_weight(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in proportion to `weights` by largest remainders (the parts sum to it)."""
    shares = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * total
    counts = np.floor(shares).astype(np.int64)
    by_remainder = np.argsort(-(shares - counts), kind="stable")
    counts[by_remainder[:total - int(counts.sum())]] += 1
    return counts.tolist()


def _coprime_stride(size: int, rng: np.random.Generator) -> int:
    while True:
        a = int(rng.integers(1, max(size, 2)))
        if math.gcd(a, size) == 1:
            return a


class BlendedDataset:
    """`datasets` mixed in proportion to `weights` (any positive numbers), `num_samples` in
    all (default: their rows summed); `names` label the mix report."""

    def __init__(self, datasets: Sequence[Rows], weights: Sequence[float], *,
                 names: Sequence[str], seed: int = 0, num_samples: int | None = None):
        if len(weights) != len(datasets):
            raise RLHFError(f"{len(datasets)} datasets but {len(weights)} weights; give one "
                            f"weight per dataset")
        if any(not (w > 0 and math.isfinite(w)) for w in weights):
            raise RLHFError(f"dataset weights must be positive numbers, got {list(weights)}")
        self.datasets, self.names = list(datasets), list(names)
        self.weights = [float(w) for w in weights]
        total = num_samples if num_samples is not None else sum(len(d) for d in datasets)
        self.counts = split_by_weight(total, self.weights)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        rng = np.random.default_rng([seed % 2**64, len(datasets)])
        self.stride = [_coprime_stride(len(d), rng) for d in datasets]
        self.shift = [int(rng.integers(0, len(d))) for d in datasets]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def rows_of(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, row) of each blend index."""
        which = np.searchsorted(self.starts, indices, side="right") - 1
        j = indices - self.starts[which]
        size = np.array([len(d) for d in self.datasets], dtype=np.int64)[which]
        stride = np.array(self.stride, dtype=np.int64)[which]
        shift = np.array(self.shift, dtype=np.int64)[which]
        return which, (stride * j + shift) % size

    def batch(self, indices: Tensor) -> Batch:
        """The samples at the blend's indices, in that order; `index` holds the blend indices."""
        which, rows = self.rows_of(indices.numpy())
        parts, order = [], []
        for d in np.unique(which):
            picked = np.flatnonzero(which == d)
            part = self.datasets[d].batch(torch.from_numpy(rows[picked]))
            parts.append(part.pop("index")[1])
            order.append(picked)
        batch = Batch.concat(parts).select(torch.from_numpy(np.argsort(np.concatenate(order))))
        return batch.union(Batch({"index": indices.to(torch.int64)}))

    def report(self) -> list[dict]:
        """Per dataset: its name, rows, weight, samples in the blend and epochs of it."""
        return [{"dataset": name, "rows": len(d), "weight": w / sum(self.weights),
                 "samples": n, "epochs": n / len(d)}
                for name, d, w, n in zip(self.names, self.datasets, self.weights, self.counts)]

    def report_text(self) -> str:
        """The mix as one line per dataset."""
        return "\n".join(f"  {r['dataset']}: weight {r['weight']:.3f}, {r['samples']} of "
                         f"{len(self)} samples from {r['rows']} rows ({r['epochs']:.2f} epochs)"
                         for r in self.report())


def open_datasets(paths: Sequence[str], weights: Sequence[float], open_one, *, seed: int,
                  what: str) -> Rows:
    """The indexed dataset folders `paths`, each opened by `open_one(path)`: one alone, or
    their blend by `weights` (default: by rows, each row once per epoch), the mix printed."""
    loose = [str(p) for p in paths if not is_indexed(p)]
    if loose:
        raise RLHFError(f"{what} mixes indexed dataset folders with the files {loose}; "
                        f"preprocess those too with `rlhf preprocess-data`, or list only files")
    datasets = [open_one(p) for p in paths]
    if len(datasets) == 1 and not weights:
        return datasets[0]
    blend = BlendedDataset(datasets, list(weights) or [len(d) for d in datasets],
                           names=[str(p) for p in paths], seed=seed)
    print(f"{what}: a blend of {len(blend)} samples per epoch\n{blend.report_text()}",
          flush=True)
    return blend
