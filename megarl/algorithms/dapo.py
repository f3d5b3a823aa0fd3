"""DAPO pieces outside the loss (Yu et al. 2025): dynamic sampling and soft overlong punishment.

Dynamic sampling keeps only prompts whose responses disagree: a group whose scores are all equal
(all correct or all wrong) has zero group-relative advantage and gives no gradient. A group of one
response is therefore dropped too (verl's DAPO keeps it; it has no group-relative signal).

Soft overlong punishment, with L the response length, L_max = max_response_length and
L_cache = buffer_length:

    penalty(L) = 0                                          if L <= L_max - L_cache
               = -factor * (L - (L_max - L_cache)) / L_cache  if L_max - L_cache < L <= L_max
               = -factor                                    if L > L_max
"""

from __future__ import annotations

import torch
from torch import Tensor


def keep_informative_groups(scores_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """Bool mask of the samples whose group has at least two distinct scores."""
    _, group_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = int(group_B.max()) + 1 if group_B.numel() else 0
    scores_B = scores_B.float()
    max_G = scores_B.new_full((num_groups,), float("-inf")).scatter_reduce(0, group_B, scores_B, "amax")
    min_G = scores_B.new_full((num_groups,), float("inf")).scatter_reduce(0, group_B, scores_B, "amin")
    return (max_G > min_G)[group_B]


def overlong_penalty(
    response_lengths_B: Tensor, max_response_length: int, buffer_length: int, penalty_factor: float
) -> Tensor:
    """Non-positive reward to add to each sample's score (see the module docstring)."""
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length must be in (0, max_response_length={max_response_length}], got {buffer_length}"
        )
    excess_B = response_lengths_B.float() - (max_response_length - buffer_length)
    return -penalty_factor * (excess_B / buffer_length).clamp(0.0, 1.0)
