"""Policy losses: fn(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, params, weights_BR)
-> (per_token_loss_BR, metrics). The caller reduces the loss with `aggregate`, in any of its modes.

Notation: r_t = exp(logp_t - old_t) the token ratio, A_t the advantage, sg[.] stop-gradient, m the mask.
Each loss below is written as the per-token loss L_t that is minimised.

vanilla (PPO clipped surrogate, with dual clip; Schulman et al. 2017, arXiv:1707.06347):
    pg_t = max(-A_t r_t, -A_t clip(r_t, 1 - low, 1 + high))      (low < high gives DAPO clip-higher)
    pg_t = min(pg_t, -A_t c)  where A_t < 0                       (dual clip, c = clip_ratio_c > 1)

gspo (Group Sequence Policy Optimization; Zheng et al. 2025, arXiv:2507.18071): one ratio per
sequence, the geometric mean of the token ratios, s_i = exp(mean_t (logp_it - old_it)) over valid
tokens. Each token uses
    r_it = sg[s_i] * exp(logp_it - sg[logp_it])
whose value is s_i and whose gradient is s_i * grad logp_it, so with `seq-mean-token-mean`
aggregation the gradient is the paper's s_i * (1/|y_i|) sum_t grad logp_it. It is then clipped as
above with (typically tiny) ranges such as low=3e-4, high=4e-4. Dual clip applies as in vanilla;
set clip_ratio_c=None for the paper's loss.

cispo (Clipped IS-weight Policy Optimization; MiniMax-M1, MiniMax 2025, arXiv:2506.13585): REINFORCE
weighted by the clipped, stop-gradient ratio, so that no token ever loses its gradient:
    L_t = -sg[clip(r_t, 1 - low, 1 + high)] A_t logp_t
The paper sets no lower bound (clip_ratio_low >= 1) and tunes only the upper one; its aggregation is
token-mean.

sapo (Soft Adaptive Policy Optimization; Gao et al. 2025, arXiv:2511.20347): a smooth gate instead
of a hard clip,
    L_t = -f(r_t) A_t,   f(r) = (4 / tau) sigmoid(tau (r - 1)),   tau = tau_pos if A_t > 0 else tau_neg
so grad L_t = -4 s (1 - s) r_t A_t grad logp_t with s = sigmoid(tau (r_t - 1)): the plain policy
gradient on-policy (r = 1), decaying smoothly off it, faster for negative advantages (tau_neg > tau_pos).
The paper aggregates with seq-mean-token-mean.

gmpo (Geometric-Mean Policy Optimization; Zhao et al. 2025, arXiv:2507.20673; verl's `geo_mean`):
the geometric instead of the arithmetic mean of the token objectives, clipped token by token in log
space with PPO's pessimism (here clip_ratio_low/high bound the LOG ratio; the paper uses 0.4):
    l~_t = sgn(A) min(sgn(A) l_t, sgn(A) clip(l_t, -low, high)),   l_t = logp_t - old_t
    L_i  = -A_i exp(mean_t l~_it)                                  (one loss per sequence)
Spread over tokens as in gspo, L_it = -A_it exp(sg[mean_t l~_it] + l~_it - sg[l~_it]), so that
seq-mean-token-mean gives the paper's loss and gradient; A is the sequence's advantage (GRPO gives
each token its sequence's), taken per token otherwise.

dppo_tv, dppo_kl (Divergence PPO, binary approximations; Qi et al. 2026, arXiv:2602.04879): instead of
clipping the ratio, drop the tokens whose probability already moved out of a trust region in the
direction their advantage pushes, the region measured by the divergence between the two Bernoulli
distributions (p, 1 - p) of the sampled token, p = exp(logp_t), q = exp(old_t):
    TV: D_t = |p - q|            KL: D_t = q log(q / p) + (1 - q) log((1 - q) / (1 - p))
    M_t = 0  if A_t > 0, p > q, D_t > high   or   A_t < 0, p < q, D_t > low;   else 1
    L_t = -M_t A_t sg[min(r_t, c)] exp(logp_t - sg[logp_t])
whose value is -M_t A_t r_t (the paper's Eq. 11) and whose gradient is truncated importance sampling,
min(r_t, c) grad logp_t with c = clip_ratio_c (the paper's Sec. 5.4 advises a large c; None: no cap).
clip_ratio_low/high are the divergence thresholds here (the paper and verl: 0.15 for TV, 0.05 for KL).
The paper anchors q at the rollout policy; here it is old_logprobs, which the trainer recomputes.

clip_cov, kl_cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617):
entropy collapses where the covariance between a token's log-prob and its advantage is large, so
act on the tokens with the largest centred product
    cov_t = (logp_t - mean(logp)) (A_t - mean(A))      (means over the valid tokens, no gradient)
  clip_cov: the vanilla loss, but of the valid tokens not already clipped whose cov_t lies in
    (clip_cov_lb, clip_cov_ub), max(1, floor(clip_cov_ratio * N)) chosen at random lose their loss
    (L_t = 0, no gradient). The choice is pseudo-random but a function of the inputs alone, so every
    rank holding the same micro-batch (TP, CP) drops the same tokens and a rerun drops them again.
  kl_cov: L_t = -A_t r_t, plus ppo_kl_coef |l_t| on the max(1, floor(kl_cov_ratio * N)) tokens
    with the largest cov_t (no clipping).
N, the means and the choice are over the micro-batch the function is given (as in verl), not the
whole batch the paper uses: the signature sees one micro-batch.

gpg (Group Policy Gradient; Chu et al. 2025, arXiv:2504.02546): plain REINFORCE, no ratio, no clip,
    L_t = -A_t logp_t
The paper's gradient scaling (alpha = B / (B - M) over groups with a zero advantage) belongs to the
advantage, not to this loss.

dro (Direct Reward Optimisation; Richemond et al. 2024, arXiv:2405.19107): the squared regression of
the advantage onto the scaled log ratio, per token, divided by beta and less its constant A^2 / (2 beta):
    L_t = [(A_t - beta l_t)^2 - A_t^2] / (2 beta) = -A_t l_t + (beta / 2) l_t^2,   l_t = logp_t - old_t
(0 on-policy; gradient -(A_t - beta l_t) grad logp_t, as verl's `dro`). The paper regularises
towards the reference policy with a sequence log ratio; here, as in verl, the anchor is the old policy
and the penalty is per token. beta = dro_beta.

Optional `weights_BR` (the rollout correction's, see rollout_correction.py) multiply the per-token
loss; they carry no gradient. Log ratios are clamped to [-20, 20] before exp (as verl) so that a
far off-policy token yields a large, finite loss instead of inf.

Metrics (detached scalars over valid tokens): `approx_kl` (mean of old - logp, i.e. k1 of the
old policy against the current one on old-policy samples) for every loss; `clipfrac` (the share of
tokens whose gradient the clip changed: the clipped term was the larger, the ratio was clipped, or
DPPO's mask dropped it) where there is a clip; `clipfrac_lower` (the dual clip bound was used) for
vanilla, gspo, clip_cov; `truncfrac` (kept tokens with r > c) for dppo; `gate_weight` (mean of the
gradient's gate 4 s (1 - s)) for sapo; `cov_frac` (share of tokens dropped or penalised) for clip_cov
and kl_cov.
"""

