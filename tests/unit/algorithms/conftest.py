"""Random ragged batches for the algorithm tests, as packed tensors plus per-sample python lists."""

import random

import pytest
import torch


def make_batch(lengths, seed, *, mask_p=0.3, num_groups=3):
    """Packed response stream with random rewards, values, masks and (non-contiguous) groups.

    Returned python lists (`rows`) hold sample i's per-token floats, so references can loop.
    """
    rng = random.Random(seed)
    rows = []
    for n in lengths:
        rows.append({
            "reward": [rng.uniform(-1, 1) for _ in range(n)],
            "value": [rng.uniform(-1, 1) for _ in range(n)],
            "logp": [rng.uniform(-3, 0) for _ in range(n)],
            "old_logp": [rng.uniform(-3, 0) for _ in range(n)],
            "adv": [rng.uniform(-2, 2) for _ in range(n)],
            "mask": [rng.random() >= mask_p for _ in range(n)],
        })
    scores = [rng.choice([0.0, 0.5, 1.0, rng.uniform(-1, 1)]) for _ in lengths]
    groups = [rng.randrange(num_groups) * 7 - 5 for _ in lengths]  # arbitrary, unsorted ids
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)

    def stream(key, dtype=torch.float64):
        return torch.tensor([x for r in rows for x in r[key]], dtype=dtype)

    return {
        "rows": rows, "scores": scores, "groups": groups,
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "mask_T": stream("mask", torch.bool), "stream": stream,
        "scores_N": torch.tensor(scores, dtype=torch.float64),
        "group_ids": torch.tensor(groups, dtype=torch.int64),
    }


@pytest.fixture(scope="session")
def batch_factory():
    return make_batch
