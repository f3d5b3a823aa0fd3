"""Advantage estimators against hand computations and plain-Python reference loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarl.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs

# Six responses: prompt "a" has two (lengths 3, 1), prompt "b" three (lengths 2, 3, 1), prompt "c" one.
LENGTHS = [3, 1, 2, 3, 1, 2]
UIDS = ["a", "a", "b", "b", "b", "c"]
GROUP_IDS = [0, 0, 1, 1, 1, 2]  # UIDS numbered by first appearance
OUTCOMES = [1.0, 0.0, 1.0, 0.0, 0.0, 0.5]
R = 3


def mask_BR() -> torch.Tensor:
    return torch.tensor([[1.0] * n + [0.0] * (R - n) for n in LENGTHS])


def token_rewards_BR(penalty: float = 0.0) -> torch.Tensor:
    """Outcome at the last valid token, `penalty` at every other valid token, garbage (5) at padding."""
    rows = []
    for n, outcome in zip(LENGTHS, OUTCOMES):
        rows.append([penalty] * (n - 1) + [outcome] + [5.0] * (R - n))
    return torch.tensor(rows)


def hand_scores(penalty: float) -> list[float]:
    return [outcome + penalty * (n - 1) for n, outcome in zip(LENGTHS, OUTCOMES)]


def inputs(**overrides) -> AdvantageInputs:
    fields = dict(
        token_rewards_BR=token_rewards_BR(penalty=-0.1),
        mask_BR=mask_BR(),
        group_ids_B=torch.tensor(GROUP_IDS),
    )
    return AdvantageInputs(**{**fields, **overrides})


def broadcast(per_sequence: list[float]) -> torch.Tensor:
    return torch.tensor([[a] * n + [0.0] * (R - n) for a, n in zip(per_sequence, LENGTHS)])


def python_whiten(rows: list[list[float]]) -> list[list[float]]:
    """(x - mean) / sqrt(unbiased var + 1e-8) over the valid tokens of all rows."""
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    variance = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(variance + 1e-8) for x in row] for row in rows]


def padded(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([row + [0.0] * (R - len(row)) for row in rows])


def test_grpo_groups_of_one_two_and_three():
    advantages_BR, returns_BR = ADVANTAGE_ESTIMATORS.get("grpo")(inputs())
    scores = hand_scores(-0.1)  # [0.8, 0.0, 0.9, -0.2, 0.0, 0.4]
    expected = []
    for i, uid in enumerate(UIDS):
        group = [scores[j] for j in range(len(UIDS)) if UIDS[j] == uid]
        mean, std = (statistics.mean(group), statistics.stdev(group)) if len(group) > 1 else (0.0, 1.0)
        expected.append((scores[i] - mean) / (std + 1e-6))
    torch.testing.assert_close(advantages_BR, broadcast(expected))
    torch.testing.assert_close(returns_BR, advantages_BR)


def test_grpo_by_hand_without_penalty():
    advantages_BR, _ = ADVANTAGE_ESTIMATORS.get("grpo")(inputs(token_rewards_BR=token_rewards_BR()))
    # Group a: scores 1, 0 -> mean 0.5, std sqrt(0.5); group b: 1, 0, 0 -> mean 1/3, std sqrt(1/3);
    # group c: a single 0.5 -> (0.5 - 0) / (1 + eps).
    a, b = 0.5 / math.sqrt(0.5), 1 / math.sqrt(1 / 3)
    expected = [a, -a, (2 / 3) * b, (-1 / 3) * b, (-1 / 3) * b, 0.5]
    torch.testing.assert_close(advantages_BR, broadcast(expected), atol=1e-5, rtol=1e-5)


def test_drgrpo_and_grpo_without_std():
    expected = [1.0 - 0.5, 0.0 - 0.5, 1.0 - 1 / 3, -1 / 3, -1 / 3, 0.5]
    no_penalty = inputs(token_rewards_BR=token_rewards_BR())
    drgrpo_BR, returns_BR = ADVANTAGE_ESTIMATORS.get("drgrpo")(no_penalty)
    torch.testing.assert_close(drgrpo_BR, broadcast(expected))
    torch.testing.assert_close(returns_BR, drgrpo_BR)
    no_penalty.norm_by_std = False
    grpo_BR, _ = ADVANTAGE_ESTIMATORS.get("grpo")(no_penalty)
    torch.testing.assert_close(grpo_BR, broadcast(expected))


def test_rloo_leaves_one_out():
    advantages_BR, returns_BR = ADVANTAGE_ESTIMATORS.get("rloo")(inputs(token_rewards_BR=token_rewards_BR()))
    # Group a: 1 - 0, 0 - 1; group b: 1 - (0+0)/2, 0 - (1+0)/2 twice; group c alone: 0.
    torch.testing.assert_close(advantages_BR, broadcast([1.0, -1.0, 1.0, -0.5, -0.5, 0.0]))
    torch.testing.assert_close(returns_BR, advantages_BR)


def test_gae_two_tokens_by_hand():
    one = AdvantageInputs(
        token_rewards_BR=torch.tensor([[0.0, 1.0, 0.0]]),
        mask_BR=torch.tensor([[1.0, 1.0, 0.0]]),
        group_ids_B=torch.tensor([0]),
        values_BR=torch.tensor([[0.5, 0.2, 100.0]]),
    )
    advantages_BR, returns_BR = ADVANTAGE_ESTIMATORS.get("gae")(one)
    # delta_1 = 1 + 0 - 0.2 = 0.8 = A_1; delta_0 = 0 + 0.2 - 0.5 = -0.3, A_0 = -0.3 + 0.8 = 0.5.
    # Returns A + V = [1, 1]; whitening [0.5, 0.8]: mean 0.65, unbiased std sqrt(0.045).
    torch.testing.assert_close(returns_BR, torch.tensor([[1.0, 1.0, 0.0]]))
    std = math.sqrt(0.045 + 1e-8)
    torch.testing.assert_close(advantages_BR, torch.tensor([[-0.15 / std, 0.15 / std, 0.0]]))


def test_gae_against_python_loop():
    gamma, lam = 0.9, 0.8
    values_BR = torch.tensor([[0.3, -0.2, 0.7], [0.1, 9.0, 9.0], [0.4, 0.6, 9.0],
                              [0.0, 0.5, -0.5], [1.0, 9.0, 9.0], [0.2, 0.2, 9.0]])
    advantages_BR, returns_BR = ADVANTAGE_ESTIMATORS.get("gae")(inputs(values_BR=values_BR, gamma=gamma, lam=lam))
    raw, returns = [], []
    for i, n in enumerate(LENGTHS):
        rewards, values = token_rewards_BR(-0.1)[i, :n].tolist(), values_BR[i, :n].tolist()
        row, last = [0.0] * n, 0.0
        for t in reversed(range(n)):
            next_value = values[t + 1] if t + 1 < n else 0.0
            last = rewards[t] + gamma * next_value - values[t] + gamma * lam * last
            row[t] = last
        raw.append(row)
        returns.append([a + v for a, v in zip(row, values)])
    torch.testing.assert_close(returns_BR, padded(returns))
    torch.testing.assert_close(advantages_BR, padded(python_whiten(raw)))


def test_reinforce_plus_plus_against_python_loop():
    gamma = 0.5
    advantages_BR, returns_BR = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(inputs(gamma=gamma))
    returns = []
    for i, n in enumerate(LENGTHS):
        rewards = token_rewards_BR(-0.1)[i, :n].tolist()
        returns.append([sum(gamma ** (k - t) * rewards[k] for k in range(t, n)) for t in range(n)])
    # Sequence 0: rewards [-0.1, -0.1, 1] -> returns [0.1, 0.4, 1.0].
    assert returns[0] == pytest.approx([0.1, 0.4, 1.0])
    torch.testing.assert_close(returns_BR, padded(returns))
    torch.testing.assert_close(advantages_BR, padded(python_whiten(returns)))


def test_remax_subtracts_the_greedy_baseline():
    baseline_B = torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0, 0.0])
    advantages_BR, returns_BR = ADVANTAGE_ESTIMATORS.get("remax")(inputs(baseline_rewards_B=baseline_B))
    scores = hand_scores(-0.1)
    expected = [s - b for s, b in zip(scores, [0.5, 0.5, 1.0, 1.0, 1.0, 0.0])]
    torch.testing.assert_close(advantages_BR, broadcast(expected))
    torch.testing.assert_close(returns_BR, advantages_BR)


def test_missing_inputs_are_named():
    with pytest.raises(ValueError, match="values_BR"):
        ADVANTAGE_ESTIMATORS.get("gae")(inputs())
    with pytest.raises(ValueError, match="baseline_rewards_B"):
        ADVANTAGE_ESTIMATORS.get("remax")(inputs())


def test_unknown_estimator_lists_the_registered_ones():
    with pytest.raises(ValueError) as error:
        ADVANTAGE_ESTIMATORS.get("ppo")
    for name in ["drgrpo", "gae", "grpo", "reinforce_plus_plus", "remax", "rloo"]:
        assert name in str(error.value)


def test_estimators_carry_no_gradient():
    rewards_BR = token_rewards_BR().requires_grad_()
    advantages_BR, _ = ADVANTAGE_ESTIMATORS.get("grpo")(inputs(token_rewards_BR=rewards_BR))
    assert not advantages_BR.requires_grad
