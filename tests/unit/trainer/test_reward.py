"""The reward phase's steps, on real tensors against hand values: the overlong penalty lands on the sequences
that run into the buffer."""

from __future__ import annotations

import torch

from megarl.trainer.reward import sequence_rewards


def test_overlong_penalty_lands_on_the_long_sequences():
    # max 8, buffer 2: lengths up to 6 are free, 7 loses half the factor, 8 all of it.
    scores_B, lengths_B = torch.tensor([1.0, 0.0, 1.0, 0.25]), torch.tensor([8, 3, 7, 6])
    shaped = sequence_rewards(scores_B, lengths_B, max_response_length=8, overlong_buffer_length=2,
                              overlong_penalty_factor=0.5)
    torch.testing.assert_close(shaped, torch.tensor([0.5, 0.0, 0.75, 0.25]), rtol=0, atol=1e-7)
    assert sequence_rewards(scores_B, lengths_B, 8, 0, 0.5) is scores_B  # no buffer, no shaping
