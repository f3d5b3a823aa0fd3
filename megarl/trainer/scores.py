"""The trainer's pure steps from scored rollouts to the batch's sequence rewards: DAPO's group
filtering, the reward model's score, and the overlong penalty. Plain tensors and lists, so that
their effect on a batch is testable without a launch.
"""

from __future__ import annotations

import torch

from megarl.algorithms import keep_informative_groups, overlong_penalty
from megarl.trainer.rollouts import Rollouts


def informative(rollouts: Rollouts) -> Rollouts:
    """The sequences of the groups whose function scores differ (DAPO's dynamic sampling)."""
    keep = keep_informative_groups(torch.tensor(rollouts.scores), torch.tensor(rollouts.group_ids))
    return rollouts.select([i for i, k in enumerate(keep.tolist()) if k])


def first_groups(rollouts: Rollouts, num_groups: int) -> Rollouts:
    """The sequences of the `num_groups` lowest group ids (the groups collected first)."""
    keep = set(sorted(set(rollouts.group_ids))[:num_groups])
    return rollouts.select([i for i, g in enumerate(rollouts.group_ids) if g in keep])


def reward_model_scores(values_BR: torch.Tensor, response_lengths_B: torch.Tensor) -> torch.Tensor:
    """A reward model's score of each sequence: its value at the last response token. (B,)"""
    last_B = (response_lengths_B - 1).clamp(min=0)
    return values_BR.gather(1, last_B[:, None]).squeeze(1)


def sequence_rewards(scores_B: torch.Tensor, response_lengths_B: torch.Tensor, max_response_length: int,
                     overlong_buffer_length: int, overlong_penalty_factor: float) -> torch.Tensor:
    """The scores with DAPO's soft overlong penalty added (no penalty when the buffer is 0). (B,)"""
    if not overlong_buffer_length:
        return scores_B
    return scores_B + overlong_penalty(response_lengths_B, max_response_length, overlong_buffer_length,
                                       overlong_penalty_factor)
