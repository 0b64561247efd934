"""Segment helpers and registries of rlhf.algorithms, checked against per-sample python loops."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algorithms import get_advantage, get_kl, get_loss_agg, register_advantage
from rlhf.algorithms.segments import (
    last_valid_index,
    reverse_scan,
    segment_sum,
    segments,
    to_tokens,
)

FAST = settings(max_examples=30, deadline=None)
lengths_st = st.lists(st.integers(0, 6), min_size=0, max_size=8)


def test_segments_hand_example():
    # lengths 2, 0, 3: tokens 0-1 are sample 0, tokens 2-4 sample 2; sample 1 is empty.
    seg = segments(torch.tensor([0, 2, 2, 5], dtype=torch.int32), 5)
    assert seg.sample_T.tolist() == [0, 0, 2, 2, 2]
    assert seg.positions().tolist() == [0, 1, 0, 1, 2]
    x_T = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert segment_sum(x_T, seg).tolist() == [3.0, 0.0, 12.0]
    valid_T = torch.tensor([True, False, False, True, False])
    assert segment_sum(x_T, seg, valid_T).tolist() == [1.0, 0.0, 4.0]
    assert last_valid_index(seg, valid_T).tolist() == [0, -1, 3]
    assert to_tokens(torch.tensor([10.0, 20.0, 30.0]), seg).tolist() == [10, 10, 30, 30, 30]
    # y = x + 0.5 * y_next per sample: sample 0: [1 + 0.5*2, 2]; sample 2: 5, 4+2.5, 3+3.25
    assert reverse_scan(x_T, seg, 0.5).tolist() == [2.0, 2.0, 6.25, 6.5, 5.0]


@pytest.mark.parametrize("cu, total", [([1, 3], 3), ([0, 3], 4), ([0, 3, 2], 2), ([], 0)])
def test_segments_rejects_bad_offsets(cu, total):
    with pytest.raises(ValueError, match="cu_seqlens"):
        segments(torch.tensor(cu, dtype=torch.int64), total)


def test_segments_rejects_float_offsets():
    with pytest.raises(ValueError, match="integers"):
        segments(torch.tensor([0.0, 2.0]), 2)


@FAST
@given(lengths=lengths_st, decay=st.floats(0, 1))
def test_reverse_scan_matches_loop(lengths, decay):
    g = torch.Generator().manual_seed(len(lengths))
    x_T = torch.randn(sum(lengths), generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()))
    got = reverse_scan(x_T, segments(cu, x_T.numel()), decay)
    expected = []
    for i, n in enumerate(lengths):
        row, acc = x_T[cu[i]:cu[i] + n].tolist(), 0.0
        out = [0.0] * n
        for t in reversed(range(n)):
            acc = row[t] + decay * acc
            out[t] = acc
        expected += out
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("getter, kind", [(get_advantage, "advantage estimator"),
                                          (get_kl, "KL estimator"),
                                          (get_loss_agg, "loss aggregation mode")])
def test_unknown_names_list_the_registered_ones(getter, kind):
    with pytest.raises(ValueError, match=kind) as info:
        getter("nope")
    assert "registered:" in str(info.value) and "nope" in str(info.value)


def test_config_defaults_are_registered_and_documented():
    from rlhf.algorithms.advantages import _ADVANTAGES
    from rlhf.algorithms.kl import _CONTROLLERS, _KL, get_kl_controller
    from rlhf.algorithms.losses import _AGGREGATIONS
    from rlhf.config import AlgorithmConfig, reference_markdown
    algo = AlgorithmConfig()
    assert callable(get_advantage(algo.adv_estimator))
    assert callable(get_kl(algo.kl_penalty)) and callable(get_kl(algo.kl_loss_type))
    reference = reference_markdown()
    assert callable(get_loss_agg(algo.loss_agg_mode))
    assert callable(get_kl_controller(algo.kl_ctrl))
    assert len(_AGGREGATIONS) == 4 and len(_CONTROLLERS) == 2
    # the reference lists every built-in choice
    for name in (*_ADVANTAGES, *_KL, *_AGGREGATIONS, *_CONTROLLERS):
        assert name in reference, name


def test_register_twice_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("gae")(lambda: None)
