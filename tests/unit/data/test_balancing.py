"""Micro-batch assignment: exact cover, token budget, equal counts per rank, order and balance."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.data.balancing import (
    _split_to_count,
    assign_micro_batches,
    balanced_partition,
    default_cost,
    karmarkar_karp,
    lpt_partition,
)

FAST = settings(max_examples=60, deadline=None)


def group_sums(groups, costs):
    return [sum(costs[i] for i in g) for g in groups]


def fill_fraction(assignment):
    """Packed tokens over the budget of all micro-batches (1.0: every one full)."""
    slots = assignment.dp * assignment.num_micro_batches * assignment.max_tokens
    return assignment.total_tokens / slots if slots else 1.0


def padding_fraction_vs_padded(assignment, max_len):
    """Share of a (num_samples, max_len) padded batch that would be padding, which packing
    avoids."""
    slots = assignment.num_samples * max_len
    return 1.0 - assignment.total_tokens / slots if slots else 0.0


def round_robin(costs, parts):
    return [list(range(j, len(costs), parts)) for j in range(parts)]


def rl_lengths(seed, n=256):
    """Lognormal like RL rollouts: most responses short, a long tail, clipped to 20..2000."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(300), 0.9, n), 20, 2000).astype(int).tolist()


@st.composite
def problems(draw):
    max_tokens = draw(st.integers(1, 64))
    one_length = st.one_of(st.just(1), st.just(max_tokens), st.integers(1, max_tokens))
    lengths = draw(st.lists(one_length, max_size=40))
    return lengths, draw(st.integers(1, 8)), max_tokens


@FAST
@given(problems())
def test_cover_budget_equal_counts_order(problem):
    lengths, dp, max_tokens = problem
    assignment = assign_micro_batches(lengths, dp=dp, max_tokens=max_tokens)
    used = sorted(i for r in range(dp) for mb in assignment.rank(i=r) for i in mb)
    assert used == list(range(len(lengths)))  # every sample exactly once
    assert assignment.dp == dp and assignment.num_samples == len(lengths)
    assert assignment.total_tokens == sum(lengths)
    for r in range(dp):
        mbs = assignment.rank(r)
        assert len(mbs) == assignment.num_micro_batches  # same count on every rank
        assert assignment.token_counts[r] == tuple(sum(lengths[i] for i in mb) for mb in mbs)
        assert all(t <= max_tokens for t in assignment.token_counts[r])
        assert all(list(mb) == sorted(mb) for mb in mbs)
        n_samples = sum(len(mb) for mb in mbs)
        if n_samples >= assignment.num_micro_batches:  # empties only when the rank lacks samples
            assert all(mbs)
        costs = [sum(default_cost(lengths[i]) for i in mb) for mb in mbs]
        mid = len(costs) // 2
        assert costs[:mid + 1] == sorted(costs[:mid + 1])  # ascending up to the middle
        assert costs[mid:] == sorted(costs[mid:], reverse=True)  # then descending
    assert assignment.has_empty_micro_batches == any(not mb for r in assignment.micro_batches for mb in r)


@FAST
@given(problems())
def test_never_worse_than_lpt(problem):
    lengths, dp, max_tokens = problem
    costs = [default_cost(n) for n in lengths]
    assignment = assign_micro_batches(lengths, dp=dp, max_tokens=max_tokens)
    lpt_max = max(group_sums(lpt_partition(costs, dp), costs))
    assert assignment.max_rank_cost <= lpt_max * (1 + 1e-12)
    assert sorted(sum(balanced_partition(costs, dp), [])) == list(range(len(lengths)))


def test_balance_on_rl_like_lengths():
    kk_wins, lpt_wins = 0, 0
    for seed in range(20):
        lengths = rl_lengths(seed)
        costs = [default_cost(n) for n in lengths]
        mean = sum(costs) / 4
        assignment = assign_micro_batches(lengths, dp=4, max_tokens=4096)
        assert assignment.imbalance < 1.005
        assert assignment.imbalance == pytest.approx(assignment.max_rank_cost / mean)
        kk = max(group_sums(karmarkar_karp(costs, 4), costs))
        lpt = max(group_sums(lpt_partition(costs, 4), costs))
        rr = max(group_sums(round_robin(costs, 4), costs))
        assert kk <= rr and assignment.max_rank_cost <= kk
        kk_wins += kk <= lpt
        lpt_wins += lpt < kk
    assert kk_wins >= 16, (kk_wins, lpt_wins)


