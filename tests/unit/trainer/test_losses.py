"""The actor loss without recorded old log-probs (the update's own forward stands in for them), rollout
corrections (weights, rejection, their metrics), multi-turn loss masks, and PRIME's PRM loss, against
gradients by hand."""

import math

import pytest
import torch

from megarl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, AdvantageInputs
from megarl.config.schema import ActorConfig, PrimeConfig, RolloutCorrectionConfig
from megarl.engine.batch import SequenceBatch, right_pad
from megarl.engine.megatron_engine import LossNormalizer
from megarl.rewards import token_level_scores
from megarl.trainer.losses import actor_loss, prm_loss


def _batch() -> SequenceBatch:
    generator = torch.Generator().manual_seed(0)
    response_lengths = torch.tensor([3, 5, 1, 4])
    batch = SequenceBatch(torch.randint(0, 50, (4, 9), generator=generator), torch.tensor([2, 4, 3, 5]),
                          response_lengths)
    mask = batch.response_mask_BR
    batch.response_tensors.advantages_BR = torch.randn(4, 5, generator=generator) * mask
    batch.response_tensors.rollout_logprobs_BR = -torch.rand(4, 5, generator=generator) * mask
    return batch


def _loss_and_grad(config: ActorConfig, batch: SequenceBatch, logprobs: torch.Tensor,
                   correction: RolloutCorrectionConfig = RolloutCorrectionConfig(preset="none")):
    logprobs = logprobs.clone().requires_grad_()
    outputs = {"logprobs": logprobs, "entropy": torch.rand(4, 5, generator=torch.Generator().manual_seed(1))}
    normalizer = LossNormalizer(int(batch.response_lengths_B.sum()), len(batch))
    loss, metrics = actor_loss(config, correction, max_response_length=5)(outputs, batch, normalizer)
    loss.backward()
    return loss.detach(), logprobs.grad, metrics


def test_missing_old_logprobs_are_the_forwards_own():
    config = ActorConfig()
    correction = RolloutCorrectionConfig(preset="token_tis")  # the importance weights use the old log-probs too
    logprobs = -torch.rand(4, 5, generator=torch.Generator().manual_seed(2)) * _batch().response_mask_BR
    recorded = _batch()
    recorded.response_tensors.old_logprobs_BR = logprobs.clone()
    expected = _loss_and_grad(config, recorded, logprobs, correction)
    actual = _loss_and_grad(config, _batch(), logprobs, correction)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert actual[2].keys() == expected[2].keys()
    # An independent value: at ratio 1 the gradient is -advantage / tokens on every response token.
    batch = _batch()
    tokens = int(batch.response_lengths_B.sum())
    weights = torch.exp(logprobs - batch.response_tensors.rollout_logprobs_BR).clamp(max=2.0)
    assert torch.allclose(actual[1], -batch.response_tensors.advantages_BR * weights * batch.response_mask_BR / tokens)


def test_truncated_importance_weights_scale_each_tokens_loss():
    # Ratios away from 1 on both sides of the clip range, and weights on both sides of the cap.
    config = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean")
    correction = RolloutCorrectionConfig(preset="token_tis", cap=1.1)
    generator = torch.Generator().manual_seed(3)
    batch = _batch()
    mask = batch.response_mask_BR
    old = -torch.rand(4, 5, generator=generator) * mask
    batch.response_tensors.old_logprobs_BR = old
    batch.response_tensors.rollout_logprobs_BR = old + 0.6 * (torch.rand(4, 5, generator=generator) - 0.5) * mask
    new = old + 0.8 * (torch.rand(4, 5, generator=generator) - 0.5) * mask
    loss, _, _ = _loss_and_grad(config, batch, new, correction)
    # By hand, token by token: w = min(pi_old / pi_rollout, cap); pg = max(-A r, -A clip(r)); token mean.
    expected, tokens = 0.0, 0
    for b in range(4):
        for t in range(int(batch.response_lengths_B[b])):
            ratio = float(torch.exp(new[b, t] - old[b, t]))
            weight = min(float(torch.exp(old[b, t] - batch.response_tensors.rollout_logprobs_BR[b, t])), 1.1)
            advantage = float(batch.response_tensors.advantages_BR[b, t])
            expected += weight * max(-advantage * ratio, -advantage * min(max(ratio, 0.8), 1.2))
            tokens += 1
    entropy = float((torch.rand(4, 5, generator=torch.Generator().manual_seed(1)) * mask).sum()) / tokens
    assert float(loss) == pytest.approx(expected / tokens - config.entropy_coeff * entropy, abs=1e-6)


def _mismatched_batch() -> SequenceBatch:
    """_batch() scored by the trainer; the engine's log-probs differ by 0.1 per token, except on sequence 1
    (5 tokens) by 0.3 each, so that its sequence ratio, exp(5 * 0.3) = 4.48, lies outside [0.5, 2]."""
    batch = _batch()
    mask = batch.response_mask_BR
    old = -torch.rand(4, 5, generator=torch.Generator().manual_seed(5)) * mask
    shift = torch.full((4, 5), 0.1)
    shift[1] = 0.3
    batch.response_tensors.old_logprobs_BR = old
    batch.response_tensors.rollout_logprobs_BR = (old - shift) * mask
    batch.response_tensors.ref_logprobs_BR = -torch.rand(4, 5, generator=torch.Generator().manual_seed(6)) * mask
    return batch


