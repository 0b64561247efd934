"""KL estimators, the in-reward KL penalty and the KL coefficient controllers."""

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl,
)
from rlhf.algorithms.kl import LOG_RATIO_BOUND

FAST = settings(max_examples=40, deadline=None)
D = torch.float64


def t(xs, dtype=D):
    return torch.tensor(xs, dtype=dtype)


# logp - ref = [0.5, -1]; ref - logp = [-0.5, 1].
LOGP, REF = t([-1.0, -2.0]), t([-1.5, -1.0])


@pytest.mark.parametrize("kind, expected", [
    ("k1", [0.5, -1.0]),                                   # logp - ref
    ("abs", [0.5, 1.0]),                                   # |logp - ref|
    ("k2", [0.125, 0.5]),                                  # 0.5 * 0.25, 0.5 * 1
    ("k3", [math.exp(-0.5) + 0.5 - 1, math.e - 1 - 1]),    # exp(u) - u - 1, u = ref - logp
])
def test_kl_hand_values(kind, expected):
    torch.testing.assert_close(kl(LOGP, REF, kind), t(expected))


def test_kl_hand_gradients():
    logp = LOGP.clone().requires_grad_(True)
    # d/dlogp: k1 -> 1; k2 -> (logp - ref) = [.5, -1]; k3 -> 1 - exp(ref - logp)
    for kind, expected in [("k1", [1.0, 1.0]), ("k2", [0.5, -1.0]),
                           ("k3", [1 - math.exp(-0.5), 1 - math.e]), ("abs", [1.0, -1.0])]:
        (grad,) = torch.autograd.grad(kl(logp, REF, kind).sum(), logp)
        torch.testing.assert_close(grad, t(expected), msg=kind)


def test_k3_clamps_the_log_ratio():
    logp = t([0.0, -100.0]).requires_grad_(True)
    ref = t([-100.0, 0.0])
    got = kl(logp, ref, "k3")
    # u = ref - logp = -100 -> -20: exp(-20) + 20 - 1; u = 100 -> 20: exp(20) - 20 - 1
    b = LOG_RATIO_BOUND
    torch.testing.assert_close(got, t([math.exp(-b) + b - 1, math.exp(b) - b - 1]))
    (grad,) = torch.autograd.grad(got.sum(), logp)
    assert grad.tolist() == [0.0, 0.0]  # beyond the bound: no gradient
    assert torch.isfinite(kl(torch.tensor([-80.0]), torch.tensor([0.0]), "k3")).all()  # fp32


@FAST
@given(pairs=st.lists(st.tuples(st.floats(-8, 0), st.floats(-8, 0)), min_size=0, max_size=12))
def test_kl_matches_loop(pairs):
    logp, ref = t([p for p, _ in pairs]), t([r for _, r in pairs])
    forms = {"k1": lambda p, r: p - r, "abs": lambda p, r: abs(p - r),
             "k2": lambda p, r: 0.5 * (p - r) ** 2,
             "k3": lambda p, r: math.exp(r - p) - (r - p) - 1}
    for kind, f in forms.items():
        torch.testing.assert_close(kl(logp, ref, kind), t([f(p, r) for p, r in pairs]),
                                   msg=kind)
        if kind == "k3":
            assert (kl(logp, ref, kind) >= 0).all()


def test_kl_rejects_unknown_kind_and_shapes():
    with pytest.raises(ValueError, match="k4"):
        kl(LOGP, REF, "k4")
    with pytest.raises(ValueError, match="shape"):
        kl(LOGP, REF[:1], "k1")


def test_apply_kl_penalty_hand_example():
    # k1 per token = logp - ref = [.5, (masked), 0, .5]; coef .1
    # rewards = scores - .1 * kl = [-.05, 0, 1, 1.95]; per-sample KL sums [.5, 0 (empty), .5]
    rewards, kl_N = apply_kl_penalty(
        t([0, 0, 1, 2]), t([-1, -2, -1, -0.5]), t([-1.5, -1, -1, -1]),
        t([1, 0, 1, 1], torch.bool), t([0, 3, 3, 4], torch.int32), coef=0.1, kind="k1")
    torch.testing.assert_close(rewards, t([-0.05, 0, 1, 1.95]))
    torch.testing.assert_close(kl_N, t([0.5, 0, 0.5]))


@FAST
@given(lengths=st.lists(st.integers(0, 5), max_size=8), seed=st.integers(0, 2**20),
       kind=st.sampled_from(["k1", "k2", "k3", "abs"]))
def test_apply_kl_penalty_matches_loop(batch_factory, lengths, seed, kind):
    b = batch_factory(lengths, seed)
    rewards, kl_N = apply_kl_penalty(b["stream"]("reward"), b["stream"]("logp"),
                                     b["stream"]("old_logp"), b["mask_T"], b["cu_seqlens"],
                                     coef=0.3, kind=kind)
    exp_rewards, exp_kl = [], []
    for r in b["rows"]:
        total = 0.0
        for rew, p, q, m in zip(r["reward"], r["logp"], r["old_logp"], r["mask"]):
            k = kl(t([p]), t([q]), kind).item() if m else 0.0
            exp_rewards.append(rew - 0.3 * k)
            total += k
        exp_kl.append(total)
    torch.testing.assert_close(rewards, t(exp_rewards))
    torch.testing.assert_close(kl_N, t(exp_kl))


def test_adaptive_controller_hand_steps():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(12.0, 100)  # error = clip(12/6 - 1 = 1) = .2 -> .1 * (1 + .2 * 100/10000)
    assert c.coef == pytest.approx(0.1 * 1.002)
    c.update(torch.tensor(6.6), 100)  # error = .1 -> * (1 + .1 * .01)
    assert c.coef == pytest.approx(0.1 * 1.002 * 1.001)
    c.update(3.0, 100)  # error = clip(-.5) = -.2 -> * (1 - .002): the coef goes down
    assert c.coef == pytest.approx(0.1 * 1.002 * 1.001 * 0.998)


def test_adaptive_controller_moves_towards_target_and_round_trips():
    c = AdaptiveKLController(0.2, target=1.0, horizon=50)
    before = c.coef
    c.update(5.0, 10)
    assert c.coef > before  # KL too high: penalise harder
    high = c.coef
    c.update(0.1, 10)
    assert c.coef < high  # KL too low: relax
    saved = copy.deepcopy(c.state_dict())
    restored = AdaptiveKLController(0.2, target=1.0, horizon=50)
    restored.load_state_dict(saved)
    assert restored.coef == c.coef != 0.2
    for kl_value in (2.0, 0.3, 1.1):
        c.update(kl_value, 7)
        restored.update(kl_value, 7)
    assert restored.coef == c.coef


def test_fixed_controller_and_builder():
    f = build_kl_controller("fixed", coef=0.05)
    assert isinstance(f, FixedKLController)
    f.update(100.0, 1000)
    assert f.coef == 0.05
    g = FixedKLController(0.0)
    g.load_state_dict(f.state_dict())
    assert g.coef == 0.05
    a = build_kl_controller("adaptive", coef=0.05, target=3.0, horizon=100)
    assert isinstance(a, AdaptiveKLController) and a.target == 3.0 and a.horizon == 100
    with pytest.raises(ValueError, match="kl_target"):
        build_kl_controller("adaptive", coef=0.05)
    with pytest.raises(ValueError, match="adaptive, fixed"):
        build_kl_controller("pid", coef=0.05)
    with pytest.raises(ValueError, match="positive"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
