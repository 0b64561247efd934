"""Advantage estimators: hand-worked numbers and per-sample python loops on ragged batches."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algorithms import (
    compute_advantage,
    gae,
    grpo,
    masked_whiten,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
    scores_to_token_rewards,
    sequence_scores,
)

FAST = settings(max_examples=40, deadline=None)
lengths_st = st.lists(st.integers(0, 6), min_size=1, max_size=9)
seed_st = st.integers(0, 2**20)
D = torch.float64


def t(xs, dtype=D):
    return torch.tensor(xs, dtype=dtype)


# ----------------------------------------------------------------------- python references


def ref_whiten(rows_vals, rows_mask):
    """Whiten valid tokens of the batch with python statistics (unbiased std); 0 when masked."""
    flat = [v for vals, m in zip(rows_vals, rows_mask) for v, k in zip(vals, m) if k]
    mean = sum(flat) / len(flat) if flat else 0.0
    var = statistics.variance(flat) if len(flat) > 1 else 0.0
    return [[(v - mean) / math.sqrt(var + 1e-8) if k else 0.0 for v, k in zip(vals, m)]
            for vals, m in zip(rows_vals, rows_mask)]


def ref_gae_row(rewards, values, mask, gamma, lam):
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    next_value, last = 0.0, 0.0
    for t_ in reversed(range(len(rewards))):
        if not mask[t_]:
            continue  # absent: the recursion links the valid tokens around it
        delta = rewards[t_] + gamma * next_value - values[t_]
        last = delta + gamma * lam * last
        adv[t_], ret[t_] = last, last + values[t_]
        next_value = values[t_]
    return adv, ret


def ref_returns_row(rewards, mask, gamma):
    out, acc = [0.0] * len(rewards), 0.0
    for t_ in reversed(range(len(rewards))):
        if mask[t_]:
            acc = rewards[t_] + gamma * acc
            out[t_] = acc
    return out


def ref_group_adv(scores, groups, kind, eps=1e-6, norm=True):
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        others = [scores[j] for j in range(len(scores)) if groups[j] == groups[i] and j != i]
        if kind == "rloo":
            out.append(s - sum(others) / len(others) if others else 0.0)
        elif kind == "baseline":
            out.append(s - sum(members) / len(members))
        elif not others:
            out.append(0.0)
        else:
            centred = s - statistics.mean(members)
            out.append(centred / (statistics.stdev(members) + eps) if norm else centred)
    return out


def broadcast(per_sample, rows):
    return [[a if m else 0.0 for m in r["mask"]] for a, r in zip(per_sample, rows)]


def flat(rows_vals):
    return t([v for r in rows_vals for v in r])


# -------------------------------------------------------------------------- hand-worked


def test_gae_hand_example():
    # Sample 0: r = [0, 0, 1], V = [.5, .5, .5], gamma .9, lam .8 (gamma*lam = .72):
    #   d2 = 1 - .5 = .5; d1 = d0 = 0 + .9*.5 - .5 = -.05
    #   A2 = .5; A1 = -.05 + .72*.5 = .31; A0 = -.05 + .72*.31 = .1732; R = A + V
    # Sample 1 is empty. Sample 2: [r=0, V=.1] then a masked token (its reward 2 is ignored):
    #   A = 0 - .1 = -.1, R = 0
    adv, ret = gae(t([0, 0, 1, 0, 2]), t([.5, .5, .5, .1, .1]), t([0, 3, 3, 5], torch.int32),
                   t([1, 1, 1, 1, 0], torch.float32), gamma=0.9, lam=0.8, whiten=False)
    torch.testing.assert_close(adv, t([.1732, .31, .5, -.1, 0]))
    torch.testing.assert_close(ret, t([.6732, .81, 1.0, 0.0, 0]))


def test_gae_skips_a_masked_token_in_the_middle():
    # Valid tokens are 0 and 2: r = [1, 2], V = [.2, .4], gamma .5, lam 1.
    #   d(2) = 2 - .4 = 1.6; d(0) = 1 + .5*.4 - .2 = 1.0; A(0) = 1.0 + .5*1.6 = 1.8
    #   R(0) = 1.8 + .2 = 2.0; R(2) = 1.6 + .4 = 2.0. The masked value 9 and reward 5 play no part.
    adv, ret = gae(t([1, 5, 2]), t([.2, 9, .4]), t([0, 3], torch.int64),
                   t([True, False, True], torch.bool), gamma=0.5, lam=1.0, whiten=False)
    torch.testing.assert_close(adv, t([1.8, 0, 1.6]))
    torch.testing.assert_close(ret, t([2.0, 0, 2.0]))


def test_masked_whiten_hand_example():
    # Valid [1, 3, 5]: mean 3, unbiased var (4 + 0 + 4) / 2 = 4, std 2 -> [-1, 0, 1].
    x, m = t([1, 3, 5, 100]), t([1, 1, 1, 0])
    torch.testing.assert_close(masked_whiten(x, m), t([-1, 0, 1, 0]))
    # shift_mean=False adds the mean back: [2, 3, 4].
    torch.testing.assert_close(masked_whiten(x, m, shift_mean=False), t([2, 3, 4, 0]))
    # One valid token: no spread, so it becomes 0; none valid: all zeros, no NaN.
    torch.testing.assert_close(masked_whiten(x, t([0, 1, 0, 0])), t([0, 0, 0, 0]))
    torch.testing.assert_close(masked_whiten(x, t([0, 0, 0, 0])), t([0, 0, 0, 0]))


# Scores [1, 2, 3, 5, 4, 7], groups [4, 9, 4, 4, 9, 2] (group 4 = samples 0, 2, 3, not
# contiguous; group 2 has one sample), lengths [2, 1, 0, 3, 2, 1], sample 3's last token masked.
GROUP_CASE = dict(scores_N=t([1, 2, 3, 5, 4, 7]), group_ids=t([4, 9, 4, 4, 9, 2], torch.int32),
                  cu_seqlens=t([0, 2, 3, 3, 6, 8, 9], torch.int32),
                  mask_T=t([1, 1, 1, 1, 1, 0, 1, 1, 1], torch.bool))


def test_grpo_hand_example():
    # Group 4: {1, 3, 5}, mean 3, unbiased std sqrt((4 + 0 + 4) / 2) = 2 -> -1, 0, +1.
    # Group 9: {2, 4}, mean 3, std sqrt((1 + 1) / 1) = sqrt(2) -> -1/sqrt2, +1/sqrt2.
    # Group 2: one sample -> 0. (eps 1e-6 is added to the std.)
    a, r2, e = -2 / (2 + 1e-6), 1 / (math.sqrt(2) + 1e-6), 0.0
    expected = t([a, a, -r2, -a, -a, e, r2, r2, 0])
    adv, ret = grpo(**GROUP_CASE)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    # Dr. GRPO (no std): centred scores -2, -1, 0, 2, 1, 0 on the tokens.
    adv, _ = grpo(**GROUP_CASE, norm_adv_by_std=False)
    torch.testing.assert_close(adv, t([-2, -2, -1, 2, 2, 0, 1, 1, 0]))


def test_rloo_hand_example():
    # Group 4: 1 - (3+5)/2 = -3; 3 - (1+5)/2 = 0; 5 - (1+3)/2 = 3. Group 9: 2 - 4, 4 - 2.
    adv, ret = rloo(**GROUP_CASE)
    torch.testing.assert_close(adv, t([-3, -3, -2, 3, 3, 0, 2, 2, 0]))
    torch.testing.assert_close(ret, adv)


def test_reinforce_plus_plus_baseline_hand_example():
    # Group means: 3, 3, 3, 3, 3, 7 -> centred -2, -1, 0, 2, 1, 0 (the lone sample gets 0).
    adv, _ = reinforce_plus_plus_baseline(**GROUP_CASE, whiten=False)
    torch.testing.assert_close(adv, t([-2, -2, -1, 2, 2, 0, 1, 1, 0]))
    # Whitened over the 8 valid tokens [-2, -2, -1, 2, 2, 1, 1, 0]: mean 1/8,
    # sum of squares 19, unbiased var = (19 - 8 * (1/8)^2) / 7 = (19 - 1/8) / 7.
    adv, _ = reinforce_plus_plus_baseline(**GROUP_CASE)
    std = math.sqrt((19 - 1 / 8) / 7)
    vals = [-2, -2, -1, 2, 2, None, 1, 1, 0]
    torch.testing.assert_close(adv, t([0.0 if v is None else (v - 1 / 8) / std for v in vals]))


def test_reinforce_plus_plus_hand_example():
    # gamma .5: sample 0 r = [0, (masked 7), 1] -> G = [0 + .5*1, 0, 1] = [.5, 0, 1]; sample 1 [2].
    args = (t([0, 7, 1, 2]), t([0, 3, 4], torch.int32), t([1, 0, 1, 1]))
    adv, ret = reinforce_plus_plus(*args, gamma=0.5, whiten=False)
    torch.testing.assert_close(ret, t([.5, 0, 1, 2]))
    torch.testing.assert_close(adv, ret)
    # Whitened over [.5, 1, 2]: mean 7/6; unbiased var ((2/3)^2 + (1/6)^2 + (5/6)^2) / 2 = 7/12.
    adv, _ = reinforce_plus_plus(*args, gamma=0.5)
    s = math.sqrt(7 / 12)
    torch.testing.assert_close(adv, t([(.5 - 7 / 6) / s, 0, (1 - 7 / 6) / s, (2 - 7 / 6) / s]))


def test_scores_to_token_rewards_hand_example():
    # Sample 0's last token is masked, so its score lands on token 1; sample 1 is empty and
    # sample 3 has no valid token: both scores are dropped.
    cu = t([0, 3, 3, 5, 6], torch.int64)
    got = scores_to_token_rewards(t([1, 2, 3, 4]), cu, t([1, 1, 0, 1, 1, 0]))
    torch.testing.assert_close(got, t([0, 1, 0, 0, 3, 0]))
    torch.testing.assert_close(sequence_scores(got, cu, None), t([1, 0, 3, 0]))


# ------------------------------------------------------------------ against python loops


@FAST
@given(lengths=lengths_st, seed=seed_st, gamma=st.sampled_from([1.0, 0.9]),
       lam=st.sampled_from([1.0, 0.95, 0.0]))
def test_gae_matches_loop(batch_factory, lengths, seed, gamma, lam):
    b = batch_factory(lengths, seed)
    rows = b["rows"]
    refs = [ref_gae_row(r["reward"], r["value"], r["mask"], gamma, lam) for r in rows]
    adv, ret = gae(b["stream"]("reward"), b["stream"]("value"), b["cu_seqlens"], b["mask_T"],
                   gamma=gamma, lam=lam)
    torch.testing.assert_close(ret, flat([r[1] for r in refs]))
    torch.testing.assert_close(adv, flat(ref_whiten([r[0] for r in refs],
                                                    [r["mask"] for r in rows])))


@FAST
@given(lengths=lengths_st, seed=seed_st, gamma=st.sampled_from([1.0, 0.7]))
def test_reinforce_plus_plus_matches_loop(batch_factory, lengths, seed, gamma):
    b = batch_factory(lengths, seed)
    rows = b["rows"]
    rets = [ref_returns_row(r["reward"], r["mask"], gamma) for r in rows]
    adv, ret = reinforce_plus_plus(b["stream"]("reward"), b["cu_seqlens"], b["mask_T"],
                                   gamma=gamma)
    torch.testing.assert_close(ret, flat(rets))
    torch.testing.assert_close(adv, flat(ref_whiten(rets, [r["mask"] for r in rows])))


@FAST
@given(lengths=lengths_st, seed=seed_st, norm=st.booleans())
def test_group_estimators_match_loop(batch_factory, lengths, seed, norm):
    b = batch_factory(lengths, seed)
    rows, args = b["rows"], (b["scores_N"], b["group_ids"], b["cu_seqlens"], b["mask_T"])
    expected = ref_group_adv(b["scores"], b["groups"], "grpo", norm=norm)
    torch.testing.assert_close(grpo(*args, norm_adv_by_std=norm)[0],
                               flat(broadcast(expected, rows)))
    expected = ref_group_adv(b["scores"], b["groups"], "rloo")
    torch.testing.assert_close(rloo(*args)[0], flat(broadcast(expected, rows)))
    expected = broadcast(ref_group_adv(b["scores"], b["groups"], "baseline"), rows)
    torch.testing.assert_close(reinforce_plus_plus_baseline(*args)[0],
                               flat(ref_whiten(expected, [r["mask"] for r in rows])))


@FAST
@given(lengths=lengths_st, seed=seed_st)
def test_scores_to_token_rewards_matches_loop(batch_factory, lengths, seed):
    b = batch_factory(lengths, seed, mask_p=0.5)
    expected = []
    for s, r in zip(b["scores"], b["rows"]):
        row = [0.0] * len(r["mask"])
        valid = [i for i, m in enumerate(r["mask"]) if m]
        if valid:
            row[valid[-1]] = s
        expected.append(row)
    got = scores_to_token_rewards(b["scores_N"], b["cu_seqlens"], b["mask_T"])
    torch.testing.assert_close(got, flat(expected))


# ------------------------------------------------------------------------- call conventions


def test_compute_advantage_passes_each_estimator_its_inputs():
    cu, mask = t([0, 2, 3], torch.int32), t([1, 1, 1], torch.bool)
    inputs = dict(token_rewards_T=t([0, 1, 2]), values_T=t([.5, .5, .5]), scores_N=t([1, 2]),
                  group_ids=t([0, 0], torch.int64), cu_seqlens=cu, mask_T=mask, gamma=1.0,
                  lam=1.0, norm_adv_by_std=True)
    for name, direct in [("gae", lambda: gae(inputs["token_rewards_T"], inputs["values_T"], cu,
                                             mask)),
                         ("grpo", lambda: grpo(inputs["scores_N"], inputs["group_ids"], cu,
                                               mask)),
                         ("rloo", lambda: rloo(inputs["scores_N"], inputs["group_ids"], cu,
                                               mask))]:
        adv, ret = compute_advantage(name, **inputs)
        torch.testing.assert_close(adv, direct()[0])
        torch.testing.assert_close(ret, direct()[1])
    with pytest.raises(ValueError, match="gama"):
        compute_advantage("gae", **inputs, gama=0.9)
    with pytest.raises(ValueError, match="values_T"):
        compute_advantage("gae", token_rewards_T=t([0, 1, 2]), cu_seqlens=cu, mask_T=mask)


def test_estimators_take_no_gradient_and_keep_float32():
    v = torch.tensor([.5, .2], requires_grad=True)
    adv, ret = gae(torch.tensor([0.0, 1.0]), v, t([0, 2], torch.int32), None)
    assert not adv.requires_grad and not ret.requires_grad
    assert adv.dtype == ret.dtype == torch.float32


def test_group_estimators_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="group_ids"):
        grpo(t([1, 2]), t([0, 0, 0], torch.int64), t([0, 1, 2], torch.int32), None)
    with pytest.raises(ValueError, match="scores_N"):
        rloo(t([1, 2, 3]), t([0, 0], torch.int64), t([0, 1, 2], torch.int32), None)


def test_group_estimators_accept_integer_scores():
    # 0/1 rewards as ints: group {1, 0, 1}: mean 2/3; rloo: 1 - (0 + 1)/2 = .5, 0 - 1 = -1
    adv, _ = rloo(torch.tensor([1, 0, 1]), torch.tensor([3, 3, 3]), t([0, 1, 2, 3], torch.int32),
                  None)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([0.5, -1.0, 0.5]))
