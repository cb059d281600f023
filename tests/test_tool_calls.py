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
def test_stream_releases_content_and_holds_the_calls(text, step):
    s = ToolCallStream()
    out = "".join(s.feed(text[i:i + step]) for i in range(0, len(text), step))
    rest, calls = s.finish()
    want_content, want_calls = parse_tool_calls(text)
    if want_calls:
        assert out + rest == "I will look that up.\n" and [_args(c) for c in calls] == [_args(c) for c in want_calls]
    else:
        assert out + rest == text and calls == []  # nothing lost, nothing repeated


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
