"""Tool calls in the chat API (``--tool-call-parser hermes``): the tools reach the chat
template, the calls the model writes come back as OpenAI ``tool_calls`` (read by the
OpenAI SDK, streamed and not), and text that is not a well-formed call stays content."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from ppspec.router.api import build_app
from ppspec.router.tool_calls import ToolCallStream, parse_tool_calls
from ppspec.router.types import RequestOutput
from test_api import run_server
from test_api import make_tokenizer as _base_tokenizer

MODEL = "tools-test"
# a ChatML template that lists the tools' names in a system turn, as Qwen's do (in JSON)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALLS_TEXT = ('I will look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>')


class ScriptedEngine:
    """Answers every request with ``self.text`` (a few tokens per update), then stop."""

    def __init__(self, tokenizer):
        self.model_name, self.tokenizer, self.max_model_len = MODEL, tokenizer, 4096
        self.text = CALLS_TEXT
        self.prompts: list[list[int]] = []

    async def generate(self, request_id, prompt_token_ids, params):
        self.prompts.append(list(prompt_token_ids))
        ids = self.tokenizer.encode(self.text)
        for i in range(0, len(ids), 3):
            await asyncio.sleep(0)
            last = i + 3 >= len(ids)
            yield RequestOutput(request_id, ids[i:i + 3], "stop" if last else None, len(prompt_token_ids), i + 3)

    async def abort(self, request_id, finish_reason="abort"):
        pass

    def health(self):
        return True, "ok"


@pytest.fixture(scope="module")
def tokenizer():
    tok = _base_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture
def engine(tokenizer):
    return ScriptedEngine(tokenizer)


def _args(call):
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_parse_content_then_calls():
    content, calls = parse_tool_calls(CALLS_TEXT)
    assert content == "I will look that up."
    assert [_args(c) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tōkyō"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "no tools here",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',  # cut off before </tool_call>
    '<tool_call>{"name": "f"}</tool_call> and then more words',  # text after the calls
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>[1, 2]</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # not JSON for a client
    '<tool_call>{"name": "f", "arguments": {"city": "\\ud800"}}</tool_call>',  # a lone surrogate
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
])
def test_text_that_is_not_well_formed_calls_stays_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_arguments_given_as_a_string_pass_through_and_no_content_is_none():
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>\n')
    assert content is None and _args(calls[0]) == ("f", {"x": 2})


@pytest.mark.parametrize("text", [CALLS_TEXT, "x < y and a <tool but not a call", "ends with <tool_ca",
                                  '<tool_call>{"name": broken</tool_call>'])
@pytest.mark.parametrize("step", [1, 2, 5])
def test_stream_releases_content_and_streams_the_calls(text, step):
    s = ToolCallStream()
    out, deltas = "", []
    for i in range(0, len(text), step):
        content, d = s.feed(text[i:i + step])
        out, deltas = out + content, deltas + d
    rest, more = s.finish()
    calls = _joined(deltas + more)
    want_content, want_calls = parse_tool_calls(text)
    if want_calls:
        assert out + rest == "I will look that up.\n" and calls == [_args(c) for c in want_calls]
    else:
        assert out + rest == text and calls == []  # nothing lost, nothing repeated


def _joined(deltas):
    """(name, arguments object) of each call in streamed tool-call deltas; checks their shape:
    a call's first delta has its id, type and name, the next only argument pieces."""
    calls = {}
    for d in deltas:
        if d["index"] not in calls:
            assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["name"]
            assert d["index"] == len(calls)
            calls[d["index"]] = [d["function"]["name"], ""]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        calls[d["index"]][1] += d["function"]["arguments"]
    return [(name, json.loads(args)) for name, args in calls.values()]


