"""Multi-turn rollouts across the colocated engines: `collect_rollouts`'s scheme, one trajectory per sample.

The replicas split the step's prompts into the same blocks as single-turn generation, and each
replica runs its block's trajectories turn by turn (`megarl.agent.trajectories`). The replica's
first rank alone holds the environments (one per trajectory), as it alone scores: tools run once per
trajectory, and its TP peers receive each turn's observation tokens in one broadcast over the
replica. The openings (each trajectory's first messages rendered with its environment's tools, or
the sample's own prompt, rendered with the run's tools, when `reset` returns none) are what every
later phase takes as the sequence's prompt (`Rollouts.openings`): they stay with their responses on the
replica's ranks and travel with them, and every rank learns their lengths.

A trajectory's score comes from `rollout.multi_turn.reward` (`final_rewards`): its environment's
reward, the reward function's score of its last assistant turn, or their sum. Every rank then learns each trajectory's
score, length, finish reason and counts (turns, tool calls, tool errors) from `share_scores`, and the
responses with their loss masks stay on their replica until `move_responses`, as single-turn ones.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist

from megarl.agent.environment import Environment, load_environment
from megarl.agent.rendering import ChatRenderer
from megarl.agent.trajectories import Conversation, Trajectory, TurnLimits, run_turns
from megarl.config.schema import RolloutConfig
from megarl.data.dataset import Prompt
from megarl.distributed import collectives
from megarl.generation.rollouts import Rollouts, score_responses, share_scores, unfilled_rollouts
from megarl.rewards.manager import RewardFunctionError, RewardManager, RewardResult
from megarl.rollout.base import RolloutEngine, RolloutOutput, Sampling

TRAJECTORY_STATS = ("turns", "tool_calls", "tool_errors")


class MultiTurnRollouts:
    """Collects multi-turn rollouts; built once on every rank (it creates the replicas' process groups)."""

    def __init__(self, environment_for: Callable[[Prompt], Environment], tokenizer, engine_tp: int, limits: TurnLimits,
                 max_prompt_length: int, reward_source: str):
        self.environment_for, self.tokenizer, self.engine_tp = environment_for, tokenizer, engine_tp
        self.limits, self.max_prompt_length, self.reward_source = limits, max_prompt_length, reward_source
        self.renderers = ChatRenderers(tokenizer)
        self.end_of_turn_id = self.renderers.end_of_turn_id
        rank, self.replica_group = dist.get_rank(), None
        self.leader = rank - rank % engine_tp
        if engine_tp > 1:  # new_group is collective: every rank creates every replica's group
            for first in range(0, dist.get_world_size(), engine_tp):
                group = dist.new_group(list(range(first, first + engine_tp)))
                if first == self.leader:
                    self.replica_group = group

    @classmethod
    def from_config(cls, rollout: RolloutConfig, tokenizer, max_prompt_length: int,
                    max_response_length: int) -> MultiTurnRollouts:
        """The collector `rollout.multi_turn` describes, on engines of `rollout.tp` ranks."""
        turns = rollout.multi_turn
        limits = TurnLimits(turns.max_turns, max_response_length, turns.max_tokens_per_turn)
        return cls(load_environment(rollout), tokenizer, rollout.tp, limits, max_prompt_length, turns.reward)

    def _share(self, value):
        """The leader's `value` (observations, openings) on every rank of the replica."""
        if self.replica_group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.leader, group=self.replica_group)
        return box[0]

    def collect(self, prompts: list[Prompt], engine: RolloutEngine, sampling: Sampling,
                rewards: RewardManager) -> Rollouts:
        """`sampling.n` trajectories per prompt, generated on the engine replicas and scored. Every rank
        returns every trajectory's scores and opening length; the responses and openings are held by their
        replica's ranks."""
        n, is_leader = sampling.n, dist.get_rank() == self.leader
        rollouts, (start, stop) = unfilled_rollouts(prompts, n, self.engine_tp)
        mine = range(start * n, stop * n)
        seats, openings = None, {}
        if is_leader:
            seats = []
            for i in mine:
                environment, renderer, messages, opening = open_trajectory(
                    self.environment_for, self.renderers, rollouts.prompts[i], self.max_prompt_length)
                seats.append((environment, renderer))
                openings[i] = (opening, messages)
        opening_ids = self._share({i: ids for i, (ids, _) in openings.items()})
        rollouts.openings = [opening_ids.get(i) for i in range(len(rollouts))]
        lengths = torch.tensor([len(opening_ids[i]) if is_leader and i in mine else 0 for i in range(len(rollouts))])
        collectives.all_reduce(lengths)  # each opening's length comes from its replica's leader alone
        rollouts.opening_lengths = lengths.tolist()
        trajectories = [Trajectory(i, opening_ids[i], messages=list(openings[i][1]) if is_leader else [])
                        for i in mine]
        stop_ids = tuple(sorted({*sampling.stop_token_ids, self.end_of_turn_id}))
        run_turns(trajectories, engine, replace(sampling, stop_token_ids=stop_ids), self.limits, seats, self._share)
        rollouts.loss_masks = [None] * len(rollouts)
        rollouts.messages = [None] * len(rollouts)
        for t in trajectories:
            rollouts.response_ids[t.index] = t.response_ids
            rollouts.rollout_logprobs[t.index] = t.logprobs
            rollouts.loss_masks[t.index] = t.loss_mask
        result, stats = None, {key: [] for key in TRAJECTORY_STATS}
        if is_leader and trajectories:
            result = final_rewards(trajectories, [rollouts.prompts[t.index] for t in trajectories], rewards,
                                   self.reward_source)
            stats = trajectory_stats(trajectories)
            for t in trajectories:
                rollouts.messages[t.index] = t.messages
        output = RolloutOutput(response_ids=[t.response_ids for t in trajectories],
                               finish_reasons=["length" if t.truncated else "stop" for t in trajectories])
        share_scores(rollouts, output, result, start * n, stats)
        return rollouts


