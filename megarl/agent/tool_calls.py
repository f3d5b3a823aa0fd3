"""Tool calls in the model's text, in the Hermes/Qwen convention the HF chat templates use:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

A turn may hold several. A block that cannot be run (not JSON, no string "name", "arguments" not an
object, a `<tool_call>` never closed) is returned as a `MalformedToolCall` saying what is wrong, in
its place among the others: the model is told, the run goes on. Parsing never raises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
EXPECTED = 'expected {"name": "<tool>", "arguments": {...}}'


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class MalformedToolCall:
    text: str
    """The block as the model wrote it, between the tags."""
    error: str


def parse_tool_calls(text: str) -> list[ToolCall | MalformedToolCall]:
    """Every `<tool_call>` block of `text`, in order; [] when there is none."""
    calls = []
    for match in BLOCK.finditer(text):
        body, closed = match.group(1), match.group(0).endswith(CLOSE)
        calls.append(_parse_block(body.strip()) if closed else MalformedToolCall(body, f"{OPEN} is never closed"))
    return calls


def _parse_block(body: str) -> ToolCall | MalformedToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return MalformedToolCall(body, f"not valid JSON ({exc.msg} at character {exc.pos}); {EXPECTED}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return MalformedToolCall(body, f"no tool name; {EXPECTED}")
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return MalformedToolCall(body, f"arguments is a {type(arguments).__name__}, not an object; {EXPECTED}")
    return ToolCall(call["name"], arguments)
