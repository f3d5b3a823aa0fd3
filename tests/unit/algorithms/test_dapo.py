"""DAPO dynamic-sampling filter and soft overlong penalty against hand values."""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms.dapo import keep_informative_groups, overlong_penalty


def test_keep_informative_groups():
    # Group 4: mixed -> kept; group 1: all 1 -> dropped; group 9: single -> dropped; group 2: all 0.
    group_ids_B = torch.tensor([4, 4, 1, 1, 1, 9, 2, 2, 4])
    scores_B = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 1.0])
    keep_B = keep_informative_groups(scores_B, group_ids_B)
    assert keep_B.dtype == torch.bool
    assert keep_B.tolist() == [True, True, False, False, False, False, False, False, True]


def test_overlong_penalty_by_hand():
    # L_max 20, buffer 4: free up to 16, then -1/4 per token of excess, -1 from 20 on.
    lengths_B = torch.tensor([10, 16, 17, 18, 20, 25])
    penalty_B = overlong_penalty(lengths_B, max_response_length=20, buffer_length=4, penalty_factor=1.0)
    torch.testing.assert_close(penalty_B, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half_B = overlong_penalty(lengths_B, max_response_length=20, buffer_length=4, penalty_factor=0.5)
    torch.testing.assert_close(half_B, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))


def test_overlong_buffer_must_fit():
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([1]), max_response_length=4, buffer_length=8, penalty_factor=1.0)