def test_rejected_sequences_leave_every_term_but_stay_in_the_counts():
    # seq_mis: sequence ratios exp(0.1 * [3, 5->0.3*5, 1, 4]) = [1.35, 4.48, 1.11, 1.49]; sequence 1 is
    # rejected, the others are weighted by their ratio. At new = old (ratio 1) the policy term's gradient
    # is -A w / 13 (13 valid tokens, the rejected 5 included), the entropy's -0.01 / 13, the KL's its own / 13.
    batch = _mismatched_batch()
    mask, tensors = batch.response_mask_BR, batch.response_tensors
    logprobs = tensors.old_logprobs_BR.clone().requires_grad_()
    entropy = torch.rand(4, 5, generator=torch.Generator().manual_seed(7)).requires_grad_()
    config = ActorConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    loss_fn = actor_loss(config, RolloutCorrectionConfig(preset="seq_mis"), max_response_length=5)
    loss, metrics = loss_fn({"logprobs": logprobs, "entropy": entropy}, batch, LossNormalizer(13, 4))
    loss.backward()
    assert torch.equal(logprobs.grad[1], torch.zeros(5)) and torch.equal(entropy.grad[1], torch.zeros(5))
    kept = mask.clone()
    kept[1] = 0
    weights = torch.tensor([math.exp(0.3), 0.0, math.exp(0.1), math.exp(0.4)])[:, None] * kept
    kl_grad = torch.func.grad(lambda lp: (KL_ESTIMATORS.get("k3")(lp, tensors.ref_logprobs_BR) * kept).sum())(
        tensors.old_logprobs_BR) * 0.1
    torch.testing.assert_close(logprobs.grad, (-tensors.advantages_BR * weights + kl_grad) / 13, rtol=1e-5,
                               atol=1e-7)
    torch.testing.assert_close(entropy.grad, -0.01 * kept / 13)
    fraction = {name.removeprefix("actor/rollout_correction/"): float(value) for name, value in metrics.items()
                if name.startswith("actor/rollout_correction/")}
    assert fraction == pytest.approx({"token_kept_fraction": 8 / 13, "token_clipped_fraction": 0.0,
                                      "token_masked_fraction": 5 / 13, "seq_kept_fraction": 3 / 4,
                                      "seq_clipped_fraction": 0.0, "seq_masked_fraction": 1 / 4,
                                      "weight_mean": float(weights.sum()) / 13})


def test_off_policy_sequence_masking_needs_the_current_policy_and_takes_no_gradient_from_it():
    # opsm_delta = 0.2 without a preset: the engine's log-probs exceed the current policy's (here the old
    # ones) by 0.1 per token, by 0.3 on sequence 1, whose negative-advantage tokens alone are dropped.
    batch = _mismatched_batch()
    mask, tensors = batch.response_mask_BR, batch.response_tensors
    tensors.rollout_logprobs_BR = (2 * tensors.old_logprobs_BR - tensors.rollout_logprobs_BR) * mask  # old + shift
    correction = RolloutCorrectionConfig(preset="none", opsm_delta=0.2)
    loss, grad, metrics = _loss_and_grad(ActorConfig(), batch, tensors.old_logprobs_BR, correction)
    dropped = torch.zeros(4, 5, dtype=torch.bool)
    dropped[1] = tensors.advantages_BR[1] < 0
    assert 0 < int(dropped.sum()) < 5
    assert torch.equal(grad[dropped], torch.zeros(int(dropped.sum())))
    # The gradient is the policy term's alone, -A / 13 on every kept token: no term from the masking's use of
    # the current log-probs.
    torch.testing.assert_close(grad, -tensors.advantages_BR * mask * ~dropped / 13)
    assert float(metrics["actor/rollout_correction/opsm_token_masked_fraction"]) == pytest.approx(
        int(dropped.sum()) / 13)


def test_correction_metrics_of_micro_batches_add_up_to_the_mini_batch():
    # token_mis on two micro-batches of two sequences each, normalised by the whole mini-batch's counts.
    batch = _mismatched_batch()
    batch.response_tensors.rollout_logprobs_BR[0, 1] -= 1.0  # one token of sequence 0 out of the band too
    loss_fn = actor_loss(ActorConfig(), RolloutCorrectionConfig(preset="token_mis", upper=1.2), max_response_length=5)
    normalizer = LossNormalizer(13, 4)

    def metrics_of(micro_batch):
        outputs = {"logprobs": micro_batch.response_tensors.old_logprobs_BR,
                   "entropy": torch.zeros_like(micro_batch.response_mask_BR)}
        return loss_fn(outputs, micro_batch, normalizer)[1]

    whole = metrics_of(batch)
    halves = [metrics_of(batch.select(indices)) for indices in ([0, 1], [2, 3])]
    for name, value in whole.items():
        if name.startswith("actor/rollout_correction/"):
            assert float(halves[0][name] + halves[1][name]) == pytest.approx(float(value))
    # By hand: token ratios exp(0.1) = 1.105 are kept, exp(0.3) = 1.35 (all of sequence 1) and exp(1.1) = 3.0
    # (the one of sequence 0) are above 1.2: 6 of 13 tokens masked, in sequences 0 and 1.
    assert float(whole["actor/rollout_correction/token_masked_fraction"]) == pytest.approx(6 / 13)
    assert float(whole["actor/rollout_correction/seq_masked_fraction"]) == pytest.approx(2 / 4)


