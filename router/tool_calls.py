"""Tool calls in generated text (the chat API's ``tools``), as vLLM's ``--tool-call-parser``.

Both formats put each call between ``<tool_call>`` and ``</tool_call>``; text before the
first call is the message content.

``hermes``: the format of the Qwen2.5 / Qwen3 chat templates (and Hermes 2 Pro): the block
is a JSON object ``{"name": ..., "arguments": {...}}``.

``qwen3_coder``: the XML format of the Qwen3-Coder, Qwen3-Next and Qwen3.5 templates::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is converted by the type its tool's JSON schema gives it
(``integer``, ``number``, ``boolean``, ``object``, ``array``, ``null``: read as JSON when it
parses; ``string`` or no schema: the text), also where the type comes through a local
``$ref``, ``anyOf`` / ``oneOf`` / ``allOf``, ``enum`` or ``const`` (pydantic's schemas), as a
forced call's grammar writes it; the arguments are sent as a JSON object.

:func:`parse_tool_calls` reads a whole text: a block that is not a well-formed call (cut
off by ``max_tokens``, malformed) makes the whole text plain content, so nothing the model
wrote is lost. :class:`ToolCallStream` reads a streamed text: content is released as it
comes until a ``<tool_call>`` may be starting (a prefix of it at the end is held back);
inside a call, the call's id and name are sent as soon as the name is complete and its
arguments as they are generated (hermes: the argument text itself; qwen3_coder: each
parameter once its ``</parameter>`` arrives), as vLLM streams them. A block that never
shows a call's name is sent as content at its end.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


def check_parser(name: str | None) -> None:
    """Raises ValueError for a parser this module does not have (None: tools are off)."""
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; available: {', '.join(TOOL_CALL_PARSERS)}")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: clients could not parse the arguments


def _encodable(*texts: str) -> bool:
    try:
        "".join(texts).encode("utf-8")  # a lone surrogate written as an escape
        return True
    except UnicodeEncodeError:
        return False


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


# --------------------------------------------------------------------------------------
# The formats: what one block between the tags holds
# --------------------------------------------------------------------------------------


class Hermes:
    """``{"name": ..., "arguments": {...}}`` blocks."""

    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')

    def __init__(self, tools: list[dict] | None = None):
        pass

    def parse(self, block: str) -> tuple[str, str] | None:
        """``(name, arguments JSON)`` of a whole block, or None when it is not a call whose
        name and arguments survive the trip to the client (strict JSON, encodable as UTF-8)."""
        try:
            obj = json.loads(block, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]
                and isinstance(obj.get("arguments", {}), (dict, str))):
            return None
        args = obj.get("arguments", {})
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return (obj["name"], args) if _encodable(obj["name"], args) else None

    def partial(self, block: str) -> tuple[str | None, str]:
        """``(name or None, arguments so far)`` of a block still being generated: the
        argument object's text up to what could be the block's closing brace."""
        head = self._HEAD.match(block)
        if head is None:
            return None, ""
        name = json.loads(head.group(1))
        args = block[head.end():].rstrip()
        if not args.startswith("{"):  # a string or another value: sent whole at the end
            return name, ""
        if args.endswith("}"):
            args = args[:-1]  # this brace may close the outer object
        return name, args.rstrip()

    def final(self, block: str) -> tuple[str, str] | None:
        """``(name, arguments)`` of a whole block whose arguments extend what
        :meth:`partial` streamed (the argument text as generated); None when not a call."""
        parsed = self.parse(block)
        head = self._HEAD.match(block)
        if parsed is None or head is None:
            return parsed
        raw = block[head.end():].rstrip()
        if raw.startswith("{") and raw.endswith("}"):
            raw = raw[:-1].rstrip()
            try:
                if isinstance(json.loads(raw), dict):
                    return parsed[0], raw
            except ValueError:
                pass
        return parsed


_VALUE_KINDS = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null",
                list: "array", dict: "object"}


def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#`` or a JSON pointer ``#/...`` into the tool's
    ``parameters``) names; None where it names nothing there (or another document)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def schema_kinds(schema: Any, root: Any, depth: int = 0) -> set[str] | None:
    """The JSON types a value of ``schema`` may have, as a forced call's grammar (xgrammar's
    qwen_xml) reads it: its ``type``, or through a local ``$ref``, ``anyOf`` / ``oneOf``
    (every branch), ``allOf`` (the first branch that says), ``const`` or ``enum`` (their
    values' types). None where it does not say (any value: the text is kept)."""
    if not isinstance(schema, dict) or depth > 32:  # 32: a $ref cycle says nothing
        return None
    if isinstance(schema.get("$ref"), str):
        return schema_kinds(_pointer(root, schema["$ref"]), root, depth + 1)
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and t and all(isinstance(k, str) for k in t):
        return set(t)
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list) and values:
        kinds = {_VALUE_KINDS.get(type(v)) for v in values}
        return None if None in kinds else kinds
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            kinds = set()
            for branch in schema[key]:
                k = schema_kinds(branch, root, depth + 1)
                if k is None:
                    return None
                kinds |= k
            return kinds
    for branch in schema.get("allOf") if isinstance(schema.get("allOf"), list) else []:
        k = schema_kinds(branch, root, depth + 1)
        if k is not None:
            return k
    return None


