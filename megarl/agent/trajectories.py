"""The multi-turn rollout loop of one engine replica: the model writes, the environment answers, turn by turn.

Every rank of the replica runs this loop with the same inputs, since every TP rank of an engine calls
`generate` with the same requests; only the replica's first rank (the `leader`) holds the
environments, steps them with the decoded text of each turn and decides what comes next. The other
ranks receive the observation tokens from it (`share`, a broadcast in the replica), so the replica's
ranks hold identical trajectories.

A turn is one engine call for the replica's unfinished trajectories, each request being its whole
trajectory so far (opening + every turn's tokens). A trajectory ends when its environment says done,
after `max_turns` model turns, or when its token budget runs out (a turn may also be capped at
`max_tokens_per_turn`; the environment then answers the cut turn): every response token, the model's
and the environment's, counts against `max_response_length`, and an observation that would leave no
room for a model token ends the trajectory before it is appended. So a trajectory always ends with a
model token (where the outcome reward is placed).

Per token: loss mask 1 on model tokens, 0 on environment tokens; the engine's log-probs on model
tokens, 0 on environment tokens. Trajectory i of the step samples turn t with seed
`derive_seed(sampling.seed, "multi_turn", draw=t) + i` (`megarl.seeding`), whichever trajectories are
still running and whichever replica runs it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from megarl.agent.rendering import ChatRenderer
from megarl.rollout.base import RolloutEngine, Sampling
from megarl.seeding import derive_seed

if TYPE_CHECKING:
    from megarl.agent.environment import Environment


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int
    max_response_length: int
    """Response tokens of a trajectory at most, the model's and the environment's."""
    max_tokens_per_turn: int = 0
    """Tokens of one model turn at most (cut turns are answered as they are); 0: no limit but the budget."""

    def turn_budget(self, num_response_tokens: int) -> int:
        left = self.max_response_length - num_response_tokens
        return min(left, self.max_tokens_per_turn) if self.max_tokens_per_turn else left


@dataclass(kw_only=True)
class Conversation:
    """What the leader knows of a trajectory: its conversation so far and how it went."""

    messages: list[dict] = field(default_factory=list)
    """The conversation: opening messages, then each assistant turn and each observation's messages."""
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    truncated: bool = False
    """Ended by the token budget."""
    ended_by: str = ""
    """The environment that said done, by class name; "" when max_turns or the budget ended it."""
    reward: float | None = None
    """The environment's reward when it ended the trajectory; None if it gave none."""

    @property
    def final_text(self) -> str:
        """The last assistant turn: what the reward function scores."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


@dataclass
class Trajectory(Conversation):
    """A trajectory of the step; its `Conversation` is known on the leader only."""

    index: int
    """Position in the step: the seed offset of its requests."""
    prompt_ids: list[int]
    """The opening: the environment's first messages, rendered with its tools and the assistant header."""
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False


def run_turns(trajectories: list[Trajectory], engine: RolloutEngine, sampling: Sampling, limits: TurnLimits,
              seats: list[tuple[Environment, ChatRenderer]] | None, share: Callable[[list | None], list]) -> None:
    """Generate `trajectories` to their end, in place. `sampling.stop_token_ids` must hold the template's
    end-of-turn token. `seats`: on the leader, each trajectory's environment and the renderer of its
    tools; None elsewhere. `share`: the leader's list, on every rank of the replica."""
    with ThreadPoolExecutor(max_workers=8) as pool:  # tool calls wait on subprocesses, not the GIL
        for turn in range(limits.max_turns):
            active = [k for k, t in enumerate(trajectories) if not t.done]
            if not active:
                return
            turn_seed = derive_seed(sampling.seed, "multi_turn", draw=turn)
            requests = [trajectories[k] for k in active]
            output = engine.generate([t.prompt_ids + t.response_ids for t in requests], replace(
                sampling, n=1, request_seeds=tuple(turn_seed + t.index for t in requests),
                request_max_tokens=tuple(limits.turn_budget(len(t.response_ids)) for t in requests)))
            for t, ids, logprobs in zip(requests, output.response_ids, output.logprobs):
                t.response_ids += ids
                t.loss_mask += [1] * len(ids)
                t.logprobs += logprobs
            observations = None
            if seats is not None:
                last_turn = turn == limits.max_turns - 1
                observations = list(pool.map(
                    lambda k, ids, reason: observe(trajectories[k], len(trajectories[k].response_ids), ids, reason,
                                                   *seats[k], last_turn, limits.max_response_length),
                    active, output.response_ids, output.finish_reasons))
            for t, observation in zip(requests, share(observations)):
                if observation is None:
                    t.done = True
                else:
                    t.response_ids += observation
                    t.loss_mask += [0] * len(observation)
                    t.logprobs += [0.0] * len(observation)
    for t in trajectories:
        t.done = True


def observe(trajectory: Conversation, num_response_tokens: int, turn_ids: list[int], finish_reason: str,
            environment: Environment, renderer: ChatRenderer, last_turn: bool,
            max_response_length: int) -> list[int] | None:
    """On the leader: the environment's answer to a model turn (`turn_ids`, the last of the trajectory's
    `num_response_tokens`) as tokens; None when the trajectory ends."""
    text = renderer.decode(turn_ids)
    trajectory.messages.append({"role": "assistant", "content": text})
    trajectory.num_turns += 1
    if finish_reason == "length" and num_response_tokens >= max_response_length:  # budget spent mid-turn
        trajectory.truncated = True
        return None
    if last_turn:
        return None
    observation = environment.step(text)
    trajectory.num_tool_calls += int(observation.info.get("tool_calls", 0))
    trajectory.num_tool_errors += int(observation.info.get("tool_errors", 0))
    if observation.done:
        trajectory.ended_by, trajectory.reward = type(environment).__name__, observation.reward
        return None
    ids = renderer.observation(observation.messages, turn_ids)
    if num_response_tokens + len(ids) >= max_response_length:  # no room left for the model
        trajectory.truncated = True
        return None
    trajectory.messages += observation.messages
    return ids
