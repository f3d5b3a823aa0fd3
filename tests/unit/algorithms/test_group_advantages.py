"""grpo_passk, opo, reinforce_plus_plus_baseline and gdpo against plain-Python loops written from their papers'
formulas, hand computations, and DP shares: estimators that whiten over the batch give a share the batch's
numbers when its `sum_over_batch` adds the other shares' sums (simulated here by threads, one per DP rank)."""

from __future__ import annotations

import math
import random
import statistics
import threading

import pytest
import torch

from megarl.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from megarl.generation.rollouts import Rollouts
from megarl.rewards.manager import RewardFunctionError, RewardManager, ScoringItem
from megarl.trainer.reward import reward_components

EPS = 1e-6  # AdvantageInputs.epsilon, added to a group's std
R = 6


def random_batch(seed: int, num_components: int = 2) -> tuple[AdvantageInputs, list[int], list[float], list]:
    """Groups of 1 to 5 responses of 1 to R tokens; outcomes from {0, 0.5, 1, 2} (even groups tie often, as
    pass@k meets them), plus token penalties in odd groups; garbage at padding. Returns the inputs, lengths,
    scores, and components (B, K)."""
    rng = random.Random(seed)
    group_ids, lengths, rows = [], [], []
    for group in range(7):
        for _ in range(rng.randint(1, 5)):
            n = rng.randint(1, R)
            penalties = [rng.choice([0.0, -0.1]) if group % 2 else 0.0 for _ in range(n - 1)]
            group_ids.append(group)
            lengths.append(n)
            rows.append(penalties + [rng.choice([0.0, 0.5, 1.0, 2.0])] + [7.0] * (R - n))
    scores = [sum(row[:n]) for row, n in zip(rows, lengths)]
    components = [[rng.choice([0.0, 1.0, rng.random()]) for _ in range(num_components)] for _ in lengths]
    inputs = AdvantageInputs(
        token_rewards_BR=torch.tensor(rows, dtype=torch.float64),
        mask_BR=torch.tensor([[1.0] * n + [0.0] * (R - n) for n in lengths], dtype=torch.float64),
        group_ids_B=torch.tensor(group_ids),
        reward_components_BK=torch.tensor(components, dtype=torch.float64),
    )
    return inputs, lengths, scores, components


def members(inputs: AdvantageInputs, i: int) -> list[int]:
    group_ids = inputs.group_ids_B.tolist()
    return [j for j in range(len(group_ids)) if group_ids[j] == group_ids[i]]


def broadcast(per_sequence: list[float], lengths: list[int]) -> torch.Tensor:
    return torch.tensor([[a] * n + [0.0] * (R - n) for a, n in zip(per_sequence, lengths)], dtype=torch.float64)


def python_whiten(per_sequence: list[float], lengths: list[int]) -> list[list[float]]:
    """Each sequence's value on each of its tokens, whitened over all those tokens (unbiased var, + 1e-8)."""
    flat = [a for a, n in zip(per_sequence, lengths) for _ in range(n)]
    mean = sum(flat) / len(flat)
    variance = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(a - mean) / math.sqrt(variance + 1e-8)] * n for a, n in zip(per_sequence, lengths)]


