"""SFT on multi-turn traces: the agent quick start's warm-start rows, rendered with the run's tools, are the
chat template's own rendering of the conversation, as a multi-turn rollout of it would hold it; the SFT loss
learns the assistant turns only, not the tool results or the prompt. A text answer is the row's
`extra_info.answer`, else its ground truth, also where parquet reads an absent answer back as None."""

from __future__ import annotations

import pytest
import torch

import make_tiny_model
from megarl.agent.rendering import ChatRenderer
from megarl.agent.tools import tool_schemas
from megarl.config.schema import MultiTurnConfig
from megarl.data import PromptDataset, load_rows, write_rows
from megarl.data.synthetic import make_multiplication
from megarl.engine.megatron_engine import LossNormalizer
from megarl.trainer.sft import negative_log_likelihood, reference_response, sft_batch


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    """(tokenizer, tool schemas, the rows of a multiplication train split, its prompts rendered with the tools)."""
    out = tmp_path_factory.mktemp("multiplication")
    train, _ = make_multiplication(8, 1, seed=0, tool_share=0.5, out_dir=out)
    tokenizer = make_tiny_model.make_tokenizer()
    schemas = tool_schemas(MultiTurnConfig(enable=True, tools=["calculator"]))
    return tokenizer, schemas, load_rows(train), PromptDataset([train], tokenizer, 128, cache_dir=out, tools=schemas)


def test_a_trace_is_the_templates_rendering_of_the_conversation_with_the_tools(warm_start):
    tokenizer, schemas, rows, prompts = warm_start
    renderer = ChatRenderer(tokenizer, schemas)
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    num_tool_traces = 0
    for row, prompt in zip(rows, prompts):
        turns = row["extra_info"]["turns"]
        num_tool_traces += any(m["role"] == "tool" for m in turns)
        conversation = row["prompt"] + [{k: v for k, v in m.items() if v is not None} for m in turns]
        # The template closes the last turn with "<|im_end|>\n"; a trajectory ends at the model's stop token.
        expected = tokenizer.apply_chat_template(conversation, tools=schemas)["input_ids"]
        assert prompt.prompt_ids + reference_response(prompt, tokenizer, renderer, 160)[0] + newline == expected
    assert 0 < num_tool_traces < len(rows)


def test_the_sft_loss_learns_the_assistant_turns_only(warm_start):
    # A tool trace and a direct answer in one batch, through the trainer's batch and loss. Which response
    # tokens are the model's is counted by hand on the character-level tokenizer: each assistant turn's
    # characters and its <|im_end|>; the tool result between them and the next header are the environment's.
    tokenizer, schemas, rows, prompts = warm_start
    renderer = ChatRenderer(tokenizer, schemas)
    tool_row = next(k for k, row in enumerate(rows) if len(row["extra_info"]["turns"]) == 3)
    direct_row = next(k for k, row in enumerate(rows) if len(row["extra_info"]["turns"]) == 1)
    expected_masks = []
    for k in (tool_row, direct_row):
        turns = [m["content"] for m in rows[k]["extra_info"]["turns"]]
        call, answer = turns[0], turns[-1]
        between = (f"\n<|im_start|>user\n<tool_response>\n{turns[1] if k == tool_row else ''}\n</tool_response>"
                   "<|im_end|>\n<|im_start|>assistant\n")
        num_between = len(tokenizer(between, add_special_tokens=False)["input_ids"])
        expected_masks.append([1] * (len(call) + 1) + [0] * num_between + [1] * (len(answer) + 1) if k == tool_row
                              else [1] * (len(answer) + 1))
    batch = sft_batch([prompts[tool_row], prompts[direct_row]],
                      [reference_response(prompts[k], tokenizer, renderer, 160) for k in (tool_row, direct_row)],
                      tokenizer.pad_token_id)
    width = batch.max_response_length
    mask_BR = torch.tensor([m + [0] * (width - len(m)) for m in expected_masks], dtype=torch.float32)
    logprobs_BR = (-torch.rand(2, width, generator=torch.Generator().manual_seed(0))).requires_grad_()
    loss, _ = negative_log_likelihood({"logprobs": logprobs_BR}, batch, LossNormalizer(batch.num_loss_tokens, 2))
    loss.backward()
    assert loss.item() == pytest.approx(float(-(logprobs_BR * mask_BR).sum() / mask_BR.sum()), rel=1e-6)
    assert torch.equal(logprobs_BR.grad, -mask_BR / mask_BR.sum())  # exactly zero off the assistant turns
    assert batch.num_loss_tokens == int(mask_BR.sum())


def test_a_row_without_an_answer_learns_its_ground_truth_in_a_file_with_answers(tmp_path):
    # Parquet stores extra_info as one struct for the file: the second row reads back {"answer": None, ...}.
    rows = [{"prompt": [{"role": "user", "content": f"{a}*3="}], "data_source": "arithmetic",
             "reward_model": {"ground_truth": str(3 * a)}, "extra_info": extra_info}
            for a, extra_info in [(12, {"answer": "12*3 = 36", "index": 0}), (7, {"index": 1})]]
    tokenizer = make_tiny_model.make_tokenizer()
    prompts = PromptDataset([write_rows(rows, tmp_path / "train.parquet")], tokenizer, 64, cache_dir=tmp_path)
    assert prompts[1].extra_info == {"answer": None, "index": 1}
    references = [tokenizer.decode(reference_response(prompt, tokenizer, None, 32)[0]) for prompt in prompts]
    assert references == ["12*3 = 36<|endoftext|>", "21<|endoftext|>"]
