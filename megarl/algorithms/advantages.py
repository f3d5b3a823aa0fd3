"""Advantage estimators: fn(AdvantageInputs) -> (advantages_BR, returns_BR), zero at padding.

r_t are the token rewards (the outcome reward at the last response token plus any per-token
penalties), m_t the response mask, score_i = sum_t r_it the outcome score of response i, and G(i)
the group of responses to the same prompt (sharing a group id).

    gae        delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1}, over valid
               tokens only (V and A after the last valid token are 0); returns = A + V before
               whitening; advantages are then whitened over all valid tokens (PPO, as in verl).
    grpo       A_i = (score_i - mean_G(i)) / (std_G(i) + eps), std unbiased as torch.std; a group of
               one has mean 0, std 1 (as verl). With norm_by_std=False the division is skipped.
    drgrpo     A_i = score_i - mean_G(i)  (Dr. GRPO: no std normalisation).
    rloo       A_i = score_i - mean_{j in G(i), j != i} score_j; a group of one gets 0 (verl keeps
               the raw score there; with no other sample there is no baseline, hence no signal).
    reinforce_plus_plus
               G_t = sum_{k >= t} gamma^{k-t} r_k (return-to-go), whitened over the batch's valid
               tokens; returns = G.
    grpo_passk A_i = max_{j in G(i)} score_j - max_{j in G(i), j != i} score_j: the leave-one-out
               gradient of the group's best score (pass@k with k the group size; Tang et al.,
               arXiv:2503.19595), so only a group's unique best response has a signal, its margin over
               the runner-up; over std_G(i) + eps unless norm_by_std=False; a group of one gets 0 (verl
               raises).
    opo        A_i = score_i - sum_{j in G(i)} l_j score_j / sum_{j in G(i)} l_j, l_j the number of
               valid tokens of response j: the baseline of least gradient variance when a response's
               squared score-function norm grows with its length (OPO, Hao et al., arXiv:2505.23585). A
               group of one gets 0 (its own score is its baseline; verl keeps the raw score there).
    reinforce_plus_plus_baseline
               A_i = score_i - mean_G(i), broadcast over the response and whitened over the batch's
               valid tokens (REINFORCE++-baseline, Hu et al., arXiv:2501.03262); a group of one gets 0
               before whitening (verl keeps the raw score there); returns = A.
    gdpo       A = whitened sum_k grpo(c_k): each reward component c_ik (`reward_components_BK`, the
               run's algorithm.reward_components) normalised within its group exactly as grpo normalises
               the score, the K results summed per response and whitened over the batch's valid tokens
               (GDPO, Liu et al., arXiv:2601.05242: normalising the sum instead collapses distinct
               component profiles onto one advantage). Whitening is token-weighted as in the authors'
               verl code (their TRL code whitens per response); the score and token rewards do not
               enter it; returns = A.
    remax      A_i = score_i - b_i, b_i the reward of the greedy response to the same prompt;
               returns = A. (verl uses the per-token return-to-go minus b_i; both agree when the
               only reward is the outcome at the last token.)
    opd        on-policy distillation: the per-token reverse KL to a teacher (`distillation.py`).
    prime      rloo's outcome advantage plus the returns of implicit process rewards, each
               baselined leave-one-out (`megarl.algorithms.prime`).

Sequence-level advantages are broadcast over the valid tokens of their response. "Whitened" is
(x - mean) / sqrt(var + 1e-8) with the masked mean and unbiased masked variance (verl masked_whiten)
of the whole batch: an estimator given one DP rank's share of it gets the batch's statistics through
`AdvantageInputs.sum_over_batch`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from megarl.registry import Registry

WHITEN_EPS = 1e-8


def whole_batch(sums: Tensor) -> Tensor:
    """`sum_over_batch` when the inputs are the whole batch: its sums are already the batch's."""
    return sums


