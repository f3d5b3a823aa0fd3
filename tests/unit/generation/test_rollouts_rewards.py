"""Rollouts of several filter rounds whose reward functions returned different extra metrics, every
per-sequence column following its sequence, stopping when no reward call of a batch succeeded, and responses
packed into one tensor and back (how they travel between ranks)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.data.dataset import Prompt
from megarl.generation.rollouts import Rollouts, pack_responses, packed_size, unpack_responses
from megarl.rewards import RewardFunctionError

NAN = math.nan


def _rollouts(group_ids, scores, extras, errors=0, first=None):
    return Rollouts(prompts=[Prompt([g], "arithmetic", "3", {}, g) for g in group_ids], group_ids=list(group_ids),
                    replicas=[0] * len(group_ids), response_lengths=[1] * len(group_ids),
                    response_ids=[[10 + g] for g in group_ids], rollout_logprobs=[[-1.0] for _ in group_ids],
                    finish_reasons=["stop"] * len(group_ids), scores=list(scores), score_extras=extras,
                    num_reward_errors=errors, first_reward_failure=first)


def _same(actual, expected):
    return len(actual) == len(expected) and all(
        (math.isnan(a) and math.isnan(e)) or a == e for a, e in zip(actual, expected))


def test_extras_a_round_lacks_are_nan_and_stay_aligned_through_select_and_extend():
    # Round 1 (n=2): groups 0..3 with a "length" metric; DAPO's group filtering keeps 0 and 2.
    kept = _rollouts([0, 0, 1, 1, 2, 2, 3, 3], [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0],
                     {"length": [5.0, 6.0, NAN, NAN, 7.0, 8.0, NAN, NAN]}).select([0, 1, 4, 5])
    assert _same(kept.score_extras["length"], [5.0, 6.0, 7.0, 8.0])
    # Round 2 tops up with a group whose scorer returned a "tokens" metric instead.
    kept.extend(_rollouts([0, 0], [1.0, 0.0], {"tokens": [3.0, 4.0]}))
    assert kept.group_ids == [0, 0, 2, 2, 3, 3] and kept.response_ids[4:] == [[10], [10]]
    assert _same(kept.score_extras["length"], [5.0, 6.0, 7.0, 8.0, NAN, NAN])
    assert _same(kept.score_extras["tokens"], [NAN, NAN, NAN, NAN, 3.0, 4.0])
    assert _same(kept.select([5, 0]).score_extras["tokens"], [4.0, NAN])


def test_every_column_follows_its_sequence_and_counts_add_up():
    # Multi-turn and split placement's columns too: loss masks, token versions, trajectory counts.
    first = _rollouts([0, 0, 1, 1], [1.0, 0.0, 0.5, 0.0], {}, errors=1, first="item 1 failed")
    first.loss_masks, first.token_versions = [[1], [0], [1], [1]], [[3], [3], [4], [4, 5]]
    first.trajectory_stats = {"turns": [1.0, 2.0, 3.0, 4.0]}
    picked = first.select([3, 0])
    assert picked.group_ids == [1, 0] and picked.scores == [0.0, 1.0] and picked.response_ids == [[11], [10]]
    assert picked.loss_masks == [[1], [1]] and picked.token_versions == [[4, 5], [3]]
    assert picked.trajectory_stats == {"turns": [4.0, 1.0]} and picked.num_reward_errors == 1
    second = _rollouts([0, 0], [0.0, 0.0], {}, errors=2, first="item 0 failed")
    second.loss_masks, second.token_versions, second.trajectory_stats = [[0], [1]], [[5], [5]], {"turns": [9.0, 9.0]}
    picked.extend(second)
    assert picked.group_ids == [1, 0, 2, 2] and picked.token_versions == [[4, 5], [3], [5], [5]]
    assert picked.trajectory_stats == {"turns": [4.0, 1.0, 9.0, 9.0]} and picked.loss_masks[2:] == [[0], [1]]
    assert picked.num_reward_errors == 3 and picked.first_reward_failure == "item 1 failed"


def test_a_batch_where_every_reward_call_failed_stops_the_run():
    failure = "item 0 (data_source 'arithmetic'): ValueError: compute_score must return a finite number, got None"
    rollouts = _rollouts([0, 0, 1, 1], [0.0] * 4, {}, errors=4, first=failure)
    with pytest.raises(RewardFunctionError) as error:
        rollouts.require_rewards()
    assert str(error.value) == f"all 4 reward calls failed (4 errors, 0 timeouts); first: {failure}"

    rollouts.num_reward_errors = 3  # one call succeeded: an unlucky batch, not a broken function
    rollouts.require_rewards()


def test_responses_packed_and_unpacked_are_the_same_values_at_the_same_sequences():
    """Token ids, log-probs, multi-turn loss masks and openings, and routed experts (L=2 layers, top-2, over
    opening + response - 1 tokens) of sequences 2 and 0, packed, land at sequences 2 and 0 of rollouts that held
    none (and knew the openings' lengths alone)."""
    lengths, generator = [3, 1, 2], torch.Generator().manual_seed(0)
    openings = [[9] * (i + 2) for i in range(3)]
    held = Rollouts(prompts=[Prompt([5] * (i + 1), "arithmetic", "3", {}, i) for i in range(3)], group_ids=[0, 1, 2],
                    replicas=[0] * 3, response_lengths=lengths,
                    response_ids=[torch.randint(0, 50_000, (n,), generator=generator).tolist() for n in lengths],
                    rollout_logprobs=[(-torch.rand(n, generator=generator, dtype=torch.float64)).tolist()
                                      for n in lengths],
                    loss_masks=[[1, 0, 1], [1], [0, 1]], openings=openings, opening_lengths=[2, 3, 4],
                    routed_experts_shape=(2, 2),
                    routed_experts=[torch.randint(0, 64, (i + 1 + n, 2, 2), generator=generator, dtype=torch.int16)
                                    for i, n in enumerate(lengths)])
    packed = pack_responses(held, [2, 0])
    assert len(packed) == packed_size(held, [2, 0]) == (3 * 2 + 4 + 5 * 2 * 2) + (3 * 3 + 2 + 4 * 2 * 2)
    empty = Rollouts(prompts=held.prompts, group_ids=[0, 1, 2], replicas=[0] * 3, response_lengths=lengths,
                     response_ids=[None] * 3, rollout_logprobs=[None] * 3, loss_masks=[None] * 3,
                     openings=[None] * 3, opening_lengths=[2, 3, 4], routed_experts_shape=(2, 2),
                     routed_experts=[None] * 3)
    unpack_responses(empty, [2, 0], packed)
    for i in (2, 0):
        assert empty.response_ids[i] == held.response_ids[i] and empty.loss_masks[i] == held.loss_masks[i]
        assert empty.openings[i] == openings[i] and empty.prompt_ids(i) == openings[i]
        assert empty.rollout_logprobs[i] == held.rollout_logprobs[i]  # float64 carries them exactly
        assert torch.equal(empty.routed_experts[i], held.routed_experts[i])
    assert empty.openings[1] is None and empty.prompt_length(1) == 3
    assert empty.response_ids[1] is None and empty.routed_experts[1] is None
