"""Clipped value loss (PPO critic).

    v_clip_t = clip(v_t, old_t - c, old_t + c)
    L_t      = 0.5 * max((v_t - R_t)^2, (v_clip_t - R_t)^2)

with v the current values, old the values at rollout time, R the GAE returns and c = clip_range.
The caller reduces L with `aggregate`. Metric `clipfrac`: fraction of valid tokens where the
clipped error was the larger one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.algorithms.aggregation import masked_mean


def clipped_value_loss(
    values_BR: Tensor,
    old_values_BR: Tensor,
    returns_BR: Tensor,
    mask_BR: Tensor,
    clip_range: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    clipped_values_BR = torch.clamp(values_BR, old_values_BR - clip_range, old_values_BR + clip_range)
    unclipped_error_BR = (values_BR - returns_BR) ** 2
    clipped_error_BR = (clipped_values_BR - returns_BR) ** 2
    loss_BR = 0.5 * torch.maximum(unclipped_error_BR, clipped_error_BR)
    clipfrac = masked_mean((clipped_error_BR > unclipped_error_BR).float(), mask_BR).detach()
    return loss_BR, {"clipfrac": clipfrac}