from __future__ import annotations

import zlib
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
    """Ratios below 1 - clip_ratio_low are clipped (gmpo: the log ratio's lower bound -clip_ratio_low;
    dppo: the divergence threshold for negative advantages)."""
    clip_ratio_high: float = 0.2
    """Ratios above 1 + clip_ratio_high are clipped (DAPO clip-higher: larger than low; gmpo: the log
    ratio's upper bound; dppo: the divergence threshold for positive advantages)."""
    clip_ratio_c: float | None = 3.0
    """Dual clip: the loss of a negative-advantage token is at most -A * clip_ratio_c; None disables.
    dppo: the cap c of the truncated importance weight min(r, c)."""
    tau_pos: float = 1.0
    """sapo: temperature of the gate for positive advantages (the paper: 1.0)."""
    tau_neg: float = 1.05
    """sapo: temperature of the gate for non-positive advantages, larger: faster decay (the paper: 1.05)."""
    clip_cov_ratio: float = 2e-4
    """clip_cov: share of the valid tokens whose loss is dropped."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens with a covariance above this are dropped."""
    clip_cov_ub: float = 5.0
    """clip_cov: only tokens with a covariance below this are dropped."""
    kl_cov_ratio: float = 2e-4
    """kl_cov: share of the valid tokens, those of largest covariance, that pay the KL penalty."""
    ppo_kl_coef: float = 1.0
    """kl_cov: weight of the |logp - old| penalty on those tokens."""
    dro_beta: float = 0.05
    """dro: weight beta of the quadratic log-ratio penalty (> 0)."""


