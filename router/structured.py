"""Structured output: a request's constraint as one grammar, before any row is taken.

The forms clients send, each turned into an xgrammar ``Grammar`` whose EBNF text travels
to the last stage (``SamplingParams.grammar``; ``stage_server/grammar.py`` masks every
verified position with it):

* ``response_format``: ``{"type": "json_object"}`` (any JSON object) or ``{"type":
  "json_schema", "json_schema": {"schema": ...}}`` (OpenAI), or vLLM's ``{"type":
  "structural_tag", "format": ...}`` (its legacy ``structures`` and ``triggers`` too);
* vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``, ``structural_tag``: xgrammar's structural tag) and its older ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``;
* ``tool_choice`` ``"required"`` (one or more calls) or naming a function (one call of it),
  with ``tools``: calls in the format of the server's ``--tool-call-parser``, each call's
  arguments following its function's ``parameters`` schema (:data:`TOOL_CALL_FORMATS`).

With a reasoning parser and a prompt that leaves a thinking block open, the constraint
starts after the thinking (as vLLM's): the grammar lets any text up to ``</think>`` (and
the newlines after it) come first, so the model thinks, then answers in the format; the
reasoning parser puts the thinking in ``reasoning_content`` and the answer in ``content``.

A constraint the grammar library cannot build (a JSON schema it does not support, a regex
or EBNF that does not parse) is an ``InvalidRequestError`` (HTTP 400) naming the field and
xgrammar's reason. At most one constraint per request.
"""
from __future__ import annotations

import json
import re
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from .reasoning import END as REASONING_END
from .tool_calls import END, START
from .types import InvalidRequestError

if TYPE_CHECKING:  # pragma: no cover
    from .protocol import _GenerationRequest

_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # "[17:44:23] /project/cpp/x.cc:94: "


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _NATIVE_PREFIX.sub("", str(e).strip()).strip()


def _xgrammar():
    import xgrammar

    return xgrammar


def _schema(value: Any, param: str) -> dict | bool:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequestError(f"{param}: the JSON schema is not valid JSON: {e}", param=param.split(".")[0]) from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError(f"{param}: a JSON schema must be an object, got {type(value).__name__}",
                                  param=param.split(".")[0])
    return value


UNENFORCED_KEYWORDS = ("not", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
                       "if", "then", "else")
"""JSON schema keywords xgrammar accepts and ignores (checked on 0.2.9: the grammar is the
same without them), so output could break a schema that uses them: refused (400), as
vLLM refuses features its xgrammar backend does not support. ``uniqueItems: true`` too."""
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("additionalProperties", "items", "prefixItems", "propertyNames", "unevaluatedProperties",
               "unevaluatedItems", "additionalItems", "allOf", "anyOf", "oneOf")


MAX_SCHEMA_DEPTH = 64
"""Subschemas nested deeper than this are refused (400): xgrammar's build grows about with
the cube of the nesting (128 levels 0.2 s, 256 levels 2 s, 450 levels 37 s on one core of
the CPU host, on the HTTP server's worker threads, where it cannot be stopped). OpenAI's
structured outputs allow 10 levels."""


def check_enforced(schema: Any) -> None:
    """Raise ValueError naming the first keyword of ``schema`` (or of a subschema) that the
    grammar would not enforce (:data:`UNENFORCED_KEYWORDS`), or the first subschema nested
    more than :data:`MAX_SCHEMA_DEPTH` levels deep. Iterative: no recursion limit."""
    todo = [(schema, "$", 0)]
    while todo:
        node, path, depth = todo.pop()
        if not isinstance(node, dict):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests subschemas more than {MAX_SCHEMA_DEPTH} levels deep (at "
                             f"{path[:200]}{'...' if len(path) > 200 else ''}), more than this server builds "
                             f"grammars for")
        bad = next((k for k in UNENFORCED_KEYWORDS if k in node), None)
        if bad is None and node.get("uniqueItems") is True:
            bad = "uniqueItems"
        if bad is not None:
            raise ValueError(f"the JSON schema uses {bad!r} (at {path}), which the grammar would not enforce, so "
                             f"the output could break the schema")
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                todo += [(sub, f"{path}.{key}.{name}", depth + 1) for name, sub in node[key].items()]
        for key in _SUBSCHEMAS:
            sub = node.get(key)
            todo += ([(x, f"{path}.{key}[{i}]", depth + 1) for i, x in enumerate(sub)] if isinstance(sub, list)
                     else [(sub, f"{path}.{key}", depth + 1)])


