"""Text and chat messages -> token ids: the one place where megarl turns text into ids (RL training
and validation prompts, launchers/generate.py, SFT, the Megatron-vs-transformers parity check).

- Raw text (a plain-string prompt, or chat messages joined by newlines when data.apply_chat_template
  is false or the tokenizer has no chat template) becomes the ids `tokenizer(text)` makes by default,
  with the special tokens it puts in front, e.g. the BOS of Llama's and Mistral's post-processors. The
  model was trained with them: a tiny model SFT'd with BOS fell from 53.5% to 10.5% greedy accuracy
  without. Specials a post-processor appends after the text's own ids (an EOS) are left out: a prompt is
  the start of a sequence the model goes on with, not a finished text. Which ids are the text's own is
  read from the text's encoding without special tokens, never from a probe text (a vocabulary may lack
  any given probe, which then encodes to nothing). A raw text with no id of its own (none of its
  characters in the vocabulary) is an error: where its leading specials end cannot be told.
- Messages rendered by the tokenizer's chat template get no special tokens from the tokenizer: the
  template writes those it wants (as transformers' `apply_chat_template(tokenize=True)` does). With
  `tools` (JSON schemas, `megarl.agent.tools.tool_schemas`), the template also writes its tools
  preamble, as for the openings of multi-turn trajectories.
- A response continues its prompt and gets no special tokens of its own.

A prompt that starts with BOS twice (a text or template that holds one, plus the tokenizer's), or that
has no token, is a ValueError: the model never saw that in training.
"""

from __future__ import annotations

PromptText = list[dict] | str
"""A prompt of the data layout: chat messages `{role, content}` or a plain string."""


def uses_chat_template(tokenizer, apply_chat_template: bool) -> bool:
    return apply_chat_template and getattr(tokenizer, "chat_template", None) is not None


def without_appended_specials(full: list[int], own: list[int]) -> list[int]:
    """`full`, a text's ids with the tokenizer's default special tokens, up to the end of `own`, the text's
    ids without them: the leading specials (a BOS) stay, those a post-processor appends (an EOS) go.
    [] when the text has no id of its own."""
    if not own:
        return []
    for start in range(len(full) - len(own) + 1):
        if full[start: start + len(own)] == own:
            return list(full[: start + len(own)])
    raise ValueError(f"the tokenizer's default special tokens do not surround the text's own ids ({full} vs {own}); "
                     "cannot tell which ones start a sequence")


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
    prompt's index if one starts with BOS twice or has no token."""
    result = unchecked_prompt_ids(prompts, tokenizer, apply_chat_template)
    error = flawed_prompts_error(source, *prompt_flaws(result, tokenizer), len(result), tokenizer, apply_chat_template)
    if error is not None:
        raise error
    return result


def unchecked_prompt_ids(prompts: list[PromptText], tokenizer, apply_chat_template: bool,
                         tools: list[dict] | None = None) -> list[list[int]]:
    """`prompt_ids` without its checks, for a caller that checks many chunks as one whole."""
    if not prompts:
        return []
    use_template = uses_chat_template(tokenizer, apply_chat_template)
    texts = [render(prompt, tokenizer, use_template, tools) for prompt in prompts]
    own = tokenizer(texts, add_special_tokens=False)["input_ids"]
    raw = [i for i, prompt in enumerate(prompts) if isinstance(prompt, str) or not use_template]
    full = dict(zip(raw, tokenizer([texts[i] for i in raw])["input_ids"] if raw else []))
    return [without_appended_specials(full[i], own[i]) if i in full else list(own[i]) for i in range(len(prompts))]


def prompt_flaws(ids: list[list[int]], tokenizer) -> tuple[list[int], list[int]]:
    """The indices of the prompts that start with BOS twice, and of those that have no token."""
    bos = tokenizer.bos_token_id
    return ([i for i, row in enumerate(ids) if bos is not None and row[:2] == [bos, bos]],
            [i for i, row in enumerate(ids) if not row])


def flawed_prompts_error(source: str, doubled: list[int], empty: list[int], num_prompts: int, tokenizer,
                         apply_chat_template: bool) -> ValueError | None:
    """The error for `source`'s prompts that start with BOS twice or have no token (their indices), if any."""
    if doubled:
        return doubled_bos_error(source, doubled[0], len(doubled), num_prompts, tokenizer, apply_chat_template)
    if empty:
        return ValueError(f"{source}: prompt {empty[0]} ({len(empty)} of {num_prompts} prompts) has no token: none "
                          "of its text is in the tokenizer's vocabulary")
    return None


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