def padded(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([row + [0.0] * (R - len(row)) for row in rows], dtype=torch.float64)


def grpo_of(values: list[float], group: list[int], i: int) -> float:
    """GRPO's normalised value of sample i within `group` (a group of one: mean 0, std 1, as verl)."""
    if len(group) == 1:
        return (values[i] - 0.0) / (1.0 + EPS)
    mine = [values[j] for j in group]
    return (values[i] - statistics.mean(mine)) / (statistics.stdev(mine) + EPS)


# ---- references from the papers' formulas -------------------------------------------------------------


def reference_passk(inputs, scores, norm_by_std):
    """Tang et al. (arXiv:2503.19595): the gradient of E[max of the group] puts max(G) - max(G without i)
    on sample i."""
    advantages = []
    for i in range(len(scores)):
        group = members(inputs, i)
        if len(group) == 1:
            advantages.append(0.0)
            continue
        best = max(scores[j] for j in group)
        best_without_i = max(scores[j] for j in group if j != i)
        advantage = best - best_without_i
        if norm_by_std:
            advantage /= statistics.stdev([scores[j] for j in group]) + EPS
        advantages.append(advantage)
    return advantages


def reference_opo(inputs, lengths, scores):
    """Hao et al. (arXiv:2505.23585): b = sum_j l_j r_j / sum_j l_j over the group, A_i = r_i - b."""
    advantages = []
    for i in range(len(scores)):
        group = members(inputs, i)
        baseline = sum(lengths[j] * scores[j] for j in group) / sum(lengths[j] for j in group)
        advantages.append(scores[i] - baseline)
    return advantages


def reference_reinforce_plus_plus_baseline(inputs, lengths, scores):
    """Hu et al. (arXiv:2501.03262): r_i minus its group's mean, then whitened over the batch's tokens."""
    centred = [scores[i] - statistics.mean([scores[j] for j in members(inputs, i)]) for i in range(len(scores))]
    return python_whiten(centred, lengths)


def reference_gdpo(inputs, lengths, components):
    """Liu et al. (arXiv:2601.05242): each component GRPO-normalised within its group, summed, then whitened."""
    summed = []
    for i in range(len(components)):
        group = members(inputs, i)
        summed.append(sum(grpo_of([row[k] for row in components], group, i) for k in range(len(components[0]))))
    return python_whiten(summed, lengths)


# ---- against the references on random batches ---------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_against_the_formula(seed, norm_by_std):
    inputs, lengths, scores, _ = random_batch(seed)
    inputs.norm_by_std = norm_by_std
    advantages_BR, returns_BR = ADVANTAGE_ESTIMATORS.get("grpo_passk")(inputs)
    torch.testing.assert_close(advantages_BR, broadcast(reference_passk(inputs, scores, norm_by_std), lengths))
    torch.testing.assert_close(returns_BR, advantages_BR)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opo_against_the_formula(seed):
    inputs, lengths, scores, _ = random_batch(seed)
    advantages_BR, returns_BR = ADVANTAGE_ESTIMATORS.get("opo")(inputs)
    torch.testing.assert_close(advantages_BR, broadcast(reference_opo(inputs, lengths, scores), lengths))
    torch.testing.assert_close(returns_BR, advantages_BR)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_plus_plus_baseline_against_the_formula(seed):
    inputs, lengths, scores, _ = random_batch(seed)
    advantages_BR, returns_BR = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus_baseline")(inputs)
    torch.testing.assert_close(advantages_BR, padded(reference_reinforce_plus_plus_baseline(inputs, lengths, scores)))
    torch.testing.assert_close(returns_BR, advantages_BR)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_components", [1, 3])
def test_gdpo_against_the_formula(seed, num_components):
    inputs, lengths, _, components = random_batch(seed, num_components)
    advantages_BR, returns_BR = ADVANTAGE_ESTIMATORS.get("gdpo")(inputs)
    torch.testing.assert_close(advantages_BR, padded(reference_gdpo(inputs, lengths, components)))
    torch.testing.assert_close(returns_BR, advantages_BR)


# ---- by hand ------------------------------------------------------------------------------------------


def one_token_inputs(group_ids: list[int], scores: list[float], **fields) -> AdvantageInputs:
    return AdvantageInputs(token_rewards_BR=torch.tensor(scores)[:, None], mask_BR=torch.ones(len(scores), 1),
                           group_ids_B=torch.tensor(group_ids), **fields)


def test_grpo_passk_by_hand():
    # Group 0: scores 1, 0, 0.5 -> only the best has a signal, its margin 1 - 0.5 = 0.5; group 1: two best
    # at 1 tie -> removing either leaves the max at 1: all 0; group 2 alone: 0.
    inputs = one_token_inputs([0, 0, 0, 1, 1, 1, 2], [1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.7], norm_by_std=False)
    advantages_BR, _ = ADVANTAGE_ESTIMATORS.get("grpo_passk")(inputs)
    torch.testing.assert_close(advantages_BR[:, 0], torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    # With the std: group 0's mean 0.5, unbiased var (0.25 + 0.25 + 0) / 2 = 0.25, std 0.5 -> 0.5 / 0.5 = 1.
    inputs.norm_by_std = True
    advantages_BR, _ = ADVANTAGE_ESTIMATORS.get("grpo_passk")(inputs)
    torch.testing.assert_close(advantages_BR[:, 0], torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))


def test_opo_by_hand():
    # Group 0: lengths 3, 1, scores 1, 0 -> b = (3 * 1 + 1 * 0) / 4 = 0.75: A = 0.25, -0.75 (the plain mean,
    # 0.5, would give +-0.5). Group 1: lengths 2, 3, 1, scores 1, 0, 0 -> b = 2 / 6: A = 2/3, -1/3, -1/3.
    # Group 2, one response: its own score is its baseline: 0.
    lengths, scores = [3, 1, 2, 3, 1, 2], [1.0, 0.0, 1.0, 0.0, 0.0, 0.5]
    inputs = AdvantageInputs(
        token_rewards_BR=torch.tensor([[0.0] * (n - 1) + [s] + [9.0] * (3 - n) for n, s in zip(lengths, scores)]),
        mask_BR=torch.tensor([[1.0] * n + [0.0] * (3 - n) for n in lengths]),
        group_ids_B=torch.tensor([0, 0, 1, 1, 1, 2]))
    advantages_BR, _ = ADVANTAGE_ESTIMATORS.get("opo")(inputs)
    expected = [0.25, -0.75, 2 / 3, -1 / 3, -1 / 3, 0.0]
    expected_BR = torch.tensor([[a] * n + [0.0] * (3 - n) for a, n in zip(expected, lengths)])
    torch.testing.assert_close(advantages_BR, expected_BR)


def test_reinforce_plus_plus_baseline_by_hand():
    # Group 0: scores 1, 0 (lengths 2, 1) -> centred 0.5, -0.5; group 1: 0.5, 0.5 (lengths 1, 1) -> 0, 0.
    # Tokens 0.5, 0.5, -0.5, 0, 0: mean 0.1; squares 0.16 + 0.16 + 0.36 + 0.01 + 0.01 = 0.7, var 0.7 / 4 = 0.175.
    inputs = AdvantageInputs(token_rewards_BR=torch.tensor([[0.0, 1.0], [0.0, 9.0], [0.5, 9.0], [0.5, 9.0]]),
                             mask_BR=torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]),
                             group_ids_B=torch.tensor([0, 0, 1, 1]))
    advantages_BR, _ = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus_baseline")(inputs)
    std = math.sqrt(0.175 + 1e-8)
    expected = torch.tensor([[0.4, 0.4], [-0.6, 0.0], [-0.1, 0.0], [-0.1, 0.0]]) / std
    torch.testing.assert_close(advantages_BR, expected)