def test_hand_example_kk_beats_lpt():
    costs = [8.0, 7.0, 6.0, 5.0, 4.0]
    assert karmarkar_karp(costs, 2) == [[1, 3, 4], [0, 2]]  # 16 / 14
    assert lpt_partition(costs, 2) == [[0, 3, 4], [1, 2]]  # 17 / 13
    assert sorted(group_sums(balanced_partition(costs, 2), costs)) == [15.0, 15.0]  # polished


def test_hand_example_plan():
    assignment = assign_micro_batches([8, 7, 6, 5, 4], dp=2, max_tokens=10, cost=float)
    # KK's {7,5,4} | {8,6} swaps 7 for 6; first-fit decreasing then packs {6,4} and {5}.
    assert assignment.micro_batches == (((3,), (2, 4)), ((1,), (0,)))
    assert assignment.token_counts == ((5, 10), (7, 8))
    assert assignment.rank_costs == (15.0, 15.0)
    assert assignment.num_micro_batches == 2 and not assignment.has_empty_micro_batches
    assert assignment.imbalance == 1.0
    assert fill_fraction(assignment) == pytest.approx(30 / 40)
    assert padding_fraction_vs_padded(assignment, 8) == pytest.approx(1 - 30 / 40)


def test_small_large_small_order():
    # One rank, five one-sample micro-batches (no two fit together): 6..10 become 6, 8, 10, 9, 7.
    assignment = assign_micro_batches([6, 7, 8, 9, 10], dp=1, max_tokens=10, cost=float)
    assert assignment.token_counts == ((6, 8, 10, 9, 7),)
    assert assignment.micro_batches == (((0,), (2,), (4,), (3,), (1,)),)


def test_split_largest_first():
    lengths = [5, 4, 3, 2]
    assert _split_to_count([[0, 1, 2], [3]], 3, lengths) == [[0], [1, 2], [3]]
    assert _split_to_count([[0, 1, 2], [3]], 4, lengths) == [[0], [1], [2], [3]]
    assert _split_to_count([[0, 1, 2], [3]], 5, lengths) == [[0], [1], [2], [3], []]
    assert _split_to_count([[0, 1]], 2, [0, 0]) == [[0], [1]]  # zero lengths still split


def test_equalises_by_splitting_and_flags_unavoidable_empty():
    # Squared cost: {8} balances {4,4,4,4}, which needs two micro-batches of 8 tokens.
    assignment = assign_micro_batches([8, 4, 4, 4, 4], dp=2, max_tokens=8, cost=lambda n: n * n)
    assert assignment.rank_costs == (64, 64)
    assert assignment.num_micro_batches == 2
    assert assignment.has_empty_micro_batches  # rank 0 has one sample for two micro-batches
    assert assignment.micro_batches[1] == ((), (0,))  # the empty one is cheapest: it goes first
    # Rank 1's {1,2,3,4} fits one micro-batch but rank 0 needs two ({1} and {10}): split it
    # into halves of equal tokens instead of padding with an empty micro-batch.
    assignment = assign_micro_batches([1, 2, 3, 4, 1, 10], dp=2, max_tokens=10, cost=float)
    assert assignment.micro_batches == (((4,), (5,)), ((0, 3), (1, 2)))
    assert assignment.token_counts == ((1, 10), (5, 5))
    assert not assignment.has_empty_micro_batches


def test_over_long_sample_raises():
    with pytest.raises(ValueError, match=r"sample 2 has 11 tokens .*max_tokens=10"):
        assign_micro_batches([3, 10, 11], dp=2, max_tokens=10)
    with pytest.raises(ValueError, match="dp"):
        assign_micro_batches([3], dp=0, max_tokens=10)
    with pytest.raises(ValueError, match="max_tokens"):
        assign_micro_batches([3], dp=1, max_tokens=0)


def test_empty_input():
    assignment = assign_micro_batches([], dp=3, max_tokens=8)
    assert assignment.micro_batches == ((), (), ()) and assignment.num_micro_batches == 0
    assert assignment.imbalance == 1.0


def test_deterministic():
    lengths = rl_lengths(7, n=128) + [20] * 16  # ties included
    a = assign_micro_batches(lengths, dp=4, max_tokens=2048)
    b = assign_micro_batches(tuple(lengths), dp=4, max_tokens=2048)
    assert a == b and hash(a) == hash(b)
