"""The on-policy distillation estimator against a hand computation."""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs

# Two responses to one prompt (lengths 3 and 2); garbage (9, 7, 5) at the padding.
STUDENT_BR = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 9.0]])
TEACHER_BR = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -2.0, 7.0]])
MASK_BR = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
TOKEN_REWARDS_BR = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 5.0]])  # outcomes 1 and 0


def _opd(weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ADVANTAGE_ESTIMATORS.get("opd")(AdvantageInputs(
        token_rewards_BR=TOKEN_REWARDS_BR, mask_BR=MASK_BR, group_ids_B=torch.tensor([0, 0]),
        student_logprobs_BR=STUDENT_BR, teacher_logprobs_BR=TEACHER_BR, task_reward_weight=weight))


def test_opd_advantage_is_the_negative_reverse_kl_per_token():
    # -(student - teacher): -(-1 + 1.5), -(-2 + 1), -(-0.5 + 0.5); -(-0.3 + 0.1), -(-1.2 + 2), padding 0.
    expected = torch.tensor([[-0.5, 1.0, 0.0], [0.2, -0.8, 0.0]])
    advantages, returns = _opd(0.0)
    assert torch.allclose(advantages, expected, atol=1e-6) and torch.allclose(returns, expected, atol=1e-6)


def test_opd_adds_the_weighted_task_advantage():
    # Outcomes 1 and 0, group mean 0.5: task advantages +0.5 and -0.5 on every valid token, times 0.5.
    expected = torch.tensor([[-0.25, 1.25, 0.25], [-0.05, -1.05, 0.0]])
    advantages, _ = _opd(0.5)
    assert torch.allclose(advantages, expected, atol=1e-6)


def test_opd_without_a_teacher_says_what_is_missing():
    with pytest.raises(ValueError, match="teacher_logprobs_BR"):
        ADVANTAGE_ESTIMATORS.get("opd")(AdvantageInputs(
            token_rewards_BR=TOKEN_REWARDS_BR, mask_BR=MASK_BR, group_ids_B=torch.tensor([0, 0])))
