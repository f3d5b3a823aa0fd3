"""Running the tool calls of one turn: concurrently, each within the per-call timeout, and every
failure (malformed call, unknown tool, bad arguments, an exception, a timeout) turned into an error
answer for the model and a counted outcome, never an exception out of `run`.

A tool running in this process (the calculator, user functions) cannot be stopped from outside: past
the timeout its answer is an error and its thread is left to finish on its own. The python tool
runs in a child process that the sandbox kills at the same timeout.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megarl.agent.tool_calls import MalformedToolCall, ToolCall
from megarl.agent.tools import Tool, ToolError, ToolTimeout

OUTCOMES = ("ok", "error", "timeout", "malformed", "unknown_tool")
GRACE_SECONDS = 1.0
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
        runnable = [call for call in calls if isinstance(call, ToolCall) and call.name in self.tools]
        executor = ThreadPoolExecutor(max_workers=max(len(runnable), 1), thread_name_prefix="tool")
        futures = {id(call): executor.submit(self._call, call) for call in runnable}
        executor.shutdown(wait=False)  # a tool stuck past its timeout must not hold up the turn
        deadline = time.monotonic() + self.timeout_seconds + GRACE_SECONDS
        results = []
        for call in calls:
            if isinstance(call, MalformedToolCall):
                results.append(ToolResult("", f"Error: malformed tool call: {call.error}", "malformed"))
            elif call.name not in self.tools:
                results.append(ToolResult(call.name, f"Error: unknown tool {call.name!r}; available: "
                                                     f"{', '.join(self.tools) or '(none)'}", "unknown_tool"))
            else:
                future = futures[id(call)]
                try:
                    results.append(future.result(timeout=max(deadline - time.monotonic(), 0)))
                except TimeoutError:
                    results.append(ToolResult(call.name, f"Error: no answer within {self.timeout_seconds:g} s",
                                              "timeout"))
        return results

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
            content = content[:self.max_output_chars] + f"\n[truncated: {len(content)} characters in all]"
        return ToolResult(call.name, content, outcome)
