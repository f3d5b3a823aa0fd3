"""Loss aggregation modes against hand sums, and micro-batch contributions adding up to the whole."""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms.aggregation import LOSS_AGGREGATIONS, aggregate, masked_mean

# Three responses of lengths 3, 1, 2; the 9s are padding and must never count.
LOSS_BR = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 6.0, 9.0]])
MASK_BR = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])

HAND = {
    "token-mean": (1 + 2 + 3 + 4 + 5 + 6) / 6,
    "seq-mean-token-sum": ((1 + 2 + 3) + 4 + (5 + 6)) / 3,
    "seq-mean-token-mean": ((1 + 2 + 3) / 3 + 4 / 1 + (5 + 6) / 2) / 3,
    "seq-mean-token-sum-norm": (1 + 2 + 3 + 4 + 5 + 6) / (3 * 3),
}


@pytest.mark.parametrize("mode", sorted(HAND))
def test_modes_by_hand(mode):
    assert aggregate(LOSS_BR, MASK_BR, mode).item() == pytest.approx(HAND[mode])


def test_every_registered_mode_is_checked():
    assert LOSS_AGGREGATIONS.names() == sorted(HAND)


@pytest.mark.parametrize("mode", sorted(HAND))
def test_micro_batches_with_global_counts_add_up_to_the_whole(mode):
    # Micro-batch 1: sequence 0 alone; micro-batch 2: sequences 1 and 2, trimmed to their own length 2.
    counts = dict(num_tokens=6, num_sequences=3, max_response_length=3)
    first = aggregate(LOSS_BR[:1], MASK_BR[:1], mode, **counts)
    second = aggregate(LOSS_BR[1:, :2], MASK_BR[1:, :2], mode, **counts)
    assert (first + second).item() == pytest.approx(HAND[mode])


def test_global_counts_replace_local_ones():
    # token-mean over 6 local tokens but 12 global ones: half the local mean.
    assert aggregate(LOSS_BR, MASK_BR, "token-mean", num_tokens=12).item() == pytest.approx(21 / 12)
    # Dr. GRPO normalises by the configured maximum length, not the padded width.
    assert aggregate(LOSS_BR, MASK_BR, "seq-mean-token-sum-norm", max_response_length=10).item() == (
        pytest.approx(21 / 30)
    )


def test_empty_sequence_contributes_zero_to_seq_mean_token_mean():
    mask_BR = MASK_BR.clone()
    mask_BR[1] = 0.0
    expected = ((1 + 2 + 3) / 3 + 0.0 + (5 + 6) / 2) / 3
    assert aggregate(LOSS_BR, mask_BR, "seq-mean-token-mean").item() == pytest.approx(expected)


def test_unknown_mode_lists_the_registered_ones():
    with pytest.raises(ValueError) as error:
        aggregate(LOSS_BR, MASK_BR, "sum")
    for name in HAND:
        assert name in str(error.value)


def test_non_positive_count_is_rejected():
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(LOSS_BR, MASK_BR, "token-mean", num_tokens=0)


def test_masked_mean_by_hand():
    assert masked_mean(LOSS_BR, MASK_BR).item() == pytest.approx(21 / 6)
    torch.testing.assert_close(masked_mean(LOSS_BR, MASK_BR, dim=-1), torch.tensor([2.0, 4.0, 5.5]))
    assert masked_mean(LOSS_BR, torch.zeros_like(MASK_BR)).item() == 0.0