def _json_grammar(schema: dict | bool | None):
    """JSON following ``schema`` (None: any JSON object), written compactly (``", "`` and
    ``": "`` between items, no other whitespace): with free whitespace a model can fill its
    tokens with newlines and never close the object (the demo model does)."""
    if schema is None:
        schema = {"type": "object"}
    check_enforced(schema)
    return _xgrammar().Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def _choice_grammar(choices: list[str]):
    # EBNF string literals take JSON's escapes (\" \\ \n \uXXXX)
    return _xgrammar().Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))


def _ebnf_or_lark(text: str):
    xgr = _xgrammar()
    try:
        return xgr.Grammar.from_ebnf(text)
    except RuntimeError as ebnf_error:
        try:
            return xgr.Grammar.from_lark(text)
        except Exception:  # noqa: BLE001 - report the EBNF reading, the documented form
            raise ebnf_error from None


def _hermes_tag(st, fn: dict, params: dict):
    """``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` (``router/tool_calls.py``
    reads it back); the arguments compact, as ``response_format``."""
    args = st.GrammarFormat(grammar=str(_json_grammar(params)))
    return st.TagFormat(begin=f'{START}\n{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": ',
                        content=args, end=f"}}\n{END}")


def _qwen3_coder_tag(st, fn: dict, params: dict):
    """``<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...\n</function>\n</tool_call>``
    (xgrammar's ``qwen_xml`` style for the parameters)."""
    check_enforced(params)
    args = st.JSONSchemaFormat(json_schema=params, style="qwen_xml", max_whitespace_cnt=MAX_XML_WHITESPACE)
    return st.TagFormat(begin=f"{START}\n<function={fn['name']}>\n", content=args, end=f"\n</function>\n{END}")


def _calls_grammar(tag_for, tools: list[dict], name: str | None, parallel: bool):
    """Call blocks one per line, each built by ``tag_for(st, function, parameters)``: only the
    named function, once, when ``name`` is given; else one or more of any tool (one when not
    ``parallel``)."""
    xgr = _xgrammar()
    from xgrammar import structural_tag as st

    tags = []
    for t in tools:
        fn = t["function"]
        if name is None or fn["name"] == name:
            params = fn.get("parameters")
            tags.append(tag_for(st, fn, {"type": "object", "properties": {}} if params is None else params))
    fmt = st.TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True,
                                     stop_after_first=name is not None or not parallel)
    return xgr.Grammar.from_structural_tag(xgr.StructuralTag(format=fmt))


MAX_XML_WHITESPACE = 1
"""Whitespace characters in a row the XML calls allow around a value: room for the format's
one newline (xgrammar lets it be any of space, tab, CR, newline), which the ``qwen3_coder``
parser strips (more would reach the arguments, and an enum's value would no longer match)."""

TOOL_CALL_FORMATS = {"hermes": partial(_calls_grammar, _hermes_tag), "qwen3_coder": partial(_calls_grammar, _qwen3_coder_tag)}
"""Grammar of the calls ``tool_choice`` forces, per ``--tool-call-parser``."""


