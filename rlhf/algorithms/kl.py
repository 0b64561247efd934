"""KL(policy || reference) estimators from per-token log-probs, the in-reward KL penalty and
the controllers of its coefficient.

Every estimator is evaluated on tokens sampled from the policy, so its mean over tokens
estimates the KL divergence of the policy from the reference (Schulman, "Approximating KL
divergence"): k1 is unbiased but noisy, k3 is unbiased and non-negative, k2 and abs are biased.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from rlhf.algorithms.registry import lookup, register
from rlhf.algorithms.segments import check_tokens, segment_sum, segments, valid_mask

LOG_RATIO_BOUND = 20.0
"""k3 clamps log(ref / policy) to +-20 before exp: exp(20) ~ 4.9e8 stays finite in fp32 (and
its square in the gradient too), far past any ratio a healthy run produces. Tokens beyond the
bound get no gradient from k3."""

_KL: dict[str, Callable[[Tensor, Tensor], Tensor]] = {}


def register_kl(name: str):
    """Decorator: make a per-token estimator `fn(logp_T, ref_logp_T) -> kl_T` available."""
    return register(_KL, "KL estimator", name)


def get_kl(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The KL estimator registered under `name`, or the user function a 'module:function'
    names (ValueError listing the registered names otherwise)."""
    return lookup(_KL, "KL estimator", name)


@register_kl("k1")
def kl_k1(logp_T: Tensor, ref_logp_T: Tensor) -> Tensor:
    """log pi - log ref."""
    return logp_T - ref_logp_T


@register_kl("abs")
def kl_abs(logp_T: Tensor, ref_logp_T: Tensor) -> Tensor:
    """|log pi - log ref|."""
    return (logp_T - ref_logp_T).abs()


@register_kl("k2")
def kl_k2(logp_T: Tensor, ref_logp_T: Tensor) -> Tensor:
    """0.5 (log pi - log ref)^2."""
    return 0.5 * (logp_T - ref_logp_T).square()


@register_kl("k3")
def kl_k3(logp_T: Tensor, ref_logp_T: Tensor) -> Tensor:
    """exp(d) - d - 1 with d = log ref - log pi clamped to +-LOG_RATIO_BOUND; always >= 0."""
    d_T = (ref_logp_T - logp_T).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.expm1(d_T) - d_T  # expm1 keeps precision where pi ~ ref (d ~ 0)


def kl(logp_T: Tensor, ref_logp_T: Tensor, kind: str = "k1") -> Tensor:
    """Per-token KL estimate of kind k1 | k2 | k3 | abs, same shape as the inputs."""
    if logp_T.shape != ref_logp_T.shape:
        raise ValueError(f"logp_T has shape {tuple(logp_T.shape)} but ref_logp_T has "
                         f"{tuple(ref_logp_T.shape)}")
    return get_kl(kind)(logp_T, ref_logp_T)


@torch.no_grad()
def apply_kl_penalty(token_scores_T: Tensor, logp_T: Tensor, ref_logp_T: Tensor,
                     mask_T: Tensor | None, cu_seqlens: Tensor, *, coef: float,
                     kind: str = "k1") -> tuple[Tensor, Tensor]:
    """token_scores - coef * KL on every valid token -> (token_rewards_T, kl_N).

    kl_N (n,) is each sample's KL summed over its valid tokens (0 for an empty sample); its
    mean over samples is the `current_kl` of `AdaptiveKLController.update`.
    """
    num_tokens = token_scores_T.shape[0]
    check_tokens(num_tokens, logp_T=logp_T, ref_logp_T=ref_logp_T)
    seg = segments(cu_seqlens, num_tokens, token_scores_T.device)
    valid_T = valid_mask(mask_T, num_tokens, token_scores_T.device)
    kl_T = kl(logp_T, ref_logp_T, kind).masked_fill(~valid_T, 0)
    return token_scores_T - coef * kl_T, segment_sum(kl_T, seg)


_CONTROLLERS: dict[str, Callable[..., KLController]] = {}
FIXED = "fixed"
"""The controller that never changes the coefficient (the default: nothing to tune)."""


class KLController(Protocol):
    """What the trainer calls on `algorithm.kl_ctrl`'s controller once per step."""

    coef: float

    def update(self, current_kl: float, n_samples: int) -> None: ...
    def state_dict(self) -> dict[str, float]: ...
    def load_state_dict(self, state: dict[str, float]) -> None: ...


def register_kl_controller(name: str):
    """Decorator: make `factory(coef, *, target, horizon) -> KLController` an `algorithm.kl_ctrl`.
    A factory whose `target` has no default needs `algorithm.kl_target` set."""
    return register(_CONTROLLERS, "KL controller", name)


def get_kl_controller(name: str) -> Callable[..., KLController]:
    """The controller factory registered under `name`, or the user's 'module:function'."""
    return lookup(_CONTROLLERS, "KL controller", name)


@register_kl_controller(FIXED)
class FixedKLController:
    """A KL coefficient that never changes."""

    def __init__(self, coef: float, *, target: float | None = None, horizon: int | None = None):
        if coef < 0:
            raise ValueError(f"KL coefficient must be non-negative, got {coef}")
        self.coef = float(coef)

    def update(self, current_kl: float | Tensor, n_samples: int) -> None:
        """No-op, so the trainer calls every controller the same way."""

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])


@register_kl_controller("adaptive")
class AdaptiveKLController:
    """Proportional controller of Ziegler et al. (2019) that steers the KL towards `target`.

    error = clip(current / target - 1, -0.2, 0.2); coef *= 1 + error * n_samples / horizon.
    """

    def __init__(self, coef: float, *, target: float, horizon: int = 10000):
        if coef < 0:
            raise ValueError(f"KL coefficient must be non-negative, got {coef}")
        if target is None:
            raise ValueError("kl_ctrl 'adaptive' needs a kl_target")
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be positive, got {target} and {horizon}")
        self.coef = float(coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float | Tensor, n_samples: int) -> None:
        """Move coef up when the KL of the last batch (n_samples samples) exceeds the target."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * n_samples / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient; target and horizon stay as configured for this run."""
        self.coef = float(state["coef"])


def build_kl_controller(kind: str, *, coef: float, target: float | None = None,
                        horizon: int = 10000) -> KLController:
    """The controller `algorithm.kl_ctrl` names, registered or the user's."""
    return get_kl_controller(kind)(coef, target=target, horizon=horizon)
