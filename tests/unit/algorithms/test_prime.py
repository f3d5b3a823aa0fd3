"""PRIME's implicit rewards, cross-entropy and advantages against hand computations (plain Python)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    implicit_accuracy,
    implicit_sequence_rewards,
    implicit_token_rewards,
    outcome_cross_entropy,
)

# Five responses: prompt 0 has three (lengths 2, 3, 1); prompts 1 and 2 have one each (groups of one).
# Log-probs at padding are garbage (9, 7): they must not count.
LENGTHS = [2, 3, 1, 2, 3]
GROUP_IDS = [0, 0, 0, 1, 2]
GROUPS = {0: [0, 1, 2], 1: [3], 2: [4]}
R = 3
PRM = [[-1.0, -2.0, 9.0], [-0.5, -1.5, -0.25], [-3.0, 9.0, 9.0], [-1.0, -1.0, 9.0], [-0.1, -0.2, -0.3]]
REF = [[-1.5, -1.0, 9.0], [-0.5, -2.5, -1.25], [-2.0, 7.0, 7.0], [-2.0, -0.5, 7.0], [-0.2, -0.2, -0.2]]
OUTCOMES = [1.0, 0.0, 1.0, 1.0, 0.0]
BETA = 0.5


def mask_BR() -> torch.Tensor:
    return torch.tensor([[1.0] * n + [0.0] * (R - n) for n in LENGTHS])


def hand_token_rewards() -> list[list[float]]:
    return [[BETA * (PRM[i][t] - REF[i][t]) for t in range(n)] for i, n in enumerate(LENGTHS)]


def test_token_and_sequence_rewards_by_hand():
    rewards = implicit_token_rewards(torch.tensor(PRM), torch.tensor(REF), mask_BR(), BETA)
    # Row 0: 0.5 * (-1 + 1.5) = 0.25, 0.5 * (-2 + 1) = -0.5, padding 0.
    assert rewards[0].tolist() == [0.25, -0.5, 0.0]
    expected = [row + [0.0] * (R - len(row)) for row in hand_token_rewards()]
    assert torch.allclose(rewards, torch.tensor(expected))
    sequence = implicit_sequence_rewards(torch.tensor(PRM), torch.tensor(REF), mask_BR(), BETA)
    assert torch.allclose(sequence, torch.tensor([sum(row) for row in hand_token_rewards()]))


def test_cross_entropy_and_accuracy_by_hand():
    rewards = torch.tensor([2.0, -1.0, 0.0, 0.5])
    labels = torch.tensor([1.0, 1.0, 0.0, 0.0])
    sigmoid = [1 / (1 + math.exp(-r)) for r in rewards.tolist()]
    expected = [-math.log(sigmoid[0]), -math.log(sigmoid[1]), -math.log(1 - sigmoid[2]), -math.log(1 - sigmoid[3])]
    assert torch.allclose(outcome_cross_entropy(rewards, labels), torch.tensor(expected))
    # Right, wrong, a tie (half), wrong.
    assert implicit_accuracy(rewards, labels).tolist() == [1.0, 0.0, 0.5, 0.0]


def token_rewards_BR() -> torch.Tensor:
    """The outcome at the last valid token, garbage (7) at padding."""
    return torch.tensor([[0.0] * (n - 1) + [o] + [7.0] * (R - n) for n, o in zip(LENGTHS, OUTCOMES)])


def hand_advantages(gamma: float, outcome_weight: float, process_weight: float) -> list[list[float]]:
    rewards = hand_token_rewards()
    means = [sum(row) / len(row) for row in rewards]
    advantages = []
    for i, n in enumerate(LENGTHS):
        others = [j for j in GROUPS[GROUP_IDS[i]] if j != i]
        if not others:
            advantages.append([0.0] * n)
            continue
        process_baseline = sum(means[j] for j in others) / len(others)
        outcome_advantage = OUTCOMES[i] - sum(OUTCOMES[j] for j in others) / len(others)
        row = []
        for t in range(n):
            process_return = sum(gamma ** (s - t) * (rewards[i][s] - process_baseline) for s in range(t, n))
            row.append(process_weight * process_return + outcome_weight * outcome_advantage)
        advantages.append(row)
    return [row + [0.0] * (R - len(row)) for row in advantages]


@pytest.mark.parametrize("gamma,outcome_weight,process_weight", [(1.0, 1.0, 1.0), (0.9, 2.0, 0.5)])
def test_prime_advantages_by_hand(gamma, outcome_weight, process_weight):
    process = implicit_token_rewards(torch.tensor(PRM), torch.tensor(REF), mask_BR(), BETA)
    advantages, returns = ADVANTAGE_ESTIMATORS.get("prime")(AdvantageInputs(
        token_rewards_BR=token_rewards_BR(), mask_BR=mask_BR(), group_ids_B=torch.tensor(GROUP_IDS),
        process_rewards_BR=process, gamma=gamma, outcome_weight=outcome_weight, process_weight=process_weight))
    expected = torch.tensor(hand_advantages(gamma, outcome_weight, process_weight))
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.equal(returns, advantages)
    # One number by hand (gamma 1, weights 1): response 2 (one token, reward 0.5 * (-3 + 2) = -0.5) against
    # the mean token rewards of responses 0 (-0.125) and 1 (0.5 * (0 + 1 + 1) / 3 = 1/3), and outcomes 1, 0.
    if gamma == 1.0:
        assert advantages[2, 0].item() == pytest.approx((-0.5 - (-0.125 + 1 / 3) / 2) + (1.0 - 0.5))


def test_prime_without_process_rewards_is_named():
    with pytest.raises(ValueError, match="process_rewards_BR"):
        ADVANTAGE_ESTIMATORS.get("prime")(AdvantageInputs(
            token_rewards_BR=token_rewards_BR(), mask_BR=mask_BR(), group_ids_B=torch.tensor(GROUP_IDS)))
