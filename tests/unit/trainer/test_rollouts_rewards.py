"""Merging replicas' rollouts whose reward functions returned different extra metrics, and stopping
when no reward call of a batch succeeded."""

from __future__ import annotations

import math

import pytest

from megarl.data.dataset import Prompt
from megarl.rewards import RewardFunctionError
from megarl.trainer.rollouts import Rollouts, merge_replicas

NAN = math.nan


def _rollouts(group_ids, scores, extras, errors=0, first=None):
    return Rollouts(prompts=[Prompt([g], "arithmetic", "3", {}, g) for g in group_ids], group_ids=list(group_ids),
                    response_ids=[[10 + g] for g in group_ids], rollout_logprobs=[[-1.0] for _ in group_ids],
                    finish_reasons=["stop"] * len(group_ids), scores=list(scores), score_extras=extras,
                    num_reward_errors=errors, first_reward_failure=first)


def _same(actual, expected):
    return len(actual) == len(expected) and all(
        (math.isnan(a) and math.isnan(e)) or a == e for a, e in zip(actual, expected))


def test_extras_one_replica_lacks_are_nan_and_stay_aligned_through_select_and_extend():
    # Replica 0 generated for prompts 0 and 2, replica 1 for prompts 1 and 3 (n=2); only replica 0's
    # responses got a "length" metric, only replica 1's a "format" one.
    replica0 = _rollouts([0, 0, 2, 2], [1.0, 0.0, 0.0, 1.0], {"length": [5.0, 6.0, 7.0, 8.0]})
    replica1 = _rollouts([1, 1, 3, 3], [0.0, 0.0, 1.0, 1.0], {"format": [1.0, 0.0, 1.0, 1.0]})
    merged = merge_replicas([replica0, replica1])
    assert merged.group_ids == [0, 0, 1, 1, 2, 2, 3, 3]
    assert merged.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert _same(merged.score_extras["length"], [5.0, 6.0, NAN, NAN, 7.0, 8.0, NAN, NAN])
    assert _same(merged.score_extras["format"], [NAN, NAN, 1.0, 0.0, NAN, NAN, 1.0, 1.0])

    # DAPO's group filtering keeps groups 0 and 2 (mixed rewards), then tops up from another round.
    kept = merged.select([0, 1, 4, 5])
    assert _same(kept.score_extras["length"], [5.0, 6.0, 7.0, 8.0])
    assert _same(kept.score_extras["format"], [NAN] * 4)
    kept.extend(_rollouts([0, 0], [1.0, 0.0], {"tokens": [3.0, 4.0]}))
    assert kept.group_ids == [0, 0, 2, 2, 3, 3]
    assert _same(kept.score_extras["length"], [5.0, 6.0, 7.0, 8.0, NAN, NAN])
    assert _same(kept.score_extras["tokens"], [NAN, NAN, NAN, NAN, 3.0, 4.0])
    assert _same(kept.select([5, 0]).score_extras["tokens"], [4.0, NAN])


def test_a_batch_where_every_reward_call_failed_stops_the_run():
    failure = "item 0 (data_source 'arithmetic'): ValueError: compute_score must return a finite number, got None"
    replicas = [_rollouts([0, 0], [0.0, 0.0], {}, errors=2, first=failure),
                _rollouts([1, 1], [0.0, 0.0], {}, errors=2, first="item 0: another")]
    merged = merge_replicas(replicas)
    with pytest.raises(RewardFunctionError) as error:
        merged.require_rewards()
    assert str(error.value) == f"all 4 reward calls failed (4 errors, 0 timeouts); first: {failure}"

    replicas[1].num_reward_errors = 1  # one call succeeded: an unlucky batch, not a broken function
    merge_replicas(replicas).require_rewards()
