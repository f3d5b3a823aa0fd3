"""The judge's engine side (megarl.generation.judge.JudgeEngine) over a stand-in engine: the prompts it is sent
(raw text, or the judge's chat template), prompts over the budget left out with an error, and truncated verdicts."""

from __future__ import annotations

import make_tiny_model
import pytest

from megarl.generation.judge import JudgeEngine
from megarl.rollout import RolloutOutput, Sampling

SAMPLING = Sampling(n=1, temperature=0.0, max_tokens=3, stop_token_ids=(1,), seed=7)


class FakeEngine:
    """Answers every prompt with fixed verdict tokens; records what it was asked."""

    def __init__(self, tokenizer, answers: list[tuple[str, str]]):
        self.tokenizer, self.answers, self.calls = tokenizer, answers, []

    def generate(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        return RolloutOutput(response_ids=[self.tokenizer.encode(text) for text, _ in self.answers[:len(prompts)]],
                             logprobs=[[] for _ in prompts], finish_reasons=[r for _, r in self.answers[:len(prompts)]])


@pytest.mark.parametrize("chat", [False, True])
def test_prompts_verdicts_and_the_length_budget(chat):
    tokenizer = make_tiny_model.make_tokenizer()  # one token per character; a ChatML template
    engine = FakeEngine(tokenizer, [("correct", "stop"), ("wro", "length")])
    prompts = ["judge 1+1=2", "judge " + "9" * 40, "judge 1+1=3"]
    verdicts = JudgeEngine(engine, tokenizer, chat, max_prompt_length=32, sampling=SAMPLING)(prompts)
    # The texts as a chat template renders a user's message, by hand, or as they are: one id per character.
    rendered = ([f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n" for text in prompts] if chat
                else prompts)
    expected = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text)) for text in rendered]
    # ChatML around the text: <|im_start|> "user" \n ... <|im_end|> \n <|im_start|> "assistant" \n, 19 tokens.
    assert len(expected[0]) == (len(prompts[0]) + 19 if chat else len(prompts[0]))
    (sent, sampling), = engine.calls
    assert sent == [expected[0], expected[2]] and sampling == SAMPLING  # the long one is not sent
    assert [(v.text, v.truncated, v.error) for v in (verdicts[0], verdicts[2])] == [("correct", False, None),
                                                                                     ("wro", True, None)]
    assert verdicts[1].error == (f"its prompt has {len(expected[1])} tokens, over reward.judge.max_prompt_length "
                                 "= 32")
