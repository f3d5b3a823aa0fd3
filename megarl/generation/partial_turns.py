"""Partial rollouts of multi-turn trajectories (`rollout.partial` with `rollout.multi_turn`): the trajectories'
side of `megarl.generation.partial`.

A trajectory's current turn is one engine request (its opening and every token so far, on the weights the
engine holds), paused like any other at a weight sync. When the turn ends (the template's end-of-turn token,
`max_tokens_per_turn` or the token budget), the environment answers it, as in a whole multi-turn rollout
(`megarl.agent.trajectories.observe`), and the next turn is submitted at the next engine step; a trajectory the
environment, `max_turns` or the budget ends is finished. So a trajectory may span policy versions, within a
turn or between turns, and each token says which sampled it (the environment's tokens carry the version of
the turn they answer; they are out of the loss).

Rollout rank 0 alone holds the environments (one per trajectory, made when its group is admitted) and steps
them; every rollout rank learns each answer from it, so all hold the same trajectories. The conversations
(the turns' texts, the environments' messages, the counts) are in the partial rollouts' state, saved with
every checkpoint; an environment cannot be, so on resume rank 0 makes each trajectory in flight a new one
and replays its conversation: reset, then each model turn's text stepped again. An environment that answers
the replay as it answered the run (one that depends only on its sample and the model's turns, as the
calculator and the sandbox's programs do) resumes the trajectory where it was; one that answers otherwise
has its group generated anew, with a warning.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch.distributed as dist

from megarl.agent.environment import Environment, load_environment
from megarl.agent.rendering import ChatRenderer
from megarl.agent.trajectories import Conversation, TurnLimits, observe
from megarl.config.schema import RunConfig
from megarl.data.prompt_dataset import PromptDataset
from megarl.generation.multi_turn import (TRAJECTORY_STATS, ChatRenderers, final_rewards, open_trajectory,
                                          trajectory_stats)
from megarl.generation.rollouts import Rollouts, share_scores, unfilled_rollouts
from megarl.rewards import RewardManager
from megarl.rollout.base import RolloutOutput, Sampling

if TYPE_CHECKING:
    from megarl.generation.partial import Group, Response

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TurnState(Conversation):
    """A multi-turn response's trajectory beyond its tokens (the conversation: rollout rank 0's)."""

    opening: list[int]
    """The trajectory's prompt: its environment's first messages rendered, or the sample's own prompt."""
    start: int = 0
    """Where the model's current turn begins in the response."""


