"""Environments: the default ToolEnvironment, choosing one per data_source or by path, and the example
guess-the-number game played to the end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megarl.agent.environment import ENVIRONMENTS, Observation, ToolEnvironment, load_environment
from megarl.config.schema import MultiTurnConfig, RolloutConfig
from megarl.data.dataset import Prompt

GUESS_NUMBER = Path(__file__).resolve().parents[3] / "examples" / "environments" / "guess_number.py"


@ENVIRONMENTS.register("test_agent_echo")
class EchoEnvironment:
    """Registered for the data_source "test_agent_echo": answers every turn with the turn, never ends."""

    def __init__(self, toolbox):
        self.tools = []

    def reset(self, sample):
        return [{"role": "user", "content": sample.ground_truth}]

    def step(self, assistant_text):
        return Observation([{"role": "user", "content": assistant_text}])


def sample(data_source: str = "arithmetic", ground_truth: str = "") -> Prompt:
    return Prompt([1, 2], data_source, ground_truth, {}, 0)


def environments(**multi_turn):
    return load_environment(RolloutConfig(multi_turn=MultiTurnConfig(**multi_turn)))


def test_tool_environment_answers_each_call_with_a_tool_message_and_ends_on_a_turn_without_calls():
    environment = environments(tools=["calculator"])(sample())
    assert isinstance(environment, ToolEnvironment) and environment.reset(sample()) == []
    assert [tool["function"]["name"] for tool in environment.tools] == ["calculator"]
    calls = "".join(f"<tool_call>{json.dumps(call)}</tool_call>" for call in [
        {"name": "calculator", "arguments": {"expression": "6*7"}}, {"name": "calculator", "arguments": {}},
        {"name": "python", "arguments": {"code": "1"}}]) + "<tool_call>{oops}</tool_call>"
    observation = environment.step("Computing. " + calls)
    assert not observation.done and observation.reward is None
    assert [(m["role"], m["name"]) for m in observation.messages] == [("tool", "calculator")] * 2 + [
        ("tool", "python"), ("tool", "")]
    assert observation.messages[0]["content"] == "42"
    assert all(m["content"].startswith("Error: ") for m in observation.messages[1:])
    assert observation.info == {"tool_calls": 4, "tool_errors": 3, "tool_timeouts": 0, "tool_malformed": 1,
                                "tool_unknown": 1}
    assert environment.step("So the answer is 42.") == Observation([], reward=None, done=True)


def test_the_environment_is_chosen_by_data_source_or_by_path():
    by_data_source = environments()
    assert isinstance(by_data_source(sample("test_agent_echo")), EchoEnvironment)
    assert isinstance(by_data_source(sample("gsm8k")), ToolEnvironment)
    by_path = environments(environment=f"{GUESS_NUMBER}:GuessNumberEnvironment")
    assert type(by_path(sample("test_agent_echo"))).__name__ == "GuessNumberEnvironment"
    with pytest.raises(ValueError, match=r"rollout.multi_turn.environment: file 'missing.py' does not exist"):
        environments(environment="missing.py:Game")


def play_binary_search(environment, secret: int) -> tuple[Observation, list[str]]:
    """Play the game as a perfect player would; the final observation and the feedback seen."""
    low, high, feedback = 1, 100, []
    messages = environment.reset(sample(ground_truth=str(secret)))
    assert "<guess>N</guess>" in messages[0]["content"]
    while True:
        guess = (low + high) // 2
        observation = environment.step(f"I will try the middle. <guess>{guess}</guess>")
        if observation.done:
            return observation, feedback
        feedback.append(observation.messages[0]["content"])
        low, high = (guess + 1, high) if feedback[-1].startswith("Higher") else (low, guess - 1)


@pytest.mark.parametrize("secret", [1, 37, 100])
def test_guess_the_number_rewards_a_player_who_searches(secret):
    environment = environments(environment=f"{GUESS_NUMBER}:GuessNumberEnvironment")(sample())
    assert environment.tools == []
    final, feedback = play_binary_search(environment, secret)
    assert final.reward == 1.0 and final.info["guesses"] == len(feedback) + 1 <= 7
    expected = []  # the feedback a binary search must get, worked out here, not by the environment
    low, high = 1, 100
    while (guess := (low + high) // 2) != secret:
        expected.append("Higher." if guess < secret else "Lower.")
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
    assert [re.sub(r" \d+ guesses left\.", "", text) for text in feedback] == expected


def test_guess_the_number_asks_for_the_format_and_ends_with_zero_when_guesses_run_out():
    environment = environments(environment=f"{GUESS_NUMBER}:GuessNumberEnvironment")(sample())
    environment.reset(sample(ground_truth="50"))
    first = environment.step("I think it is 50.")
    assert first.messages == [{"role": "user",
                               "content": "Answer with your guess as <guess>N</guess>. 6 guesses left."}]
    assert first.info == {"guesses": 1, "invalid_guesses": 1} and not first.done
    observations = [environment.step("<guess>10</guess>") for _ in range(6)]
    assert [o.done for o in observations] == [False] * 5 + [True]
    assert observations[-1].reward == 0.0 and observations[-1].messages == []
