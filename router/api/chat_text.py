"""One chat choice's text split into reasoning, content and tool calls, whole or streamed.

The reasoning parser (``router/reasoning.py``) goes first: tool calls are read from the
content after the thinking only, as vLLM does.
"""
from __future__ import annotations

from typing import Any

from ..reasoning import ReasoningStream, split_reasoning
from ..tool_calls import ToolCallStream, parse_tool_calls


class ChoiceText:
    """``in_reasoning``: None when the reasoning split is off, else whether the prompt left a
    thinking block open. ``tool_parser``: None when tool calls are not read. ``parallel``:
    False keeps only the first tool call (``parallel_tool_calls: false``, as vLLM filters)."""

    def __init__(self, in_reasoning: bool | None, tool_parser: str | None, tools: list[dict] | None,
                 parallel: bool = True):
        self.in_reasoning, self.tool_parser, self.tools = in_reasoning, tool_parser, tools
        self.parallel = parallel
        self.reasoning = ReasoningStream(in_reasoning) if in_reasoning is not None else None
        self.calls = ToolCallStream(tool_parser, tools) if tool_parser is not None else None

    def whole(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """``(reasoning, content, calls)`` of a whole text."""
        reasoning, content = (None, text) if self.in_reasoning is None else split_reasoning(text, self.in_reasoning)
        calls: list[dict[str, Any]] = []
        if self.tool_parser is not None and content:
            content, calls = parse_tool_calls(content, self.tool_parser, self.tools)
        return reasoning, content, calls if self.parallel else calls[:1]

    def feed(self, delta: str) -> tuple[str, str, list[dict[str, Any]]]:
        """``(reasoning, content, tool call deltas)`` to send for a text delta."""
        reasoning, content = self.reasoning.feed(delta) if self.reasoning else ("", delta)
        deltas: list[dict[str, Any]] = []
        if self.calls is not None:
            content, deltas = self.calls.feed(content)
        return reasoning, content, self._kept(deltas)

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        """What was held back, at the end of the choice."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        deltas: list[dict[str, Any]] = []
        if self.calls is not None:
            content, deltas = self.calls.feed(content)
            rest, more = self.calls.finish()
            content, deltas = content + rest, deltas + more
        return reasoning, content, self._kept(deltas)

    def _kept(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return deltas if self.parallel else [d for d in deltas if d["index"] == 0]

    @property
    def calls_sent(self) -> int:
        return self.calls.calls if self.calls is not None else 0