def _constraints(body: "_GenerationRequest", tool_call_parser: str | None) -> list[tuple[str, Any]]:
    """``(param, build)`` of every constraint the request asks for; ``build()`` makes the
    grammar (raising xgrammar's errors)."""
    found = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", lambda: _json_grammar(None)))
    elif rf is not None and rf.type == "json_schema":
        schema = _schema(rf.json_schema.schema_, "response_format.json_schema.schema")
        found.append(("response_format", lambda s=schema: _json_grammar(s)))
    elif rf is not None and rf.type == "structural_tag":
        found.append(("response_format", lambda: _structural_tag(_response_format_tag(rf))))
    so = body.structured_outputs
    if so is not None:
        given = [k for k in ("json_", "regex", "choice", "grammar", "structural_tag") if getattr(so, k) is not None]
        given += ["json_object"] if so.json_object else []
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs: give exactly one of json, regex, choice, grammar, "
                                      f"json_object, structural_tag (got {', '.join(k.rstrip('_') for k in given) or 'none'})",
                                      param="structured_outputs")
        kind = given[0]
        if kind == "json_":
            schema = _schema(so.json_, "structured_outputs.json")
            found.append(("structured_outputs", lambda s=schema: _json_grammar(s)))
        elif kind == "json_object":
            found.append(("structured_outputs", lambda: _json_grammar(None)))
        elif kind == "structural_tag":
            found.append(("structured_outputs", lambda: _structural_tag(so.structural_tag)))
        elif kind == "regex":
            found.append(("structured_outputs", lambda: _xgrammar().Grammar.from_regex(so.regex)))
        elif kind == "choice":
            found.append(("structured_outputs", lambda: _choice_grammar(so.choice)))
        else:
            found.append(("structured_outputs", lambda: _ebnf_or_lark(so.grammar)))
    if body.guided_json is not None:
        schema = _schema(body.guided_json, "guided_json")
        found.append(("guided_json", lambda s=schema: _json_grammar(s)))
    if body.guided_regex is not None:
        found.append(("guided_regex", lambda: _xgrammar().Grammar.from_regex(body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", lambda: _choice_grammar(body.guided_choice)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", lambda: _ebnf_or_lark(body.guided_grammar)))
    choice = getattr(body, "tool_choice", None)  # chat only
    if choice not in (None, "none", "auto"):
        fmt = TOOL_CALL_FORMATS.get(tool_call_parser or "")
        if fmt is None:
            raise InvalidRequestError(
                f"tool_choice {'required' if choice == 'required' else 'naming a function'} needs a server started "
                f"with --tool-call-parser {' or '.join(TOOL_CALL_FORMATS)}", param="tool_choice")
        name = None if choice == "required" else choice.function.name
        parallel = body.parallel_tool_calls is not False
        found.append(("tool_choice", lambda: fmt(body.tools, name, parallel)))
    return found


def _structural_tag(tag: dict | str):
    """xgrammar's structural tag (``{"type": "structural_tag", "format": {...}}``, as an
    object or its JSON text) as a grammar; the JSON schemas it holds are checked as
    ``response_format``'s are."""
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as e:
            raise ValueError(f"the structural tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError(f"a structural tag must be an object, got {type(tag).__name__}")
    todo = [tag]
    while todo:  # JSON schemas inside, at any depth
        node = todo.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                check_enforced(node["json_schema"])
            todo += list(node.values())
        elif isinstance(node, list):
            todo += node
    return _xgrammar().Grammar.from_structural_tag(json.dumps(tag))


def _response_format_tag(rf) -> dict:
    """vLLM's ``response_format`` ``structural_tag`` as xgrammar's: its ``format``, or the
    legacy ``structures`` each allowed after one of ``triggers``."""
    if rf.format is not None:
        return {"type": "structural_tag", "format": rf.format}
    tags = [{"begin": s.begin, "content": {"type": "json_schema", "json_schema": s.schema_}, "end": s.end}
            for s in rf.structures]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": list(rf.triggers or []),
                                                 "tags": tags}}


def _after_thinking(grammar):
    """``grammar`` after an open thinking block: any text, ``</think>``, newlines or spaces."""
    xgr = _xgrammar()
    from xgrammar import structural_tag as st

    think = st.SequenceFormat(elements=[st.TagFormat(begin="", content=st.AnyTextFormat(), end=REASONING_END),
                                        st.RegexFormat(pattern=r"[ \n]*")])
    return xgr.Grammar.concat(xgr.Grammar.from_structural_tag(xgr.StructuralTag(format=think)), grammar)


def grammar_builder(body: "_GenerationRequest", tool_call_parser: str | None = None,
                    after_thinking: bool = False) -> Callable[[], str] | None:
    """What builds the grammar (xgrammar EBNF text) of the request's structured output, or
    None when it has none; ``after_thinking``: the prompt left a thinking block open (the
    constraint starts after it). The build takes seconds for a big schema (a 600k-entry
    enum: 4-7 s; xgrammar releases the GIL): the HTTP server runs it on a worker thread.

    Raises ``InvalidRequestError`` (HTTP 400, before anything is allocated): more than one
    constraint; so does the build: a constraint the grammar library cannot build (its
    reason in the message)."""
    found = _constraints(body, tool_call_parser)
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequestError(f"give one structured output constraint, got {', '.join(p for p, _ in found)}",
                                  param=found[1][0])
    param, build = found[0]

    def built() -> str:
        try:
            grammar = build()
            if after_thinking:
                grammar = _after_thinking(grammar)
        except (RuntimeError, ValueError) as e:  # xgrammar's parse / conversion errors
            raise InvalidRequestError(f"{param}: the grammar library (xgrammar) cannot use it: {_reason(e)}",
                                      param=param) from None
        return str(grammar)

    return built


def request_grammar(body: "_GenerationRequest", tool_call_parser: str | None = None,
                    after_thinking: bool = False) -> str | None:
    """The grammar of :func:`grammar_builder`, built here, or None."""
    build = grammar_builder(body, tool_call_parser, after_thinking)
    return None if build is None else build()
