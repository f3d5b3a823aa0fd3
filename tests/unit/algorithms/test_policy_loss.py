"""Policy losses against hand computations, including gradients checked with autograd."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.aggregation import aggregate
from megarl.algorithms.policy_loss import POLICY_LOSSES, PolicyLossParams

CLIP_HIGHER = PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def from_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, old_logprobs) whose per-token ratio is `ratios`; old logprobs are arbitrary."""
    old_BR = torch.tensor([[-1.0 - 0.3 * j for j in range(len(row))] for row in ratios])
    logprobs_BR = old_BR + torch.tensor([[math.log(r) for r in row] for row in ratios])
    return logprobs_BR, old_BR


def test_vanilla_by_hand_with_clip_higher_and_dual_clip():
    # Row 0: A=1, r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped high); A=2, r=1.1 -> -2.2;
    #        A=-1, r=4 -> max(4, 1.28) = 4, dual clip min(4, 3) = 3.
    # Row 1: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8 (clipped low); A=-0.5, r=1.1 -> 0.55; padding.
    logprobs_BR, old_BR = from_ratios([[1.5, 1.1, 4.0], [0.5, 1.1, 1.0]])
    advantages_BR = torch.tensor([[1.0, 2.0, -1.0], [-1.0, -0.5, 7.0]])
    mask_BR = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss_BR, metrics = POLICY_LOSSES.get("vanilla")(logprobs_BR, old_BR, advantages_BR, mask_BR, CLIP_HIGHER)
    torch.testing.assert_close(loss_BR[0], torch.tensor([-1.28, -2.2, 3.0]))
    torch.testing.assert_close(loss_BR[1, :2], torch.tensor([0.8, 0.55]))
    assert metrics["clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["clipfrac_lower"].item() == pytest.approx(1 / 5)
    approx_kl = -(math.log(1.5) + math.log(1.1) + math.log(4.0) + math.log(0.5) + math.log(1.1)) / 5
    assert metrics["approx_kl"].item() == pytest.approx(approx_kl, rel=1e-5)


def test_vanilla_without_dual_clip_is_unbounded_for_negative_advantages():
    logprobs_BR, old_BR = from_ratios([[4.0]])
    params = PolicyLossParams(clip_ratio_c=None)
    loss_BR, metrics = POLICY_LOSSES.get("vanilla")(
        logprobs_BR, old_BR, torch.tensor([[-1.0]]), torch.ones(1, 1), params
    )
    assert loss_BR.item() == pytest.approx(4.0)
    assert metrics["clipfrac_lower"].item() == 0.0


def test_dual_clip_bound_must_exceed_one():
    logprobs_BR, old_BR = from_ratios([[1.0]])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        POLICY_LOSSES.get("vanilla")(
            logprobs_BR, old_BR, torch.ones(1, 1), torch.ones(1, 1), PolicyLossParams(clip_ratio_c=1.0)
        )


def test_importance_weights_multiply_the_loss():
    logprobs_BR, old_BR = from_ratios([[1.1, 0.9]])
    advantages_BR, mask_BR = torch.tensor([[1.0, -2.0]]), torch.ones(1, 2)
    weights_BR = torch.tensor([[0.5, 2.0]])
    loss_BR, _ = POLICY_LOSSES.get("vanilla")(logprobs_BR, old_BR, advantages_BR, mask_BR, CLIP_HIGHER, weights_BR)
    torch.testing.assert_close(loss_BR, torch.tensor([[-1.1 * 0.5, 1.8 * 2.0]]))


def test_vanilla_gradient_is_minus_advantage_times_ratio_over_token_count():
    # Ratios 1.1, 0.9, 1.05 lie inside [0.8, 1.28]; 1.5 (A>0) and 0.5 (A<0) are clipped: zero gradient.
    logprobs_BR, old_BR = from_ratios([[1.1, 0.9, 1.5], [1.05, 0.5, 1.0]])
    logprobs_BR.requires_grad_()
    advantages_BR = torch.tensor([[2.0, -1.0, 1.0], [0.5, -1.0, 3.0]])
    mask_BR = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss_BR, _ = POLICY_LOSSES.get("vanilla")(logprobs_BR, old_BR, advantages_BR, mask_BR, CLIP_HIGHER)
    aggregate(loss_BR, mask_BR, "token-mean").backward()
    expected = torch.tensor([[-2.0 * 1.1 / 5, 1.0 * 0.9 / 5, 0.0], [-0.5 * 1.05 / 5, 0.0, 0.0]])
    torch.testing.assert_close(logprobs_BR.grad, expected)


def gspo_inputs():
    # Sequence 0: log ratios 0.1, -0.05, 0.2 -> s_0 = exp(0.25 / 3); sequence 1: 0.3 then padding
    # whose garbage log ratio (5.0) must not enter the mean -> s_1 = exp(0.3).
    old_BR = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -1.0, -1.0]])
    logprobs_BR = old_BR + torch.tensor([[0.1, -0.05, 0.2], [0.3, 5.0, 5.0]])
    mask_BR = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages_BR = torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 0.0]])
    return logprobs_BR, old_BR, advantages_BR, mask_BR


