"""CISPO, SAPO, GMPO, DPPO (TV, KL), Clip-Cov, KL-Cov, GPG and DRO against the papers' formulas.

Each loss is checked (a) on random masked batches, per-token loss and gradient w.r.t. the log-probs,
against a reference written here from the paper, token by token on Python floats with the
derivative worked out by hand (GMPO: the paper's per-sequence product, differentiated by autograd);
(b) on a small case computed by hand; (c) under every aggregation mode.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.aggregation import LOSS_AGGREGATIONS, aggregate
from megarl.algorithms.policy_loss import POLICY_LOSSES, PolicyLossParams

NEW_LOSSES = ["cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "gpg", "dro"]
LENGTHS = [7, 3, 5, 1, 6]


def random_batch(seed: int, sequence_advantages: bool = False, spread: float = 0.3):
    """(logprobs, old_logprobs, advantages, mask) in float64, right-padded with garbage (+7, 9) after
    each response of LENGTHS; logprobs is a leaf that wants gradients."""
    generator = torch.Generator().manual_seed(seed)
    num_sequences, length = len(LENGTHS), max(LENGTHS)
    mask_BR = torch.tensor([[1.0 if t < n else 0.0 for t in range(length)] for n in LENGTHS], dtype=torch.float64)
    old_BR = -0.05 - 3.0 * torch.rand(num_sequences, length, generator=generator, dtype=torch.float64)
    logprobs_BR = (old_BR + spread * torch.randn(num_sequences, length, generator=generator, dtype=torch.float64))
    logprobs_BR = logprobs_BR.clamp(max=-1e-3)
    if sequence_advantages:
        advantages_BR = torch.randn(num_sequences, 1, generator=generator, dtype=torch.float64).expand(-1, length)
        advantages_BR = advantages_BR.clone()
    else:
        advantages_BR = torch.randn(num_sequences, length, generator=generator, dtype=torch.float64)
    padding_BR = mask_BR == 0
    logprobs_BR = torch.where(padding_BR, 7.0, logprobs_BR).requires_grad_()
    advantages_BR = torch.where(padding_BR, 9.0, advantages_BR)
    return logprobs_BR, old_BR, advantages_BR, mask_BR


def valid_tokens(mask_BR):
    return [(i, t) for i in range(mask_BR.shape[0]) for t in range(mask_BR.shape[1]) if mask_BR[i, t] > 0]


def check_against_reference(name, params, reference, seed=0, spread=0.3):
    """`reference(logp, old, A, i, t) -> (L_t, dL_t/dlogp_t)` for one token; token-mean gradient."""
    logprobs_BR, old_BR, advantages_BR, mask_BR = random_batch(seed, spread=spread)
    loss_BR, _ = POLICY_LOSSES.get(name)(logprobs_BR, old_BR, advantages_BR, mask_BR, params)
    aggregate(loss_BR, mask_BR, "token-mean").backward()
    tokens = valid_tokens(mask_BR)
    expected_grad_BR = torch.zeros_like(mask_BR)
    for i, t in tokens:
        value, derivative = reference(logprobs_BR[i, t].item(), old_BR[i, t].item(), advantages_BR[i, t].item(), i, t)
        assert loss_BR[i, t].item() == pytest.approx(value, rel=1e-9, abs=1e-12), (name, i, t)
        expected_grad_BR[i, t] = derivative / len(tokens)
    torch.testing.assert_close(logprobs_BR.grad, expected_grad_BR, rtol=1e-9, atol=1e-12)


def from_probabilities(old_probs, new_probs):
    """(logprobs leaf, old_logprobs) of one sequence from probabilities."""
    old_BR = torch.tensor([[math.log(q) for q in old_probs]], dtype=torch.float64)
    logprobs_BR = torch.tensor([[math.log(p) for p in new_probs]], dtype=torch.float64, requires_grad=True)
    return logprobs_BR, old_BR


# ---------------------------------------------------------------- CISPO (arXiv:2506.13585)

CISPO = PolicyLossParams(clip_ratio_low=10.0, clip_ratio_high=0.1, clip_ratio_c=None)


def cispo_reference(logp, old, advantage, i, t):
    # J = sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi; the loss is -J, its derivative -w A.
    weight = min(max(math.exp(logp - old), 1 - CISPO.clip_ratio_low), 1 + CISPO.clip_ratio_high)
    return -weight * advantage * logp, -weight * advantage


def test_cispo_matches_the_paper_on_random_batches():
    check_against_reference("cispo", CISPO, cispo_reference)
    # With a binding lower bound as well (verl's usual 0.2 / 0.28).
    both = PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28)

    def reference(logp, old, advantage, i, t):
        weight = min(max(math.exp(logp - old), 0.8), 1.28)
        return -weight * advantage * logp, -weight * advantage

    check_against_reference("cispo", both, reference, seed=1)


def test_cispo_by_hand():
    # old = -1.0, -1.3; ratios 1.5, 0.5 -> logp = -1 + ln 1.5 = -0.594535, -1.3 + ln 0.5 = -1.993147.
    # No lower bound, upper 1.28: weights 1.28 (clipped), 0.5 (not clipped: the lower bound is -9).
    # Loss -w A logp: -1.28 * 1 * -0.594535 = 0.761005;  -0.5 * -1 * -1.993147 = -0.996574.
    # Token-mean gradient -w A / 2: -0.64, +0.25. clipfrac 1/2.
    old_BR = torch.tensor([[-1.0, -1.3]], dtype=torch.float64)
    logprobs_BR = (old_BR + torch.tensor([[math.log(1.5), math.log(0.5)]], dtype=torch.float64)).requires_grad_()
    params = PolicyLossParams(clip_ratio_low=10.0, clip_ratio_high=0.28)
    loss_BR, metrics = POLICY_LOSSES.get("cispo")(
        logprobs_BR, old_BR, torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2), params
    )
    torch.testing.assert_close(loss_BR, torch.tensor([[0.761005, -0.996574]], dtype=torch.float64), atol=1e-6, rtol=0)
    aggregate(loss_BR, torch.ones(1, 2), "token-mean").backward()
    torch.testing.assert_close(logprobs_BR.grad, torch.tensor([[-0.64, 0.25]], dtype=torch.float64))
    assert metrics["clipfrac"].item() == pytest.approx(0.5)


# ---------------------------------------------------------------- SAPO (arXiv:2511.20347)

SAPO = PolicyLossParams(tau_pos=1.0, tau_neg=1.05)


def sapo_reference(logp, old, advantage, i, t):
    # f(r) = sigmoid(tau (r - 1)) 4 / tau; J = f(r) A; df/dlogp = 4 s (1 - s) r.
    ratio = math.exp(logp - old)
    tau = SAPO.tau_pos if advantage > 0 else SAPO.tau_neg
    s = 1.0 / (1.0 + math.exp(-tau * (ratio - 1.0)))
    return -4.0 / tau * s * advantage, -4.0 * s * (1.0 - s) * ratio * advantage


def test_sapo_matches_the_paper_on_random_batches():
    check_against_reference("sapo", SAPO, sapo_reference)


def test_sapo_by_hand():
    # Token 0: r = 1, A = 2, tau = 1: f = 4 sigmoid(0) = 2, loss -4; d/dlogp = -A 4 (1/4) 1 = -2.
    # Token 1: r = 2, A = -1, tau = 1.05: s = sigmoid(1.05) = 0.740775, f = 4 / 1.05 * s = 2.822000,
    #          loss +2.822000; d/dlogp = -A 4 s (1 - s) r = 4 * 0.7407749 * 0.2592251 * 2 = 1.536220.
    # Token-mean over 2: gradient -1, 0.768110.
    old_BR = torch.tensor([[-0.7, -1.6]], dtype=torch.float64)
    logprobs_BR = (old_BR + torch.tensor([[0.0, math.log(2.0)]], dtype=torch.float64)).requires_grad_()
    loss_BR, metrics = POLICY_LOSSES.get("sapo")(
        logprobs_BR, old_BR, torch.tensor([[2.0, -1.0]], dtype=torch.float64), torch.ones(1, 2), SAPO
    )
    torch.testing.assert_close(loss_BR, torch.tensor([[-4.0, 2.822000]], dtype=torch.float64), atol=1e-6, rtol=0)
    aggregate(loss_BR, torch.ones(1, 2), "token-mean").backward()
    torch.testing.assert_close(logprobs_BR.grad, torch.tensor([[-1.0, 0.768110]], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    assert metrics["gate_weight"].item() == pytest.approx((1.0 + 4 * 0.7407749 * 0.2592251) / 2, abs=1e-6)


# ---------------------------------------------------------------- GMPO (arXiv:2507.20673)

GMPO = PolicyLossParams(clip_ratio_low=0.4, clip_ratio_high=0.4)


def gmpo_reference_objective(logprobs_BR, old_BR, advantages_BR, mask_BR, low, high):
    """The paper's loss, -(1/G) sum_i sgn(A_i) prod_t |min(rho A_i, clip(rho, e^-low, e^high) A_i)|^(1/|o_i|),
    one scalar op at a time; also each sequence's -J_i."""
    total, per_sequence = 0.0, []
    for i in range(mask_BR.shape[0]):
        advantage = advantages_BR[i, 0].item()
        length = int(mask_BR[i].sum().item())
        product = torch.ones((), dtype=torch.float64)
        for t in range(length):
            rho = torch.exp(logprobs_BR[i, t] - old_BR[i, t])
            clipped = torch.clamp(rho, math.exp(-low), math.exp(high))
            product = product * torch.abs(torch.minimum(rho * advantage, clipped * advantage))
        objective = math.copysign(1.0, advantage) * product ** (1.0 / length)
        per_sequence.append(-objective.item())
        total = total - objective
    return total / mask_BR.shape[0], per_sequence