def test_tools_need_a_parser(engine):
    with run_server(build_app(engine, MODEL)) as url:
        r = httpx.post(url + "/v1/chat/completions", json=dict(
            messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "--tool-call-parser" in r.json()["error"]["message"]
        # with tool_choice "none" the tools are not used at all
        r = httpx.post(url + "/v1/chat/completions", json=dict(
            messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER], tool_choice="none"))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == CALLS_TEXT
    with pytest.raises(ValueError, match="unknown tool call parser"):
        build_app(engine, MODEL, tool_call_parser="mistral")


@pytest.mark.parametrize("bad", [dict(tools=[{"type": "function"}]), dict(tools=[{"type": "web"}]),
                                 dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})])
def test_bad_tools_get_400(engine, bad):
    with run_server(build_app(engine, MODEL, tool_call_parser="hermes")) as url:
        r = httpx.post(url + "/v1/chat/completions", json=dict(messages=[{"role": "user", "content": "x"}], **bad))
        assert r.status_code == 400, r.text


def test_calls_come_back_as_tool_calls_streamed_and_not(engine, tokenizer):
    with run_server(build_app(engine, MODEL, tool_call_parser="hermes")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER])
        assert "Tools: get_weather" in tokenizer.decode(engine.prompts[-1])  # the template saw the tools
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look that up."
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert got == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tōkyō"})]

        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    calls.setdefault(d.index, {"name": "", "arguments": ""})
                    calls[d.index]["name"] += d.function.name or ""
                    calls[d.index]["arguments"] += d.function.arguments or ""
                finish = c.finish_reason or finish
        assert content == "I will look that up.\n" and finish == "tool_calls"
        assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == got

        # the history goes back with the assistant's calls and the tool's answer
        follow = msgs + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny"}]
        engine.text = "It is sunny."
        r = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER])
        assert r.choices[0].message.content == "It is sunny." and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop"
        assert "<tool_call>get_weather</tool_call>" in tokenizer.decode(engine.prompts[-1])


def test_parallel_tool_calls_false_keeps_the_first_call(engine):
    """``parallel_tool_calls: false``: of the model's two calls only the first comes back,
    streamed and not (vLLM's filter; with ``tool_choice`` "required" the grammar allows one)."""
    with run_server(build_app(engine, MODEL, tool_call_parser="hermes")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], parallel_tool_calls=False)
        assert [_args(c.model_dump()) for c in r.choices[0].message.tool_calls] == [("get_weather", {"city": "Paris"})]
        assert r.choices[0].finish_reason == "tool_calls"
        calls: dict = {}
        for chunk in client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], stream=True,
                                                    parallel_tool_calls=False):
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    calls.setdefault(d.index, "")
                    calls[d.index] += d.function.arguments or ""
        assert list(calls) == [0] and json.loads(calls[0]) == {"city": "Paris"}


# --------------------------------------------------------------------------------------
# qwen3_coder (the XML format of Qwen3-Coder / Qwen3-Next / Qwen3.5 templates)
# --------------------------------------------------------------------------------------

FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "note": {"type": "string"}}}}}
XML_TEXT = ("Checking both.\n<tool_call>\n<function=forecast>\n<parameter=city>\nSão Paulo\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
            "<parameter=hours>\n[6, 18]\n</parameter>\n<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call>")
XML_ARGS = [("forecast", {"city": "São Paulo", "days": 3, "metric": True, "hours": [6, 18], "note": "42"}),
            ("get_weather", {"city": "Lyon"})]


def test_qwen3_coder_whole_text_with_schema_types():
    content, calls = parse_tool_calls(XML_TEXT, "qwen3_coder", [FORECAST, WEATHER])
    assert content == "Checking both."
    assert [_args(c) for c in calls] == XML_ARGS  # "42" stays a string: its schema says so
    # a value that is not JSON for its type stays the text the model wrote
    _, calls = parse_tool_calls(XML_TEXT.replace("\n3\n", "\nthree\n"), "qwen3_coder", [FORECAST, WEATHER])
    assert _args(calls[0])[1]["days"] == "three"


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=forecast>\n<parameter=city>\nLyon\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\n<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call>",  # no function
    "<tool_call>\n<function=forecast>\n</function>\n</tool_call> and more",  # text after
    "<tool_call>\n<function=forecast>\n<parameter=city>\nLyon",  # cut off
])
def test_qwen3_coder_malformed_stays_content(text):
    assert parse_tool_calls(text, "qwen3_coder", [FORECAST]) == (text, [])