class TrajectoryTurns:
    """Multi-turn trajectories' side of partial rollouts (`megarl.generation.partial.SingleTurns`'s methods)."""

    def __init__(self, config: RunConfig, tokenizer, rewards: RewardManager):
        turns = config.rollout.multi_turn
        self.environment_for = load_environment(config.rollout)
        self.renderers = ChatRenderers(tokenizer)
        self.limits = TurnLimits(turns.max_turns, config.data.max_response_length, turns.max_tokens_per_turn)
        self.max_prompt_length, self.reward_source, self.rewards = config.data.max_prompt_length, turns.reward, rewards
        self.is_leader = dist.get_rank() == 0
        self.seats: dict[tuple[int, int], tuple[Environment, ChatRenderer]] = {}
        """On rollout rank 0: the environment and renderer of each trajectory in flight, by (admission, sample)."""

    def sampling(self, sampling: Sampling) -> Sampling:
        """`sampling` that also stops at the end of a model turn."""
        return replace(sampling, stop_token_ids=tuple(sorted({*sampling.stop_token_ids,
                                                                self.renderers.end_of_turn_id})))

    def open(self, groups: list[Group], dataset: PromptDataset) -> None:
        """The trajectories of newly admitted groups: rank 0 makes and resets their environments; every rank
        learns their openings."""
        if not groups:
            return
        openings, conversations = None, []
        if self.is_leader:
            openings = []
            for group in groups:
                for j in range(len(group.responses)):
                    environment, renderer, messages, opening = open_trajectory(
                        self.environment_for, self.renderers, dataset[group.index], self.max_prompt_length)
                    self.seats[group.admission, j] = environment, renderer
                    openings.append(opening)
                    conversations.append(list(messages))
        openings, conversations = iter(_from_leader(openings)), iter(conversations)
        for group in groups:
            for response in group.responses:
                response.turn = TurnState(opening=next(openings), messages=next(conversations, []))

    def context(self, group: Group, response: Response) -> list[int]:
        """The request that continues `response`: its trajectory's opening and every token so far."""
        return response.turn.opening + response.ids

    def max_tokens(self, response: Response) -> int:
        """The model tokens the current turn's request may add: what is left of the turn's or the trajectory's
        budget, whichever ends first."""
        start = response.turn.start
        return self.limits.turn_budget(start) - (len(response.ids) - start)

    def advanced(self, advanced: list[tuple[Group, int, Response, int, str | None]], version: int) -> None:
        """After an engine step (each response it advanced, with its number of new model tokens and the engine's
        finish reason: None while its request goes on): the turns that ended get the environment's answer (rank 0
        steps the environments, every rank appends the tokens); a trajectory that ends is finished ("length" when
        the budget ended it)."""
        for _, _, response, new_tokens, _ in advanced:
            response.loss_mask += [1] * new_tokens
        ended = [(group, j, response, reason) for group, j, response, _, reason in advanced if reason is not None]
        if not ended:
            return
        answers = None
        if self.is_leader:
            with ThreadPoolExecutor(max_workers=8) as pool:  # tool calls wait on subprocesses, not the GIL
                answers = list(pool.map(lambda item: self._observe(*item), ended))
        for (group, j, response, _), (ids, finish_reason) in zip(ended, _from_leader(answers)):
            if finish_reason is not None:
                response.finish_reason = finish_reason
                self.seats.pop((group.admission, j), None)
                continue
            response.ids += ids
            response.loss_mask += [0] * len(ids)
            response.logprobs += [0.0] * len(ids)
            response.versions += [version] * len(ids)
            response.turn.start = len(response.ids)

    def release(self, groups: list[Group]) -> None:
        """Forget the environments of groups generated anew."""
        for group in groups:
            for j in range(len(group.responses)):
                self.seats.pop((group.admission, j), None)

    def restore(self, groups: list[Group], dataset: PromptDataset) -> list[Group]:
        """After a resume: rank 0 replays the unfinished trajectories of `groups` into new environments (module
        docstring). The groups whose environments answered otherwise, to be generated anew (every rank)."""
        broken = None
        if self.is_leader:
            broken = [group.admission for group in groups
                      if not all(self._replay(group, j, response, dataset) for j, response in
                                 enumerate(group.responses) if response.finish_reason is None)]
            for admission in broken:
                logger.warning("resuming partial multi-turn rollouts: an environment of prompt admission %d answered "
                               "its replayed turns otherwise; its group is generated anew", admission)
        broken = set(_from_leader(broken))
        return [group for group in groups if group.admission in broken]

    def scored(self, batch: list[Group], dataset: PromptDataset, n: int, engine_tp: int) -> Rollouts:
        """The batch's trajectories as `Rollouts` held by every rank (with their openings), scored
        by rank 0 from `rollout.multi_turn.reward`."""
        rollouts, _ = unfilled_rollouts([dataset[group.index] for group in batch], n, engine_tp)
        responses = [response for group in batch for response in group.responses]
        rollouts.openings = [response.turn.opening for response in responses]
        rollouts.opening_lengths = [len(opening) for opening in rollouts.openings]
        rollouts.response_ids = [response.ids for response in responses]
        rollouts.rollout_logprobs = [response.logprobs for response in responses]
        rollouts.token_versions = [response.versions for response in responses]
        rollouts.loss_masks = [response.loss_mask for response in responses]
        rollouts.replicas = [0] * len(rollouts)
        output = RolloutOutput(response_ids=rollouts.response_ids,
                               finish_reasons=[response.finish_reason for response in responses])
        result, stats = None, {key: [] for key in TRAJECTORY_STATS}
        if self.is_leader and responses:
            conversations = [response.turn for response in responses]
            result = final_rewards(conversations, rollouts.prompts, self.rewards, self.reward_source)
            stats = trajectory_stats(conversations)
        share_scores(rollouts, output, result, 0, stats)
        return rollouts

    def _observe(self, group: Group, j: int, response: Response, reason: str) -> tuple[list[int], str | None]:
        """On rank 0: the environment's answer to the turn that just ended, or the trajectory's finish reason."""
        turn = response.turn
        ids = observe(turn, len(response.ids), response.ids[turn.start:], reason, *self.seats[group.admission, j],
                      last_turn=turn.num_turns == self.limits.max_turns - 1,
                      max_response_length=self.limits.max_response_length)
        if ids is None:
            return [], "length" if turn.truncated else "stop"
        return ids, None

    def _replay(self, group: Group, j: int, response: Response, dataset: PromptDataset) -> bool:
        """A new environment for a trajectory in flight, stepped through its conversation's turns; False when it
        answers otherwise than the saved conversation says."""
        environment, renderer, messages, opening = open_trajectory(
            self.environment_for, self.renderers, dataset[group.index], self.max_prompt_length)
        script = response.turn.messages
        if opening != response.turn.opening or script[:len(messages)] != messages:
            return False
        position = len(messages)
        while position < len(script):
            text, position = script[position]["content"], position + 1
            answer_end = next((k for k in range(position, len(script)) if script[k]["role"] == "assistant"),
                              len(script))
            observation = environment.step(text)
            if observation.done or observation.messages != script[position:answer_end]:
                return False
            position = answer_end
        self.seats[group.admission, j] = environment, renderer
        return True


def _from_leader(value: list | None) -> list:
    """Rollout rank 0's `value` on every rollout rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