PolicyLoss = Callable[
    [Tensor, Tensor, Tensor, Tensor, PolicyLossParams, Tensor | None], tuple[Tensor, dict[str, Tensor]]
]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _log_ratio(logprobs_BR: Tensor, old_logprobs_BR: Tensor) -> Tensor:
    return (logprobs_BR - old_logprobs_BR).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _weighted(loss_BR: Tensor, weights_BR: Tensor | None) -> Tensor:
    return loss_BR if weights_BR is None else loss_BR * weights_BR.detach()


def _value_with_logp_gradient(value_BR: Tensor, logprobs_BR: Tensor) -> Tensor:
    """Equal to `value_BR` (taken without gradient); its gradient is value * grad logp."""
    return value_BR.detach() * (logprobs_BR - logprobs_BR.detach()).exp()


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
    return _weighted(loss_BR, weights_BR), metrics


@POLICY_LOSSES.register("vanilla")
def vanilla(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    log_ratio_BR = _log_ratio(logprobs_BR, old_logprobs_BR)
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


@POLICY_LOSSES.register("cispo")
def cispo(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    log_ratio_BR = _log_ratio(logprobs_BR, old_logprobs_BR).detach()
    ratio_BR = log_ratio_BR.exp()
    # A lower bound of 1 - low <= 0 never binds: the paper's "no lower clip".
    is_weight_BR = ratio_BR.clamp(1 - params.clip_ratio_low, 1 + params.clip_ratio_high)
    loss_BR = -is_weight_BR * advantages_BR * logprobs_BR
    metrics = {
        "clipfrac": masked_mean((is_weight_BR != ratio_BR).float(), mask_BR),
        "approx_kl": masked_mean(-log_ratio_BR, mask_BR),
    }
    return _weighted(loss_BR, weights_BR), metrics


@POLICY_LOSSES.register("sapo")
def sapo(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    if params.tau_pos <= 0 or params.tau_neg <= 0:
        raise ValueError(f"sapo needs tau_pos, tau_neg > 0, got {params.tau_pos}, {params.tau_neg}")
    log_ratio_BR = _log_ratio(logprobs_BR, old_logprobs_BR)
    tau_BR = torch.full_like(log_ratio_BR, params.tau_neg).masked_fill(advantages_BR > 0, params.tau_pos)
    gate_BR = torch.sigmoid(tau_BR * (log_ratio_BR.exp() - 1))
    loss_BR = -(4 / tau_BR) * gate_BR * advantages_BR
    metrics = {
        "gate_weight": masked_mean(4 * gate_BR * (1 - gate_BR), mask_BR).detach(),
        "approx_kl": masked_mean(-log_ratio_BR, mask_BR).detach(),
    }
    return _weighted(loss_BR, weights_BR), metrics


@POLICY_LOSSES.register("gmpo")
def gmpo(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    log_ratio_BR = logprobs_BR - old_logprobs_BR
    sign_BR = torch.sign(advantages_BR)
    clipped_BR = log_ratio_BR.clamp(-params.clip_ratio_low, params.clip_ratio_high)
    # PPO's pessimistic min, in log space: clip only where clipping lowers the objective.
    bounded_BR = sign_BR * torch.minimum(sign_BR * log_ratio_BR, sign_BR * clipped_BR)
    sequence_log_ratio_B = masked_mean(bounded_BR, mask_BR, dim=-1)
    token_log_ratio_BR = sequence_log_ratio_B.detach().unsqueeze(-1) + bounded_BR - bounded_BR.detach()
    loss_BR = -advantages_BR * token_log_ratio_BR.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    metrics = {
        "clipfrac": masked_mean((sign_BR * log_ratio_BR > sign_BR * clipped_BR).float(), mask_BR).detach(),
        "approx_kl": masked_mean(-log_ratio_BR, mask_BR).detach(),
    }
    return _weighted(loss_BR, weights_BR), metrics


def _dppo(
    outside_BR: Tensor,
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO's loss given, per token, whether it left the trust region in its advantage's direction."""
    log_ratio_BR = _log_ratio(logprobs_BR, old_logprobs_BR).detach()
    ratio_BR = log_ratio_BR.exp()
    keep_BR = (~outside_BR).to(ratio_BR.dtype)
    is_weight_BR = ratio_BR if params.clip_ratio_c is None else ratio_BR.clamp(max=params.clip_ratio_c)
    loss_BR = -keep_BR * advantages_BR * _value_with_logp_gradient(is_weight_BR, logprobs_BR)
    metrics = {
        "clipfrac": masked_mean(1 - keep_BR, mask_BR),
        "truncfrac": masked_mean(((is_weight_BR < ratio_BR) & ~outside_BR).float(), mask_BR),
        "approx_kl": masked_mean(-log_ratio_BR, mask_BR),
    }
    return _weighted(loss_BR, weights_BR), metrics


def _moved_out(rise_BR: Tensor, divergence_BR: Tensor, advantages_BR: Tensor, params: PolicyLossParams) -> Tensor:
    """Tokens whose probability rose (A > 0) or fell (A < 0) by more than the threshold's divergence."""
    up_BR = (advantages_BR > 0) & (rise_BR > 0) & (divergence_BR > params.clip_ratio_high)
    down_BR = (advantages_BR < 0) & (rise_BR < 0) & (divergence_BR > params.clip_ratio_low)
    return up_BR | down_BR


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    rise_BR = logprobs_BR.detach().exp() - old_logprobs_BR.exp()
    outside_BR = _moved_out(rise_BR, rise_BR.abs(), advantages_BR, params)
    return _dppo(outside_BR, logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, params, weights_BR)


def _log1m_exp(log_p: Tensor) -> Tensor:
    """log(1 - p) from log p, accurate for p near 1 (expm1); p is kept below 1 so that it stays finite."""
    return torch.log(-torch.expm1(log_p.clamp(max=-1e-6)))


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    logp_BR, old_BR = logprobs_BR.detach(), old_logprobs_BR
    # KL(Bernoulli(q) || Bernoulli(p)) of the sampled token, q the old probability.
    divergence_BR = old_BR.exp() * (old_BR - logp_BR) + (-old_BR.expm1()) * (_log1m_exp(old_BR) - _log1m_exp(logp_BR))
    outside_BR = _moved_out(logp_BR - old_BR, divergence_BR, advantages_BR, params)
    return _dppo(outside_BR, logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, params, weights_BR)


def _covariance(logprobs_BR: Tensor, advantages_BR: Tensor, mask_BR: Tensor) -> Tensor:
    """(logp - mean logp) (A - mean A), means over the valid tokens; no gradient."""
    logp_BR = logprobs_BR.detach()
    return (logp_BR - masked_mean(logp_BR, mask_BR)) * (advantages_BR - masked_mean(advantages_BR, mask_BR))


def _pseudo_random_subset(candidates_BR: Tensor, count: int, key_BR: Tensor) -> Tensor:
    """`count` of the candidates (all if fewer), drawn with a seed that is a checksum of `key_BR`."""
    index_N = candidates_BR.flatten().nonzero().squeeze(-1)
    if index_N.numel() > count:
        seed = zlib.crc32(key_BR.detach().float().cpu().numpy().tobytes())
        order_N = torch.randperm(index_N.numel(), generator=torch.Generator().manual_seed(seed))
        index_N = index_N[order_N[:count].to(index_N.device)]
    chosen = torch.zeros(candidates_BR.numel(), dtype=torch.bool, device=candidates_BR.device)
    chosen[index_N] = True
    return chosen.view_as(candidates_BR)


@POLICY_LOSSES.register("clip_cov")
def clip_cov(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    if params.clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {params.clip_cov_ratio}")
    log_ratio_BR = _log_ratio(logprobs_BR, old_logprobs_BR)
    ratio_BR = log_ratio_BR.exp()
    loss_BR, metrics = _clipped_surrogate(ratio_BR, advantages_BR, mask_BR, params, None)
    ratio_clipped_BR = -advantages_BR * ratio_BR.clamp(1 - params.clip_ratio_low, 1 + params.clip_ratio_high)
    already_clipped_BR = (ratio_clipped_BR > -advantages_BR * ratio_BR).detach()
    cov_BR = _covariance(logprobs_BR, advantages_BR, mask_BR)
    candidates_BR = (mask_BR > 0) & ~already_clipped_BR & (cov_BR > params.clip_cov_lb) & (cov_BR < params.clip_cov_ub)
    count = max(int(params.clip_cov_ratio * mask_BR.sum().item()), 1)
    # Padding holds arbitrary values: the seed sees the valid tokens' old log-probs only.
    dropped_BR = _pseudo_random_subset(candidates_BR, count, torch.where(mask_BR > 0, old_logprobs_BR, 0.0))
    loss_BR = torch.where(dropped_BR, 0.0, loss_BR)
    metrics["cov_frac"] = masked_mean(dropped_BR.float(), mask_BR)
    metrics["approx_kl"] = masked_mean(-log_ratio_BR, mask_BR).detach()
    return _weighted(loss_BR, weights_BR), metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    if params.kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {params.kl_cov_ratio}")
    log_ratio_BR = _log_ratio(logprobs_BR, old_logprobs_BR)
    cov_N = _covariance(logprobs_BR, advantages_BR, mask_BR).flatten()
    valid_N = (mask_BR.flatten() > 0).nonzero().squeeze(-1)
    count = min(max(int(params.kl_cov_ratio * valid_N.numel()), 1), valid_N.numel())
    penalised_N = torch.zeros_like(cov_N, dtype=torch.bool)
    penalised_N[valid_N[cov_N[valid_N].topk(count).indices]] = True
    penalised_BR = penalised_N.view_as(mask_BR)
    penalty_BR = torch.where(penalised_BR, params.ppo_kl_coef * log_ratio_BR.abs(), 0.0)
    loss_BR = -advantages_BR * log_ratio_BR.exp() + penalty_BR
    metrics = {
        "cov_frac": masked_mean(penalised_BR.float(), mask_BR),
        "approx_kl": masked_mean(-log_ratio_BR, mask_BR).detach(),
    }
    return _weighted(loss_BR, weights_BR), metrics


@POLICY_LOSSES.register("gpg")
def gpg(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    loss_BR = -advantages_BR * logprobs_BR
    metrics = {"approx_kl": masked_mean(-_log_ratio(logprobs_BR, old_logprobs_BR), mask_BR).detach()}
    return _weighted(loss_BR, weights_BR), metrics


@POLICY_LOSSES.register("dro")
def dro(
    logprobs_BR: Tensor,
    old_logprobs_BR: Tensor,
    advantages_BR: Tensor,
    mask_BR: Tensor,
    params: PolicyLossParams,
    weights_BR: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    if params.dro_beta <= 0:
        raise ValueError(f"dro_beta must be > 0, got {params.dro_beta}")
    log_ratio_BR = logprobs_BR - old_logprobs_BR
    loss_BR = -advantages_BR * log_ratio_BR + 0.5 * params.dro_beta * log_ratio_BR.square()
    metrics = {"approx_kl": masked_mean(-log_ratio_BR, mask_BR).detach()}
    return _weighted(loss_BR, weights_BR), metrics
