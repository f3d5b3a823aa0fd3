"""Tools: schemas from signatures and docstrings, the calculator, loading user tools, and running the
calls of a turn concurrently with a per-call timeout."""

from __future__ import annotations

import textwrap
import time

import pytest

from megarl.agent.calculator import evaluate
from megarl.agent.tool_calls import MalformedToolCall, ToolCall
from megarl.agent.toolbox import Toolbox
from megarl.agent.tools import load_tools
from megarl.config.schema import MultiTurnConfig

USER_TOOLS = textwrap.dedent('''
    import time

    from megarl.agent.tools import ToolError

    def wait(seconds: float, label: str = "done") -> str:
        """Sleep, then answer.

        Args:
            seconds: how long to sleep
            label: what to answer
        """
        time.sleep(seconds)
        return label

    def refuse(reason: str) -> str:
        """Always fail.

        Args:
            reason: the message of the failure
        """
        raise ToolError(reason)

    def undocumented(x: int) -> str:
        return str(x)
''')


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(USER_TOOLS)
    return str(path)


def toolbox(tools: list[str], timeout_seconds: float = 5.0) -> Toolbox:
    config = MultiTurnConfig(tools=tools, tool_timeout_seconds=timeout_seconds)
    return Toolbox(load_tools(config), timeout_seconds, config.max_tool_output_chars)


def test_schemas_come_from_signatures_and_docstrings(user_file):
    calculator, wait = load_tools(MultiTurnConfig(tools=["calculator", f"{user_file}:wait"]))
    assert wait.schema == {"type": "function", "function": {
        "name": "wait", "description": "Sleep, then answer.",
        "parameters": {"type": "object", "properties": {
            "seconds": {"type": "number", "description": "how long to sleep"},
            "label": {"type": "string", "description": "what to answer"}}, "required": ["seconds"]},
        "return": {"type": "string"}}}
    assert calculator.name == "calculator"
    assert calculator.schema["function"]["parameters"]["required"] == ["expression"]


def test_bad_tool_specs_fail_at_load_naming_the_key(user_file):
    with pytest.raises(ValueError, match=r"rollout.multi_turn.tools\[1\]='search': not a built-in tool "
                                         r"\(calculator, python\)"):
        load_tools(MultiTurnConfig(tools=["python", "search"]))
    with pytest.raises(ValueError, match=r"tools\[0\]=.*undocumented.*no docstring.*Args section"):
        load_tools(MultiTurnConfig(tools=[f"{user_file}:undocumented"]))
    with pytest.raises(ValueError, match="two tools share a name"):
        load_tools(MultiTurnConfig(tools=["calculator", "calculator"]))


@pytest.mark.parametrize("expression, value", [
    ("123456789 * 987654321", 121932631112635269),
    ("(12 + 3) * 4**2 - -7 // 2", 244),
    ("2**100 % 1000", 376),
    ("7 / 2", 3.5),
])
def test_calculator_computes_exactly(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("9**9**9", "too large"),
    ("(2**4000) * (2**4000)", "too large"),
    ("__import__('os').system('true')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("1 / 0", "division by zero"),
    ("1 +", "not an arithmetic expression"),
])
def test_calculator_refuses_what_is_not_cheap_arithmetic(expression, error):
    with pytest.raises(ValueError, match=error):
        evaluate(expression)


def test_calls_of_a_turn_run_concurrently_and_every_failure_is_an_answer(user_file):
    box = toolbox([f"{user_file}:wait", f"{user_file}:refuse", "calculator"])
    started = time.monotonic()
    results = box.run([ToolCall("wait", {"seconds": 0.5, "label": "first"}), ToolCall("wait", {"seconds": 0.5}),
                       ToolCall("refuse", {"reason": "no such city"}), ToolCall("calculator", {"expr": "1"}),
                       ToolCall("search", {}), MalformedToolCall("{", "not valid JSON")])
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 1.0, f"two 0.5 s calls took {elapsed:.2f} s: not concurrent"
    assert [(r.name, r.outcome) for r in results] == [
        ("wait", "ok"), ("wait", "ok"), ("refuse", "error"), ("calculator", "error"), ("search", "unknown_tool"),
        ("", "malformed")]
    assert [r.content for r in results[:3]] == ["first", "done", "Error: no such city"]
    assert "unexpected keyword argument 'expr'" in results[3].content
    assert results[4].content == "Error: unknown tool 'search'; available: wait, refuse, calculator"


def test_a_call_past_the_timeout_is_a_timeout_answer_and_does_not_hold_the_others(user_file):
    box = toolbox([f"{user_file}:wait"], timeout_seconds=1.0)  # ample for the quick call on a loaded machine
    started = time.monotonic()
    stuck, quick = box.run([ToolCall("wait", {"seconds": 10}), ToolCall("wait", {"seconds": 0.05})])
    elapsed = time.monotonic() - started
    assert elapsed < 1.0 + 3.0, f"the turn waited {elapsed:.2f} s for a stuck tool"
    assert (stuck.outcome, stuck.content) == ("timeout", "Error: no answer within 1 s")
    assert (quick.outcome, quick.content) == ("ok", "done")
