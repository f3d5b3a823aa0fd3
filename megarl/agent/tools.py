"""Tools the model may call: plain Python functions with type hints and a docstring.

A tool's JSON schema (what the chat template shows the model, `tools=`) comes from its signature and
docstring through `transformers.utils.get_json_schema`, the convention HF chat templates consume:

    def lookup(city: str) -> str:
        '''The weather in a city.

        Args:
            city: the city's name
        '''

A tool returns its answer as text and raises to report an error: the model is told the exception's
type and message (only the message for a `ToolError`).
Built in: `python` (runs code in the sandbox) and `calculator`. User tools are named
`path/to/file.py:function` in `rollout.multi_turn.tools`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from transformers.utils import get_json_schema

from megarl.agent.calculator import evaluate as evaluate_arithmetic
from megarl.agent.sandbox import remove_orphaned_scratch, run_python
from megarl.config.schema import MultiTurnConfig
from megarl.messages import one_line
from megarl.registry import Registry
from megarl.user_code import load_callable

BUILTIN_TOOLS: Registry[Callable[[MultiTurnConfig], Callable[..., str]]] = Registry("built-in tool")


class ToolError(Exception):
    """A tool's own report of a failure: the model is told the message as it is."""


class ToolTimeout(ToolError):
    """A tool that stopped its own work at the time limit (counted apart from other errors)."""


@dataclass(frozen=True)
class Tool:
    function: Callable[..., str]
    schema: dict
    """{"type": "function", "function": {"name", "description", "parameters"}}"""

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def tool_from_function(function: Callable[..., str], what: str) -> Tool:
    """The function with its schema; ValueError naming `what` when its hints or docstring do not say
    enough to write one."""
    try:
        return Tool(function, get_json_schema(function))
    except Exception as exc:  # DocstringParsingException, TypeHintParsingException: one message for both
        raise ValueError(f"{what}: cannot make a tool schema of {getattr(function, '__name__', function)!r}: "
                         f"{one_line(exc)} (it needs type hints and a docstring with an Args section)") from None


def load_tools(config: MultiTurnConfig) -> list[Tool]:
    """The tools `config.tools` names, built-in or user functions; ValueError on a bad entry or two
    tools with one name."""
    tools = []
    for index, spec in enumerate(config.tools):
        what = f"rollout.multi_turn.tools[{index}]"
        function = load_callable(spec, what) if ":" in spec else _builtin(spec, what)(config)
        tools.append(tool_from_function(function, f"{what}={spec!r}"))
    names = [tool.name for tool in tools]
    if len(set(names)) < len(names):
        raise ValueError(f"rollout.multi_turn.tools={config.tools}: two tools share a name ({', '.join(names)})")
    return tools


def tool_schemas(config: MultiTurnConfig) -> list[dict]:
    """The schemas every prompt of a run opens with (the chat template's `tools=`): those of `config.tools`
    when multi-turn rollouts are on, else none. SFT, RL and generation all take them from here, so a
    warm start sees the same system/tools preamble as the RL run after it."""
    return [tool.schema for tool in load_tools(config)] if config.enable else []


def _builtin(name: str, what: str) -> Callable[[MultiTurnConfig], Callable[..., str]]:
    if name not in BUILTIN_TOOLS.names():
        raise ValueError(f"{what}={name!r}: not a built-in tool ({', '.join(BUILTIN_TOOLS.names())}) "
                         f"nor path/to/file.py:function")
    return BUILTIN_TOOLS.get(name)


@BUILTIN_TOOLS.register("calculator")
def make_calculator(config: MultiTurnConfig) -> Callable[..., str]:
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression exactly (integers of any size up to 4096 bits).

        Args:
            expression: numbers, parentheses and the operators + - * / // % **, e.g. "(12 + 3) * 4**2"
        """
        return str(evaluate_arithmetic(str(expression)))

    return calculator


@BUILTIN_TOOLS.register("python")
def make_python(config: MultiTurnConfig) -> Callable[..., str]:
    remove_orphaned_scratch()  # of an earlier run on this node that was killed mid-call
    def python(code: str) -> str:
        """Run Python code in a fresh sandboxed interpreter and return what it prints. No network, no
        files outside its own temporary directory, nothing kept between calls.

        Args:
            code: a complete Python program; print the values you want to see
        """
        result = run_python(str(code), config.sandbox, config.tool_timeout_seconds, config.max_tool_output_chars)
        output = "".join(part for part in (result.stdout, result.stderr and f"stderr:\n{result.stderr}") if part)
        if result.timed_out:
            raise ToolTimeout(f"{result.error}\n{output}".strip())
        if result.error:
            raise ToolError(f"{result.error}\n{output}".strip())
        return output

    return python