def test_gmpo_matches_the_paper_on_random_batches():
    for seed in range(3):
        logprobs_BR, old_BR, advantages_BR, mask_BR = random_batch(seed, sequence_advantages=True, spread=0.5)
        loss_BR, metrics = POLICY_LOSSES.get("gmpo")(logprobs_BR, old_BR, advantages_BR, mask_BR, GMPO)
        aggregate(loss_BR, mask_BR, "seq-mean-token-mean").backward()
        ours = logprobs_BR.grad.clone()
        logprobs_BR.grad = None
        objective, per_sequence = gmpo_reference_objective(logprobs_BR, old_BR, advantages_BR, mask_BR, 0.4, 0.4)
        objective.backward()
        torch.testing.assert_close(ours, logprobs_BR.grad, rtol=1e-9, atol=1e-12)
        for i, t in valid_tokens(mask_BR):
            assert loss_BR[i, t].item() == pytest.approx(per_sequence[i], rel=1e-9)
        assert 0 < metrics["clipfrac"].item() < 1


def test_gmpo_by_hand():
    # Sequence 0, A = +1, log ratios 0.6, -0.2: A > 0 clips only above 0.4 -> 0.4, -0.2; mean 0.1;
    #   loss -exp(0.1) = -1.105171; gradient only at token 1 (token 0 is clipped).
    # Sequence 1, A = -1, log ratios -0.6, 0.2, padding: A < 0 clips only below -0.4 -> -0.4, 0.2;
    #   mean -0.1; loss +exp(-0.1) = 0.904837; gradient only at token 1.
    # seq-mean-token-mean, B = 2: d/dlogp = -A_i exp(mean_i) / |y_i| / B
    #   = -1.105171 / 4 = -0.276293 and +0.904837 / 4 = 0.226209. clipfrac 2 / 4.
    old_BR = torch.tensor([[-1.0, -2.0, -1.0], [-1.5, -0.5, -1.0]], dtype=torch.float64)
    logprobs_BR = (old_BR + torch.tensor([[0.6, -0.2, 3.0], [-0.6, 0.2, 3.0]], dtype=torch.float64))
    logprobs_BR.requires_grad_()
    advantages_BR = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask_BR = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    loss_BR, metrics = POLICY_LOSSES.get("gmpo")(logprobs_BR, old_BR, advantages_BR, mask_BR, GMPO)
    torch.testing.assert_close(loss_BR[:, :2], torch.tensor([[-1.105171] * 2, [0.904837] * 2], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    aggregate(loss_BR, mask_BR, "seq-mean-token-mean").backward()
    expected = torch.tensor([[0.0, -0.276293, 0.0], [0.0, 0.226209, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs_BR.grad, expected, atol=1e-6, rtol=0)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)


# ---------------------------------------------------------------- DPPO (arXiv:2602.04879)

DPPO_TV = PolicyLossParams(clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=3.0)
DPPO_KL = PolicyLossParams(clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=3.0)


def dppo_reference(divergence, dropped_advantages):
    def reference(logp, old, advantage, i, t):
        # Eq. 11 with the binary mask: L = -M r A; truncated IS gradient -M min(r, c) A.
        p, q = math.exp(logp), math.exp(old)
        params = DPPO_TV if divergence == "tv" else DPPO_KL
        if divergence == "tv":
            distance = abs(p - q)
        else:
            distance = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
        dropped = (advantage > 0 and p > q and distance > params.clip_ratio_high) or (
            advantage < 0 and p < q and distance > params.clip_ratio_low)
        if dropped:
            dropped_advantages.append(advantage)
            return 0.0, 0.0
        weight = min(math.exp(logp - old), params.clip_ratio_c)
        return -weight * advantage, -weight * advantage

    return reference


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_matches_the_paper_on_random_batches(divergence):
    params = DPPO_TV if divergence == "tv" else DPPO_KL
    dropped_advantages = []
    for seed in range(4):
        check_against_reference(f"dppo_{divergence}", params, dppo_reference(divergence, dropped_advantages),
                                seed=seed, spread=0.6)
    # The random batch does exercise the mask, on both sides, and leaves most tokens in.
    assert min(dropped_advantages) < 0 < max(dropped_advantages) and len(dropped_advantages) < 4 * sum(LENGTHS) / 2


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_by_hand(divergence):
    # (q, p, A): 0.5 -> 0.7, A=+1: rose by TV 0.2 > 0.15 and KL 0.5 ln(5/7) + 0.5 ln(5/3) = 0.087177 > 0.05
    #            -> dropped.
    # 0.5 -> 0.6, A=+1: TV 0.1, KL 0.5 ln(5/6) + 0.5 ln(5/4) = 0.020411: kept, r = 1.2, loss -1.2.
    # 0.5 -> 0.63, A=+1: just inside, TV 0.13, KL 0.5 ln(50/63) + 0.5 ln(50/37) = 0.034997: kept, loss -1.26.
    # 0.5 -> 0.3, A=+1: fell, which the positive advantage does not push: kept, r = 0.6, loss -0.6.
    # 0.2 -> 0.04, A=-1: fell by TV 0.16 > 0.15 and KL 0.2 ln 5 + 0.8 ln(0.8/0.96) = 0.176030 > 0.05: dropped.
    # 0.1 -> 0.4, A=-2: rose, against a negative advantage: kept; r = 4 truncated to c = 3: loss 6.
    # Token-mean gradient (T = 6) equals the loss / 6 here: 0, -0.2, -0.21, -0.1, 0, 1.0.
    # clipfrac 2/6, truncfrac 1/6.
    logprobs_BR, old_BR = from_probabilities([0.5, 0.5, 0.5, 0.5, 0.2, 0.1], [0.7, 0.6, 0.63, 0.3, 0.04, 0.4])
    advantages_BR = torch.tensor([[1.0, 1.0, 1.0, 1.0, -1.0, -2.0]], dtype=torch.float64)
    params = DPPO_TV if divergence == "tv" else DPPO_KL
    loss_BR, metrics = POLICY_LOSSES.get(f"dppo_{divergence}")(
        logprobs_BR, old_BR, advantages_BR, torch.ones(1, 6), params
    )
    torch.testing.assert_close(loss_BR, torch.tensor([[0.0, -1.2, -1.26, -0.6, 0.0, 6.0]], dtype=torch.float64))
    aggregate(loss_BR, torch.ones(1, 6), "token-mean").backward()
    expected = torch.tensor([[0.0, -0.2, -0.21, -0.1, 0.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs_BR.grad, expected)
    assert metrics["clipfrac"].item() == pytest.approx(2 / 6)
    assert metrics["truncfrac"].item() == pytest.approx(1 / 6)


# ---------------------------------------------------------------- Clip-Cov, KL-Cov (arXiv:2505.22617)

def token_covariances(logprobs_BR, advantages_BR, mask_BR):
    tokens = valid_tokens(mask_BR)
    mean_logp = sum(logprobs_BR[i, t].item() for i, t in tokens) / len(tokens)
    mean_advantage = sum(advantages_BR[i, t].item() for i, t in tokens) / len(tokens)
    return {(i, t): (logprobs_BR[i, t].item() - mean_logp) * (advantages_BR[i, t].item() - mean_advantage)
            for i, t in tokens}


def ppo_token(logp, old, advantage, params):
    """The vanilla clipped surrogate with dual clip and its derivative, one token."""
    ratio = math.exp(logp - old)
    clipped = min(max(ratio, 1 - params.clip_ratio_low), 1 + params.clip_ratio_high)
    unclipped_loss, clipped_loss = -advantage * ratio, -advantage * clipped
    if clipped_loss > unclipped_loss:
        value, derivative = clipped_loss, 0.0
    else:
        value, derivative = unclipped_loss, -advantage * ratio
    if advantage < 0 and value > -advantage * params.clip_ratio_c:
        value, derivative = -advantage * params.clip_ratio_c, 0.0
    return value, derivative, clipped_loss > unclipped_loss


def test_clip_cov_matches_the_paper_on_random_batches():
    # clip_cov_ratio = 1: every candidate is dropped, so the random choice does not enter.
    params = PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                              clip_cov_ratio=1.0, clip_cov_lb=0.1, clip_cov_ub=1.5)
    logprobs_BR, old_BR, advantages_BR, mask_BR = random_batch(2)
    cov = token_covariances(logprobs_BR, advantages_BR, mask_BR)
    dropped = set()
    for (i, t), value in cov.items():
        _, _, was_clipped = ppo_token(logprobs_BR[i, t].item(), old_BR[i, t].item(), advantages_BR[i, t].item(), params)
        if params.clip_cov_lb < value < params.clip_cov_ub and not was_clipped:
            dropped.add((i, t))
    assert 0 < len(dropped) < len(cov) / 2

    def reference(logp, old, advantage, i, t):
        if (i, t) in dropped:
            return 0.0, 0.0
        value, derivative, _ = ppo_token(logp, old, advantage, params)
        return value, derivative

    check_against_reference("clip_cov", params, reference, seed=2)


def test_clip_cov_by_hand_and_its_choice_is_a_function_of_the_inputs():
    # logp = -0.5, -2.5, -0.5, -2.5 (mean -1.5, centred +1, -1, +1, -1), ratio 1; A = 3, 1, -1, -3 (mean 0).
    # cov = 3, -1, -1, 3: tokens 0 and 3 lie in (1, 5). Vanilla loss -A r = -3, -1, 1, 3.
    # clip_cov_ratio 0.5: max(1, floor(0.5 * 4)) = 2 tokens, both candidates: loss 0, -1, 1, 0.
    logprobs_BR = torch.tensor([[-0.5, -2.5, -0.5, -2.5]], dtype=torch.float64, requires_grad=True)
    old_BR = logprobs_BR.detach().clone()
    advantages_BR = torch.tensor([[3.0, 1.0, -1.0, -3.0]], dtype=torch.float64)
    mask_BR = torch.ones(1, 4, dtype=torch.float64)
    loss = POLICY_LOSSES.get("clip_cov")
    params = PolicyLossParams(clip_cov_ratio=0.5, clip_cov_lb=1.0, clip_cov_ub=5.0)
    loss_BR, metrics = loss(logprobs_BR, old_BR, advantages_BR, mask_BR, params)
    torch.testing.assert_close(loss_BR, torch.tensor([[0.0, -1.0, 1.0, 0.0]], dtype=torch.float64))
    assert metrics["cov_frac"].item() == pytest.approx(0.5)
    # clip_cov_ratio 0.25: one token, one of the two candidates, the same one on every call.
    params = PolicyLossParams(clip_cov_ratio=0.25, clip_cov_lb=1.0, clip_cov_ub=5.0)
    first, _ = loss(logprobs_BR, old_BR, advantages_BR, mask_BR, params)
    second, _ = loss(logprobs_BR, old_BR, advantages_BR, mask_BR, params)
    dropped = [t for t in range(4) if first[0, t].item() == 0.0]
    assert len(dropped) == 1 and dropped[0] in (0, 3)
    torch.testing.assert_close(first, second)


KL_COV = PolicyLossParams(kl_cov_ratio=0.25, ppo_kl_coef=0.7)


def test_kl_cov_matches_the_paper_on_random_batches():
    logprobs_BR, old_BR, advantages_BR, mask_BR = random_batch(3)
    cov = token_covariances(logprobs_BR, advantages_BR, mask_BR)
    count = max(1, int(KL_COV.kl_cov_ratio * len(cov)))
    penalised = set(sorted(cov, key=cov.get, reverse=True)[:count])

    def reference(logp, old, advantage, i, t):
        # L = -r A, plus beta |log r| on the top-k covariance tokens.
        ratio = math.exp(logp - old)
        value, derivative = -ratio * advantage, -ratio * advantage
        if (i, t) in penalised:
            value += KL_COV.ppo_kl_coef * abs(logp - old)
            derivative += KL_COV.ppo_kl_coef * math.copysign(1.0, logp - old)
        return value, derivative

    check_against_reference("kl_cov", KL_COV, reference, seed=3)


def test_kl_cov_by_hand():
    # The Clip-Cov example's logp and A (cov = 3, -1, -1, 3), old = logp - (0.1, 0, 0, -0.2).
    # kl_cov_ratio 0.5: the two largest covariances, tokens 0 and 3, pay |log r| (coefficient 1):
    #   loss -3 e^0.1 + 0.1 = -3.215513; -1; 1; 3 e^-0.2 + 0.2 = 2.656192.
    # Token-mean gradient (T = 4): (-3 e^0.1 + 1) / 4 = -0.578878; -0.25; 0.25; (3 e^-0.2 - 1) / 4 = 0.364048.
    logprobs_BR = torch.tensor([[-0.5, -2.5, -0.5, -2.5]], dtype=torch.float64, requires_grad=True)
    old_BR = logprobs_BR.detach() - torch.tensor([[0.1, 0.0, 0.0, -0.2]], dtype=torch.float64)
    advantages_BR = torch.tensor([[3.0, 1.0, -1.0, -3.0]], dtype=torch.float64)
    mask_BR = torch.ones(1, 4, dtype=torch.float64)
    params = PolicyLossParams(kl_cov_ratio=0.5, ppo_kl_coef=1.0)
    loss_BR, _ = POLICY_LOSSES.get("kl_cov")(logprobs_BR, old_BR, advantages_BR, mask_BR, params)
    torch.testing.assert_close(loss_BR, torch.tensor([[-3.215513, -1.0, 1.0, 2.656192]], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    aggregate(loss_BR, mask_BR, "token-mean").backward()
    torch.testing.assert_close(logprobs_BR.grad, torch.tensor([[-0.578878, -0.25, 0.25, 0.364048]],
                                                              dtype=torch.float64), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- GPG (arXiv:2504.02546)

def test_gpg_matches_the_paper_on_random_batches():
    check_against_reference("gpg", PolicyLossParams(), lambda logp, old, a, i, t: (-a * logp, -a))


def test_gpg_by_hand():
    # L = -A logp: -1 * -0.5 = 0.5, 0.5 * -2 = -1; token-mean gradient -A / 2 = -0.5, 0.25.
    logprobs_BR = torch.tensor([[-0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    loss_BR, _ = POLICY_LOSSES.get("gpg")(logprobs_BR, torch.full((1, 2), -1.0, dtype=torch.float64),
                                          torch.tensor([[1.0, -0.5]], dtype=torch.float64), torch.ones(1, 2),
                                          PolicyLossParams())
    torch.testing.assert_close(loss_BR, torch.tensor([[0.5, -1.0]], dtype=torch.float64))
    aggregate(loss_BR, torch.ones(1, 2), "token-mean").backward()
    torch.testing.assert_close(logprobs_BR.grad, torch.tensor([[-0.5, 0.25]], dtype=torch.float64))


# ---------------------------------------------------------------- DRO (arXiv:2405.19107)

DRO = PolicyLossParams(dro_beta=0.3)


def dro_reference(logp, old, advantage, i, t):
    # The paper's squared loss (A - beta l)^2 / 2, over beta, less its constant A^2 / (2 beta).
    log_ratio = logp - old
    value = ((advantage - DRO.dro_beta * log_ratio) ** 2 - advantage**2) / (2 * DRO.dro_beta)
    return value, -(advantage - DRO.dro_beta * log_ratio)


def test_dro_matches_the_paper_on_random_batches():
    check_against_reference("dro", DRO, dro_reference)


def test_dro_by_hand():
    # beta = 0.1, l = 0.2, -0.4, A = 1, -1: loss -0.2 + 0.05 * 0.04 = -0.198; -0.4 + 0.05 * 0.16 = -0.392.
    # Gradient -(A - beta l) / 2: -(1 - 0.02) / 2 = -0.49; -(-1 + 0.04) / 2 = 0.48.
    old_BR = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    logprobs_BR = (old_BR + torch.tensor([[0.2, -0.4]], dtype=torch.float64)).requires_grad_()
    loss_BR, _ = POLICY_LOSSES.get("dro")(logprobs_BR, old_BR, torch.tensor([[1.0, -1.0]], dtype=torch.float64),
                                          torch.ones(1, 2), PolicyLossParams(dro_beta=0.1))
    torch.testing.assert_close(loss_BR, torch.tensor([[-0.198, -0.392]], dtype=torch.float64))
    aggregate(loss_BR, torch.ones(1, 2), "token-mean").backward()
    torch.testing.assert_close(logprobs_BR.grad, torch.tensor([[-0.49, 0.48]], dtype=torch.float64))


# ---------------------------------------------------------------- all of them

@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("name", NEW_LOSSES)
def test_every_aggregation_mode_applies(name, mode):
    logprobs_BR, old_BR, advantages_BR, mask_BR = random_batch(4, sequence_advantages=True)
    weights_BR = torch.full_like(mask_BR, 0.5)
    loss_BR, metrics = POLICY_LOSSES.get(name)(logprobs_BR, old_BR, advantages_BR, mask_BR, PolicyLossParams(),
                                               weights_BR)
    loss = aggregate(loss_BR, mask_BR, mode)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs_BR.grad).all()
    assert logprobs_BR.grad[mask_BR == 0].abs().sum() == 0
    assert logprobs_BR.grad.abs().sum() > 0
    assert all(torch.isfinite(value) and not value.requires_grad for value in metrics.values())
    # The importance weights scale the loss; they carry no gradient of their own.
    unweighted_BR, _ = POLICY_LOSSES.get(name)(logprobs_BR, old_BR, advantages_BR, mask_BR, PolicyLossParams())
    torch.testing.assert_close(loss_BR, 0.5 * unweighted_BR)


@pytest.mark.parametrize("name, field, value", [
    ("sapo", "tau_neg", 0.0), ("clip_cov", "clip_cov_ratio", 0.0), ("kl_cov", "kl_cov_ratio", 0.0),
    ("dro", "dro_beta", 0.0),
])
def test_bad_parameters_are_refused(name, field, value):
    logprobs_BR, old_BR, advantages_BR, mask_BR = random_batch(5)
    with pytest.raises(ValueError, match=field):
        POLICY_LOSSES.get(name)(logprobs_BR, old_BR, advantages_BR, mask_BR, PolicyLossParams(**{field: value}))


def test_every_registered_loss_is_tested():
    assert set(POLICY_LOSSES.names()) == set(NEW_LOSSES) | {"vanilla", "gspo"}
