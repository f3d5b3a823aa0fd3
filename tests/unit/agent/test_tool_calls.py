"""Tool calls in the model's text (Hermes/Qwen `<tool_call>` blocks): well-formed, several, malformed."""

from __future__ import annotations

import pytest

from megarl.agent.tool_calls import MalformedToolCall, ToolCall, parse_tool_calls


def test_several_well_formed_calls_in_one_turn_in_order_with_text_around():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
            'and also <tool_call>{"name": "python", "arguments": {"code": "print(\'<tool_call>\')"}}</tool_call> done')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "12*34"}),
                                      ToolCall("python", {"code": "print('<tool_call>')"})]


def test_a_turn_without_calls_and_a_call_without_arguments():
    assert parse_tool_calls("The answer is 408.") == []
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


@pytest.mark.parametrize("body, error", [
    ('{"name": "calculator", "arguments": {"expression": "1+"', "not valid JSON"),
    ('{"arguments": {"expression": "1+1"}}', "no tool name"),
    ('["calculator"]', "no tool name"),
    ('{"name": "calculator", "arguments": "1+1"}', "arguments is a str, not an object"),
])
def test_malformed_calls_are_reported_in_their_place_never_raised(body, error):
    text = f'<tool_call>{body}</tool_call><tool_call>{{"name": "f", "arguments": {{}}}}</tool_call>'
    malformed, good = parse_tool_calls(text)
    assert isinstance(malformed, MalformedToolCall) and malformed.text == body
    assert malformed.error.startswith(error), malformed.error
    assert good == ToolCall("f", {})


def test_an_unclosed_call_is_malformed_after_the_closed_ones():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call> then <tool_call>{"name": "g", "argu'
    assert parse_tool_calls(text) == [ToolCall("f", {}),
                                      MalformedToolCall('{"name": "g", "argu', "<tool_call> is never closed")]
