"""The driver's batch split: exact cover, layout-independent mini-batches, token balance over DP
groups against contiguous chunks, budgets, equal micro-batch counts, and clear errors."""

import pickle

import numpy as np
import pytest
import torch

from rlhf.data.balancing import default_cost
from rlhf.data.batch import Batch
from rlhf.data.batch_split import split_batch
from rlhf.data.ragged import Ragged
from workers.micro_batches import build_micro_batches


def rl_lengths(seed, n):
    """Prompts of 16-64 tokens plus long-tailed responses (lognormal, clipped to 1..400)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(16, 65, n)
    responses = np.clip(rng.lognormal(np.log(60), 1.0, n), 1, 400).astype(int)
    return (prompts + responses).tolist()


def contiguous_imbalance(lengths, dp, mini):
    """Max over mean cost of the contiguous DP chunks a planless dispatch would send."""
    worst = 1.0
    for k in range(0, len(lengths), mini):
        costs = [sum(default_cost(x) for x in c) for c in np.array_split(lengths[k:k + mini], dp)]
        worst = max(worst, max(costs) / np.mean(costs))
    return worst


def check_cover(split, lengths, *, max_tokens, mini):
    """Every driver row once; group index lists point into the group's rows in order; budgets."""
    assert sorted(i for rows in split.rows for i in rows) == list(range(len(lengths)))
    for rows, grp in zip(split.rows, split.groups):
        flat = [i for mini_mbs in grp.mini_batches for mb in mini_mbs for i in mb]
        assert flat == list(range(len(rows))), "a group runs its rows in the order it gets them"
        for mbs, counts in zip(grp.mini_batches, grp.token_counts):
            assert [sum(lengths[rows[i]] for i in mb) for mb in mbs] == list(counts)
            assert all(0 < c <= max_tokens for c in counts)
    if mini is not None:
        for k in range(split.num_mini_batches):
            assert split.mini_batch_rows(k) == list(range(k * mini, (k + 1) * mini))


@pytest.mark.parametrize("n", [64, 128, 256])
@pytest.mark.parametrize("dp", [2, 4])
def test_forward_plans_balance_tokens_over_dp_groups(n, dp):
    for seed in range(3):
        lengths = rl_lengths(seed, n)
        split = split_batch(lengths, dp=dp, max_tokens=1024)
        check_cover(split, lengths, max_tokens=1024, mini=None)
        assert split.imbalance < 1.001, (seed, split.imbalance)
        assert split.imbalance < contiguous_imbalance(lengths, dp, n)
        counts = {len(g.mini_batches[0]) for g in split.groups}
        assert len(counts) == 1, "every group runs the same number of micro-batches"


@pytest.mark.parametrize("n", [64, 256])
@pytest.mark.parametrize("dp", [2, 4])
def test_update_plans_balance_every_mini_batch(n, dp):
    mini = n // 4
    for seed in range(3):
        lengths = rl_lengths(seed, n)
        split = split_batch(lengths, dp=dp, max_tokens=512, mini_size=mini)
        check_cover(split, lengths, max_tokens=512, mini=mini)
        assert split.num_mini_batches == 4
        assert split.imbalance < 1.03, (seed, split.imbalance)
        assert split.imbalance < contiguous_imbalance(lengths, dp, mini)
        for k in range(4):
            assert len({len(g.mini_batches[k]) for g in split.groups}) == 1


def test_every_dp_size_steps_on_the_same_samples():
    lengths = rl_lengths(7, 96)
    splits = {dp: split_batch(lengths, dp=dp, max_tokens=600, mini_size=24, max_seqs=5)
              for dp in (1, 2, 4)}
    for k in range(4):
        steps = {dp: p.mini_batch_rows(k) for dp, p in splits.items()}
        assert steps[1] == steps[2] == steps[4] == list(range(24 * k, 24 * (k + 1)))
    for split in splits.values():
        check_cover(split, lengths, max_tokens=600, mini=24)
        assert all(len(mb) <= 5 for g in split.groups for m in g.mini_batches for mb in m)