def test_gdpo_by_hand_keeps_apart_what_grpo_of_the_sum_collapses():
    # Components (correct, format). Group 0: (0, 1), (0, 0); group 1: (1, 1), (0, 0). Summed, both groups
    # score (1, 0) and (2, 0), which GRPO maps alike to +-a, a = 0.5 / sqrt(0.5) = 1/sqrt(2).
    # GDPO: group 0's correct is constant (0, 0 -> 0), format gives +-a: sum +-a; group 1: +-a twice: +-2a.
    # Whitened: mean 0, unbiased var (a^2 + a^2 + 4a^2 + 4a^2) / 3 = 5/3 -> +-a / sqrt(5/3) = +-0.5477 and
    # +-2a / sqrt(5/3) = +-1.0954.
    components_BK = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    inputs = one_token_inputs([0, 0, 1, 1], components_BK.sum(1).tolist(), reward_components_BK=components_BK)
    advantages_BR, _ = ADVANTAGE_ESTIMATORS.get("gdpo")(inputs)
    torch.testing.assert_close(advantages_BR[:, 0], torch.tensor([0.5477, -0.5477, 1.0954, -1.0954]),
                               atol=1e-4, rtol=0)
    grpo_BR, _ = ADVANTAGE_ESTIMATORS.get("grpo")(inputs)
    torch.testing.assert_close(grpo_BR[:2], grpo_BR[2:])  # the collapse GDPO is for


def test_gdpo_without_components_names_them():
    with pytest.raises(ValueError, match="reward_components_BK"):
        ADVANTAGE_ESTIMATORS.get("gdpo")(one_token_inputs([0, 0], [1.0, 0.0]))


# ---- DP shares ----------------------------------------------------------------------------------------


def share_of(inputs: AdvantageInputs, indices: list[int], sum_over_batch, components_BK=None) -> AdvantageInputs:
    """The rows `indices` of `inputs` (with `components_BK` for them, if given, else `inputs`' own)."""
    pick = torch.tensor(indices)
    if components_BK is None:
        components_BK = inputs.reward_components_BK[pick]
    return AdvantageInputs(token_rewards_BR=inputs.token_rewards_BR[pick], mask_BR=inputs.mask_BR[pick],
                           group_ids_B=inputs.group_ids_B[pick], reward_components_BK=components_BK,
                           sum_over_batch=sum_over_batch)


