"""Running the tool calls of one turn: concurrently, each within the per-call timeout, and every
failure (malformed call, unknown tool, bad arguments, an exception, a timeout) turned into an error
answer for the model and a counted outcome, never an exception out of `run`.

A tool running in this process (the calculator, user functions) cannot be stopped from outside: past
the timeout its answer is an error and its (daemon) thread is left to finish on its own. The python tool
runs in a child process that the sandbox kills at the same timeout.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from megarl.agent.tool_calls import MalformedToolCall, ToolCall
from megarl.agent.tools import Tool, ToolError, ToolTimeout

OUTCOMES = ("ok", "error", "timeout", "malformed", "unknown_tool")
GRACE_SECONDS = 0.5
"""Extra wait past the timeout for a tool that enforces the timeout itself (the python sandbox)."""


@dataclass
class ToolResult:
    name: str
    """The tool's name, or "" for a call too malformed to name one."""
    content: str
    """The answer, or the error the model is told about."""
    outcome: str
    """One of OUTCOMES."""


class Toolbox:
    """The run's tools, their schemas for the chat template, and `run` for the calls of a turn."""

    def __init__(self, tools: list[Tool], timeout_seconds: float, max_output_chars: int):
        self.tools = {tool.name: tool for tool in tools}
        self.schemas = [tool.schema for tool in tools]
        self.timeout_seconds = timeout_seconds
        self.max_output_chars = max_output_chars

    def run(self, calls: list[ToolCall | MalformedToolCall]) -> list[ToolResult]:
        """One result per call, in the calls' order; the runnable ones run at the same time."""
        answers: dict[int, ToolResult] = {}
        threads = {}
        for index, call in enumerate(calls):
            if isinstance(call, ToolCall) and call.name in self.tools:
                # Daemon threads: a tool stuck forever must hold up neither the turn nor the process's exit.
                threads[index] = threading.Thread(target=self._call_into, args=(answers, index, call),
                                                  name=f"tool-{call.name}", daemon=True)
                threads[index].start()
        deadline = time.monotonic() + self.timeout_seconds + GRACE_SECONDS
        for thread in threads.values():
            thread.join(max(deadline - time.monotonic(), 0))
        return [self._answer(index, call, answers) for index, call in enumerate(calls)]

    def _answer(self, index: int, call: ToolCall | MalformedToolCall, answers: dict[int, ToolResult]) -> ToolResult:
        if isinstance(call, MalformedToolCall):
            return ToolResult("", f"Error: malformed tool call: {call.error}", "malformed")
        if call.name not in self.tools:
            return ToolResult(call.name, f"Error: unknown tool {call.name!r}; available: "
                                         f"{', '.join(self.tools) or '(none)'}", "unknown_tool")
        if index not in answers:
            return ToolResult(call.name, f"Error: no answer within {self.timeout_seconds:g} s", "timeout")
        return answers[index]

    def _call_into(self, answers: dict[int, ToolResult], index: int, call: ToolCall) -> None:
        answers[index] = self._call(call)

    def _call(self, call: ToolCall) -> ToolResult:
        try:
            content, outcome = str(self.tools[call.name].function(**call.arguments)), "ok"
        except ToolTimeout as exc:
            content, outcome = f"Error: {exc}", "timeout"
        except ToolError as exc:
            content, outcome = f"Error: {exc}", "error"
        except Exception as exc:  # the tool's own failure or arguments it does not take: the model is told
            content, outcome = f"Error: {type(exc).__name__}: {exc}", "error"
        if len(content) > self.max_output_chars:
            content = content[:self.max_output_chars] + f"\n[answer cut to {self.max_output_chars} characters]"
        return ToolResult(call.name, content, outcome)
