"""The turn loop on a real engine (plain transformers, a tiny random Qwen2) with an environment that
answers every turn with a tool message, checked against independent computations: the template's
rendering of the recorded messages, an HF forward pass for the log-probs, and a lone generation of one
trajectory for its seeds; and the final reward of each rollout.multi_turn.reward source, on such trajectories."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby

import make_tiny_model
import pytest
import torch
from transformers import AutoModelForCausalLM

from megarl.agent.rendering import ChatRenderer
from megarl.agent.trajectories import Trajectory, TurnLimits, run_turns
from megarl.data.dataset import Prompt
from megarl.generation.multi_turn import final_rewards
from megarl.rewards.manager import RewardFunctionError, RewardManager
from megarl.rollout.base import Sampling
from megarl.rollout.hf_backend import HFRollout

TOOLS = [{"type": "function", "function": {"name": "echo"}}]
MAX_RESPONSE = 140  # an observation takes ~55 tokens (characters)


@dataclass
class Observation:  # the fields of megarl.agent.environment.Observation
    messages: list[dict]
    reward: float | None = None
    done: bool = False
    info: dict = field(default_factory=dict)


class EchoEnvironment:
    """Answers the first turn with its length; ends the trajectory with `reward` after the second."""

    tools = TOOLS

    def __init__(self, reward: float | None = 7.0):
        self.turns, self.reward = 0, reward

    def step(self, text: str) -> Observation:
        self.turns += 1
        if self.turns == 2:
            return Observation([], reward=self.reward, done=True, info={"tool_calls": 0})
        return Observation([{"role": "tool", "content": f"{len(text)} chars"}],
                           info={"tool_calls": 1, "tool_errors": 1})


@pytest.fixture(scope="module")
def engine(tiny_models):
    return HFRollout(str(tiny_models["qwen2-tied"]), "float32")


def _stop_early(renderer, tokenizer, seed=11):
    # A random model rarely samples <|im_end|>: ten stop characters end its turns early.
    stops = tuple(tokenizer.convert_tokens_to_ids(list("aeiouAEIOU"))) + (renderer.end_of_turn_id,)
    return Sampling(temperature=1.0, stop_token_ids=stops, seed=seed)


def _run(engine, renderer, indices, sampling, max_turns, reward=7.0):
    opening = [{"role": "user", "content": "Say something."}]
    trajectories = [Trajectory(i, renderer.opening(opening), messages=list(opening)) for i in indices]
    seats = [(EchoEnvironment(reward), renderer) for _ in indices]
    run_turns(trajectories, engine, sampling, TurnLimits(max_turns, MAX_RESPONSE), seats,
              share=lambda observations: observations)
    return trajectories


def test_turns_are_kept_as_tokens_with_masks_and_the_engines_logprobs(tiny_models, engine):
    model_dir = str(tiny_models["qwen2-tied"])
    # The model's tokenizer as made (AutoTokenizer loads a Qwen2 directory's with Qwen2's byte-level
    # pre-tokenizer, which drops the character vocabulary's whitespace).
    tokenizer = make_tiny_model.make_tokenizer()
    renderer = ChatRenderer(tokenizer, TOOLS)
    sampling = _stop_early(renderer, tokenizer)
    trajectories = _run(engine, renderer, range(4), sampling, max_turns=4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for t in trajectories:
        assert t.done and 1 <= t.num_turns <= 2 and len(t.response_ids) <= MAX_RESPONSE
        assert t.loss_mask[-1] == 1  # the outcome reward lands on a model token
        answered = sum(m["role"] == "tool" for m in t.messages)  # an answer without room ends it unanswered
        assert t.num_tool_calls == t.num_tool_errors and answered <= t.num_tool_calls <= answered + t.truncated
        assert (t.reward == 7.0) == (t.num_turns == 2 and not t.truncated)
        # The engine's log-probs sit on the model's tokens: an HF forward of the whole trajectory agrees.
        sequence = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(sequence).logits[0, :-1].float(), -1)
        positions = torch.arange(len(t.prompt_ids) - 1, sequence.shape[1] - 1)
        reference = logp[positions, sequence[0, positions + 1]] * torch.tensor(t.loss_mask)
        torch.testing.assert_close(torch.tensor(t.logprobs), reference, rtol=0, atol=1e-5)
        # The model's turns are the runs of mask 1; the environment read each as its text.
        turns = [[token for token, _ in run] for model, run in groupby(zip(t.response_ids, t.loss_mask),
                                                                       key=lambda pair: pair[1]) if model]
        assistant = [m for m in t.messages if m["role"] == "assistant"]
        assert [m["role"] for m in t.messages[1:]] == ["assistant", "tool"] * (t.num_turns - 1) + ["assistant"]
        assert [m["content"] for m in assistant] == [tokenizer.decode(turn, skip_special_tokens=True) for turn in turns]
        # Token for token the template's rendering of the messages, the model's sampled special tokens
        # written into its turns (rendering.py: a turn stopped by EOS keeps it and gets the whole closing);
        # the template closes the last turn, the trajectory ends at the model's last token.
        sampled = [dict(m, content=tokenizer.decode(turn[:-1] if turn[-1] == renderer.end_of_turn_id else turn))
                   for m, turn in zip(assistant, turns)]
        messages = [sampled.pop(0) if m["role"] == "assistant" else m for m in t.messages]
        rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
        closing = tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
        closing = closing[1:] if t.response_ids[-1] == renderer.end_of_turn_id else closing
        assert t.prompt_ids + t.response_ids + closing == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert sum(t.num_turns for t in trajectories) > len(trajectories)  # several turns were played
    # Each trajectory samples its own seeds: alone, trajectory 2 is generated token for token the same.
    alone = _run(engine, renderer, [2], sampling, max_turns=4)[0]
    assert alone.response_ids == trajectories[2].response_ids and alone.loss_mask == trajectories[2].loss_mask


def _length_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 10


def test_the_final_reward_comes_from_the_source_rollout_multi_turn_reward_names(engine):
    # Trajectories 0-3 play two turns and the environment ends them with reward 7 (unless the budget ran out
    # first); 4-5 are cut by max_turns=1 before the environment judges them: its reward is 0 for them.
    tokenizer = make_tiny_model.make_tokenizer()
    renderer = ChatRenderer(tokenizer, TOOLS)
    sampling = _stop_early(renderer, tokenizer)
    trajectories = _run(engine, renderer, range(4), sampling, 4) + _run(engine, renderer, [4, 5], sampling, 1)
    ended = [t.num_turns == 2 and not t.truncated for t in trajectories]
    assert ended[:4].count(True) >= 2 and ended[4:] == [False, False]
    environment = [7.0 if e else 0.0 for e in ended]
    function = [len(t.final_text) / 10 for t in trajectories]  # the last assistant turn's text
    assert function == [len(t.messages[-1]["content"]) / 10 for t in trajectories]
    prompts = [Prompt([], "arithmetic", "", {}, 100 + i) for i in range(6)]
    rewards = RewardManager(_length_score)
    expected = {"environment": environment, "function": function,
                "sum": [e + f for e, f in zip(environment, function)]}
    for source, scores in expected.items():
        assert final_rewards(trajectories, prompts, rewards, source).scores == pytest.approx(scores, abs=1e-12), source
    # An environment that ends a trajectory without a reward cannot give one to take.
    silent = _run(engine, renderer, range(4), sampling, 4, reward=None)
    assert any(t.ended_by for t in silent)
    for source in ("environment", "sum"):
        pattern = (r"rollout.multi_turn.reward='%s'.* environment \w+ ended .* prompt 10\d .* at turn 2 with none"
                   % source)
        with pytest.raises(RewardFunctionError, match=pattern):
            final_rewards(silent, prompts, rewards, source)
    assert final_rewards(silent, prompts, rewards, "function").scores == pytest.approx(
        [len(t.final_text) / 10 for t in silent])