def test_gspo_sequence_ratio_by_hand():
    logprobs_BR, old_BR, advantages_BR, mask_BR = gspo_inputs()
    s0, s1 = math.exp(0.25 / 3), math.exp(0.3)
    # Wide clip: nothing clipped, loss = -A s_i at every valid token.
    wide = PolicyLossParams(clip_ratio_low=0.5, clip_ratio_high=0.5, clip_ratio_c=None)
    loss_BR, metrics = POLICY_LOSSES.get("gspo")(logprobs_BR, old_BR, advantages_BR, mask_BR, wide)
    torch.testing.assert_close(loss_BR[0], torch.tensor([-s0, -s0, -s0]))
    assert loss_BR[1, 0].item() == pytest.approx(2.0 * s1, rel=1e-5)
    assert metrics["clipfrac"].item() == 0.0
    assert metrics["approx_kl"].item() == pytest.approx(-(0.25 + 0.3) / 4, rel=1e-5)
    # GSPO-sized ranges: s_0 ~ 1.087 clipped to 1 + 4e-4 (A>0); s_1 ~ 1.35 with A<0 keeps -A s_1.
    tight = PolicyLossParams(clip_ratio_low=3e-4, clip_ratio_high=4e-4, clip_ratio_c=None)
    loss_BR, metrics = POLICY_LOSSES.get("gspo")(logprobs_BR, old_BR, advantages_BR, mask_BR, tight)
    torch.testing.assert_close(loss_BR[0], torch.full((3,), -(1 + 4e-4)))
    assert loss_BR[1, 0].item() == pytest.approx(2.0 * s1, rel=1e-5)
    assert metrics["clipfrac"].item() == pytest.approx(3 / 4)


def test_gspo_gradient_is_the_sequence_ratio_spread_over_tokens():
    logprobs_BR, old_BR, advantages_BR, mask_BR = gspo_inputs()
    logprobs_BR.requires_grad_()
    wide = PolicyLossParams(clip_ratio_low=0.5, clip_ratio_high=0.5, clip_ratio_c=None)
    loss_BR, _ = POLICY_LOSSES.get("gspo")(logprobs_BR, old_BR, advantages_BR, mask_BR, wide)
    aggregate(loss_BR, mask_BR, "seq-mean-token-mean").backward()
    # d/d logp_it of (1/B) sum_i (1/|y_i|) sum_t -A_i s_i = -A_i s_i / (|y_i| B), as in the paper.
    s0, s1 = math.exp(0.25 / 3), math.exp(0.3)
    expected = torch.tensor([[-s0 / 6] * 3, [2.0 * s1 / 2, 0.0, 0.0]])
    torch.testing.assert_close(logprobs_BR.grad, expected)


def test_unknown_policy_loss_lists_the_registered_ones():
    with pytest.raises(ValueError, match="gspo, kl_cov, sapo, vanilla"):
        POLICY_LOSSES.get("ppo")