def test_plans_are_small_plain_objects():
    split = split_batch(rl_lengths(1, 256), dp=4, max_tokens=2048, mini_size=64)
    assert pickle.loads(pickle.dumps(split)) == split
    assert len(pickle.dumps(split)) < 16 * 256 + 4096  # index lists and counts, nothing else
    with pytest.raises(AttributeError):
        split.rows = ()


def test_fewer_samples_than_groups_leave_groups_empty_in_forward_plans():
    split = split_batch([5, 9], dp=4, max_tokens=16)
    assert sorted(len(r) for r in split.rows) == [0, 0, 1, 1]
    empty = split_batch([], dp=2, max_tokens=16)
    assert empty.rows == ((), ()) and all(g.num_rows == 0 for g in empty.groups)


def test_expert_parallel_plans_keep_empty_micro_batches_so_counts_are_equal():
    """Two samples (per mini-batch) over 4 groups: without keep_empty two groups run nothing;
    with it (ep > 1) every group runs one micro-batch per mini-batch, two of them empty, and
    the plan still covers every sample once."""
    lengths = [5, 9, 7, 3, 6, 4, 8, 2]
    for n, mini in ((2, None), (8, 2)):
        plain = split_batch(lengths[:n], dp=4, max_tokens=9, mini_size=mini)
        kept = split_batch(lengths[:n], dp=4, max_tokens=9, mini_size=mini, keep_empty=True)
        assert kept.rows == plain.rows
        counts = {tuple(len(m) for m in g.mini_batches) for g in kept.groups}
        assert len(counts) == 1, counts  # every group: as many micro-batches per mini-batch
        empties = [mb for g in kept.groups for m in g.mini_batches for mb in m if not mb]
        assert empties and all(c == 0 for g in kept.groups for m, cs in
                               zip(g.mini_batches, g.token_counts)
                               for mb, c in zip(m, cs) if not mb)
        assert len({tuple(len(m) for m in g.mini_batches) for g in plain.groups}) > 1


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"10 samples do not split into mini-batches of "
                                         r"actor\.x = 4; send a multiple of 4"):
        split_batch([3] * 10, dp=2, max_tokens=8, mini_size=4, what="actor.x")
    with pytest.raises(ValueError, match="raise the budget to at least 9"):
        split_batch([3, 9], dp=1, max_tokens=8)


def test_groups_build_equal_micro_batch_counts_small_large_small():
    """Long samples first, short last: contiguous chunks would give group 0 more micro-batches;
    the plan gives every group the same count, each built by workers.micro_batches."""
    lengths = [14, 13, 12, 11, 10, 9, 8, 4, 3, 3, 2, 2, 2]
    batch = Batch({"prompt_ids": Ragged.from_list([[1, 1]] * len(lengths), dtype=torch.int64),
                   "response_ids": Ragged.from_list([[2] * (n - 2) for n in lengths],
                                                    dtype=torch.int64)})
    split = split_batch(lengths, dp=2, max_tokens=24, max_seqs=3)
    built = []
    for rows, grp in zip(split.rows, split.groups):
        mbs = build_micro_batches(batch.select(list(rows)), grp.mini_batches[0])
        assert [mb.num_tokens for mb in mbs] == list(grp.token_counts[0])
        assert sorted(torch.cat([mb.sample_ids for mb in mbs]).tolist()) == \
            list(range(len(rows)))
        assert max(mb.num_seqs for mb in mbs) <= 3 and max(mb.num_tokens for mb in mbs) <= 24
        tokens = [mb.num_tokens for mb in mbs]
        assert max(tokens[0], tokens[-1]) <= max(tokens[1:-1])  # cheap ones at both ends
        built.append(len(mbs))
    assert built[0] == built[1] >= 3