@dataclass
class AdvantageInputs:
    token_rewards_BR: Tensor
    """Reward at the last valid response token plus any per-token penalties (e.g. KL)."""
    mask_BR: Tensor
    """1.0 at valid response tokens, 0.0 at right padding."""
    group_ids_B: Tensor
    """Long; responses to the same prompt share an id."""
    values_BR: Tensor | None = None
    """Critic values at the response tokens (gae only)."""
    baseline_rewards_B: Tensor | None = None
    """Reward of the greedy response for each sample's prompt (remax only)."""
    student_logprobs_BR: Tensor | None = None
    """The policy's log-probs of the response tokens it sampled (opd only)."""
    teacher_logprobs_BR: Tensor | None = None
    """A teacher model's log-probs of the same tokens (opd only)."""
    task_reward_weight: float = 0.0
    """opd: weight of the task reward's advantage added to the distillation advantage."""
    process_rewards_BR: Tensor | None = None
    """Implicit process reward of each response token (prime only)."""
    outcome_weight: float = 1.0
    """prime: weight of the outcome reward's advantage."""
    process_weight: float = 1.0
    """prime: weight of the process rewards' returns."""
    reward_components_BK: Tensor | None = None
    """The K named components of each response's reward, `algorithm.reward_components` (gdpo only)."""
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    """grpo: divide by the group std."""
    epsilon: float = 1e-6
    """grpo: added to the group std."""
    sum_over_batch: Callable[[Tensor], Tensor] = whole_batch
    """Adds a tensor of sums over this share's sequences across all shares of the batch (the trainer
    all-reduces over DP); the identity when the inputs are the whole batch."""


ADVANTAGE_ESTIMATORS: Registry[Callable[[AdvantageInputs], tuple[Tensor, Tensor]]] = Registry(
    "advantage estimator"
)


def register_estimator(name: str, *, needs_groups: bool = False, needs_greedy_baseline: bool = False,
                       needs_values: bool = False, needs_teacher: bool = False,
                       needs_process_rewards: bool = False, needs_reward_components: bool = False):
    """Register an estimator with what it needs from the trainer, as attributes of the function, so
    that the trainer asks the estimator rather than branching on its name:

    needs_groups           its baseline comes from the other responses to the same prompt, so a
                           group of one has no signal (rollout.n must be at least 2)
    needs_greedy_baseline  its inputs include the reward of a greedy response per prompt
                           (baseline_rewards_B), which the trainer generates for it
    needs_values           its inputs include critic values (values_BR): a run choosing it needs a critic
    needs_teacher          its inputs include a teacher's log-probs (teacher_logprobs_BR): a run choosing
                           it needs teacher.path
    needs_process_rewards  its inputs include implicit process rewards (process_rewards_BR), which the
                           trainer's PRIME reward model gives
    needs_reward_components  its inputs include the reward's named components (reward_components_BK):
                           a run choosing it names them in algorithm.reward_components
    """

    def add(estimator):
        estimator.needs_groups, estimator.needs_greedy_baseline = needs_groups, needs_greedy_baseline
        estimator.needs_values, estimator.needs_teacher = needs_values, needs_teacher
        estimator.needs_process_rewards, estimator.needs_reward_components = (needs_process_rewards,
                                                                              needs_reward_components)
        return ADVANTAGE_ESTIMATORS.register(name)(estimator)

    return add


def masked_whiten(values_BR: Tensor, mask_BR: Tensor,
                  sum_over_batch: Callable[[Tensor], Tensor] = whole_batch) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the valid tokens of the batch, var unbiased (Bessel's
    correction); `values_BR` may be a share of the batch whose sums `sum_over_batch` completes."""
    total, num_valid = sum_over_batch(torch.stack([(values_BR * mask_BR).sum(), mask_BR.sum()]))
    mean = total / num_valid.clamp(min=1)
    squares = sum_over_batch(((values_BR - mean) ** 2 * mask_BR).sum())
    variance = squares / (num_valid - 1).clamp(min=1)
    return (values_BR - mean) * torch.rsqrt(variance + WHITEN_EPS)


def _group_statistics(scores_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per sample: its group's size, sum, mean and unbiased std (gathered back to shape (B,))."""
    _, group_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = int(group_B.max()) + 1 if group_B.numel() else 0
    zeros_G = scores_B.new_zeros(num_groups)
    size_G = zeros_G.index_add(0, group_B, torch.ones_like(scores_B))
    sum_G = zeros_G.index_add(0, group_B, scores_B)
    mean_G = sum_G / size_G
    squares_G = zeros_G.index_add(0, group_B, (scores_B - mean_G[group_B]) ** 2)
    std_G = (squares_G / (size_G - 1).clamp(min=1)).sqrt()
    return size_G[group_B], sum_G[group_B], mean_G[group_B], std_G[group_B]