@pytest.mark.parametrize("parser,text,want", [
    ("hermes", CALLS_TEXT, [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tōkyō"})]),
    ("qwen3_coder", XML_TEXT, XML_ARGS),
])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_arguments_come_as_they_are_generated(parser, text, want, step):
    """Each call's name goes out once complete and its arguments in pieces while the block
    is still open, never all at its end; the joined pieces are the whole-text answer."""
    s = ToolCallStream(parser, [FORECAST, WEATHER])
    content, deltas, pieces_before_end = "", [], 0
    for i in range(0, len(text), step):
        c, d = s.feed(text[i:i + step])
        content, deltas = content + c, deltas + d
        if s.in_block:
            pieces_before_end += sum(1 for x in d if x["function"]["arguments"])
    rest, more = s.finish()
    assert content + rest == text[:text.index("<tool_call>")]
    assert _joined(deltas + more) == want
    assert pieces_before_end >= 2


def test_qwen3_coder_end_to_end_streamed_and_not(engine, tokenizer):
    engine.text = XML_TEXT
    with run_server(build_app(engine, MODEL, tool_call_parser="qwen3_coder")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Forecast?"}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[FORECAST, WEATHER])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking both."
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert got == XML_ARGS
        calls, finish, chunks_with_args = {}, None, 0
        for chunk in client.chat.completions.create(model=MODEL, messages=msgs, tools=[FORECAST, WEATHER],
                                                    stream=True):
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    calls.setdefault(d.index, ["", ""])
                    calls[d.index][0] += d.function.name or ""
                    calls[d.index][1] += d.function.arguments or ""
                    chunks_with_args += bool(d.function.arguments)
                finish = c.finish_reason or finish
        assert finish == "tool_calls" and chunks_with_args >= 3
        assert [(calls[i][0], json.loads(calls[i][1])) for i in sorted(calls)] == got


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("function, field", [
    ({"name": "f", "parameters": "x"}, "parameters"),
    ({"name": "f", "parameters": [1]}, "parameters"),
    ({"name": "f", "parameters": 5}, "parameters"),
    ({"name": "f", "description": 5}, "description"),
    ({"name": "f", "strict": "yes"}, "strict"),
])
def test_tool_fields_of_a_wrong_type_get_400_naming_them(engine, parser, function, field):
    """A function's parameters that are not a JSON schema object (or null), a description
    that is not a string, a strict that is not a boolean: 400 naming the field, with or
    without a forced call (the qwen3_coder parser read such parameters and failed: 500)."""
    with run_server(build_app(engine, MODEL, tool_call_parser=parser)) as url:
        for extra in ({}, {"tool_choice": "required"}):
            r = httpx.post(url + "/v1/chat/completions", json=dict(
                messages=[{"role": "user", "content": "x"}], tools=[{"type": "function", "function": function}],
                **extra))
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "tools" and f"'f'" in err["message"] and field in err["message"], err
        # a null parameters is a function without arguments, as OpenAI's
        r = httpx.post(url + "/v1/chat/completions", json=dict(
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": None, "description": None}}]))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("call, says", [
    ({"id": "c1", "type": "function"}, "needs a function object"),
    ({"id": "c1", "type": "function", "function": {"arguments": "{}"}}, "function.name"),
    ({"id": "c1", "type": "function", "function": {"name": "", "arguments": "{}"}}, "function.name"),
    ({"id": "c1", "type": "function", "function": {"name": "f", "arguments": 5}}, "function.arguments"),
    ({"id": "c1", "type": "function", "function": {"name": "f"}}, "function.arguments"),
    ({"id": "c1", "type": "tool", "function": {"name": "f", "arguments": "{}"}}, "type must be 'function'"),
    ({"id": 5, "type": "function", "function": {"name": "f", "arguments": "{}"}}, "id must be a string"),
])
def test_a_malformed_tool_call_in_the_history_gets_400_naming_it(engine, call, says):
    """An assistant message's tool call that is not OpenAI's shape (vLLM's request model
    refuses it too): 400 naming the call, where the template rendered it (200) or failed;
    the same call well formed, with its arguments as a string or an object, renders."""
    def history(c):
        return [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [c]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    with run_server(build_app(engine, MODEL, tool_call_parser="hermes")) as url:
        r = httpx.post(url + "/v1/chat/completions", json=dict(messages=history(call), max_tokens=2))
        assert r.status_code == 400, r.text
        assert "tool_calls[0]" in r.json()["error"]["message"] and says in r.json()["error"]["message"], r.json()
        for args in ('{"a": 1}', {"a": 1}):
            ok = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
            r = httpx.post(url + "/v1/chat/completions", json=dict(messages=history(ok), max_tokens=2))
            assert r.status_code == 200, r.text


# the shapes pydantic (openai.pydantic_function_tool) writes: Optional[int] as anyOf with
# null, an Enum and a nested model through $ref to $defs, a Literal of integers as enum
BOOKING = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "additionalProperties": False,
    "$defs": {"Size": {"enum": [1, 2, 3], "title": "Size"}, "Color": {"enum": ["red", "blue"], "type": "string"},
              "Slot": {"type": "object", "properties": {"hour": {"type": "integer"}}}},
    "properties": {
        "guests": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "size": {"$ref": "#/$defs/Size"},
        "color": {"$ref": "#/$defs/Color"},
        "slot": {"$ref": "#/$defs/Slot"},
        "price": {"allOf": [{"type": "number"}]},
        "room": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        "level": {"enum": [0, 1], "default": 0},
        "tag": {"const": 7},
        "loop": {"$ref": "#"},
        "missing": {"$ref": "#/$defs/Nope"},
        "remote": {"$ref": "https://example.com/schema.json"},
    }}}}


# the same in JSON schema draft 7's spelling: definitions, not $defs
BOOKING_DRAFT7 = json.loads(json.dumps(BOOKING).replace('"$defs"', '"definitions"').replace("#/$defs/", "#/definitions/"))


@pytest.mark.parametrize("tools", [[BOOKING], [BOOKING_DRAFT7]], ids=["defs", "definitions"])
def test_qwen3_coder_types_values_through_ref_anyof_and_enum(tools):
    """A forced call's grammar (xgrammar's qwen_xml) writes a value whose schema has no string
    branch as JSON, also where the type comes through ``$ref``, ``anyOf`` / ``oneOf`` /
    ``allOf``, ``enum`` or ``const``: such a value comes back typed (pydantic's Optional[int]
    was the string "4"), a value that may be a string stays the text written, and a ``$ref``
    that cannot be followed types nothing."""
    values = {"guests": "4", "size": "2", "color": "red", "slot": '{"hour": 9}', "price": "9.5", "room": "12",
              "level": "1", "tag": "7", "loop": "{}", "missing": "5", "remote": "6"}
    text = "<tool_call>\n<function=book>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items()) + "</function>\n</tool_call>"
    _, calls = parse_tool_calls(text, "qwen3_coder", tools)
    assert _args(calls[0]) == ("book", {"guests": 4, "size": 2, "color": "red", "slot": {"hour": 9}, "price": 9.5,
                                        "room": "12", "level": 1, "tag": 7, "loop": {}, "missing": "5",
                                        "remote": "6"})
    # null where the schema allows it, the text where it does not parse as the type
    _, calls = parse_tool_calls(text.replace("\n4\n", "\nnull\n").replace("\n2\n", "\ntwo\n"), "qwen3_coder", tools)
    assert _args(calls[0])[1]["guests"] is None and _args(calls[0])[1]["size"] == "two"
