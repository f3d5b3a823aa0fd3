"""Clipped value loss against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms.value_loss import clipped_value_loss


def test_clipped_value_loss_by_hand():
    # Sequence 0 (3 tokens), sequence 1 (1 token + padding), clip range 0.2.
    values_BR = torch.tensor([[1.5, 1.1, 0.5], [0.5, 7.0, 7.0]])
    old_values_BR = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    returns_BR = torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    mask_BR = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss_BR, metrics = clipped_value_loss(values_BR, old_values_BR, returns_BR, mask_BR, clip_range=0.2)
    # v=1.5 -> clip 1.2: max(0.5^2, 0.8^2) = 0.64 (clipped); v=1.1 inside: 1.21;
    # v=0.5 -> clip 0.8, R=0: max(0.25, 0.64) = 0.64 (clipped); v=0.5 -> 0.8, R=1: max(0.25, 0.04) = 0.25.
    torch.testing.assert_close(loss_BR[0], torch.tensor([0.5 * 0.64, 0.5 * 1.21, 0.5 * 0.64]))
    assert loss_BR[1, 0].item() == pytest.approx(0.125)
    assert metrics["clipfrac"].item() == pytest.approx(2 / 4)