def leave_one_out_means(scores_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, Tensor]:
    """(mean_{j in G(i), j != i} score_j, whether G(i) has another member) of each sample; the mean is 0
    in a group of one, which has no baseline. (B,), (B,) bool"""
    size_B, sum_B, _, _ = _group_statistics(scores_B, group_ids_B)
    return (sum_B - scores_B) / (size_B - 1).clamp(min=1), size_B > 1


def returns_to_go(rewards_BR: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k >= t} gamma^{k-t} r_k along each row (rewards already zero at padding)."""
    returns_BR = torch.zeros_like(rewards_BR)
    running_B = torch.zeros_like(rewards_BR[:, 0])
    for t in reversed(range(rewards_BR.shape[1])):
        running_B = rewards_BR[:, t] + gamma * running_B
        returns_BR[:, t] = running_B
    return returns_BR


def _broadcast(advantages_B: Tensor, mask_BR: Tensor) -> tuple[Tensor, Tensor]:
    advantages_BR = advantages_B.unsqueeze(-1) * mask_BR
    return advantages_BR, advantages_BR


def outcome_scores(inputs: AdvantageInputs) -> Tensor:
    return (inputs.token_rewards_BR * inputs.mask_BR).sum(dim=-1)


@register_estimator("gae", needs_values=True)
@torch.no_grad()
def gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    if inputs.values_BR is None:
        raise ValueError("advantage estimator 'gae' needs values_BR (a critic)")
    rewards_BR, values_BR, mask_BR = inputs.token_rewards_BR, inputs.values_BR, inputs.mask_BR
    next_value_B = torch.zeros_like(values_BR[:, 0])
    last_advantage_B = torch.zeros_like(values_BR[:, 0])
    advantages_BR = torch.zeros_like(values_BR)
    for t in reversed(range(rewards_BR.shape[1])):
        delta_B = rewards_BR[:, t] + inputs.gamma * next_value_B - values_BR[:, t]
        advantage_B = delta_B + inputs.gamma * inputs.lam * last_advantage_B
        # A masked token is skipped: the recursion carries over it unchanged.
        valid_B = mask_BR[:, t]
        next_value_B = torch.where(valid_B > 0, values_BR[:, t], next_value_B)
        last_advantage_B = torch.where(valid_B > 0, advantage_B, last_advantage_B)
        advantages_BR[:, t] = last_advantage_B
    returns_BR = (advantages_BR + values_BR) * mask_BR
    return masked_whiten(advantages_BR, mask_BR, inputs.sum_over_batch) * mask_BR, returns_BR


def _group_normalised(scores_B: Tensor, inputs: AdvantageInputs) -> Tensor:
    """grpo's (score - mean_G) / (std_G + eps) of each sample, the division skipped unless norm_by_std."""
    size_B, _, mean_B, std_B = _group_statistics(scores_B, inputs.group_ids_B)
    # A group of one has no baseline: mean 0 and std 1, as in verl.
    mean_B = torch.where(size_B > 1, mean_B, torch.zeros_like(mean_B))
    std_B = torch.where(size_B > 1, std_B, torch.ones_like(std_B))
    advantages_B = scores_B - mean_B
    if inputs.norm_by_std:
        advantages_B = advantages_B / (std_B + inputs.epsilon)
    return advantages_B


@register_estimator("grpo", needs_groups=True)
@torch.no_grad()
def grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return _broadcast(_group_normalised(outcome_scores(inputs), inputs), inputs.mask_BR)


@register_estimator("drgrpo", needs_groups=True)
def drgrpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return grpo(replace(inputs, norm_by_std=False))


