"""SFT on multi-turn traces: the agent quick start's warm-start rows, rendered with the run's tools, are the
chat template's own rendering of the conversation, as a multi-turn rollout of it would hold it."""

from __future__ import annotations

import pytest

import make_tiny_model
from megarl.agent.rendering import ChatRenderer
from megarl.agent.tools import tool_schemas
from megarl.config.schema import MultiTurnConfig
from megarl.data import PromptDataset, load_rows
from megarl.data.synthetic import make_multiplication
from megarl.trainer.sft import response_ids


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
        assert prompt.prompt_ids + response_ids(prompt, tokenizer, renderer, 160) + newline == expected
    assert 0 < num_tool_traces < len(rows)
