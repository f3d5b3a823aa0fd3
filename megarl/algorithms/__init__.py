"""RL algorithms as pure tensor functions in registries (see each module's docstring for the math).

Tensors are response-aligned: shape (B, R), column j the j-th response token, right-padded, with a
float 0/1 `mask_BR`. Nothing here knows about process groups or configs.
"""

from megarl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    masked_whiten,
    register_estimator,
)
from megarl.algorithms.aggregation import LOSS_AGGREGATIONS, aggregate, masked_mean
from megarl.algorithms.dapo import keep_informative_groups, overlong_penalty
from megarl.algorithms.distillation import reverse_kl_tokens
from megarl.algorithms.importance import rollout_mismatch_tokens
from megarl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty_rewards,
)
from megarl.algorithms.policy_loss import POLICY_LOSSES, PolicyLossParams
from megarl.algorithms.prime import (  # also registers the prime estimator
    implicit_accuracy,
    implicit_sequence_rewards,
    implicit_token_rewards,
    outcome_cross_entropy,
)
from megarl.algorithms.rollout_correction import ROLLOUT_CORRECTIONS, RolloutCorrection, correct_rollout
from megarl.algorithms.value_loss import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTIONS",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "PolicyLossParams",
    "RolloutCorrection",
    "aggregate",
    "clipped_value_loss",
    "correct_rollout",
    "implicit_accuracy",
    "implicit_sequence_rewards",
    "implicit_token_rewards",
    "keep_informative_groups",
    "kl_penalty_rewards",
    "masked_mean",
    "masked_whiten",
    "outcome_cross_entropy",
    "overlong_penalty",
    "register_estimator",
    "reverse_kl_tokens",
    "rollout_mismatch_tokens",
]
