"""PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards"): dense token rewards from a
language model trained only on outcome labels, and the advantages that add them to the outcome reward.

The implicit PRM pi_phi is a causal LM with a frozen reference pi_ref (both start as the SFT model, or
both as a given PRM). Its token reward and sequence reward are

    r_phi(y_t) = beta * (log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t)),    r_phi(y) = sum_t r_phi(y_t)

r_phi(y) is trained as the logit of P(correct | y): every step, on the step's responses and the outcome
verifier's 0/1 labels l, with the cross-entropy

    L_CE = -[l log sigmoid(r_phi(y)) + (1 - l) log(1 - sigmoid(r_phi(y)))]

so the token rewards need no process labels. For response i of the K responses G(i) to a prompt, with
r_o the outcome score and mean_j = r_phi(y^j) / |y^j| the mean token reward of response j (eq. 5):

    A_t^i = process_weight * sum_{s >= t} gamma^(s-t) [r_phi(y_s^i) - 1/(K-1) sum_{j in G(i), j != i} mean_j]
          + outcome_weight * [r_o(y^i) - 1/(K-1) sum_{j in G(i), j != i} r_o(y^j)]

the process rewards baselined leave-one-out and turned into returns, the outcome reward RLOO's, both
broadcast over the response's tokens; returns = A. A group of one has no baseline and gets 0 (as rloo).

Departures from verl's recipe, which follows the paper's algorithm otherwise: verl subtracts the baseline
from K/(K-1) r_phi(y_s) (its baseline also holds the response's own mean) and whitens the advantages over
the batch; here they are the paper's equation, unwhitened.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megarl.algorithms.advantages import (
    AdvantageInputs,
    leave_one_out_means,
    outcome_scores,
    register_estimator,
    returns_to_go,
)


def implicit_token_rewards(prm_logprobs_BR: Tensor, ref_logprobs_BR: Tensor, mask_BR: Tensor, beta: float) -> Tensor:
    """r_phi(y_t) = beta * (log pi_phi - log pi_ref) at each response token, 0 at padding. (B, R)"""
    return beta * (prm_logprobs_BR - ref_logprobs_BR) * mask_BR


def implicit_sequence_rewards(prm_logprobs_BR: Tensor, ref_logprobs_BR: Tensor, mask_BR: Tensor,
                              beta: float) -> Tensor:
    """r_phi(y) = sum_t r_phi(y_t): the PRM's logit of the response being correct. (B,)"""
    return implicit_token_rewards(prm_logprobs_BR, ref_logprobs_BR, mask_BR, beta).sum(dim=-1)


def outcome_cross_entropy(sequence_rewards_B: Tensor, labels_B: Tensor) -> Tensor:
    """L_CE of each response: binary cross-entropy of sigmoid(r_phi(y)) against its 0/1 label. (B,)"""
    return F.binary_cross_entropy_with_logits(sequence_rewards_B, labels_B, reduction="none")


def implicit_accuracy(sequence_rewards_B: Tensor, labels_B: Tensor) -> Tensor:
    """1 where the sign of r_phi(y) gives the label (positive: correct), 0 where not; a reward of exactly
    0 (the PRM equal to its reference, as at the start) counts one half, a coin's chance. (B,)"""
    predicted_B = torch.sign(sequence_rewards_B) * 0.5 + 0.5
    return 1.0 - (predicted_B - labels_B).abs()


@register_estimator("prime", needs_groups=True, needs_process_rewards=True)
@torch.no_grad()
def prime(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    if inputs.process_rewards_BR is None:
        raise ValueError("advantage estimator 'prime' needs process_rewards_BR (the implicit PRM's token rewards)")
    mask_BR, group_ids_B = inputs.mask_BR, inputs.group_ids_B
    scores_B = outcome_scores(inputs)
    outcome_baseline_B, has_baseline_B = leave_one_out_means(scores_B, group_ids_B)
    process_BR = inputs.process_rewards_BR * mask_BR
    mean_reward_B = process_BR.sum(dim=-1) / mask_BR.sum(dim=-1).clamp(min=1)
    process_baseline_B, _ = leave_one_out_means(mean_reward_B, group_ids_B)
    process_returns_BR = returns_to_go((process_BR - process_baseline_B[:, None]) * mask_BR, inputs.gamma)
    advantages_BR = (inputs.process_weight * process_returns_BR
                     + inputs.outcome_weight * (scores_B - outcome_baseline_B)[:, None])
    advantages_BR = advantages_BR * mask_BR * has_baseline_B[:, None]
    return advantages_BR, advantages_BR
