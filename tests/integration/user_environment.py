"""An environment loaded by path (`rollout.multi_turn.environment=.../user_environment.py:AnswerEveryTurn`)
for multi-turn runs of random tiny models, which never write a tool call: it opens with a question and
answers every turn with a short user message, so every trajectory plays `rollout.multi_turn.max_turns`
turns (unless its token budget runs out first) and half its response tokens or so are the environment's."""

from megarl.agent.environment import Observation

ANSWER = "go on"


class AnswerEveryTurn:
    def __init__(self, toolbox):
        self.tools = []

    def reset(self, sample) -> list[dict]:
        return [{"role": "user", "content": f"{sample.ground_truth}?"}]

    def step(self, assistant_text: str) -> Observation:
        return Observation([{"role": "user", "content": ANSWER}], info={"tool_calls": 1, "tool_errors": 0})
