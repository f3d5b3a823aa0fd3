"""A trajectory assembled from the renderer's pieces (opening, model turns as sampled, observations) is
the chat template's own rendering of the same messages, token for token, with and without a BOS token;
where the model stops on EOS instead of the end-of-turn token, its EOS stays and the closing follows; a
trajectory's opening is the template's rendering with the run's tool schemas; so it is for templates
that trim message contents or write text before their end-of-turn token, and a template the renderer
cannot cut fails with one line."""

from __future__ import annotations

import pytest

import make_tiny_model
from megarl.agent.environment import ToolEnvironment
from megarl.agent.rendering import ChatRenderer
from megarl.agent.toolbox import Toolbox
from megarl.agent.tools import load_tools, tool_schemas
from megarl.config.schema import MultiTurnConfig
from megarl.data import PromptDataset, write_rows

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
OPENING = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 123*45?"}]
FIRST = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'
RESULTS = [{"role": "tool", "content": "5535"}, {"role": "tool", "content": "error: none"}]
LAST = "123*45 = 5535"
# As Llama 3's and Gemma's templates, trims contents (`| trim`): the probe's sentinel must not end in whitespace.
TRIMMING = make_tiny_model.CHAT_TEMPLATE.replace("{{ message['content'] }}<|im_end|>",
                                                 "{{ message['content'] | trim }}<|im_end|>")
# As Llama 2's template: strips contents, and an assistant turn ends with ' ' + eos_token, the space text.
SPACE_EOS = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
             "{{ message['content'].strip() + ' ' + eos_token }}"
             "{% else %}{{ '[' + message['role'] + '] ' + message['content'].strip() + ' [/' + message['role'] + ']' }}"
             "{% endif %}{% endfor %}")


@pytest.mark.parametrize("bos", [False, True])
def test_trajectory_equals_the_templates_rendering(bos):
    tokenizer = make_tiny_model.make_tokenizer(bos)
    renderer = ChatRenderer(tokenizer, TOOLS)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert renderer.end_of_turn_id == end_of_turn

    def sampled(text):  # what a model that ends its turn properly samples
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [end_of_turn]

    first, last = sampled(FIRST), sampled(LAST)
    trajectory = renderer.opening(OPENING) + first + renderer.observation(RESULTS, first) + last
    messages = OPENING + [{"role": "assistant", "content": FIRST}, *RESULTS, {"role": "assistant", "content": LAST}]
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    # The template closes the last turn with "<|im_end|>\n"; the trajectory ends at the model's stop token.
    assert rendered.endswith("<|im_end|>\n")
    assert trajectory + tokenizer("\n", add_special_tokens=False)["input_ids"] == tokenizer(
        rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(trajectory).startswith("<|bos|>" if bos else "<|im_start|>system\nBe brief.\nTools: calc")


def test_a_turn_stopped_by_eos_keeps_it_and_gets_the_whole_closing():
    tokenizer = make_tiny_model.make_tokenizer()
    renderer = ChatRenderer(tokenizer, TOOLS)
    turn = tokenizer(FIRST, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    observation = renderer.observation(RESULTS[:1], turn)
    assert tokenizer.decode(turn[-1:] + observation) == (
        "<|endoftext|><|im_end|>\n<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.mark.parametrize("bos", [False, True])
def test_openings_carry_the_tools_preamble_of_the_tool_schemas(bos, tmp_path):
    # The default environment keeps the sample's prompt, which the data loader renders with the run's
    # tools; an environment's own opening is rendered with its tools: both are the template's own ids.
    tokenizer = make_tiny_model.make_tokenizer(bos)
    config = MultiTurnConfig(enable=True, tools=["calculator"])
    schemas = tool_schemas(config)
    toolbox = Toolbox(load_tools(config), config.tool_timeout_seconds, config.max_tool_output_chars)
    data = write_rows([{"prompt": OPENING, "data_source": "arithmetic", "reward_model": {"ground_truth": "5535"}}],
                      tmp_path / "data.parquet")
    expected = tokenizer.apply_chat_template(OPENING, tools=schemas, add_generation_prompt=True)["input_ids"]
    assert "Tools: calculator" in tokenizer.decode(expected)
    assert PromptDataset([str(data)], tokenizer, 128, cache_dir=tmp_path, tools=schemas)[0].prompt_ids == expected
    assert ChatRenderer(tokenizer, ToolEnvironment(toolbox).tools).opening(OPENING) == expected
    assert tool_schemas(MultiTurnConfig(enable=False, tools=["calculator"])) == []


@pytest.mark.parametrize("template, turn_end, rest", [(TRIMMING, "<|im_end|>", "\n"),
                                                      (SPACE_EOS, " <|endoftext|>", "")])
def test_templates_that_trim_contents_or_write_text_before_the_end_of_turn_token(template, turn_end, rest):
    # A model turn ends with the closing up to its first special token (`turn_end`), which is the token it
    # stops on: <|endoftext|> after Llama 2's space, never the space. `rest`: the closing after it.
    tokenizer = make_tiny_model.make_tokenizer()
    tokenizer.chat_template = template
    renderer = ChatRenderer(tokenizer, TOOLS)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    assert renderer.end_of_turn_id == tokenizer.convert_tokens_to_ids(turn_end.strip())
    first, last = ids(FIRST + turn_end), ids(LAST + turn_end)
    trajectory = renderer.opening(OPENING) + first + renderer.observation(RESULTS, first) + last
    turns = [{"role": "assistant", "content": FIRST}, *RESULTS, {"role": "assistant", "content": LAST}]
    rendered = tokenizer.apply_chat_template(OPENING + turns, tools=TOOLS, tokenize=False)
    assert rendered.endswith(turn_end + rest)
    assert trajectory + ids(rest) == ids(rendered)
    assert renderer.opening(OPENING) + renderer.continuation(turns)[0] == trajectory


@pytest.mark.parametrize("content, error", [("{{ message['content'] | upper }}<|im_end|>", "content as given"),
                                            ("{{ message['content'] }}\n", "no special token")])
def test_a_template_the_renderer_cannot_cut_fails_with_one_line(content, error):
    tokenizer = make_tiny_model.make_tokenizer()
    tokenizer.chat_template = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n" + content
                               + "{% endfor %}")
    with pytest.raises(ValueError, match=f"chat template of model.path's tokenizer .*{error}") as raised:
        ChatRenderer(tokenizer, [])
    assert "\n" not in str(raised.value)
