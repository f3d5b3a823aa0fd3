"""Rollout corrections: importance weights and rejection for tokens the rollout engine sampled with
log-probs other than the trainer's (other kernels and precision when colocated, an older policy under
split placement or with in-flight updates).

With m_t the response mask, on each valid token

    d_t = log pi_train(y_t) - log pi_rollout(y_t)       pi_train: the trainer's old log-probs
    token ratio       r_t   = exp(d_t)
    sequence ratio    R_i   = exp(sum_t d_it)             (the product of the token ratios)
    geometric ratio   G_i   = exp(sum_t d_it / |y_i|)     (their geometric mean: length-invariant)

A correction is IS weights at one level, truncated at `cap`, and rejection at one level, outside the
band [lower, upper]:

    weights    token: w_t = min(r_t, cap)    sequence: w_it = min(R_i, cap)    none: w = 1
    rejection  token: keep lower <= r_t <= upper
               sequence: keep lower <= R_i <= upper (every token of the sequence)
               geometric: keep lower <= G_i <= upper (every token of the sequence)

The named presets (`ROLLOUT_CORRECTIONS`; bounds are the sources' defaults, each can be overridden):

    none              nothing (no weights, no rejection)
    token_tis         token weights, cap 2                 Yao et al. 2025 (TIS)
    seq_tis           sequence weights, cap 2              verl's Seq-TIS
    token_mis         token weights, token band [0.5, 2]   masked IS (slime/miles `tis_mode: mask`)
    seq_mis           sequence weights, sequence band [0.5, 2]   verl's Seq-MIS
    icepop            token weights, token band [0.5, 5]   IcePop (Ring-1T): masked two-sided truncation
    geo_rs            geometric band [0.999, 1.001], no weights   verl's Geo-RS
    geo_rs_token_tis  geometric band [0.999, 1.001], token weights cap 2

Independently of the preset, off-policy sequence masking (DeepSeek-V3.2; `opsm_delta` > 0) drops the
tokens with a negative advantage of a sequence the current policy pi_theta has drifted from:

    keep_it = 0  where  A_it < 0  and  (1/|y_i|) sum_t (log pi_rollout(y_it) - log pi_theta(y_it)) > opsm_delta

The actor's loss becomes sum_t keep_t * (w_t * policy_loss_t + entropy and KL terms_t): a rejected token
leaves every term, so it gets exactly zero gradient. Weights and the keep mask carry no gradient: the
log-probs they come from are the trainer's old ones, the engine's, and the current ones detached.

Rejected tokens stay in the aggregation's counts (`token-mean` divides by all valid tokens, as without a
correction), for two reasons. The counts are the whole mini-batch's, gathered over micro-batches and DP
ranks before the first forward, while off-policy sequence masking is decided in the forward itself.
And it makes rejection a zero importance weight: the surviving tokens are not scaled up, so a step whose
mismatch rejects most tokens moves the policy less instead of amplifying the few that remain.

Safety: weights come from log ratios clamped to [-20, 20] (ratios within [2e-9, 5e8]), so an untruncated
weight (the masked presets, no cap) stays finite; rejection compares the unclamped log ratios with the
log of the bounds.

Metrics, as sums over this batch that the caller divides by the mini-batch's tokens or sequences
(`CorrectedTokens`): the fractions of tokens kept, clipped (kept, with the weight truncated) and masked
(rejected), the mean weight, the fractions of sequences kept whole, with a clipped token and with a
masked token, and the fraction of tokens off-policy sequence masking dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor

from megarl.registry import Registry

MAX_LOG_RATIO = 20.0
WEIGHT_LEVELS = ("none", "token", "sequence")
REJECTION_LEVELS = ("none", "token", "sequence", "geometric")


@dataclass(frozen=True)
class RolloutCorrection:
    weights: str = "none"
    """IS weights: none, token or sequence."""
    rejection: str = "none"
    """Rejection: none, token, sequence or geometric."""
    cap: float = math.inf
    """Weights above this are truncated to it (inf: not truncated)."""
    lower: float = 0.0
    """Ratios below this are rejected."""
    upper: float = math.inf
    """Ratios above this are rejected."""
    opsm_delta: float = 0.0
    """Off-policy sequence masking threshold; 0 disables it."""

    def __post_init__(self):
        assert self.weights in WEIGHT_LEVELS and self.rejection in REJECTION_LEVELS, self
        assert self.cap > 0 and 0 <= self.lower < self.upper and self.opsm_delta >= 0, self

    @property
    def is_active(self) -> bool:
        return self.weights != "none" or self.rejection != "none" or self.opsm_delta > 0

    def with_bounds(self, cap: float | None = None, lower: float | None = None, upper: float | None = None,
                    opsm_delta: float = 0.0) -> RolloutCorrection:
        """This preset with the bounds that are given (None keeps the preset's)."""
        assert cap is None or self.weights != "none", "a cap for a correction without weights"
        assert (lower is None and upper is None) or self.rejection != "none", "a band for one without rejection"
        given = {name: value for name, value in (("cap", cap), ("lower", lower), ("upper", upper)) if value is not None}
        return replace(self, opsm_delta=opsm_delta, **given)


ROLLOUT_CORRECTIONS: Registry[RolloutCorrection] = Registry("rollout correction")
ROLLOUT_CORRECTIONS.register("none")(RolloutCorrection())
ROLLOUT_CORRECTIONS.register("token_tis")(RolloutCorrection(weights="token", cap=2.0))
ROLLOUT_CORRECTIONS.register("seq_tis")(RolloutCorrection(weights="sequence", cap=2.0))
ROLLOUT_CORRECTIONS.register("token_mis")(RolloutCorrection(weights="token", rejection="token", lower=0.5, upper=2.0))
ROLLOUT_CORRECTIONS.register("seq_mis")(
    RolloutCorrection(weights="sequence", rejection="sequence", lower=0.5, upper=2.0))
ROLLOUT_CORRECTIONS.register("icepop")(RolloutCorrection(weights="token", rejection="token", lower=0.5, upper=5.0))
ROLLOUT_CORRECTIONS.register("geo_rs")(RolloutCorrection(rejection="geometric", lower=0.999, upper=1.001))
ROLLOUT_CORRECTIONS.register("geo_rs_token_tis")(
    RolloutCorrection(weights="token", cap=2.0, rejection="geometric", lower=0.999, upper=1.001))


class CorrectedTokens(NamedTuple):
    weights_BR: Tensor
    """w_t * keep_t: what the per-token policy loss is multiplied by (0 at padding and rejected tokens)."""
    keep_BR: Tensor
    """1 at kept valid tokens, 0 at rejected tokens and padding (float)."""
    token_counts: dict[str, Tensor]
    """Sums over valid tokens that, divided by a number of tokens, are the metrics they are named after:
    token_kept_fraction, token_clipped_fraction, token_masked_fraction, weight_mean (of w_t * keep_t) and,
    with off-policy sequence masking, opsm_token_masked_fraction."""
    sequence_counts: dict[str, Tensor]
    """Numbers of sequences that, divided by a number of sequences, are seq_kept_fraction (no token
    masked), seq_clipped_fraction (a token clipped) and seq_masked_fraction (a token masked)."""


@torch.no_grad()
def correct_rollout(correction: RolloutCorrection, train_logprobs_BR: Tensor, rollout_logprobs_BR: Tensor,
                    mask_BR: Tensor, logprobs_BR: Tensor | None = None,
                    advantages_BR: Tensor | None = None) -> CorrectedTokens:
    """Weights, keep mask and counts of `correction` (see the module docstring). `logprobs_BR` (the current
    policy's) and `advantages_BR` are needed by off-policy sequence masking alone."""
    valid_BR = mask_BR > 0
    # Padding may hold anything (even inf): it gets log ratio 0, so nothing below sees it.
    log_ratio_BR = torch.where(valid_BR, train_logprobs_BR - rollout_logprobs_BR, 0.0)
    lengths_B = valid_BR.sum(dim=1)
    sequence_log_ratio_B = log_ratio_BR.sum(dim=1)

    raw_BR = _raw_weights(correction.weights, log_ratio_BR, sequence_log_ratio_B)
    keep_BR = valid_BR & _in_band(correction, log_ratio_BR, sequence_log_ratio_B, lengths_B)
    opsm_masked_BR = torch.zeros_like(valid_BR)
    if correction.opsm_delta > 0:
        assert logprobs_BR is not None and advantages_BR is not None, "off-policy sequence masking needs both"
        drift_BR = torch.where(valid_BR, rollout_logprobs_BR - logprobs_BR.detach(), 0.0)
        drift_B = drift_BR.sum(dim=1) / lengths_B.clamp(min=1)
        opsm_masked_BR = valid_BR & (advantages_BR < 0) & (drift_B > correction.opsm_delta)[:, None]
        keep_BR = keep_BR & ~opsm_masked_BR
    keep = keep_BR.to(mask_BR.dtype)
    weights_BR = raw_BR.clamp(max=correction.cap) * keep
    clipped_BR = keep_BR & (raw_BR > correction.cap)
    masked_BR = valid_BR & ~keep_BR

    def count(flags) -> Tensor:
        return flags.sum().to(keep.dtype)

    token_counts = {"token_kept_fraction": count(keep_BR), "token_clipped_fraction": count(clipped_BR),
                    "token_masked_fraction": count(masked_BR), "weight_mean": weights_BR.sum()}
    if correction.opsm_delta > 0:
        token_counts["opsm_token_masked_fraction"] = count(opsm_masked_BR)
    sequence_counts = {"seq_kept_fraction": count((lengths_B > 0) & ~masked_BR.any(dim=1)),
                       "seq_clipped_fraction": count(clipped_BR.any(dim=1)),
                       "seq_masked_fraction": count(masked_BR.any(dim=1))}
    return CorrectedTokens(weights_BR, keep, token_counts, sequence_counts)


def _raw_weights(level: str, log_ratio_BR: Tensor, sequence_log_ratio_B: Tensor) -> Tensor:
    """The untruncated weights: token or sequence ratios, from log ratios clamped for safety; 1 for none."""
    if level == "none":
        return torch.ones_like(log_ratio_BR)
    if level == "token":
        return log_ratio_BR.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    return sequence_log_ratio_B.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()[:, None].expand_as(log_ratio_BR)


def _in_band(correction: RolloutCorrection, log_ratio_BR: Tensor, sequence_log_ratio_B: Tensor,
             lengths_B: Tensor) -> Tensor:
    """Where the rejection's ratio lies in [lower, upper], compared as log ratios (unclamped)."""
    if correction.rejection == "none":
        return torch.ones_like(log_ratio_BR, dtype=torch.bool)
    if correction.rejection == "token":
        statistic_BR = log_ratio_BR
    elif correction.rejection == "sequence":
        statistic_BR = sequence_log_ratio_B[:, None].expand_as(log_ratio_BR)
    else:
        statistic_BR = (sequence_log_ratio_B / lengths_B.clamp(min=1))[:, None].expand_as(log_ratio_BR)
    log_lower = math.log(correction.lower) if correction.lower > 0 else -math.inf
    return (statistic_BR >= log_lower) & (statistic_BR <= math.log(correction.upper))