class ChatRenderers:
    """A `ChatRenderer` for each set of tools the environments use, made once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.renderers: dict[str, ChatRenderer] = {}
        self.end_of_turn_id = ChatRenderer(tokenizer, []).end_of_turn_id

    def __call__(self, tools: list[dict]) -> ChatRenderer:
        key = json.dumps(tools, sort_keys=True)
        if key not in self.renderers:
            self.renderers[key] = ChatRenderer(self.tokenizer, tools)
        return self.renderers[key]


def open_trajectory(environment_for: Callable[[Prompt], Environment], renderers: ChatRenderers, prompt: Prompt,
                    max_prompt_length: int) -> tuple[Environment, ChatRenderer, list[dict], list[int]]:
    """A new trajectory of `prompt`: its environment, reset; the renderer of its tools; its opening messages and
    their tokens (the sample's own prompt when the environment opens with none)."""
    environment = environment_for(prompt)
    messages, renderer = environment.reset(prompt), renderers(environment.tools)
    opening = renderer.opening(messages) if messages else prompt.prompt_ids
    if len(opening) > max_prompt_length:
        raise ValueError(f"the environment's opening of prompt {prompt.index} has {len(opening)} tokens, over "
                         f"data.max_prompt_length={max_prompt_length}")
    return environment, renderer, messages, opening


def trajectory_stats(conversations: list[Conversation]) -> dict[str, list[int]]:
    """Per trajectory: its model turns, tool calls and tool errors (TRAJECTORY_STATS)."""
    return {"turns": [c.num_turns for c in conversations], "tool_calls": [c.num_tool_calls for c in conversations],
            "tool_errors": [c.num_tool_errors for c in conversations]}


def final_rewards(trajectories: list[Conversation], prompts: list[Prompt], rewards: RewardManager,
                  source: str) -> RewardResult:
    """Each trajectory's reward (`prompts`: theirs, in order) from `source` (rollout.multi_turn.reward):
    "environment", the reward its environment gave when it ended it (0 for one cut by max_turns or the token
    budget, which no environment judged); "function", the reward function's score of its last assistant turn;
    "sum", both added. RewardFunctionError (the launcher's one line) when an environment ended a trajectory
    without the reward `source` takes from it."""
    if source == "function":
        return _function_scores(trajectories, prompts, rewards)
    given = [(t.reward if t.ended_by else 0.0) for t in trajectories]
    missing = next((i for i, reward in enumerate(given) if reward is None), None)
    if missing is not None:
        prompt, missing = prompts[missing], trajectories[missing]
        raise RewardFunctionError(
            f"rollout.multi_turn.reward={source!r} takes the environment's reward, but environment {missing.ended_by} "
            f"ended the trajectory of prompt {prompt.index} (data_source {prompt.data_source!r}) at turn "
            f"{missing.num_turns} with none; expected a float reward from its step(), or "
            "rollout.multi_turn.reward=function")
    if source == "environment":
        return RewardResult([float(reward) for reward in given])
    result = _function_scores(trajectories, prompts, rewards)
    return replace(result, scores=[reward + score for reward, score in zip(given, result.scores)])


def _function_scores(trajectories: list[Conversation], prompts: list[Prompt], rewards: RewardManager) -> RewardResult:
    return score_responses(rewards, prompts, [t.final_text for t in trajectories])
