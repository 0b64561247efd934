"""A seeded permutation of range(n) computed index by index, with no table that grows with n.

The prompt loader shuffles each epoch with it: position i of epoch e's order is computed from
(seed, e, i) alone, so the memory is the same at 10 thousand rows and at 100 million, every
process that asks gets the same order, and a resume starts at any position.

It is a balanced Feistel network on 2h-bit values (the smallest even width that covers n, so
fewer than 4n values): whatever its round function, a Feistel network is a bijection of its
domain. A value at or above n is sent through the network again until it lands below n (cycle
walking), which keeps the map a bijection of range(n): following a value's cycle from below n
must come back below n. The round function is splitmix64's finaliser keyed per round from the
seed and epoch; with six rounds the order passes the tests a shuffled list does (no fixed
structure, no correlation with position) without storing one.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
ORDER = f"feistel-{ROUNDS}-splitmix64"
"""The order's name in a loader's checkpoint: a resume refuses a checkpoint of another."""
_MUL1, _MUL2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit (uint64 wraps)."""
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """The seeded order of range(n) for one (seed, epoch): `take(start, stop)` are its
    positions start..stop-1, each a distinct index below n."""

    def __init__(self, n: int, *, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"a permutation needs at least one element, got n={n}")
        self.n = n
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self.keys = np.random.SeedSequence([seed % 2**64, epoch]).generate_state(
            ROUNDS, dtype=np.uint64)

    def _network(self, x: np.ndarray) -> np.ndarray:
        h, mask = np.uint64(self.half_bits), np.uint64((1 << self.half_bits) - 1)
        left, right = x >> h, x & mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << h) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The index at each position (each below n), int64."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        out = self._network(positions.astype(np.uint64))
        outside = np.flatnonzero(out >= self.n)
        while outside.size:  # cycle walking: fewer than 4n values, so a few passes at most
            out[outside] = self._network(out[outside])
            outside = outside[out[outside] >= self.n]
        return out.astype(np.int64)

    def take(self, start: int, stop: int) -> np.ndarray:
        """The indices at positions start..stop-1 (stop clipped to n), int64."""
        return self(np.arange(start, min(stop, self.n), dtype=np.int64))
