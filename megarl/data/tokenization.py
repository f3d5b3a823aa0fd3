"""Text and chat messages -> token ids: the one place where megarl turns text into ids (RL training
and validation prompts, launchers/generate.py, SFT, the Megatron-vs-transformers parity check).

- Raw text (a plain-string prompt, or chat messages joined by newlines when data.apply_chat_template
  is false or the tokenizer has no chat template) gets the special tokens the tokenizer puts in
  front of a text by default, e.g. the BOS of Llama's and Mistral's post-processors. The model was
  trained with them: a tiny model SFT'd with BOS fell from 53.5% to 10.5% greedy accuracy without.
  Specials a post-processor would append (an EOS) are left out: a prompt is the start of a
  sequence the model goes on with, not a finished text.
- Messages rendered by the tokenizer's chat template get no special tokens from the tokenizer: the
  template writes those it wants (as transformers' `apply_chat_template(tokenize=True)` does). With
  `tools` (JSON schemas, `megarl.agent.tools.tool_schemas`), the template also writes its tools
  preamble, as for the openings of multi-turn trajectories.
- A response continues its prompt and gets no special tokens of its own.

A prompt that starts with BOS twice (a text or template that holds one, plus the tokenizer's) is a
ValueError: the model never saw that in training.
"""

from __future__ import annotations

PromptText = list[dict] | str
"""A prompt of the data layout: chat messages `{role, content}` or a plain string."""


def uses_chat_template(tokenizer, apply_chat_template: bool) -> bool:
    return apply_chat_template and getattr(tokenizer, "chat_template", None) is not None


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts in front of every text it encodes by default ([] or [BOS] mostly)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start: start + len(plain)] == plain:
            return list(full[:start])
    raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r}: its default special tokens do not "
                     f"surround the text's own ids ({full} vs {plain}); cannot tell which ones start a sequence")


def render(prompt: PromptText, tokenizer, use_template: bool, tools: list[dict] | None = None) -> str:
    """The text of a prompt: the chat template (offering `tools`) with the generation prompt, or the raw text."""
    if isinstance(prompt, str):
        return prompt
    if use_template:
        return tokenizer.apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True, tokenize=False)
    return "\n".join(message["content"] for message in prompt)


def prompt_ids(prompts: list[PromptText], tokenizer, apply_chat_template: bool,
               source: str = "prompts") -> list[list[int]]:
    """Token ids of each prompt as the model expects them; ValueError naming `source` and the
    prompt's index if one starts with BOS twice."""
    result = unchecked_prompt_ids(prompts, tokenizer, apply_chat_template)
    bos = tokenizer.bos_token_id
    doubled = [i for i, ids in enumerate(result) if bos is not None and ids[:2] == [bos, bos]]
    if doubled:
        raise doubled_bos_error(source, doubled[0], len(doubled), len(result), tokenizer, apply_chat_template)
    return result


def unchecked_prompt_ids(prompts: list[PromptText], tokenizer, apply_chat_template: bool,
                         tools: list[dict] | None = None) -> list[list[int]]:
    """`prompt_ids` without the doubled-BOS check, for a caller that checks many chunks as one whole."""
    use_template = uses_chat_template(tokenizer, apply_chat_template)
    texts = [render(prompt, tokenizer, use_template, tools) for prompt in prompts]
    all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    prefix = special_prefix(tokenizer)
    return [list(ids) if use_template and not isinstance(prompt, str) else prefix + list(ids)
            for prompt, ids in zip(prompts, all_ids)]


def doubled_bos_error(source: str, first: int, num_doubled: int, num_prompts: int, tokenizer,
                      apply_chat_template: bool) -> ValueError:
    """The error for prompts that start with BOS twice: the first one's index and how many."""
    how = ("the chat template writes one" if uses_chat_template(tokenizer, apply_chat_template)
           else "the tokenizer adds one to raw text (data.apply_chat_template=false or no chat template)")
    return ValueError(f"{source}: prompt {first} ({num_doubled} of {num_prompts} prompts) starts with the "
                      f"BOS token {tokenizer.bos_token!r} twice: {how} and the prompt text holds another; "
                      "remove it from the text or set data.apply_chat_template to match the data")


def continuation_ids(text: str, tokenizer) -> list[int]:
    """Token ids of a text that continues a sequence (an SFT response): no special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
