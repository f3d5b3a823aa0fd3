"""What answers the model's turns in a multi-turn rollout: the `Environment` interface, the default
`ToolEnvironment`, and how the run picks one.

The turn loop (`megarl.agent.trajectories`) calls, for each trajectory:

    env = make_environment(sample)          # make_environment = load_environment(config.rollout)
    opening = env.reset(sample)             # chat messages that open the trajectory
    while not done:
        ... the model writes a turn ...
        observation = env.step(turn_text)   # messages to append, done, the environment's reward

An environment is constructed with the run's `Toolbox` (one that uses no tools ignores it). A
trajectory's reward is, per `rollout.multi_turn.reward`, its environment's (`Observation.reward` when
done; 0 if it never said done), the reward function's score of the last assistant turn, or their sum
(`megarl.generation.multi_turn.final_rewards`). Environments never import the engine or the trainer.

Which environment: `rollout.multi_turn.environment=path/to/file.py:Class` for every sample, else the
one registered in ENVIRONMENTS under the sample's data_source, else `ToolEnvironment`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol

from megarl.agent.tool_calls import parse_tool_calls
from megarl.agent.toolbox import Toolbox
from megarl.agent.tools import load_tools
from megarl.config.schema import RolloutConfig
from megarl.data.dataset import Prompt
from megarl.registry import Registry
from megarl.user_code import load_callable


@dataclass
class Observation:
    messages: list[dict]
    """Chat messages to append after the model's turn (e.g. role "tool"); [] when none."""
    reward: float | None = None
    """The environment's reward for the trajectory (only meaningful when done); None: it gives none."""
    done: bool = False
    info: dict = field(default_factory=dict)
    """Counters for metrics, e.g. {"tool_calls": 2, "tool_errors": 1}."""


class Environment(Protocol):
    tools: list[dict]
    """JSON tool schemas to pass to the chat template as `tools=` ([] for none)."""

    def reset(self, sample: Prompt) -> list[dict]:
        """The chat messages that open the trajectory, rendered with `tools`; [] keeps the sample's own
        prompt, which the data loader rendered with rollout.multi_turn.tools (`tool_schemas`)."""

    def step(self, assistant_text: str) -> Observation:
        """React to the model's turn (its decoded text)."""


ENVIRONMENTS: Registry[Callable[[Toolbox], Environment]] = Registry("environment (data_source)")


class ToolEnvironment:
    """The default: runs the tool calls of each turn, one "tool" message per call, in the calls'
    order; done when a turn calls no tool. Its reward is None: runs with it score the text with the reward
    function (rollout.multi_turn.reward=function).

    info counts the turn's calls by outcome: tool_calls (all), tool_errors (every failed one), and
    among those tool_timeouts, tool_malformed, tool_unknown.
    """

    def __init__(self, toolbox: Toolbox):
        self.toolbox = toolbox
        self.tools = toolbox.schemas

    def reset(self, sample: Prompt) -> list[dict]:
        return []  # the sample's prompt, rendered with the same tools (`tool_schemas`) by the data loader

    def step(self, assistant_text: str) -> Observation:
        calls = parse_tool_calls(assistant_text)
        if not calls:
            return Observation([], done=True)
        results = self.toolbox.run(calls)
        outcomes = Counter(result.outcome for result in results)
        info = {"tool_calls": len(results), "tool_errors": len(results) - outcomes["ok"],
                "tool_timeouts": outcomes["timeout"], "tool_malformed": outcomes["malformed"],
                "tool_unknown": outcomes["unknown_tool"]}
        return Observation([{"role": "tool", "name": result.name, "content": result.content} for result in results],
                           info=info)


def load_environment(rollout: RolloutConfig) -> Callable[[Prompt], Environment]:
    """A function making each sample's environment, per `rollout.multi_turn` (see the module docstring);
    a bad tool or environment spec fails here, once, with the config key named."""
    config = rollout.multi_turn
    toolbox = Toolbox(load_tools(config), config.tool_timeout_seconds, config.max_tool_output_chars)
    if config.environment:
        environment_class = load_callable(config.environment, "rollout.multi_turn.environment")
        return lambda sample: environment_class(toolbox)
    return lambda sample: (ENVIRONMENTS.get(sample.data_source) if sample.data_source in ENVIRONMENTS.names()
                           else ToolEnvironment)(toolbox)
