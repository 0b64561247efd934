"""PPO policy loss (clip, dual clip, IS weights), value loss (clipped or not), entropy and KL
losses: hand-worked numbers and gradients, and per-token python loops."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algorithms import entropy_bonus, kl_loss, ppo_policy_loss, value_loss

FAST = settings(max_examples=40, deadline=None)
D = torch.float64
nan = float("nan")


def t(xs, dtype=D):
    return torch.tensor(xs, dtype=dtype)


# Policy case, clip_low .2, clip_high .28, clip_c 3. Token 5 is masked: its advantage (and IS
# weight below) is NaN, its log-probs finite, so only masking before the math keeps its grad 0.
RATIOS = [1.5, 0.5, 0.5, 4.0, 1.1]
ADV = t([1.0, 1.0, -1.0, -1.0, -2.0, nan])
OLD = t([-1.0, -1.2, -0.7, -2.0, -1.5, -1.0])
CU = t([0, 2, 6], torch.int32)
MASK = t([1, 1, 1, 1, 1, 0], torch.bool)
# Per token, loss = max(-A r, -A clip(r, .8, 1.28)), then min(., -A * 3) where A < 0:
#   0: A=1,  r=1.5: max(-1.5, -1.28) = -1.28  clipped (upper)          grad 0
#   1: A=1,  r=0.5: max(-0.5, -0.8)  = -0.5                            grad -A r = -0.5
#   2: A=-1, r=0.5: max(0.5, 0.8)    = 0.8    clipped (lower)          grad 0
#   3: A=-1, r=4:   max(4, 1.28) = 4 -> min(4, 3) = 3  dual clip       grad 0
#   4: A=-2, r=1.1: max(2.2, 2.2)    = 2.2                             grad -A r = 2.2
TOKEN_LOSSES = [-1.28, -0.5, 0.8, 3.0, 2.2]


def policy_logp(ratios=RATIOS):
    logp = OLD.clone()
    logp += t([math.log(r) for r in ratios] + [0.1])
    return logp.requires_grad_(True)


def test_policy_loss_hand_example_with_dual_clip():
    logp = policy_logp()
    loss, metrics = ppo_policy_loss(logp, OLD, ADV, MASK, CU, clip_low=0.2, clip_high=0.28,
                                    clip_c=3.0)
    torch.testing.assert_close(loss, t(sum(TOKEN_LOSSES) / 5))  # 4.22 / 5 = .844
    assert metrics["clipfrac"].item() == pytest.approx(2 / 5)  # tokens 0 and 2
    assert metrics["clipfrac_lower"].item() == pytest.approx(1 / 5)  # token 3
    # approx_kl = k3 of KL(old || new) = mean of r - log r - 1
    assert metrics["approx_kl"].item() == pytest.approx(
        sum(r - math.log(r) - 1 for r in RATIOS) / 5)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    loss.backward()
    torch.testing.assert_close(logp.grad, t([0, -0.5, 0, 0, 2.2, 0]) / 5)


def test_policy_loss_without_dual_clip_and_with_is_weights():
    loss, metrics = ppo_policy_loss(policy_logp(), OLD, ADV, MASK, CU, clip_low=0.2,
                                    clip_high=0.28)
    # token 3 keeps max(4, 1.28) = 4: (4.22 - 3 + 4) / 5
    torch.testing.assert_close(loss, t(5.22 / 5))
    assert "clipfrac_lower" not in metrics
    weights = t([2.0, 1.0, 1.0, 1.0, 0.5, nan]).requires_grad_(True)
    logp = policy_logp()
    loss, _ = ppo_policy_loss(logp, OLD, ADV, MASK, CU, clip_low=0.2, clip_high=0.28,
                              clip_c=3.0, is_weights_T=weights)
    # (2 * -1.28 - 0.5 + 0.8 + 3 + 0.5 * 2.2) / 5 = 1.84 / 5
    torch.testing.assert_close(loss, t(1.84 / 5))
    loss.backward()
    assert weights.grad is None  # weights are constants of the loss
    torch.testing.assert_close(logp.grad, t([0, -0.5, 0, 0, 0.5 * 2.2, 0]) / 5)


def test_policy_loss_seq_mean_token_mean():
    # Sequence 0 = tokens 0, 1; sequence 1 = tokens 2-4 (token 5 masked).
    loss, _ = ppo_policy_loss(policy_logp(), OLD, ADV, MASK, CU, clip_low=0.2,
                              clip_high=0.28, clip_c=3.0, agg_mode="seq-mean-token-mean")
    expected = ((-1.28 - 0.5) / 2 + (0.8 + 3.0 + 2.2) / 3) / 2
    torch.testing.assert_close(loss, t(expected))


def ref_policy_token(logp, old, a, low, high, c):
    """Per-token loss and flags written with explicit branches on the sign of A."""
    r = math.exp(logp - old)
    if a >= 0:
        loss, clipped = -a * min(r, 1 + high), a > 0 and r > 1 + high
        return loss, clipped, False
    loss, clipped = -a * max(r, 1 - low), r < 1 - low
    lower = c is not None and loss > -a * c
    return (-a * c if lower else loss), clipped, lower


@FAST
@given(lengths=st.lists(st.integers(0, 5), max_size=8), seed=st.integers(0, 2**20),
       clip_c=st.sampled_from([None, 1.5, 3.0]))
def test_policy_loss_matches_loop(batch_factory, lengths, seed, clip_c):
    b = batch_factory(lengths, seed)
    losses, clipped, lower, kls = [], [], [], []
    for r in b["rows"]:
        for p, q, a, m in zip(r["logp"], r["old_logp"], r["adv"], r["mask"]):
            if m:
                loss, c, lo = ref_policy_token(p, q, a, 0.2, 0.3, clip_c)
                losses.append(loss)
                clipped.append(c)
                lower.append(lo)
                kls.append(math.exp(p - q) - (p - q) - 1)
    n = max(len(losses), 1)
    loss, metrics = ppo_policy_loss(b["stream"]("logp"), b["stream"]("old_logp"),
                                    b["stream"]("adv"), b["mask_T"], b["cu_seqlens"],
                                    clip_low=0.2, clip_high=0.3, clip_c=clip_c)
    torch.testing.assert_close(loss, t(sum(losses) / n))
    assert metrics["clipfrac"].item() == pytest.approx(sum(clipped) / n)
    assert metrics["approx_kl"].item() == pytest.approx(sum(kls) / n, rel=1e-5, abs=1e-6)
    if clip_c is not None:
        assert metrics["clipfrac_lower"].item() == pytest.approx(sum(lower) / n)


def test_policy_loss_gradcheck():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(7, generator=g, dtype=D) * 2
    logp = (old + 0.6 * torch.randn(7, generator=g, dtype=D)).requires_grad_(True)
    adv, mask = torch.randn(7, generator=g, dtype=D), t([1, 1, 0, 1, 1, 1, 1], torch.bool)
    cu = t([0, 3, 3, 7], torch.int64)

    def f(x):
        return ppo_policy_loss(x, old, adv, mask, cu, clip_low=0.2, clip_high=0.3, clip_c=2.0,
                               agg_mode="seq-mean-token-mean")[0]
    assert torch.autograd.gradcheck(f, (logp,))


def test_policy_loss_rejects_bad_clip_c_and_shapes():
    with pytest.raises(ValueError, match="clip_c"):
        ppo_policy_loss(policy_logp(), OLD, ADV, MASK, CU, clip_c=1.0)
    with pytest.raises(ValueError, match="advantages_T"):
        ppo_policy_loss(policy_logp(), OLD, ADV[:4], MASK, CU)


# Value case, clip .2; token 3 masked (NaN):
#   0: v=1.0, old=.5, R=1.5: (v-R)^2 = .25; v clipped to .7: (.7-1.5)^2 = .64 -> .64, clipped
#      (v is outside old +- .2, so the clipped term has no gradient)                grad 0
#   1: v=.6,  old=.5, R=0:   .36 both ways (v inside the clip range)               grad v-R = .6
#   2: v=0,   old=.5, R=1:   1.0; clipped to .3: .49 -> 1.0                        grad v-R = -1
VALUES = [1.0, 0.6, 0.0, nan]
OLD_V, RET = t([0.5, 0.5, 0.5, nan]), t([1.5, 0.0, 1.0, nan])
VCU, VMASK = t([0, 1, 4], torch.int32), t([1, 1, 1, 0], torch.bool)


def test_value_loss_hand_example_clipped():
    v = t(VALUES).requires_grad_(True)
    loss, metrics = value_loss(v, OLD_V, RET, VMASK, VCU, clip=0.2)
    torch.testing.assert_close(loss, t(0.5 * (0.64 + 0.36 + 1.0) / 3))
    assert metrics["clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(v.grad, t([0, 0.6, -1.0, 0]) / 3)


def test_value_loss_hand_example_unclipped():
    v = t(VALUES).requires_grad_(True)
    loss, metrics = value_loss(v, OLD_V, RET, VMASK, VCU, clip=None)
    torch.testing.assert_close(loss, t(0.5 * (0.25 + 0.36 + 1.0) / 3))
    assert metrics["clipfrac"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(v.grad, t([-0.5, 0.6, -1.0, 0]) / 3)


@FAST
@given(lengths=st.lists(st.integers(0, 5), max_size=8), seed=st.integers(0, 2**20),
       clip=st.sampled_from([None, 0.1, 0.5]))
def test_value_loss_matches_loop(batch_factory, lengths, seed, clip):
    b = batch_factory(lengths, seed)
    losses, clipped = [], []
    for r in b["rows"]:
        # old values = rewards stream, returns = advantages stream (any numbers do)
        for v, old, ret, m in zip(r["value"], r["reward"], r["adv"], r["mask"]):
            if not m:
                continue
            plain = (v - ret) ** 2
            vc = v if clip is None else min(max(v, old - clip), old + clip)
            losses.append(0.5 * max(plain, (vc - ret) ** 2))
            clipped.append((vc - ret) ** 2 > plain)
    n = max(len(losses), 1)
    loss, metrics = value_loss(b["stream"]("value"), b["stream"]("reward"), b["stream"]("adv"),
                               b["mask_T"], b["cu_seqlens"], clip=clip)
    torch.testing.assert_close(loss, t(sum(losses) / n))
    assert metrics["clipfrac"].item() == pytest.approx(sum(clipped) / n)


def test_entropy_bonus_and_kl_loss():
    ent = t([1.0, 2.0, nan, 4.0]).requires_grad_(True)
    mask, cu = t([1, 1, 0, 1], torch.bool), t([0, 3, 4], torch.int32)
    bonus = entropy_bonus(ent, mask, cu)  # (1 + 2 + 4) / 3
    torch.testing.assert_close(bonus, t(7 / 3))
    bonus.backward()
    torch.testing.assert_close(ent.grad, t([1, 1, 0, 1]) / 3)
    # seq-mean-token-sum: (1 + 2) and 4 -> mean 3.5
    torch.testing.assert_close(entropy_bonus(ent, mask, cu, agg_mode="seq-mean-token-sum"),
                               t(3.5))
    # k3 with u = ref - logp = [-.5, 1, (masked), 0]: (exp(-.5) + .5 - 1 + e - 2 + 0) / 3
    logp = t([-1.0, -2.0, nan, -0.3]).requires_grad_(True)
    ref = t([-1.5, -1.0, nan, -0.3])
    loss = kl_loss(logp, ref, mask, cu, kind="k3")
    torch.testing.assert_close(loss, t((math.exp(-0.5) - 0.5 + math.e - 2) / 3))
    loss.backward()
    # d/dlogp k3 = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad, t([1 - math.exp(-0.5), 1 - math.e, 0, 0]) / 3)
    torch.testing.assert_close(kl_loss(logp, ref, mask, cu, kind="k1"), t((0.5 - 1 + 0) / 3))
    # k2 = .5 (logp - ref)^2 = [.125, .5, (masked), 0]; d/dlogp = logp - ref, 0 where masked
    logp.grad = None
    loss = kl_loss(logp, ref, mask, cu, kind="k2")
    torch.testing.assert_close(loss, t(0.625 / 3))
    loss.backward()
    torch.testing.assert_close(logp.grad, t([0.5, -1.0, 0, 0]) / 3)
