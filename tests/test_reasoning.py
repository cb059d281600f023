"""The ``qwen3`` reasoning parser (``--reasoning-parser qwen3``): thinking between
``<think>`` and ``</think>`` goes to ``reasoning_content``, streamed and not, with the block
opened by the model or by the prompt, ``enable_thinking: false`` honoured, and tool calls
read from the content after the thinking. The outputs are crafted (a scripted engine emits
them token by token), so the demo model's weakness does not decide the test."""
from __future__ import annotations

import json
import random

import openai
import pytest

from ppspec.router.api import build_app
from ppspec.router.reasoning import ReasoningStream, prompt_opens_reasoning, split_reasoning
from test_api import make_tokenizer, run_server
from test_tool_calls import CALLS_TEXT, MODEL, WEATHER, ScriptedEngine

THINK = "The user asks for 2 + 2.\n\nThat is 4 (four); no <think> nesting here."
ANSWER = "2 + 2 = 4.\n\nAnything else?"
# Qwen3-style: the template opens <think> itself unless enable_thinking is false, when it
# writes an empty, closed block (the model then answers directly)
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_think %}<think>\n{% endif %}{% endif %}"
)


def _stream(text, in_reasoning, cuts):
    s, reasoning, content = ReasoningStream(in_reasoning), "", ""
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        r, c = s.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    return (reasoning + r) or None, (content + c) or None


CASES = [  # (text, in_reasoning, want)
    (f"<think>\n{THINK}\n</think>\n\n{ANSWER}", False, (THINK, ANSWER)),
    (f"\n<think>{THINK}</think>{ANSWER}", False, (THINK, ANSWER)),
    (f"{THINK}\n</think>\n\n{ANSWER}", True, (THINK, ANSWER)),  # the prompt opened the block
    (f"<think>\n{THINK}\n</think>\n\n{ANSWER}", True, (THINK, ANSWER)),
    (f"<think>\n{THINK}", False, (THINK, None)),  # cut off while thinking
    (f"{THINK}\n", True, (THINK, None)),
    (ANSWER, False, (None, ANSWER)),  # no thinking at all
    (f"{ANSWER} </think> tail", False, (None, f"{ANSWER} </think> tail")),
    ("<think>\n\n</think>\n\n" + ANSWER, False, (None, ANSWER)),
    ("<thi", False, (None, "<thi")),
    ("", True, (None, None)),
]


@pytest.mark.parametrize("text,in_reasoning,want", CASES)
def test_split_whole_and_streamed_at_every_cut(text, in_reasoning, want):
    assert split_reasoning(text, in_reasoning) == want
    rng = random.Random(text)
    for step in (1, 2, 5):
        assert _stream(text, in_reasoning, list(range(step, len(text), step))) == want
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, max(2, len(text))), min(len(text) - 1, rng.randint(0, 6)))) if text else []
        assert _stream(text, in_reasoning, cuts) == want


def test_stream_sends_reasoning_before_the_block_ends():
    s = ReasoningStream()
    first, _ = s.feed("<think>\nStep one. ")
    assert first == "Step one. "  # not held until </think>
    assert s.feed("Step two.\n</thi") == ("Step two.", "")
    assert s.feed("nk>\n\nDone") == ("", "Done")


def test_prompt_tail():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_tokenizer()
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def _chat(client, stream, **kw):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "2 + 2?"}]) | kw
    if not stream:
        m = client.chat.completions.create(**kw).choices[0]
        return (m.message.model_extra or {}).get("reasoning_content"), m.message.content, m.finish_reason, \
            [(c.function.name, json.loads(c.function.arguments)) for c in m.message.tool_calls or []]
    reasoning, content, finish, calls, order = "", "", None, {}, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            r = (c.delta.model_extra or {}).get("reasoning_content") or ""
            reasoning += r
            content += c.delta.content or ""
            order += ["r"] * bool(r) + ["c"] * bool(c.delta.content)
            for d in c.delta.tool_calls or []:
                calls.setdefault(d.index, ["", ""])
                calls[d.index][0] += d.function.name or ""
                calls[d.index][1] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert order == sorted(order, key="rc".index), order  # all reasoning before any content
    return reasoning or None, content or None, finish, [(n, json.loads(a)) for n, a in calls.values()]


@pytest.mark.parametrize("stream", [False, True])
def test_end_to_end(tokenizer, stream):
    engine = ScriptedEngine(tokenizer)
    with run_server(build_app(engine, MODEL, reasoning_parser="qwen3", tool_call_parser="hermes")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        engine.text = f"<think>\n{THINK}\n</think>\n\n{ANSWER}"
        assert _chat(client, stream) == (THINK, ANSWER, "stop", [])
        # enable_thinking false: the template closed the block; nothing is split
        engine.text = ANSWER + " </think>"
        got = _chat(client, stream, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert got == (None, ANSWER + " </think>", "stop", [])
        assert tokenizer.decode(engine.prompts[-1]).endswith("<think>\n\n</think>\n\n")
        # the template opened the block: the output starts inside it
        engine.text = f"{THINK}\n</think>\n\n{ANSWER}"
        got = _chat(client, stream, extra_body={"chat_template_kwargs": {"open_think": True}})
        assert got == (THINK, ANSWER, "stop", [])
        # thinking, then tool calls read from the content after it
        engine.text = f"<think>\n{THINK}\n</think>\n\n{CALLS_TEXT}"
        reasoning, content, finish, calls = _chat(client, stream, tools=[WEATHER])
        assert reasoning == THINK and finish == "tool_calls"
        assert content.strip() == "I will look that up."
        assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tōkyō"})]
        # completions are not split
        engine.text = f"<think>\n{THINK}\n</think>\n\n{ANSWER}"
        assert client.completions.create(model=MODEL, prompt="x").choices[0].text == engine.text
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        build_app(engine, MODEL, reasoning_parser="deepseek_r1")


def test_structured_output_starts_after_the_thinking(tokenizer):
    """With the reasoning parser and a prompt that opens a thinking block, a
    ``response_format`` grammar lets the thinking and ``</think>`` come first (as vLLM's):
    the reply's thinking is ``reasoning_content``, the JSON its content. The grammar sent is
    checked with xgrammar on the demo tokenizer: it takes the thinking then the JSON, not the
    JSON alone as a whole output; with ``enable_thinking: false`` the JSON alone."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from ppspec.router.llm import DEMO_MODEL

    engine, sent = ScriptedEngine(tokenizer), []
    generate = engine.generate
    engine.generate = lambda rid, ids, params: sent.append(params.grammar) or generate(rid, ids, params)
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}}
    answer = '{"sum": 4}'
    with run_server(build_app(engine, MODEL, reasoning_parser="qwen3")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        engine.text = f"{THINK}\n</think>\n\n{answer}"
        for stream in (False, True):
            got = _chat(client, stream, response_format=fmt, extra_body={"chat_template_kwargs": {"open_think": True}})
            assert got == (THINK, answer, "stop", [])
        engine.text = answer
        got = _chat(client, False, response_format=fmt, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert got == (None, answer, "stop", [])
    thinking, _, plain = sent
    demo = AutoTokenizer.from_pretrained(DEMO_MODEL)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(demo, vocab_size=8192, stop_token_ids=[2]))

    def completes(grammar, text):
        m = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
        return m.accept_string(text) and m.accept_token(2)

    assert completes(thinking, f"{THINK}\n</think>\n\n{answer}")
    assert not completes(thinking, answer)
    assert completes(plain, answer) and not completes(plain, f"{THINK}\n</think>\n\n{answer}")
