"""Measuring the mismatch between the rollout engine and the trainer.

The rollout engine (e.g. vLLM, other kernels and precision) samples from pi_rollout while the loss
is computed with pi_train; `megarl.algorithms.rollout_correction` corrects for it. Mismatch metrics
over valid tokens:
    mismatch/logprob_abs_diff_mean   mean |train_t - rollout_t|
    mismatch/logprob_abs_diff_max    max  |train_t - rollout_t|
    mismatch/kl                      mean k3(rollout_t, train_t), an estimate of
                                     KL(pi_rollout || pi_train) from the rollout's own samples
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.algorithms.kl import k3


@torch.no_grad()
def rollout_mismatch_tokens(
    train_logprobs_BR: Tensor, rollout_logprobs_BR: Tensor, mask_BR: Tensor
) -> dict[str, Tensor]:
    """|train_t - rollout_t| and k3(rollout_t, train_t) at the valid tokens, flattened: the per-token
    values the metrics above average (over all DP ranks' tokens, in `megarl.trainer.metrics`)."""
    valid_BR = mask_BR > 0
    return {"abs_diff": (train_logprobs_BR - rollout_logprobs_BR).abs()[valid_BR],
            "kl": k3(rollout_logprobs_BR, train_logprobs_BR)[valid_BR]}
