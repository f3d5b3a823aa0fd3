"""Environments loaded by path (`rollout.multi_turn.environment=.../user_environment.py:AnswerEveryTurn`) for
multi-turn runs of random tiny models, which never write a tool call: they open with a question and answer a
turn with a short user message. AnswerEveryTurn answers every turn, so every trajectory plays
`rollout.multi_turn.max_turns` turns (unless its token budget runs out first) and half its response tokens or
so are the environment's; AnswerSomeTurns ends a trajectory after a turn of odd length (in characters), so
trajectories play 1 to max_turns turns."""

from pathlib import Path

from megarl.agent.environment import Observation

ANSWER = "go on"


def overrides(environment: str = "AnswerEveryTurn") -> list[str]:
    """A run's config overrides for trajectories of at most 3 model turns of at most 8 tokens with `environment`."""
    return ["rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=3", "rollout.multi_turn.reward=function",
            "rollout.multi_turn.max_tokens_per_turn=8", "data.max_response_length=76", "data.max_prompt_length=32",
            f"rollout.multi_turn.environment={Path(__file__).resolve()}:{environment}"]


class AnswerEveryTurn:
    def __init__(self, toolbox):
        self.tools = []

    def reset(self, sample) -> list[dict]:
        return [{"role": "user", "content": f"{sample.ground_truth}?"}]

    def step(self, assistant_text: str) -> Observation:
        return Observation([{"role": "user", "content": ANSWER}], info={"tool_calls": 1, "tool_errors": 0})


class AnswerSomeTurns(AnswerEveryTurn):
    def step(self, assistant_text: str) -> Observation:
        if len(assistant_text) % 2:
            return Observation([], done=True)
        return super().step(assistant_text)
