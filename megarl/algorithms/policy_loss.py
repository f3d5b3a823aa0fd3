"""Policy losses: fn(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, params, weights_BR)
-> (per_token_loss_BR, metrics). The caller reduces the loss with `aggregate`.

vanilla (PPO clipped surrogate, with dual clip):
    r_t  = exp(logp_t - old_t)
    pg_t = max(-A_t r_t, -A_t clip(r_t, 1 - low, 1 + high))      (low < high gives DAPO clip-higher)
    pg_t = min(pg_t, -A_t c)  where A_t < 0                       (dual clip, c = clip_ratio_c > 1)

gspo (Group Sequence Policy Optimization): one ratio per sequence, the geometric mean of the
token ratios, s_i = exp(mean_t (logp_it - old_it)) over valid tokens. Each token uses
    r_it = sg[s_i] * exp(logp_it - sg[logp_it])
whose value is s_i and whose gradient is s_i * grad logp_it, so with `seq-mean-token-mean`
aggregation the gradient is the paper's s_i * (1/|y_i|) sum_t grad logp_it. It is then clipped as
above with (typically tiny) ranges such as low=3e-4, high=4e-4. Dual clip applies as in vanilla;
set clip_ratio_c=None for the paper's loss.

Optional `weights_BR` (truncated importance weights, see importance.py) multiply the per-token
loss; they carry no gradient. Log ratios are clamped to [-20, 20] before exp (as verl) so that a
far off-policy token yields a large, finite loss instead of inf.

Metrics (detached scalars over valid tokens): `clipfrac` (the clipped term was the larger),
`clipfrac_lower` (the dual clip bound was used), `approx_kl` (mean of old - logp, i.e. k1 of the
old policy against the current one on old-policy samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from megarl.algorithms.aggregation import masked_mean
from megarl.registry import Registry

MAX_LOG_RATIO = 20.0


@dataclass
class PolicyLossParams:
    clip_ratio_low: float = 0.2
    """Ratios below 1 - clip_ratio_low are clipped."""
    clip_ratio_high: float = 0.2
    """Ratios above 1 + clip_ratio_high are clipped (DAPO clip-higher: larger than low)."""
    clip_ratio_c: float | None = 3.0
    """Dual clip: the loss of a negative-advantage token is at most -A * clip_ratio_c; None disables."""


PolicyLoss = Callable[
    [Tensor, Tensor, Tensor, Tensor, PolicyLossParams, Tensor | None], tuple[Tensor, dict[str, Tensor]]
]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _clipped_surrogate(
    ratio_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    unclipped_BR = -advantages_BR * ratio_BR
    clipped_BR = -advantages_BR * ratio_BR.clamp(1 - params.clip_ratio_low, 1 + params.clip_ratio_high)
    loss_BR = torch.maximum(unclipped_BR, clipped_BR)
    metrics = {"clipfrac": masked_mean((clipped_BR > unclipped_BR).float(), mask_BR).detach()}
    if params.clip_ratio_c is not None:
        if params.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (or None to disable dual clip), got {params.clip_ratio_c}")
        bound_BR = -advantages_BR * params.clip_ratio_c
        negative_BR = advantages_BR < 0
        metrics["clipfrac_lower"] = masked_mean(((loss_BR > bound_BR) & negative_BR).float(), mask_BR).detach()
        loss_BR = torch.where(negative_BR, torch.minimum(loss_BR, bound_BR), loss_BR)
    else:
        metrics["clipfrac_lower"] = torch.zeros((), device=loss_BR.device)
    if weights_BR is not None:
        loss_BR = loss_BR * weights_BR.detach()
    return loss_BR, metrics


@POLICY_LOSSES.register("vanilla")
def vanilla(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    log_ratio_BR = (logprobs_BR - old_logprobs_BR).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    loss_BR, metrics = _clipped_surrogate(log_ratio_BR.exp(), advantages_BR, mask_BR, params, weights_BR)
    metrics["approx_kl"] = masked_mean(-log_ratio_BR, mask_BR).detach()
    return loss_BR, metrics


@POLICY_LOSSES.register("gspo")
def gspo(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    log_ratio_BR = logprobs_BR - old_logprobs_BR
    sequence_log_ratio_B = masked_mean(log_ratio_BR, mask_BR, dim=-1)
    # Value: the sequence log ratio; gradient: that of logp_t alone (the paper's token-level form).
    token_log_ratio_BR = sequence_log_ratio_B.detach().unsqueeze(-1) + logprobs_BR - logprobs_BR.detach()
    ratio_BR = token_log_ratio_BR.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    loss_BR, metrics = _clipped_surrogate(ratio_BR, advantages_BR, mask_BR, params, weights_BR)
    metrics["approx_kl"] = masked_mean(-log_ratio_BR, mask_BR).detach()
    return loss_BR, metrics
