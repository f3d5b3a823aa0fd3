"""The reward phase's pure steps from scored rollouts to the batch's sequence rewards: the overlong penalty
and the reward's named components. Plain tensors, so that their effect on a batch is testable without a
launch. (A reward model's score is its engine's `last_values`.)
"""

from __future__ import annotations

import torch

from megarl.algorithms import overlong_penalty
from megarl.rewards.manager import RewardFunctionError


def sequence_rewards(scores_B: torch.Tensor, response_lengths_B: torch.Tensor, max_response_length: int,
                     overlong_buffer_length: int, overlong_penalty_factor: float) -> torch.Tensor:
    """The scores with DAPO's soft overlong penalty added (no penalty when the buffer is 0). (B,)"""
    if not overlong_buffer_length:
        return scores_B
    return scores_B + overlong_penalty(response_lengths_B, max_response_length, overlong_buffer_length,
                                       overlong_penalty_factor)


def reward_components(score_extras: dict[str, list[float]], names: list[str]) -> torch.Tensor | None:
    """The named components of each sequence's reward (`algorithm.reward_components`), (B, K) in the order
    named; None when none are named. A response whose reward call failed or left a component out counts 0
    for it, as a failed call's score does."""
    if not names:
        return None
    missing = [name for name in names if name not in score_extras]
    if missing:
        raise RewardFunctionError(f"the reward function returned no {missing[0]!r} (algorithm.reward_components) for "
                                  f"any response of the step; its numeric keys beside 'score': {sorted(score_extras)}")
    return torch.tensor([score_extras[name] for name in names], dtype=torch.float32).T.nan_to_num(0.0)
