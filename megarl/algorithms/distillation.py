"""On-policy distillation (OPD): a teacher scores the student's own samples token by token.

The student pi_s samples y ~ pi_s(. | x); a frozen teacher pi_T gives the log-prob of every sampled
token. The per-token reverse KL estimate is

    k_t = log pi_s(y_t | x, y_<t) - log pi_T(y_t | x, y_<t)       (E_{y~pi_s}[sum_t k_t] = KL(pi_s || pi_T))

and the advantage of token t is its negative, with no discounting over later tokens (as in
Agarwal et al., "On-Policy Distillation of Language Models", 2024, and Thinking Machines' "On-Policy
Distillation", 2025):

    A_t = -k_t + w * (score_i - mean_G(i) score)       (w = task_reward_weight; w = 0: pure distillation)

The optional second term is the task reward's Dr. GRPO advantage (the outcome score minus its
group's mean; a group of one keeps its raw score), broadcast over the response. The policy loss
(PPO clip) then pushes up tokens the teacher likes more than the student and down the others. Both
log-probs are inputs (no gradient reaches the teacher); returns equal the advantages.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.algorithms.advantages import AdvantageInputs, drgrpo, register_estimator


def reverse_kl_tokens(student_logprobs_BR: Tensor, teacher_logprobs_BR: Tensor, mask_BR: Tensor) -> Tensor:
    """k_t = log pi_s - log pi_T per response token, zero at padding. (B, R)"""
    return (student_logprobs_BR - teacher_logprobs_BR) * mask_BR


@register_estimator("opd", needs_teacher=True)
@torch.no_grad()
def opd(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    if inputs.student_logprobs_BR is None or inputs.teacher_logprobs_BR is None:
        raise ValueError("advantage estimator 'opd' needs student_logprobs_BR and teacher_logprobs_BR (a teacher)")
    advantages_BR = -reverse_kl_tokens(inputs.student_logprobs_BR, inputs.teacher_logprobs_BR, inputs.mask_BR)
    if inputs.task_reward_weight:
        task_BR, _ = drgrpo(inputs)
        advantages_BR = advantages_BR + inputs.task_reward_weight * task_BR
    return advantages_BR, advantages_BR
