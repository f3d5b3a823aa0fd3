"""The reward phase's pure steps from scored rollouts to the batch's sequence rewards: the reward model's
score and the overlong penalty. Plain tensors, so that their effect on a batch is testable without a launch.
"""

from __future__ import annotations

import torch

from megarl.algorithms import overlong_penalty


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
