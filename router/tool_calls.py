"""Tool calls in generated text (the chat API's ``tools``), as vLLM's ``--tool-call-parser``.

``hermes``: the format of the Qwen2.5 / Qwen3 / Qwen3-Next chat templates (and Hermes 2
Pro): each call is a JSON object ``{"name": ..., "arguments": {...}}`` between
``<tool_call>`` and ``</tool_call>``; text before the first call is the message content.
A block that is not such an object (cut off by ``max_tokens``, malformed JSON) makes the
whole text plain content, so nothing the model wrote is lost.

:class:`ToolCallStream` splits a streamed text the same way: content is released as it
comes until a ``<tool_call>`` may be starting (a prefix of it at the end is held back);
from there the text is held, and at the end of the stream it becomes tool calls or, when
it does not parse, content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_PARSERS = ("hermes",)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


def check_parser(name: str | None) -> None:
    """Raises ValueError for a parser this module does not have (None: tools are off)."""
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; available: {', '.join(TOOL_CALL_PARSERS)}")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, calls)`` of a whole generated text. ``calls``: OpenAI's tool call
    objects (``id``, ``type: function``, ``function: {name, arguments}``, the arguments a
    JSON string); empty, with ``content`` the whole text, when the text holds no
    well-formed call or anything but whitespace between and after the calls."""
    first = text.find(START)
    if first < 0:
        return text, []
    calls, pos = [], first
    for m in _BLOCK.finditer(text, first):
        if text[pos:m.start()].strip():
            return text, []
        call = _call(m.group(1))
        if call is None:
            return text, []
        calls.append(call)
        pos = m.end()
    if not calls or text[pos:].strip():
        return text, []
    content = text[:first].rstrip()
    return (content or None), calls


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: clients could not parse the arguments


def _call(block: str) -> dict[str, Any] | None:
    """The tool call object of one block's JSON, or None when it is not a call whose name
    and arguments survive the trip to the client (strict JSON, encodable as UTF-8)."""
    try:
        obj = json.loads(block, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]
            and isinstance(obj.get("arguments", {}), (dict, str))):
        return None
    args = obj.get("arguments", {})
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    try:
        (obj["name"] + args).encode("utf-8")  # a lone surrogate written as an escape
    except UnicodeEncodeError:
        return None
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": args}}


@dataclass
class ToolCallStream:
    """One streamed choice: :meth:`feed` each text delta and send what it returns as
    content; :meth:`finish` at the end gives the held text's ``(content, calls)``."""

    held: str = ""  # text from a possible <tool_call> on (what was sent never holds one)

    def feed(self, delta: str) -> str:
        if self.in_calls:
            self.held += delta
            return ""
        text = self.held + delta
        i = text.find(START)
        if i >= 0:
            out, self.held = text[:i], text[i:]
        else:
            # hold back a suffix that could be the start of <tool_call>
            keep = next((n for n in range(min(len(START) - 1, len(text)), 0, -1) if START.startswith(text[-n:])), 0)
            out, self.held = text[: len(text) - keep], text[len(text) - keep:]
        return out

    @property
    def in_calls(self) -> bool:
        return self.held.startswith(START)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """``(content still to send, calls)``: the calls when the whole text parses as
        content then calls (the held text is then not sent), else the held text as content."""
        _, calls = parse_tool_calls(self.held)  # the content sent before it is plain text
        if calls:
            return "", calls
        rest, self.held = self.held, ""
        return rest, []