_XML_SPACE = (" ", "\t", "\r", "\n")  # never "": text[:1] of an empty value


class Qwen3Coder:
    """``<function=NAME><parameter=P>value</parameter>...</function>`` blocks."""

    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
    _END = re.compile(r"</function>\s*$")

    def __init__(self, tools: list[dict] | None = None):
        # function -> parameter -> the JSON types its value may have (None: unknown, the text)
        self.types: dict[str, dict[str, set[str] | None]] = {}
        for tool in tools or []:
            fn = tool.get("function") or {}
            params = fn.get("parameters")
            props = (params.get("properties") if isinstance(params, dict) else None) or {}
            if isinstance(fn.get("name"), str) and isinstance(props, dict):
                self.types[fn["name"]] = {k: schema_kinds(v, params) for k, v in props.items() if isinstance(v, dict)}

    def _value(self, function: str, param: str, text: str) -> Any:
        # One whitespace character on each side is the format's: its newline, or what a forced
        # call's grammar (xgrammar's qwen_xml) allows there instead (a space, tab or CR),
        # which left in a string would break the schema the grammar enforced on the rest.
        text = text[1:] if text[:1] in _XML_SPACE else text
        text = text[:-1] if text[-1:] in _XML_SPACE else text
        kinds = self.types.get(function, {}).get(param)
        if kinds is None or "string" in kinds:
            return text
        try:
            return json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return text  # not JSON after all: the text, as the model wrote it

    def _items(self, name: str, body: str) -> list[str]:
        """The arguments' ``"key": value`` JSON items of each complete parameter in ``body``."""
        return [f"{json.dumps(k.strip(), ensure_ascii=False)}: {json.dumps(self._value(name, k.strip(), v), ensure_ascii=False)}"
                for k, v in self._PARAMETER.findall(body)]

    def partial(self, block: str) -> tuple[str | None, str]:
        m = self._FUNCTION.match(block)
        if m is None:
            return None, ""
        name = m.group(1).strip()
        return name, "{" + ", ".join(self._items(name, block[m.end():]))

    def final(self, block: str) -> tuple[str, str] | None:
        m = self._FUNCTION.match(block)
        body = block[m.end():] if m else ""
        if m is None or not self._END.search(body) or not m.group(1).strip():
            return None
        name = m.group(1).strip()
        args = "{" + ", ".join(self._items(name, body)) + "}"
        return (name, args) if _encodable(name, args) else None

    parse = final


FORMATS = {"hermes": Hermes, "qwen3_coder": Qwen3Coder}


# --------------------------------------------------------------------------------------
# Whole texts and streams
# --------------------------------------------------------------------------------------


