"""Colocated placement: every rank trains and, between updates, generates on the engine replica it
shares memory with (`RolloutPolicy` swaps the Megatron models and the engine around each rollout).

A step's rollouts are the sampler's next batch of prompts, sampled on the replicas and scored; with
DAPO's group filtering (`algorithm.filter_groups`), more batches until the step has
`data.train_batch_size` informative groups or the round limit is hit. ReMax's baseline (an estimator
that `needs_greedy_baseline`) is the score of a greedy response to each prompt, generated in the same
rollout phase.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from megarl.algorithms import keep_informative_groups
from megarl.config.schema import RunConfig
from megarl.data.dataset import Prompt
from megarl.generation.collector import RolloutCollector
from megarl.generation.inputs import RunInputs
from megarl.generation.judge import training_rewards
from megarl.generation.policy import RolloutPolicy
from megarl.generation.rollouts import Rollouts, move_responses
from megarl.generation.validation import validation_metrics
from megarl.placement.base import Placement, StepRollouts, sync_metrics
from megarl.rollout import Sampling
from megarl.tracking.timing import PhaseTimer


class ColocatedPlacement(Placement):
    def __init__(self, config: RunConfig, inputs: RunInputs, policy: RolloutPolicy, needs_greedy_baseline: bool):
        self.config, self.inputs, self.policy = config, inputs, policy
        self.needs_greedy_baseline = needs_greedy_baseline
        self.collector = RolloutCollector(config, inputs.tokenizer, training_rewards(config, inputs.rewards),
                                          inputs.rewards)

    def start(self, start_step: int, sampler_state: dict, saved: dict) -> None:
        pass  # the trainer's sampler is the one that draws the prompts; no state of its own

    def rollouts(self, step: int, timer: PhaseTimer) -> StepRollouts:
        sync = self.policy.enter_rollout(step, timer)
        with timer("rollout"):
            rollouts, rounds = self._training_rollouts(step)
            baseline_B = self._greedy_baseline(rollouts, step) if self.needs_greedy_baseline else None
        self.policy.leave_rollout(timer)
        metrics = {**sync_metrics(sync), "rollout/filter_rounds": float(rounds)}
        return StepRollouts(rollouts, functools.partial(move_responses, engine_tp=self.config.rollout.tp), metrics,
                            baseline_B)

    def validate(self, step: int) -> dict[str, float]:
        """Synced first, because after a step the engine still holds the weights that step started from (a
        checkpoint of `step` holds the updated ones). The engine keeps these weights asleep: the next step's
        rollout starts from them, unsynced."""
        timer = PhaseTimer(step)
        self.policy.enter_rollout(step, timer)
        rollouts = self.collector.validation(self.policy.engine, self.inputs.val_data)
        rollouts.require_rewards()
        self.policy.leave_rollout(timer, keep_weights=True)
        return validation_metrics(rollouts, self.config.rollout.val_n)

    def checkpoint_state(self) -> dict:
        return {}

    def shutdown(self) -> None:
        self.policy.engine.shutdown()

    def _training_rollouts(self, step: int) -> tuple[Rollouts, int]:
        """A batch of prompts; with DAPO's group filtering, more prompts until the batch is full of
        informative groups (or the round limit is hit)."""
        algorithm = self.config.algorithm
        wanted = self.config.data.train_batch_size
        kept, rounds = Rollouts(), 0
        while rounds == 0 or (algorithm.filter_groups and len(set(kept.group_ids)) < wanted
                              and rounds <= algorithm.max_filter_rounds):
            prompts = [self.inputs.train_data[i] for i in self.inputs.sampler.next_batch()]
            fresh = self._collect(prompts, self.collector.sampling(step, validation=False, draw=rounds))
            kept.extend(informative(fresh) if algorithm.filter_groups else fresh)
            rounds += 1
        if algorithm.filter_groups:
            if not kept.group_ids:
                raise RuntimeError(f"step {step}: every group had equal rewards in {rounds} rounds; "
                                   "raise algorithm.max_filter_rounds or disable algorithm.filter_groups")
            kept = first_groups(kept, wanted)
        return kept, rounds

    def _collect(self, prompts: list[Prompt], sampling: Sampling) -> Rollouts:
        """Rollouts of `prompts`, scored; stops the run if no reward call succeeded."""
        rollouts = self.collector.collect(prompts, self.policy.engine, sampling)
        rollouts.require_rewards()
        return rollouts

    def _greedy_baseline(self, rollouts: Rollouts, step: int) -> torch.Tensor:
        """ReMax's baseline: the reward of a greedy response to each sequence's prompt."""
        groups = sorted(set(rollouts.group_ids))
        prompts = [rollouts.prompts[rollouts.group_ids.index(g)] for g in groups]
        greedy = dataclasses.replace(self.collector.sampling(step, validation=False), n=1, temperature=0.0)
        scores = self._collect(prompts, greedy).scores
        by_group = dict(zip(groups, scores))
        return torch.tensor([by_group[g] for g in rollouts.group_ids])


def informative(rollouts: Rollouts) -> Rollouts:
    """The sequences of the groups whose function scores differ (DAPO's dynamic sampling)."""
    keep = keep_informative_groups(torch.tensor(rollouts.scores), torch.tensor(rollouts.group_ids))
    return rollouts.select([i for i, k in enumerate(keep.tolist()) if k])


def first_groups(rollouts: Rollouts, num_groups: int) -> Rollouts:
    """The sequences of the `num_groups` lowest group ids (the groups collected first)."""
    keep = set(sorted(set(rollouts.group_ids))[:num_groups])
    return rollouts.select([i for i, g in enumerate(rollouts.group_ids) if g in keep])
