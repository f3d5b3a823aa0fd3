"""The token pieces of a multi-turn trajectory, cut from the model's own chat template.

A trajectory is kept as token ids, token-in, token-out: the model's tokens exactly as sampled, and
between its turns the tokens of what the environment said, never a re-tokenization of decoded text.
Each environment turn is rendered by the chat template (with the environment's `tools`) as the
difference of two renderings of a probe conversation that ends with an assistant turn:

    observation = closing + render(probe + observation messages, generation prompt)[len(render(probe)):]

where `closing` is what the template writes after an assistant message's content (`<|im_end|>\\n` for
Qwen's ChatML, ` </s>` for Llama 2). The model ends its turn by sampling the closing's first special
token (its end-of-turn token, a stop token of multi-turn generation), after any text the closing has
before it; the rest of the closing and the next turn's header follow as environment tokens. So the
trajectory, plus the rest of the last turn's closing, is exactly the template's rendering of its
messages (tests/unit/agent/test_rendering.py), except where:
- the model stopped with another stop token (EOS) or ran out of budget: its tokens are kept, and the
  closing follows in full (the template would have no EOS there);
- the model's tokens are not the tokenizer's own encoding of their text (BPE can sample a
  non-canonical split): they are kept, the log-probs belong to them;
- the template rewrites earlier turns (Qwen3 drops the <think> of past assistant turns): the trajectory
  keeps what the model saw when it wrote each turn.
"""

from __future__ import annotations

SENTINEL = "\ue000assistant turn\ue001"
"""Content of the probe's assistant turn: marks where the template's closing of an assistant turn begins.
Its ends are private-use characters, not whitespace: templates trim contents (Llama 3's and Gemma's
`| trim`, Llama 2's `.strip()`), and Python's strip takes control characters such as \\x1f for whitespace."""
PROBE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}]


class ChatRenderer:
    """Renders openings and observations of conversations using `tools` as token ids."""

    def __init__(self, tokenizer, tools: list[dict]):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("rollout.multi_turn needs a tokenizer with a chat template (model.path's has none)")
        self.tokenizer, self.tools = tokenizer, tools or None
        self.probe_text = self._text(PROBE)
        if SENTINEL not in self.probe_text:
            raise ValueError(f"the chat template of model.path's tokenizer does not write an assistant message's "
                             f"content as given: an assistant message {SENTINEL!r} renders without it")
        self.closing = self.probe_text[self.probe_text.index(SENTINEL) + len(SENTINEL):]
        special_ids = {*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder}
        self.end_of_turn_id = next((id for id in self._ids(self.closing) if id in special_ids), None)
        """The token that ends a model turn: the first special (or added) token of the template's closing."""
        if self.end_of_turn_id is None:
            raise ValueError(f"the chat template of model.path's tokenizer closes an assistant turn with "
                             f"{self.closing!r}, which holds no special token to end a turn on")
        end_of_turn = tokenizer.convert_ids_to_tokens(self.end_of_turn_id)
        self.turn_end = self.closing[: self.closing.index(end_of_turn) + len(end_of_turn)]
        """What a model turn ends with: the closing up to its end-of-turn token (` </s>` for Llama 2)."""

    def _text(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        # The template writes its own special tokens (BOS included): the tokenizer must add none.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def opening(self, messages: list[dict]) -> list[int]:
        """The prompt of a trajectory: its opening messages and the first assistant header."""
        return self._ids(self._text(messages, generation_prompt=True))

    def observation(self, messages: list[dict], turn_ids: list[int]) -> list[int]:
        """What follows the model's turn `turn_ids`: the rest of its closing, `messages` (tool results),
        and the next assistant header."""
        after = self._text(PROBE + messages, generation_prompt=True)
        if not after.startswith(self.probe_text):
            raise ValueError("the chat template renders earlier turns differently once tool messages follow; "
                             "multi-turn rollouts need a template that only appends")
        ids = self._ids(self.closing + after[len(self.probe_text):])
        # A turn that ended on the end-of-turn token holds the closing through it (`turn_end`): special
        # tokens split a text, so the ids up to the first end-of-turn token are those of `turn_end`.
        ended = turn_ids and turn_ids[-1] == self.end_of_turn_id
        return ids[ids.index(self.end_of_turn_id) + 1:] if ended else ids

    def continuation(self, turns: list[dict]) -> tuple[list[int], list[int]]:
        """A reference continuation of an opening (an SFT target): `turns`, assistant messages with the
        environment's messages (tool results) between them, as the tokens a trajectory that played them
        holds (each model turn ending on the end-of-turn token), and its loss mask: 1 on the model's
        tokens, 0 on the environment's. ValueError if `turns` do not alternate so, from and to an
        assistant message."""
        roles = [message["role"] == "assistant" for message in turns]
        if not roles or not roles[0] or not roles[-1] or any(a and b for a, b in zip(roles, roles[1:])):
            raise ValueError("expected assistant messages with other messages (tool results) between them, first "
                             f"and last an assistant's; got roles {[message['role'] for message in turns]}")
        ids, loss_mask, turn_ids, observed = [], [], [], []
        for message in turns:
            if message["role"] != "assistant":
                observed.append(message)
                continue
            if observed:
                observation = self.observation(observed, turn_ids)
                ids, loss_mask, observed = ids + observation, loss_mask + [0] * len(observation), []
            turn_ids = self._ids(message["content"] + self.turn_end)
            ids, loss_mask = ids + turn_ids, loss_mask + [1] * len(turn_ids)
        return ids, loss_mask

    def decode(self, turn_ids: list[int]) -> str:
        """The text of a model turn, as the environment reads it (special tokens dropped)."""
        return self.tokenizer.decode(turn_ids, skip_special_tokens=True)
