"""KL estimators, controllers and the KL-in-reward penalty against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty_rewards,
)

LOGPROBS_BR = torch.tensor([[-1.0, -0.5], [-2.0, -0.1]])
REF_BR = torch.tensor([[-1.2, -0.5], [-1.0, -0.4]])
DIFFS = [[0.2, 0.0], [-1.0, 0.3]]  # logp - ref


def hand(estimator: str, d: float) -> float:
    return {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[estimator]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_estimators_by_hand(estimator):
    expected = torch.tensor([[hand(estimator, d) for d in row] for row in DIFFS])
    torch.testing.assert_close(KL_ESTIMATORS.get(estimator)(LOGPROBS_BR, REF_BR), expected)


def test_registered_estimators():
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    with pytest.raises(ValueError, match="k1, k2, k3"):
        KL_ESTIMATORS.get("low_var_kl")


def test_k3_is_clamped_like_verl():
    # ref - logp = 30 is clamped to 20 before exp; the result exp(20) - 21 is clamped to 10.
    assert KL_ESTIMATORS.get("k3")(torch.tensor([-30.0]), torch.tensor([0.0])).item() == 10.0
    # ref - logp = -30 -> clamp -20: exp(-20) + 20 - 1 ~ 19 -> 10.
    assert KL_ESTIMATORS.get("k3")(torch.tensor([0.0]), torch.tensor([-30.0])).item() == 10.0


def test_fixed_controller_never_moves():
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, num_steps=256)
    assert controller.value == 0.05


def test_adaptive_controller_by_hand():
    controller = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    controller.update(current_kl=6.6, num_steps=256)  # error 0.1 -> x (1 + 0.1 * 0.0256)
    assert controller.value == pytest.approx(0.1 * 1.00256)
    controller.update(current_kl=9.0, num_steps=256)  # error 0.5 clipped to 0.2 -> x 1.00512
    assert controller.value == pytest.approx(0.1 * 1.00256 * 1.00512)
    controller.update(current_kl=1.0, num_steps=100)  # error -5/6 clipped to -0.2 -> x 0.998
    assert controller.value == pytest.approx(0.1 * 1.00256 * 1.00512 * 0.998)


def test_adaptive_controller_rejects_non_positive_target():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(init_coef=0.1, target=0.0, horizon=10)


def test_kl_penalty_rewards_by_hand():
    rewards_BR = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    mask_BR = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # sequence 1 has one token
    penalised_BR, mean_kl = kl_penalty_rewards(rewards_BR, LOGPROBS_BR, REF_BR, mask_BR, coef=0.5, estimator="k1")
    expected = torch.tensor([[0.0 - 0.5 * 0.2, 1.0 - 0.0], [0.5 - 0.5 * -1.0, 0.0]])
    torch.testing.assert_close(penalised_BR, expected)
    # Sequence means 0.1 and -1.0, then their mean.
    assert mean_kl == pytest.approx((0.1 + -1.0) / 2)