def parse_tool_calls(text: str, parser: str = "hermes",
                     tools: list[dict] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, calls)`` of a whole generated text. ``calls``: OpenAI's tool call
    objects (``id``, ``type: function``, ``function: {name, arguments}``, the arguments a
    JSON string); empty, with ``content`` the whole text, when the text holds no
    well-formed call or anything but whitespace between and after the calls."""
    fmt = FORMATS[parser](tools)
    first = text.find(START)
    if first < 0:
        return text, []
    calls, pos = [], first
    for m in _BLOCK.finditer(text, first):
        if text[pos:m.start()].strip():
            return text, []
        parsed = fmt.parse(m.group(1))
        if parsed is None:
            return text, []
        calls.append(_call(*parsed))
        pos = m.end()
    if not calls or text[pos:].strip():
        return text, []
    content = text[:first].rstrip()
    return (content or None), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class ToolCallStream:
    """One streamed choice: :meth:`feed` each text delta and send the ``(content,
    tool_call_deltas)`` it returns; :meth:`finish` at the end returns the rest. A delta is
    OpenAI's streamed tool call: ``{"index", "id", "type", "function": {"name",
    "arguments": ""}}`` first, then ``{"index", "function": {"arguments": piece}}``."""

    def __init__(self, parser: str = "hermes", tools: list[dict] | None = None):
        self.fmt = FORMATS[parser](tools)
        self.held = ""  # text not released: a possible <tool_call> prefix, or the block so far
        self.in_block = False
        self.calls = 0  # calls whose header was sent
        self.header_sent = False  # for the current block
        self.args_sent = ""  # the current call's arguments sent so far
        self.space = ""  # whitespace after a call, held (see _text)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.held += delta
        content, deltas = "", []
        while True:
            if not self.in_block:
                i = self.held.find(START)
                if i < 0:
                    keep = _partial_suffix(self.held, START)
                    content += self._text(self.held[:len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep:]
                    return content, deltas
                content += self._text(self.held[:i])
                self.held, self.in_block = self.held[i + len(START):], True
                self.header_sent, self.args_sent = False, ""
                continue
            j = self.held.find(END)
            if j < 0:
                deltas += self._progress(self.held)
                return content, deltas
            block, self.held, self.in_block = self.held[:j], self.held[j + len(END):], False
            done = self._close(block)
            if done is None:
                content += START + block + END  # not a call: what the model wrote
            deltas += done or []

    def _text(self, text: str) -> str:
        """Text outside the blocks; once a call went out, whitespace between and after the
        calls is the format's (held until other text shows it is not)."""
        if self.calls and not text.strip():
            self.space += text
            return ""
        out, self.space = self.space + text, ""
        return out

    def _header(self, name: str) -> dict[str, Any]:
        self.header_sent = True
        self.calls += 1
        return {"index": self.calls - 1, "id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _arguments(self, args: str) -> list[dict[str, Any]]:
        if len(args) <= len(self.args_sent) or not args.startswith(self.args_sent):
            return []  # nothing new (or, for a malformed block, text that does not extend what went out)
        piece, self.args_sent = args[len(self.args_sent):], args
        return [{"index": self.calls - 1, "function": {"arguments": piece}}]

    def _progress(self, block: str) -> list[dict[str, Any]]:
        block = block[:len(block) - _partial_suffix(block, END)]  # "</tool_ca" is no argument text
        name, args = self.fmt.partial(block)
        if name is None or not _encodable(name):
            return []
        out = [] if self.header_sent else [self._header(name)]
        return out + self._arguments(args)

    def _close(self, block: str) -> list[dict[str, Any]] | None:
        """Deltas that complete a whole block's call; None when the block is no call and
        nothing of it was sent (it becomes content)."""
        final = self.fmt.final(block)
        if final is None:
            return None if not self.header_sent else []
        out = [] if self.header_sent else [self._header(final[0])]
        return out + self._arguments(final[1])

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """``(content still to send, deltas)`` at the end: a block cut off before
        ``</tool_call>`` is content unless its call was already being sent."""
        held, self.held = self.held, ""
        if self.in_block:
            self.in_block = False
            return ("", []) if self.header_sent else (self._text(START + held), [])
        return self._text(held), []
