"""The actor's, critic's and PRIME reward model's losses, assembled from the registered pure functions.

Each loss is computed per micro-batch but normalised by the counts of the whole mini-batch (the
engine's `LossNormalizer`), so per-micro-batch losses and metrics are contributions that add up
to the mini-batch value across micro-batches and DP ranks.
"""

from __future__ import annotations

import torch

from megarl.algorithms import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    PolicyLossParams,
    RolloutCorrection,
    aggregate,
    clipped_value_loss,
    correct_rollout,
    implicit_accuracy,
    implicit_sequence_rewards,
    outcome_cross_entropy,
)
from megarl.config.schema import ActorConfig, CriticConfig, PrimeConfig, RolloutCorrectionConfig
from megarl.engine.batch import SequenceBatch
from megarl.engine.megatron_engine import LossFn, LossNormalizer


def _as_contribution(value: torch.Tensor, micro_batch: SequenceBatch, normalizer: LossNormalizer) -> torch.Tensor:
    """A token-mean metric of one micro-batch, weighted by its share of the mini-batch's (model) tokens."""
    return value.detach() * micro_batch.num_loss_tokens / normalizer.num_tokens


def rollout_correction(config: RolloutCorrectionConfig) -> RolloutCorrection:
    """The preset with the bounds the config sets (`megarl.trainer.startup` checked that it reads them)."""
    if config.preset == "auto":  # the schema's default, which needs the placement to resolve
        raise ValueError("algorithm.rollout_correction.preset 'auto' is resolved when the run config is loaded "
                         "(megarl.config.load_config); a config built in code names its preset")
    return ROLLOUT_CORRECTIONS.get(config.preset).with_bounds(config.cap, config.lower, config.upper,
                                                              config.opsm_delta)


def actor_loss(config: ActorConfig, correction_config: RolloutCorrectionConfig, max_response_length: int) -> LossFn:
    """PPO-style policy loss (`actor.policy_loss`) times the rollout correction's weights, minus the entropy
    bonus, plus the KL loss; a token the correction rejects leaves all three (its keep mask multiplies them)
    but stays in the normaliser's counts (why: `megarl.algorithms.rollout_correction`)."""
    correction = rollout_correction(correction_config)
    policy_loss = POLICY_LOSSES.get(config.policy_loss)
    kl_estimator = KL_ESTIMATORS.get(config.kl_loss_type)
    params = PolicyLossParams(
        clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c or None, tau_pos=config.tau_pos, tau_neg=config.tau_neg,
        clip_cov_ratio=config.clip_cov_ratio, clip_cov_lb=config.clip_cov_lb, clip_cov_ub=config.clip_cov_ub,
        kl_cov_ratio=config.kl_cov_ratio, ppo_kl_coef=config.ppo_kl_coef, dro_beta=config.dro_beta,
    )

    def loss_fn(outputs: dict, micro_batch: SequenceBatch, normalizer: LossNormalizer):
        tensors = micro_batch.response_tensors.map(lambda tensor_BR: tensor_BR.to(outputs["logprobs"].device))
        mask_BR = micro_batch.response_mask_BR.to(outputs["logprobs"].device)

        # Without old log-probs the trainer skipped scoring because this is the update's only step: the
        # policy being trained is still the one the batch is scored against, so they are its own.
        old_BR = tensors.old_logprobs_BR if tensors.old_logprobs_BR is not None else outputs["logprobs"].detach()
        weights_BR = keep_BR = None
        correction_metrics = {}
        if correction.is_active:
            corrected = correct_rollout(correction, old_BR, tensors.rollout_logprobs_BR, mask_BR, outputs["logprobs"],
                                        tensors.advantages_BR)
            weights_BR, keep_BR = corrected.weights_BR, corrected.keep_BR
            # Sums over this micro-batch divided by the mini-batch's counts: contributions that add up.
            for counts, count in ((corrected.token_counts, normalizer.num_tokens),
                                  (corrected.sequence_counts, normalizer.num_sequences)):
                correction_metrics.update({f"actor/rollout_correction/{name}": total / count
                                           for name, total in counts.items()})

        def mean(values_BR):
            kept_BR = values_BR if keep_BR is None else values_BR * keep_BR
            return aggregate(kept_BR, mask_BR, config.loss_agg_mode, normalizer.num_tokens,
                             normalizer.num_sequences, max_response_length)

        pg_BR, pg_metrics = policy_loss(outputs["logprobs"], old_BR, tensors.advantages_BR, mask_BR, params,
                                        weights_BR)
        pg_loss, entropy = mean(pg_BR), mean(outputs["entropy"])
        loss = pg_loss - config.entropy_coeff * entropy
        metrics = {"actor/pg_loss": pg_loss.detach(), "actor/entropy": entropy.detach(), **correction_metrics}
        if config.use_kl_loss:
            kl = mean(kl_estimator(outputs["logprobs"], tensors.ref_logprobs_BR))
            loss = loss + config.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        for name, value in pg_metrics.items():
            metrics[f"actor/{name}"] = _as_contribution(torch.as_tensor(value), micro_batch, normalizer)
        return loss, metrics

    return loss_fn


def critic_loss(config: CriticConfig) -> LossFn:
    def loss_fn(outputs: dict, micro_batch: SequenceBatch, normalizer: LossNormalizer):
        tensors = micro_batch.response_tensors.map(lambda tensor_BR: tensor_BR.to(outputs["values"].device))
        mask_BR = micro_batch.response_mask_BR.to(outputs["values"].device)
        loss_BR, value_metrics = clipped_value_loss(outputs["values"], tensors.values_BR, tensors.returns_BR,
                                                    mask_BR, config.cliprange_value)
        loss = aggregate(loss_BR, mask_BR, "token-mean", normalizer.num_tokens)
        metrics = {"critic/vf_loss": loss.detach()}
        for name, value in value_metrics.items():
            metrics[f"critic/{name}"] = _as_contribution(torch.as_tensor(value), micro_batch, normalizer)
        return loss, metrics

    return loss_fn


def prm_loss(config: PrimeConfig) -> LossFn:
    """PRIME's cross-entropy of the implicit sequence reward against the outcome labels, a mean over the
    mini-batch's responses; the batch carries the reference's log-probs (`prm_ref_logprobs_BR`) and each
    response's 0/1 label on its tokens (`prm_labels_BR`)."""

    def loss_fn(outputs: dict, micro_batch: SequenceBatch, normalizer: LossNormalizer):
        device = outputs["logprobs"].device
        tensors = micro_batch.response_tensors.map(lambda tensor_BR: tensor_BR.to(device))
        mask_BR = micro_batch.response_mask_BR.to(device)
        rewards_B = implicit_sequence_rewards(outputs["logprobs"], tensors.prm_ref_logprobs_BR, mask_BR, config.beta)
        labels_B = tensors.prm_labels_BR[:, 0]  # every response has a first token
        loss = outcome_cross_entropy(rewards_B, labels_B).sum() / normalizer.num_sequences
        accuracy = implicit_accuracy(rewards_B.detach(), labels_B).sum() / normalizer.num_sequences
        return loss, {"prime/prm_loss": loss.detach(), "prime/prm_accuracy": accuracy}

    return loss_fn