def in_shares(estimator, inputs: AdvantageInputs, shares: list[list[int]], components=None) -> torch.Tensor:
    """The estimator run by one thread per share (given `components[r]` as share r's reward components, if
    any), `sum_over_batch` an all-reduce among the threads; the shares' advantages put back in batch order."""
    barrier, slots, results = threading.Barrier(len(shares)), [None] * len(shares), [None] * len(shares)

    def rank(r: int) -> None:
        def all_reduce(sums: torch.Tensor) -> torch.Tensor:
            slots[r] = sums
            barrier.wait()
            total = torch.stack(slots).sum(0)
            barrier.wait()  # nobody overwrites a slot before everyone has read it
            return total

        results[r], _ = estimator(share_of(inputs, shares[r], all_reduce, components and components[r]))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(shares))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    advantages_BR = torch.empty_like(inputs.token_rewards_BR)
    for indices, result in zip(shares, results):
        advantages_BR[torch.tensor(indices)] = result
    return advantages_BR


@pytest.mark.parametrize("name", ["reinforce_plus_plus_baseline", "gdpo", "grpo_passk", "opo"])
def test_dp_shares_of_whole_groups_get_the_batch_advantages(name):
    inputs, _, _, _ = random_batch(seed=3)
    group_ids = inputs.group_ids_B.tolist()
    # Three uneven shares of whole groups, out of order (as the trainer's token balancing deals them).
    shares = [[i for i, g in enumerate(group_ids) if g in wanted] for wanted in ({0, 4}, {1, 2, 3, 6}, {5})]
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    whole_BR, _ = estimator(inputs)
    torch.testing.assert_close(in_shares(estimator, inputs, shares), whole_BR)
    if name in ("reinforce_plus_plus_baseline", "gdpo"):  # batch statistics: a lone share would differ
        alone_BR, _ = estimator(share_of(inputs, shares[0], lambda sums: sums))
        assert not torch.allclose(alone_BR, whole_BR[torch.tensor(shares[0])])


# ---- reward components, from the reward function to gdpo ---------------------------------------------


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Two components: whether the answer is right, and whether it is wrapped in <a>...</a>; the total as score."""
    if solution_str == "boom":
        raise RuntimeError("the scorer fails on this one")
    correct = float(ground_truth in solution_str)
    wrapped = float(solution_str.startswith("<a>") and solution_str.endswith("</a>"))
    return {"score": correct + wrapped, "correct": correct, "format": wrapped, "note": "ignored: not numeric"}


def test_reward_components_reach_gdpo_from_the_reward_function_through_dp_shares():
    texts = ["<a>4</a>", "4", "<a>5</a>", "boom", "<a>7</a>", "7", "<a>7</a>", "x"]
    group_ids = [0, 0, 0, 0, 1, 1, 2, 2]
    truths = ["4"] * 4 + ["7"] * 4
    result = RewardManager(compute_score).score([ScoringItem("user", t, g) for t, g in zip(texts, truths)])
    assert result.num_errors == 1
    rollouts = Rollouts(group_ids=group_ids, scores=result.scores, score_extras=result.extra)
    # By hand: (correct, format) per response; the failed call ("boom") has neither: 0, 0.
    expected_BK = torch.tensor([[1, 1], [1, 0], [0, 1], [0, 0], [1, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.float32)
    components_BK = reward_components(rollouts.score_extras, ["correct", "format"])
    assert torch.equal(components_BK, expected_BK)
    lengths = [3, 1, 2, 2, 1, 3, 2, 1]
    mask_BR = torch.tensor([[1.0] * n + [0.0] * (R - n) for n in lengths])
    token_rewards_BR = torch.zeros(8, R)  # gdpo reads the components alone
    whole = AdvantageInputs(token_rewards_BR=token_rewards_BR, mask_BR=mask_BR, group_ids_B=torch.tensor(group_ids),
                            reward_components_BK=components_BK)
    gdpo = ADVANTAGE_ESTIMATORS.get("gdpo")
    whole_BR, _ = gdpo(whole)
    reference = reference_gdpo(whole, lengths, expected_BK.tolist())
    torch.testing.assert_close(whole_BR, padded(reference).float())
    # Each DP rank takes its share's columns (`Rollouts.select`, as `take_share` does) and gets the same.
    shares = [[4, 5, 0, 1, 2, 3], [6, 7]]
    share_components = [reward_components(rollouts.select(indices).score_extras, ["correct", "format"])
                        for indices in shares]
    for indices, share_BK in zip(shares, share_components):
        assert torch.equal(share_BK, expected_BK[torch.tensor(indices)])
    torch.testing.assert_close(in_shares(gdpo, whole, shares, share_components), whole_BR)


def test_a_component_the_reward_function_never_returns_fails_naming_it():
    extras = {"correct": [1.0, 0.0], "format": [0.0, 1.0]}
    assert reward_components(extras, []) is None
    with pytest.raises(RewardFunctionError,
                       match=r"no 'length' \(algorithm.reward_components\).*\['correct', 'format'\]"):
        reward_components(extras, ["correct", "length"])
