"""DAPO's group filtering on real rollouts against hand values: only informative groups are kept (the first
ones collected), whole, every per-sequence field following its sequence."""

from __future__ import annotations

from megarl.data.dataset import Prompt
from megarl.generation.rollouts import Rollouts
from megarl.placement.colocated import first_groups, informative


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
