"""Text -> prompt ids with a tokenizer that prepends BOS and one that does not: RL training and
validation prompts and launchers/generate.py (all a PromptDataset), SFT sequences and the parity
check carry the tokenizer's BOS exactly once, at the start; a chat template's BOS is not doubled.

Expected ids are spelled out by hand from the character-level vocabulary.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, processors
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from megarl.data import PromptDataset, write_rows
from megarl.data.tokenization import prompt_ids
from megarl.engine.parity import tokenize
from megarl.trainer.sft import reference_response

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "checkpoints_tools"))
import make_tiny_model  # noqa: E402


def _chars(tokenizer, text: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids([make_tiny_model.character_token(c) for c in text])


def _row(prompt, ground_truth="3") -> dict:
    return {"prompt": prompt, "data_source": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": ground_truth}, "extra_info": {"answer": "3"}}


@pytest.fixture(params=[True, False], ids=["bos", "no-bos"])
def tokenizer(request):
    return make_tiny_model.make_tokenizer(bos=request.param)


def test_prompts_carry_the_tokenizers_bos_once(tokenizer, tmp_path):
    path = [write_rows([_row([{"role": "user", "content": "1+2="}])], tmp_path / "messages.parquet"),
            write_rows([_row("Q: 2+2=")], tmp_path / "string.parquet")]  # one layout per file
    bos = [tokenizer.convert_tokens_to_ids("<|bos|>")] if tokenizer.bos_token else []
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    raw = PromptDataset(path, tokenizer, 64, apply_chat_template=False)
    assert raw[0].prompt_ids == bos + _chars(tokenizer, "1+2=")
    assert raw[1].prompt_ids == bos + _chars(tokenizer, "Q: 2+2=")
    templated = PromptDataset(path, tokenizer, 64, apply_chat_template=True)
    # The template writes BOS itself; the tokenizer adds none on top of it.
    assert templated[0].prompt_ids == (bos + [start] + _chars(tokenizer, "user\n1+2=") + [end]
                                       + _chars(tokenizer, "\n") + [start] + _chars(tokenizer, "assistant\n"))
    assert templated[1].prompt_ids == bos + _chars(tokenizer, "Q: 2+2=")  # a plain string is raw text

    # SFT: the response continues the prompt: BOS once, at the start of the whole sequence.
    sequence = raw[0].prompt_ids + reference_response(raw[0], tokenizer, None, max_response_length=8)[0]
    assert sequence == bos + _chars(tokenizer, "1+2=3") + [tokenizer.eos_token_id]


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_transformers_loads_the_saved_tokenizer_as_it_was_made(tokenizer, family, tmp_path):
    """transformers loads a Qwen model's tokenizer as Qwen2Tokenizer, which rebuilds Qwen2's own
    pipeline around the saved vocabulary; whitespace and every other character must survive it."""
    tokenizer.save_pretrained(tmp_path)
    AutoConfig.for_model(family).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = 'Tools: calculator\n{"a": 1}'
    bos = [tokenizer.convert_tokens_to_ids("<|bos|>")] if tokenizer.bos_token else []
    assert loaded(text)["input_ids"] == bos + _chars(tokenizer, text)
    assert loaded.decode(_chars(tokenizer, text)) == text


def test_parity_prompts_carry_the_tokenizers_bos(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    tokens_BT, mask_BT = tokenize(str(tmp_path))
    first = tokens_BT[:, 0].tolist()
    if tokenizer.bos_token:
        assert first == [tokenizer.bos_token_id] * len(first)
        assert (tokens_BT[:, 1:][mask_BT[:, 1:]] != tokenizer.bos_token_id).all()
    else:
        assert first == _chars(tokenizer, "WTdM")  # the first characters of the four check prompts


def test_a_text_that_holds_bos_is_not_doubled_silently(tmp_path):
    tokenizer = make_tiny_model.make_tokenizer(bos=True)
    path = write_rows([_row("1+2="), _row("<|bos|>1+2=")], tmp_path / "data.parquet")
    with pytest.raises(ValueError) as error:
        PromptDataset([path], tokenizer, 64, apply_chat_template=False)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{path}: prompt 1 (1 of 2 prompts) starts with the BOS")
    assert "data.apply_chat_template" in message


def test_specials_a_post_processor_appends_are_not_part_of_a_prompt():
    tokenizer = make_tiny_model.make_tokenizer(bos=True)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A <|endoftext|>", special_tokens=[("<|bos|>", bos), ("<|endoftext|>", eos)])
    assert tokenizer("1+2=")["input_ids"] == [bos] + _chars(tokenizer, "1+2=") + [eos]
    assert prompt_ids(["1+2="], tokenizer, apply_chat_template=False) == [[bos] + _chars(tokenizer, "1+2=")]


def _digits_tokenizer(appends_eos: bool) -> PreTrainedTokenizerFast:
    """Digits and operators only, made here with `tokenizers`: no "a", no unknown token (a character outside
    the vocabulary encodes to nothing), BOS in front of every text, and with `appends_eos` EOS after it."""
    specials = ["<|bos|>", "<|eos|>"]
    backend = Tokenizer(models.BPE({token: i for i, token in enumerate([*specials, *"0123456789+-*=: "])}, merges=[]))
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A <|eos|>" if appends_eos else "<|bos|> $A", special_tokens=[("<|bos|>", 0), ("<|eos|>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|eos|>")


@pytest.mark.parametrize("appends_eos", [False, True], ids=["bos", "bos-eos"])
def test_prompts_are_the_tokenizers_default_ids_without_trailing_specials(appends_eos, tmp_path):
    """RL training and validation prompts and generate.py's (a PromptDataset), SFT sequences and the parity
    check's prompts are `tokenizer(text)["input_ids"]` without the EOS a post-processor appends, for a
    vocabulary that lacks any probe text; a prompt with no id of its own is a one-line data error."""
    tokenizer = _digits_tokenizer(appends_eos)
    assert tokenizer("a", add_special_tokens=False)["input_ids"] == []
    texts = ["12+30=", "Q: 7*8="]  # "Q" is not in the vocabulary: dropped, as the tokenizer does by default
    expected = [tokenizer(text)["input_ids"] for text in texts]
    expected = [ids[:-1] if appends_eos else ids for ids in expected]
    assert [ids[0] for ids in expected] == [tokenizer.bos_token_id] * 2 and tokenizer.eos_token_id not in expected[0]
    dataset = PromptDataset([write_rows([_row(text) for text in texts], tmp_path / "data.parquet")], tokenizer, 64,
                            apply_chat_template=False)
    assert [dataset[i].prompt_ids for i in range(len(texts))] == expected
    assert prompt_ids(texts, tokenizer, apply_chat_template=False) == expected
    response, _ = reference_response(dataset[0], tokenizer, None, max_response_length=8)
    assert dataset[0].prompt_ids + response == expected[0] + tokenizer("3", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id]

    path = write_rows([_row("1+1="), _row("abc")], tmp_path / "letters.parquet")
    with pytest.raises(ValueError, match=rf"^{path}: prompt 1 \(1 of 2 prompts\) has no token"):
        PromptDataset([path], tokenizer, 64, apply_chat_template=False)
