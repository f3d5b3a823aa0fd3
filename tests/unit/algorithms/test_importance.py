"""Train/rollout mismatch metrics against hand values (the corrections: test_rollout_correction.py)."""

from __future__ import annotations

import math

import torch

from megarl.algorithms.importance import rollout_mismatch_tokens

ROLLOUT_BR = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -3.0, 0.0]])
DIFFS = [[0.1, -0.2, 1.5], [0.05, 40.0, 0.0]]  # train - rollout; [1, 1] and [1, 2] are padding
MASK_BR = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
TRAIN_BR = ROLLOUT_BR + torch.tensor(DIFFS)


def test_rollout_mismatch_tokens_by_hand():
    tokens = rollout_mismatch_tokens(TRAIN_BR, ROLLOUT_BR, MASK_BR)
    valid = [0.1, -0.2, 1.5, 0.05]
    torch.testing.assert_close(tokens["abs_diff"], torch.tensor([abs(d) for d in valid]), rtol=1e-5, atol=1e-6)
    # KL(rollout || train) with k3: r = pi_train / pi_rollout = exp(d), k3 = r - 1 - log r.
    torch.testing.assert_close(tokens["kl"], torch.tensor([math.exp(d) - 1 - d for d in valid]), rtol=1e-4, atol=1e-6)
