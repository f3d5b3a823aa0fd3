"""Which DP rank trains on which sequences of a step: whole groups, balanced by tokens.

A step's groups (the n responses of one prompt) are numbered 0..G-1 in the step's order. The
actor's first-epoch mini-batches (`mini_batch_groups`: seeded, the same at any DP) are each dealt
over the DP ranks by tokens (`owned_groups`, the LPT rule). A DP rank keeps its groups whole, so
group estimators (GRPO, RLOO) compute advantages on its share alone; the placement's `StepRollouts.move`
brings the share's responses from where it made them to all TP and PP ranks of the DP rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megarl.distributed import collectives
from megarl.distributed.layout import ParallelLayout
from megarl.engine.batching import mini_batch_groups, owned_groups
from megarl.generation.rollouts import Rollouts


@dataclass
class Share:
    indices: list[int]
    """This DP rank's sequences, as indices into the step's rollouts."""
    group_ids_B: torch.Tensor
    """Their groups' ids, 0..G-1 in the step."""
    num_groups: int
    """G, the step's number of groups."""


def take_share(rollouts: Rollouts, layout: ParallelLayout, move: Callable[[Rollouts, list[list[int]]], None],
               groups_per_mini_batch: int, seed: int, step: int) -> tuple[Rollouts, Share]:
    """This DP rank's part of the step's rollouts, its responses held here (collective: every rank
    calls). `move`: the placement's way to bring each rank the responses it wants (`StepRollouts.move`)."""
    groups = sorted(set(rollouts.group_ids))
    number = {group: k for k, group in enumerate(groups)}
    group_of = [number[group] for group in rollouts.group_ids]
    tokens = [0] * len(groups)
    for i, (length, group) in enumerate(zip(rollouts.response_lengths, group_of)):
        tokens[group] += rollouts.prompt_length(i) + length
    owners = owned_groups(tokens, mini_batch_groups(len(groups), groups_per_mini_batch, seed, step, epoch=0), layout.dp)
    if not all(owners):
        raise RuntimeError(f"step {step}: {len(groups)} groups for {layout.dp} DP ranks; every DP rank needs a "
                           "group: raise algorithm.max_filter_rounds or data.train_batch_size")
    sequences = [[i for i, group in enumerate(group_of) if group in owned] for owned in map(set, owners)]
    dp_rank_of = collectives.all_gather(torch.tensor([layout.dp_rank]))
    move(rollouts, [sequences[int(dp_rank)] for dp_rank in dp_rank_of])
    mine = sequences[layout.dp_rank]
    return rollouts.select(mine), Share(mine, torch.tensor([group_of[i] for i in mine]), len(groups))


def sum_over_shares(sums: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """`sums` over this DP rank's share, added over all DP ranks' shares: the batch's sums (the TP
    and PP ranks of a DP rank hold the same share, so the DP group counts each share once)."""
    total = sums.clone()
    collectives.all_reduce(total, group=layout.dp_group)
    return total
