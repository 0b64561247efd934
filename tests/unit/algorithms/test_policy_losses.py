"""GSPO and CISPO policy losses (and the registry that names them): hand-worked losses,
gradients and clip fractions."""

import math

import pytest
import torch

from rlhf.algorithms import cispo_policy_loss, get_policy_loss, gspo_policy_loss, ppo_policy_loss
from rlhf.algorithms.policy_losses import sequence_ratio

D = torch.float64
nan = float("nan")


def t(xs, dtype=D):
    return torch.tensor(xs, dtype=dtype)


def test_registry_names_the_three_losses():
    assert get_policy_loss("ppo") is ppo_policy_loss
    assert get_policy_loss("gspo") is gspo_policy_loss
    assert get_policy_loss("cispo") is cispo_policy_loss
    with pytest.raises(ValueError, match="cispo, gspo, ppo"):
        get_policy_loss("grpo")


# GSPO case: sample A has 2 tokens with log-ratios (logp - old) 0.1 and -0.3 (mean -0.1, so
# s_A = exp(-0.1) = 0.904837); sample B has 3 valid tokens 0.2, 0.0, 0.1 (mean 0.1, s_B =
# exp(0.1) = 1.105171) and a masked 4th token with a huge log-ratio and NaN advantage.
# Advantage +1 everywhere. Clip range [0.95, 1.05]:
#   A: max(-0.904837, -0.95) = -0.904837, unclipped: grad of each token -A s_A = -0.904837
#   B: max(-1.105171, -1.05) = -1.05, clipped: grad 0
GSPO_OLD = t([-1.0, -2.0, -1.5, -0.5, -1.0, -1.0])
GSPO_LOG_RATIO = t([0.1, -0.3, 0.2, 0.0, 0.1, 9.0])
GSPO_ADV = t([1.0, 1.0, 1.0, 1.0, 1.0, nan])
GSPO_CU = t([0, 2, 6], torch.int32)
GSPO_MASK = t([1, 1, 1, 1, 1, 0], torch.bool)


def gspo_case(agg_mode):
    logp = (GSPO_OLD + GSPO_LOG_RATIO).requires_grad_()
    loss, metrics = gspo_policy_loss(logp, GSPO_OLD, GSPO_ADV, GSPO_MASK, GSPO_CU,
                                     clip_low=0.05, clip_high=0.05, agg_mode=agg_mode)
    loss.backward()
    return loss, metrics, logp.grad


def test_sequence_ratio_has_the_sequence_value_on_every_token():
    logp = GSPO_OLD + GSPO_LOG_RATIO
    ratio = sequence_ratio(logp, GSPO_OLD, GSPO_MASK, GSPO_CU)
    s_a, s_b = 0.9048374180359595, 1.1051709180756477
    torch.testing.assert_close(ratio, t([s_a, s_a, s_b, s_b, s_b, 0.0]))


def test_gspo_token_mean_loss_grad_and_clipfrac():
    loss, metrics, grad = gspo_case("token-mean")
    # (2 * -0.904837 + 3 * -1.05) / 5 valid tokens
    assert float(loss.detach()) == pytest.approx(-0.9919349672143838, abs=1e-12)
    torch.testing.assert_close(grad, t([-0.904837418 / 5] * 2 + [0.0] * 4))
    assert float(metrics["clipfrac"]) == pytest.approx(3 / 5)


def test_gspo_seq_mean_token_mean_gives_the_sequence_objective_gradient():
    # GSPO's sequence objective -A s_A has gradient -A s_A / |y_A| per token; with two
    # sequences in the mean, -0.904837 / 2 / 2.
    loss, _, grad = gspo_case("seq-mean-token-mean")
    assert float(loss.detach()) == pytest.approx(-0.9774187090179798, abs=1e-12)
    torch.testing.assert_close(grad, t([-0.904837418 / 4] * 2 + [0.0] * 4))


def test_gspo_lower_clip_binds_for_negative_advantages():
    # Sample B with A = -1: surr = 1.105171 beats clip(1.105171) = 1.05, unclipped; sample A
    # with A = -1: max(0.904837, 0.95) = 0.95, clipped.
    logp = (GSPO_OLD + GSPO_LOG_RATIO).requires_grad_()
    loss, metrics = gspo_policy_loss(logp, GSPO_OLD, -GSPO_ADV, GSPO_MASK, GSPO_CU,
                                     clip_low=0.05, clip_high=0.05, agg_mode="token-mean")
    loss.backward()
    assert float(loss.detach()) == pytest.approx((2 * 0.95 + 3 * 1.1051709180756477) / 5, abs=1e-12)
    torch.testing.assert_close(logp.grad, t([0.0] * 2 + [1.105170918 / 5] * 3 + [0.0]))
    assert float(metrics["clipfrac"]) == pytest.approx(2 / 5)


# CISPO case: ratios 1.5, 0.5, 1.1 (old -1 each), advantages 1, -1, 2, clip_high 0.28 caps
# the weight at 1.28: weights 1.28, 0.5, 1.1. Loss per token -w A logp:
#   0: -1.28 * 1 * (-1 + ln 1.5) = 0.761005     grad -w A = -1.28
#   1: -0.5 * -1 * (-1 + ln 0.5) = -0.846574    grad 0.5
#   2: -1.1 * 2 * (-1 + ln 1.1) = 1.990318      grad -2.2
# plus a masked 4th token whose advantage is NaN.
def test_cispo_loss_and_gradient_through_logp_only():
    old = t([-1.0, -1.0, -1.0, -1.0])
    logp = (old + t([math.log(1.5), math.log(0.5), math.log(1.1), 0.3])).requires_grad_()
    adv = t([1.0, -1.0, 2.0, nan])
    mask = t([1, 1, 1, 0], torch.bool)
    loss, metrics = cispo_policy_loss(logp, old, adv, mask, t([0, 4], torch.int32),
                                      clip_low=0.2, clip_high=0.28, agg_mode="token-mean")
    loss.backward()
    expected = (0.7610046616215496 - 0.8465735902799727 + 1.990317604430485) / 3
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-12)
    torch.testing.assert_close(logp.grad, t([-1.28 / 3, 0.5 / 3, -2.2 / 3, 0.0]))
    assert float(metrics["clipfrac"]) == pytest.approx(1 / 3)


def test_cispo_keeps_the_gradient_of_clipped_tokens_where_ppo_drops_it():
    old = t([-1.0])
    adv = t([1.0])
    cu = t([0, 1], torch.int32)
    grads = {}
    for name in ("ppo", "cispo"):
        logp = (old + math.log(2.0)).requires_grad_()
        loss, _ = get_policy_loss(name)(logp, old, adv, None, cu, clip_low=0.2, clip_high=0.2)
        loss.backward()
        grads[name] = float(logp.grad)
    assert grads == {"ppo": 0.0, "cispo": pytest.approx(-1.2)}


def test_is_weights_scale_gspo_and_cispo_token_losses():
    old = t([-1.0, -1.0])
    logp = old.clone()  # ratio 1: no clipping anywhere
    adv = t([1.0, 1.0])
    cu = t([0, 2], torch.int32)
    w = t([2.0, 0.5])
    gspo, _ = gspo_policy_loss(logp, old, adv, None, cu, agg_mode="token-mean", is_weights_T=w)
    cispo, _ = cispo_policy_loss(logp, old, adv, None, cu, is_weights_T=w)
    assert float(gspo) == pytest.approx((-2.0 - 0.5) / 2)  # -A * 1 * w
    assert float(cispo) == pytest.approx((2.0 * 1 + 0.5 * 1) / 2)  # -1 * A * (-1) * w
