"""An example environment: guess-the-number, with feedback, rewarded by the environment itself.

Each sample's `ground_truth` is the secret, an integer from 1 to 100 (the row's prompt is not used:
`reset` opens the trajectory with the rules). The model answers with
<guess>N</guess>; the environment says "higher" or "lower" until the model finds it or uses up its
guesses. Reward 1.0 for finding it, 0.0 otherwise: no reward function needed (rollout.multi_turn.reward=
environment, the default).

    rollout.multi_turn.environment=examples/environments/guess_number.py:GuessNumberEnvironment

An environment is any class with `tools`, `reset(sample) -> messages` and `step(text) -> Observation`,
constructed with the run's Toolbox (unused here: this game offers no tools).
"""

from __future__ import annotations

import re

from megarl.agent.environment import Observation

MAX_GUESSES = 7  # enough for a binary search of 1..100
GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")
RULES = (f"I am thinking of a whole number from 1 to 100. You have {MAX_GUESSES} guesses. Answer each turn "
         "with your guess as <guess>N</guess>; I will say whether the number is higher or lower.")


class GuessNumberEnvironment:
    def __init__(self, toolbox):
        self.tools = []

    def reset(self, sample) -> list[dict]:
        self.secret, self.num_guesses = int(sample.ground_truth), 0
        return [{"role": "user", "content": RULES}]

    def step(self, assistant_text: str) -> Observation:
        self.num_guesses += 1  # an answer without a guess uses one up too, so every game ends
        guesses = GUESS.findall(assistant_text)
        info = {"guesses": self.num_guesses, "invalid_guesses": int(not guesses)}
        if guesses and int(guesses[-1]) == self.secret:
            return Observation([], reward=1.0, done=True, info=info)
        if self.num_guesses >= MAX_GUESSES:
            return Observation([], reward=0.0, done=True, info=info)
        if not guesses:
            feedback = "Answer with your guess as <guess>N</guess>."
        else:
            feedback = "Higher." if int(guesses[-1]) < self.secret else "Lower."
        left = MAX_GUESSES - self.num_guesses
        return Observation([{"role": "user", "content": f"{feedback} {left} guesses left."}], info=info)
