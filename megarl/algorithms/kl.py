"""KL estimators, KL coefficient controllers, and the KL penalty in the reward.

Per-token estimators of KL(pi || pi_ref) from samples of pi, with d_t = logp_t - ref_t:

    k1  d_t                                   unbiased, high variance, can be negative
    k2  0.5 d_t^2                             biased, low variance (the "mse" estimator)
    k3  exp(-d_t) - (-d_t) - 1                the "low-variance" estimator (Schulman's k3, verl's
                                              low_var_kl): unbiased, always >= 0. As in verl, -d_t is
                                              clamped to [-20, 20] before exp and the result to [-10, 10].

Controllers hold the coefficient beta. The adaptive one follows Ziegler et al. (2019):
    error = clip(current_kl / target - 1, -0.2, 0.2);   beta <- beta * (1 + error * num_steps / horizon)

KL in the reward: r'_t = r_t - beta * k(logp_t, ref_t) * m_t, with logp the rollout-time (old)
policy; the reported KL is the mean over sequences of each sequence's token mean.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from megarl.algorithms.aggregation import masked_mean
from megarl.registry import Registry

KL_ESTIMATORS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def k1(logprobs_BR: Tensor, ref_logprobs_BR: Tensor) -> Tensor:
    return logprobs_BR - ref_logprobs_BR


@KL_ESTIMATORS.register("k2")
def k2(logprobs_BR: Tensor, ref_logprobs_BR: Tensor) -> Tensor:
    return 0.5 * (logprobs_BR - ref_logprobs_BR) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logprobs_BR: Tensor, ref_logprobs_BR: Tensor) -> Tensor:
    log_ratio_BR = (ref_logprobs_BR - logprobs_BR).clamp(-20.0, 20.0)
    return (log_ratio_BR.exp() - log_ratio_BR - 1).clamp(-10.0, 10.0)


class FixedKLController:
    """A constant coefficient; `update` does nothing."""

    def __init__(self, coef: float):
        self.value = coef

    def update(self, current_kl: float, num_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Moves the coefficient so that the measured KL tracks `target` (Ziegler et al. 2019)."""

    def __init__(self, init_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be positive, got target={target}, horizon={horizon}")
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, num_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * num_steps / self.horizon


@torch.no_grad()
def kl_penalty_rewards(
    token_rewards_BR: Tensor,
    logprobs_BR: Tensor,
    ref_logprobs_BR: Tensor,
    mask_BR: Tensor,
    coef: float,
    estimator: str,
) -> tuple[Tensor, float]:
    """Token rewards minus coef * KL at valid tokens, and the mean KL (sequence mean of token means)."""
    kl_BR = KL_ESTIMATORS.get(estimator)(logprobs_BR, ref_logprobs_BR) * mask_BR
    mean_kl = masked_mean(kl_BR, mask_BR, dim=-1).mean().item()
    return token_rewards_BR - coef * kl_BR, mean_kl
