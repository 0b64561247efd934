"""The loader's computed permutation: a permutation of range(n) at every n, the same for every
caller, sliceable at any position, shuffled like a random order, and with no table in memory."""

import tracemalloc

import numpy as np
import pytest
import torch

from rlhf.data.batch import Batch
from rlhf.data.dataset import PromptLoader
from rlhf.data.shuffle import Permutation


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 23, 64, 255, 256, 257, 1000, 4097])
def test_every_index_once_and_any_slice_continues_the_same_order(n):
    whole = Permutation(n, seed=7, epoch=2).take(0, n)
    assert sorted(whole.tolist()) == list(range(n))
    again = Permutation(n, seed=7, epoch=2)  # another rank, or a resumed run
    cut = n // 3
    assert np.array_equal(np.concatenate([again.take(0, cut), again.take(cut, n + 5)]), whole)
    assert np.array_equal(again(np.array([n - 1, 0])), whole[[n - 1, 0]])
    with pytest.raises(IndexError):
        again(np.array([n]))


def test_the_order_is_shuffled_like_a_random_one():
    n = 10_000
    position = np.arange(n)
    orders = {(seed, epoch): Permutation(n, seed=seed, epoch=epoch).take(0, n)
              for seed in (0, 1) for epoch in (0, 1)}
    for order in orders.values():
        # Not near the identity, nor a rotation or stride: a uniform random order has about
        # one fixed point, mean displacement n/3, no correlation with position, and
        # consecutive differences that almost never repeat.
        assert (order == position).sum() <= 5
        assert abs(np.abs(order - position).mean() / n - 1 / 3) < 0.02
        assert abs(np.corrcoef(position, order)[0, 1]) < 0.05
        assert len(np.unique(np.diff(order))) > 0.6 * n
        # Any stretch of positions draws from the whole range: a batch's 1,000 in deciles.
        counts = np.bincount(order[4000:5000] * 10 // n, minlength=10)
        assert ((counts - 100) ** 2 / 100).sum() < 27.9  # chi-square, 9 dof, p = 0.001
    # Another seed or epoch: another order; two random draws of 100 share about 1 index.
    firsts = [set(order[:100].tolist()) for order in orders.values()]
    assert max(len(a & b) for i, a in enumerate(firsts) for b in firsts[i + 1:]) <= 6


class Numbers:
    """A dataset of `n` samples whose batch is just their indices (nothing held per row)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def batch(self, indices):
        return Batch({"index": indices.to(torch.int64)})


def test_a_batch_of_a_huge_dataset_holds_no_table_of_the_rows():
    loader = PromptLoader(Numbers(10**8), batch_size=32, seed=3)
    tracemalloc.start()
    try:
        first = next(loader)["index"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024  # a stored order would be 800 MB
    assert len(set(first.tolist())) == 32 and int(first.max()) < 10**8
    assert int(first.max()) > 10**6  # drawn from the whole range, not its start