def test_prm_loss_gradient_is_beta_times_sigmoid_minus_label():
    # d CE / d log pi_prm(y_t) = beta * (sigmoid(r(y)) - label) at every valid token of y, over the
    # mini-batch's sequence count (here twice this micro-batch's: another micro-batch holds the rest).
    batch = _batch()
    mask = batch.response_mask_BR
    generator = torch.Generator().manual_seed(3)
    reference = -torch.rand(4, 5, generator=generator) * mask
    labels = [1.0, 0.0, 1.0, 0.0]
    batch.response_tensors.prm_ref_logprobs_BR = reference
    batch.response_tensors.prm_labels_BR = torch.tensor(labels)[:, None] * mask
    logprobs = (-torch.rand(4, 5, generator=generator) * mask).requires_grad_()
    loss, metrics = prm_loss(PrimeConfig(beta=0.1))({"logprobs": logprobs}, batch, LossNormalizer(100, 8))
    loss.backward()
    rewards = [0.1 * float(((logprobs[i] - reference[i]) * mask[i]).sum()) for i in range(4)]
    sigmoid = [1 / (1 + math.exp(-r)) for r in rewards]
    expected_grad = torch.tensor([0.1 * (sigmoid[i] - labels[i]) / 8 for i in range(4)])[:, None] * mask
    assert torch.allclose(logprobs.grad, expected_grad, atol=1e-7)
    expected_loss = sum(-math.log(s) if y else -math.log(1 - s) for s, y in zip(sigmoid, labels)) / 8
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    right = sum((r > 0) == (y == 1.0) for r, y in zip(rewards, labels))
    assert metrics["prime/prm_accuracy"].item() == pytest.approx(right / 8)


def test_environment_tokens_of_multi_turn_responses_get_exactly_zero_gradient():
    # Two trajectories of one prompt, model turns with tool answers between them (loss mask 0), and a
    # single-turn response: GRPO advantages from their rewards, then the actor loss with entropy and KL
    # terms, differentiated with respect to every per-token input of the loss.
    generator = torch.Generator().manual_seed(4)
    loss_masks = [[1, 1, 0, 0, 0, 1], [1, 0, 0, 1, 1, 1, 0, 1], [1, 1, 1]]
    batch = SequenceBatch.from_sequences([[7, 8], [7, 8], [9]], [[20 + i for i in range(len(m))] for m in loss_masks],
                                         0, loss_masks=loss_masks)
    mask = right_pad(loss_masks, 0, torch.float32)
    rewards = token_level_scores([1.0, 0.0, 0.5], batch.response_lengths_B.tolist())
    advantages, _ = ADVANTAGE_ESTIMATORS.get("grpo")(AdvantageInputs(rewards * mask, mask, torch.tensor([0, 0, 1])))
    batch.response_tensors.advantages_BR = advantages * mask
    batch.response_tensors.ref_logprobs_BR = -torch.rand(3, 8, generator=generator) * mask
    logprobs = (-torch.rand(3, 8, generator=generator)).requires_grad_()
    entropy = torch.rand(3, 8, generator=generator).requires_grad_()
    config = ActorConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    batch.response_tensors.old_logprobs_BR = logprobs.detach().clone()
    loss, _ = actor_loss(config, RolloutCorrectionConfig(preset="none"), max_response_length=8)(
        {"logprobs": logprobs, "entropy": entropy}, batch, LossNormalizer(batch.num_loss_tokens, len(batch)))
    loss.backward()
    environment = mask == 0
    assert torch.equal(logprobs.grad[environment], torch.zeros(int(environment.sum())))
    assert torch.equal(entropy.grad[environment], torch.zeros(int(environment.sum())))
    assert (entropy.grad[mask > 0] != 0).all()
    # Model tokens: at ratio 1 the policy-gradient term is -A / (model tokens), plus the KL term's.
    reference = batch.response_tensors.ref_logprobs_BR
    kl_grad = torch.func.grad(lambda lp: (KL_ESTIMATORS.get(config.kl_loss_type)(lp, reference) * mask).sum())(
        logprobs.detach()) * 0.1
    expected = (-batch.response_tensors.advantages_BR * mask + kl_grad) / 11
    torch.testing.assert_close(logprobs.grad[mask > 0], expected[mask > 0], rtol=1e-6, atol=1e-7)
    assert torch.equal(batch.response_mask_BR, mask) and batch.num_loss_tokens == 11