@register_estimator("rloo", needs_groups=True)
@torch.no_grad()
def rloo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    scores_B = outcome_scores(inputs)
    baseline_B, has_baseline_B = leave_one_out_means(scores_B, inputs.group_ids_B)
    advantages_B = torch.where(has_baseline_B, scores_B - baseline_B, torch.zeros_like(scores_B))
    return _broadcast(advantages_B, inputs.mask_BR)


@register_estimator("grpo_passk", needs_groups=True)
@torch.no_grad()
def grpo_passk(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    scores_B = outcome_scores(inputs)
    _, group_B = torch.unique(inputs.group_ids_B, return_inverse=True)
    num_groups = int(group_B.max()) + 1 if group_B.numel() else 0
    lowest_G = scores_B.new_full((num_groups,), -math.inf)
    best_G = lowest_G.scatter_reduce(0, group_B, scores_B, "amax")
    is_best_B = scores_B == best_G[group_B]
    num_best_G = torch.zeros_like(best_G).index_add(0, group_B, is_best_B.to(scores_B.dtype))
    runner_up_G = lowest_G.scatter_reduce(0, group_B, scores_B.masked_fill(is_best_B, -math.inf), "amax")
    # Without sample i the group's best is unchanged, unless i was its only best: then the runner-up's.
    sole_best_B = is_best_B & (num_best_G[group_B] == 1)
    size_B, _, _, std_B = _group_statistics(scores_B, inputs.group_ids_B)
    margin_B = torch.where(sole_best_B & (size_B > 1), best_G[group_B] - runner_up_G[group_B],
                           torch.zeros_like(scores_B))
    if inputs.norm_by_std:
        margin_B = margin_B / (std_B + inputs.epsilon)
    return _broadcast(margin_B, inputs.mask_BR)


@register_estimator("opo", needs_groups=True)
@torch.no_grad()
def opo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    scores_B, lengths_B = outcome_scores(inputs), inputs.mask_BR.sum(dim=-1)
    _, weighted_sum_B, _, _ = _group_statistics(lengths_B * scores_B, inputs.group_ids_B)
    _, length_sum_B, _, _ = _group_statistics(lengths_B, inputs.group_ids_B)
    # Responses without valid tokens carry no gradient; the clamp only keeps their group's baseline finite.
    return _broadcast(scores_B - weighted_sum_B / length_sum_B.clamp(min=1), inputs.mask_BR)


@register_estimator("reinforce_plus_plus_baseline", needs_groups=True)
@torch.no_grad()
def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    scores_B = outcome_scores(inputs)
    _, _, mean_B, _ = _group_statistics(scores_B, inputs.group_ids_B)
    advantages_BR, _ = _broadcast(scores_B - mean_B, inputs.mask_BR)
    advantages_BR = masked_whiten(advantages_BR, inputs.mask_BR, inputs.sum_over_batch) * inputs.mask_BR
    return advantages_BR, advantages_BR


@register_estimator("gdpo", needs_groups=True, needs_reward_components=True)
@torch.no_grad()
def gdpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    if inputs.reward_components_BK is None:
        raise ValueError("advantage estimator 'gdpo' needs reward_components_BK (algorithm.reward_components)")
    components_BK = inputs.reward_components_BK
    summed_B = sum(_group_normalised(components_BK[:, k], inputs) for k in range(components_BK.shape[1]))
    advantages_BR, _ = _broadcast(summed_B, inputs.mask_BR)
    advantages_BR = masked_whiten(advantages_BR, inputs.mask_BR, inputs.sum_over_batch) * inputs.mask_BR
    return advantages_BR, advantages_BR


@register_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    mask_BR = inputs.mask_BR
    returns_BR = returns_to_go(inputs.token_rewards_BR * mask_BR, inputs.gamma)
    return masked_whiten(returns_BR, mask_BR, inputs.sum_over_batch) * mask_BR, returns_BR * mask_BR


@register_estimator("remax", needs_greedy_baseline=True)
@torch.no_grad()
def remax(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    if inputs.baseline_rewards_B is None:
        raise ValueError("advantage estimator 'remax' needs baseline_rewards_B (greedy-response rewards)")
    return _broadcast(outcome_scores(inputs) - inputs.baseline_rewards_B, inputs.mask_BR)
