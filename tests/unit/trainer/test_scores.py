"""The trainer's steps from scored rollouts to sequence rewards, on real tensors against hand values:
DAPO group filtering keeps only informative groups (the first ones collected), the reward model's
score is its value at each sequence's last response token, and the overlong penalty lands on the
sequences that run into the buffer."""

from __future__ import annotations

import torch

from megarl.data.dataset import Prompt
from megarl.trainer.rollouts import Rollouts
from megarl.trainer.scores import first_groups, informative, reward_model_scores, sequence_rewards


def _rollouts(group_ids: list[int], scores: list[float]) -> Rollouts:
    prompts = [Prompt([g], "arithmetic", str(g), {}, g) for g in group_ids]
    return Rollouts(prompts=prompts, group_ids=group_ids, replicas=[0] * len(group_ids),
                    response_lengths=[2] * len(group_ids), response_ids=[[g, i] for i, g in enumerate(group_ids)],
                    rollout_logprobs=[[-0.5, -0.5]] * len(group_ids), finish_reasons=["stop"] * len(group_ids),
                    scores=scores, score_extras={"length": [float(i) for i in range(len(group_ids))]})


def test_group_filtering_keeps_the_first_informative_groups_whole():
    # Groups 0 and 3 disagree; 1 (all right), 2 (all wrong) and 4 (alone) carry no signal.
    rollouts = _rollouts([0, 0, 1, 1, 2, 2, 3, 3, 4], [1, 0, 1, 1, 0, 0, 0.5, 0, 1])
    kept = informative(rollouts)
    assert kept.group_ids == [0, 0, 3, 3] and kept.scores == [1, 0, 0.5, 0]
    assert kept.response_ids == [[0, 0], [0, 1], [3, 6], [3, 7]]  # every field follows its sequence
    assert kept.score_extras["length"] == [0.0, 1.0, 6.0, 7.0]
    for group in set(kept.group_ids):  # independently: each kept group has two distinct scores
        assert len({s for g, s in zip(kept.group_ids, kept.scores) if g == group}) > 1
    second_round = informative(_rollouts([0, 0, 1, 1], [0, 1, 1, 1]))
    kept.extend(second_round)  # a later round's groups come after the earlier ones
    assert kept.group_ids == [0, 0, 3, 3, 4, 4]
    assert first_groups(kept, 2).group_ids == [0, 0, 3, 3]


def test_reward_model_score_is_the_value_at_the_last_response_token():
    values_BR = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    lengths_B = torch.tensor([3, 1, 5])
    expected = torch.stack([values_BR[0, 2], values_BR[1, 0], values_BR[2, 4]])
    assert torch.equal(reward_model_scores(values_BR, lengths_B), expected)  # a gather: the same bytes


def test_overlong_penalty_lands_on_the_long_sequences():
    # max 8, buffer 2: lengths up to 6 are free, 7 loses half the factor, 8 all of it.
    scores_B, lengths_B = torch.tensor([1.0, 0.0, 1.0, 0.25]), torch.tensor([8, 3, 7, 6])
    shaped = sequence_rewards(scores_B, lengths_B, max_response_length=8, overlong_buffer_length=2,
                              overlong_penalty_factor=0.5)
    torch.testing.assert_close(shaped, torch.tensor([0.5, 0.0, 0.75, 0.25]), rtol=0, atol=1e-7)
    assert sequence_rewards(scores_B, lengths_B, 8, 0, 0.5) is scores_B  # no buffer, no shaping
