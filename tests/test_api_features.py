"""API features real clients use (issue 29): unknown fields accepted with one warning line,
``stream_options.continuous_usage_stats``, ``include_stop_str_in_output``, chat template
arguments (``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``),
``/tokenize``, ``/detokenize``, ``/version``, ``ppspec --version`` and the access log.

The engine is test_api's ``FakeEngine`` (it records each request's prompt ids and what it
generated); expected values come from that record and from the tokenizer itself.
"""
from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

import ppspec
from ppspec.cli import main as cli_main
from ppspec.router.api import build_app
from test_api import FakeEngine, make_tokenizer, run_server

MODEL = "features-test"
# a template with a variable of its own, as Qwen3's ``enable_thinking``
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (continue_final_message and loop.last) %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture(scope="module")
def server(engine):
    with run_server(build_app(engine, served_model_name=MODEL)) as url:
        yield url


@pytest.fixture(autouse=True)
def _fresh(engine):
    engine.reset()


def _post(server, path, body):
    return httpx.post(f"{server}{path}", content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=30)


def test_unknown_fields_are_ignored_with_one_warning(server, engine, caplog):
    body = {"prompt": "hi", "max_tokens": 3, "seed": 1, "metadata": {"k": "v"}, "store": False,
            "service_tier": "auto", "priority": 3}
    with caplog.at_level(logging.WARNING, logger="ppspec.router.api"):
        r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if "ignored unknown" in rec.getMessage()]
    assert lines == ["/v1/completions: ignored unknown request fields: metadata, store, service_tier, priority"]
    # the answer is the one without them
    plain = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "seed": 1})
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]

    caplog.clear()
    chat = {"messages": [{"role": "user", "content": "hi", "foo": 1}], "max_tokens": 2, "reasoning_effort": "low",
            "stream": True, "stream_options": {"include_usage": True, "bar": True}}
    with caplog.at_level(logging.WARNING, logger="ppspec.router.api"):
        r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    lines = [rec.getMessage() for rec in caplog.records if "ignored unknown" in rec.getMessage()]
    assert lines == ["/v1/chat/completions: ignored unknown request fields: reasoning_effort, "
                     "stream_options.bar, messages.0.foo"]



def test_a_chat_template_in_the_request_is_refused_not_ignored(server, engine):
    """A request's own ``chat_template`` would change the prompt: rendering with the server's
    instead (what ignoring it did) answers another question, so it is a 400 (vLLM's too,
    without ``--trust-request-chat-template``) and nothing reaches the engine."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and "--chat-template" in err["message"], err
    assert engine.calls == {}


def _events(text):
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def _check_continuous_usage(engine, events, *, n: int, chat: bool, ids_per_chunk: bool):
    """vLLM's ``continuous_usage_stats``: every chunk with a choice carries that choice's usage
    so far (its prompt's tokens; its completion tokens up to and with this chunk's, 0 on
    chat's role chunk), the last chunk (``choices: []``) the totals over all choices, each
    prompt counted once. ``ids_per_chunk``: the chunks carry ``token_ids``, so the count after
    each chunk is known exactly (else: never back, and the choice's whole count at its end).
    Returns the number of chunks per choice."""
    request_id = events[0]["id"]
    calls = {int(rid.rsplit("-", 1)[1]): v for rid, v in engine.calls.items() if rid.startswith(request_id + "-")}
    outputs = {int(rid.rsplit("-", 1)[1]): v for rid, v in engine.outputs.items() if rid.startswith(request_id + "-")}
    counted = {i: 0 for i in calls}
    chunks = {i: 0 for i in calls}
    for ev in events[:-1]:
        assert len(ev["choices"]) == 1, "only the last chunk has no choices"
        choice = ev["choices"][0]
        i = choice["index"]
        prompt_tokens = len(calls[i][0])
        usage = ev["usage"]
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}, usage
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        if chat and choice["delta"].get("role"):
            assert chunks[i] == 0 and usage["completion_tokens"] == 0  # vLLM's role chunk: nothing generated yet
        if ids_per_chunk:
            counted[i] += len(choice.get("token_ids") or [])
            assert usage["completion_tokens"] == counted[i], (i, usage, counted)
        else:
            assert usage["completion_tokens"] >= counted[i]  # never goes back
            counted[i] = usage["completion_tokens"]
        chunks[i] += 1
        if choice["finish_reason"] is not None:  # the choice's last chunk: its whole count
            assert usage["completion_tokens"] == len(outputs[i])
    assert counted == {i: len(out) for i, out in outputs.items()}
    last = events[-1]
    assert last["choices"] == []
    prompt_total = sum(len(calls[i][0]) for i in calls if i % n == 0)  # choice p * n + j runs prompt p
    completion_total = sum(len(out) for out in outputs.values())
    assert last["usage"]["prompt_tokens"] == prompt_total
    assert last["usage"]["completion_tokens"] == completion_total
    assert last["usage"]["total_tokens"] == prompt_total + completion_total
    return chunks


@pytest.mark.parametrize("ids_per_chunk", [True, False])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(server, engine, tokenizer, path, ids_per_chunk):
    """n = 2 (completions: of two prompts of different lengths, so four choices), the fake
    engine's rounds emitting 1 to 3 tokens each, as speculative rounds do."""
    chat = "chat" in path
    body = {"max_tokens": 20, "seed": 3, "temperature": 1.0, "n": 2, "stream": True, "stream_options": CONTINUOUS,
            "return_token_ids": ids_per_chunk}
    body |= {"messages": [{"role": "user", "content": "the fox"}]} if chat else \
        {"prompt": ["the fox", "a longer prompt, of more tokens than the other"]}
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    events = _events(r.text)
    chunks = _check_continuous_usage(engine, events, n=2, chat=chat, ids_per_chunk=ids_per_chunk)
    assert len(chunks) == (2 if chat else 4) and all(c >= 2 for c in chunks.values())
    rounds = [len(ev["choices"][0].get("token_ids") or []) for ev in events[:-1]]
    if ids_per_chunk:
        assert max(rounds) >= 2  # chunks of several tokens were counted


def test_continuous_usage_stats_through_the_openai_sdk(server, engine):
    """The SDK reads each chunk's ``usage``: n = 1, the running count of the one choice."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the fox"}],
                                            max_tokens=16, seed=2, temperature=1.0, stream=True,
                                            stream_options=CONTINUOUS, extra_body={"return_token_ids": True})
    got = list(stream)
    (rid,) = [k for k in engine.outputs]
    prompt_tokens = len(engine.calls[rid][0])
    so_far = 0
    for c in got[:-1]:
        so_far += len(getattr(c.choices[0], "token_ids", None) or [])
        assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == \
            (prompt_tokens, so_far, prompt_tokens + so_far)
    assert so_far == len(engine.outputs[rid]) and got[-1].choices == []
    assert (got[-1].usage.completion_tokens, got[-1].usage.total_tokens) == (so_far, prompt_tokens + so_far)


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(server, engine, tokenizer, stream):
    base = {"prompt": "stop test", "max_tokens": 120, "seed": 11, "temperature": 1.0}
    full = _post(server, "/v1/completions", base | {"ignore_eos": True}).json()["choices"][0]["text"]
    words = [w for w in full.split() if len(w) >= 4]
    stop = words[1]
    cut = full[:full.index(stop)]
    for include, expected in ((False, cut), (True, cut + stop)):
        body = base | {"ignore_eos": True, "stop": [stop], "include_stop_str_in_output": include, "stream": stream}
        r = _post(server, "/v1/completions", body)
        if stream:
            evs = _events(r.text)
            text = "".join(c["text"] for ev in evs for c in ev["choices"])
            last = [c for ev in evs for c in ev["choices"] if c["finish_reason"]][-1]
        else:
            text, last = r.json()["choices"][0]["text"], r.json()["choices"][0]
        assert text == expected
        assert last["finish_reason"] == "stop" and last["stop_reason"] == stop


def test_chat_template_arguments_reach_the_template(server, engine, tokenizer):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    cases = [
        ({}, {"add_generation_prompt": True}),
        ({"chat_template_kwargs": {"enable_thinking": False}}, {"add_generation_prompt": True,
                                                                 "enable_thinking": False}),
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        ({"add_generation_prompt": False, "continue_final_message": True},
         {"add_generation_prompt": False, "continue_final_message": True}),
    ]
    for fields, kwargs in cases:
        engine.reset()
        r = _post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2} | fields)
        assert r.status_code == 200, r.text
        expected = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False, **kwargs)
        assert engine.only_call()[1] == list(expected), fields
        # /tokenize renders the same
        tok = _post(server, "/tokenize", {"messages": msgs} | fields).json()
        assert tok["tokens"] == list(expected) and tok["count"] == len(expected)
    rendered = tokenizer.decode(engine.only_call()[1])
    assert rendered.endswith("Hello, I am")  # continued, not closed
    thinking_off = tokenizer.decode(_post(server, "/tokenize", {"messages": msgs[:1], "chat_template_kwargs": {
        "enable_thinking": False}}).json()["tokens"])
    assert thinking_off.endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_puts_the_last_assistant_message_first(server, engine, tokenizer, stream):
    """vLLM's chat ``echo``: the last message's content starts the reply when it is the
    assistant's (here continued with ``continue_final_message``); a user's last message is
    not echoed."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, here"}]
    body = dict(messages=msgs, max_tokens=4, temperature=0, echo=True, add_generation_prompt=False,
                continue_final_message=True, stream=stream)
    for messages, want in ((msgs, "Sure, here"), (msgs[:1], "")):
        engine.reset()
        extra = {} if messages is msgs else dict(add_generation_prompt=True, continue_final_message=False)
        r = _post(server, "/v1/chat/completions", {**body, "messages": messages, **extra})
        assert r.status_code == 200, r.text
        if stream:
            content = "".join(c["delta"].get("content") or "" for ev in _events(r.text) for c in ev["choices"])
        else:
            content = r.json()["choices"][0]["message"]["content"]
        (rid,) = engine.outputs
        assert content == want + tokenizer.decode(engine.outputs[rid], skip_special_tokens=True)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_is_the_prompt_alone(server, engine, tokenizer, stream):
    """vLLM's ``echo`` with ``max_tokens`` 0: the choice is the prompt's text and its
    log-probability entries (one per prompt token), no completion token counted,
    ``finish_reason`` ``length``; the engine ran one token, which is dropped."""
    prompt = "Echo me back"
    ids = tokenizer.encode(prompt)
    r = _post(server, "/v1/completions", dict(prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=stream,
                                              **({"stream_options": {"include_usage": True}} if stream else {})))
    assert r.status_code == 200, r.text
    if stream:
        events = _events(r.text)
        choices = [c for ev in events for c in ev["choices"]]
        text = "".join(c["text"] for c in choices)
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        finish, usage = choices[-1]["finish_reason"], events[-1]["usage"]
    else:
        choice = r.json()["choices"][0]
        text, tokens, finish, usage = choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"], r.json()["usage"]
    assert text == prompt and len(tokens) == len(ids) and finish == "length"
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)
    ((_, params),) = engine.calls.values()
    assert params.max_tokens == 1 and params.prompt_logprobs == 1



@pytest.mark.parametrize("stream", [False, True])
def test_echo_text_offsets_count_the_echoed_prompt(server, engine, tokenizer, stream):
    """With ``echo``, every generated token's ``text_offset`` counts the prompt text before
    it, in each chunk of a stream too (the chunks after the first counted from the
    completion's start): the offsets without echo, shifted by the prompt's length."""
    prompt = "Echo me back"
    body = dict(prompt=prompt, max_tokens=12, seed=5, temperature=1.0, logprobs=1, stream=stream)

    def offsets(echo):
        r = _post(server, "/v1/completions", dict(body, echo=echo))
        assert r.status_code == 200, r.text
        choices = [c for ev in _events(r.text) for c in ev["choices"]] if stream else r.json()["choices"]
        return [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]

    plain, echoed = offsets(False), offsets(True)
    n = len(tokenizer.encode(prompt))
    assert len(plain) == 12 and len(echoed) == n + 12
    assert echoed[n:] == [len(prompt) + o for o in plain]


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_of_a_token_id_prompt_with_special_tokens(server, engine, tokenizer, stream, skip_special):
    """``echo`` of a prompt given as token ids: its text is the ids decoded as vLLM decodes
    them (``tokenizer.decode``, special tokens kept: ``<|im_start|>`` is echoed, whatever the
    request's ``skip_special_tokens``, which applies to the generated text alone), the prompt
    tokens' ``text_offset`` count that text, and a stream's first chunk carries their
    log-probability entries as the whole response does."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for ids in ([start, start], [start] + tokenizer.encode("Echo me back")):
        engine.reset()
        r = _post(server, "/v1/completions", dict(prompt=ids, max_tokens=3, echo=True, logprobs=1, stream=stream,
                                                  seed=2, temperature=1.0, ignore_eos=True,
                                                  skip_special_tokens=skip_special))
        assert r.status_code == 200, r.text
        choices = [c for ev in _events(r.text) for c in ev["choices"]] if stream else r.json()["choices"]
        text = "".join(c["text"] for c in choices)
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        prompt_text = tokenizer.decode(ids)
        assert prompt_text.startswith("<|im_start|>")
        ((rid, out),) = engine.outputs.items()
        assert text == prompt_text + tokenizer.decode(out, skip_special_tokens=skip_special)
        assert len(tokens) == len(ids) + 3
        assert tokens[:len(ids)] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        assert offsets[:len(ids)] == [len(tokenizer.decode(ids[:j])) for j in range(len(ids))]
        assert offsets[len(ids)] == len(prompt_text)


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, engine, tokenizer):
    """vLLM's ``truncate_prompt_tokens``: the engine runs each prompt's last k tokens (a
    chat's rendered prompt too; -1: the context's worth, so a prompt longer than the context
    runs its tail); echo gives the text of the tokens kept; 0 or more than the context is a 400."""
    text = "one two three four five six seven eight"
    ids = tokenizer.encode(text)
    r = _post(server, "/v1/completions", dict(prompt=text, max_tokens=2, truncate_prompt_tokens=3, echo=True))
    assert r.status_code == 200, r.text
    ((prompt, _),) = engine.calls.values()
    assert prompt == ids[-3:] and r.json()["usage"]["prompt_tokens"] == 3
    assert r.json()["choices"][0]["text"].startswith(tokenizer.decode(ids[-3:]))
    engine.reset()
    msgs = [{"role": "user", "content": text}]
    r = _post(server, "/v1/chat/completions", dict(messages=msgs, max_tokens=2, truncate_prompt_tokens=4))
    assert r.status_code == 200, r.text
    ((prompt, _),) = engine.calls.values()
    assert prompt == tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)[-4:]
    engine.reset()
    limit = engine.max_model_len
    long_ids = (ids * (limit // len(ids) + 2))[: limit + 5]
    r = _post(server, "/v1/completions", dict(prompt=long_ids, max_tokens=1, truncate_prompt_tokens=-1))
    # the tail kept fills the context: no room for a token (not the untruncated length)
    assert r.status_code == 400 and f"({limit} in the prompt" in r.json()["error"]["message"], r.text
    for bad in (0, limit + 1, -2):
        r = _post(server, "/v1/completions", dict(prompt=text, max_tokens=2, truncate_prompt_tokens=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_tokens_as_token_ids(server, engine, tokenizer, path):
    """vLLM's ``return_tokens_as_token_ids``: every logprob entry names its token
    ``token_id:{id}`` (the sampled ones and the alternatives), whatever the token's text."""
    chat = "chat" in path
    body = dict(max_tokens=4, temperature=0, return_tokens_as_token_ids=True,
                **({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2} if chat
                   else {"prompt": "hi", "logprobs": 2}))
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    (rid,) = engine.outputs
    want = [f"token_id:{t}" for t in engine.outputs[rid]]
    lp = r.json()["choices"][0]["logprobs"]
    if chat:
        assert [e["token"] for e in lp["content"]] == want
        assert [e["bytes"] for e in lp["content"]] == [list(w.encode()) for w in want]
        tops = [[t["token"] for t in e["top_logprobs"]] for e in lp["content"]]
    else:
        assert lp["tokens"] == want
        tops = [list(t) for t in lp["top_logprobs"]]
    assert tops == [[f"token_id:{i}" for i, _ in x.top[:2]] + ([] if chat or w in [f"token_id:{i}" for i, _ in x.top[:2]]
                                                               else [w])
                    for x, w in zip(engine.logprobs[rid], want)]


def test_tokenize_detokenize_version(server, engine, tokenizer):
    text = "Café crème ✓ — the fox 🦊"
    r = _post(server, "/tokenize", {"prompt": text, "model": MODEL}).json()
    assert r["tokens"] == tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.max_model_len
    ids = r["tokens"] + [tokenizer.eos_token_id]
    back = _post(server, "/detokenize", {"tokens": ids}).json()
    assert back == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert _post(server, "/detokenize", {"tokens": [10**6]}).status_code == 400
    assert _post(server, "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}).status_code == 400
    assert _post(server, "/tokenize", {"prompt": "x", "model": "other"}).status_code == 404
    assert httpx.get(f"{server}/version").json() == {"version": ppspec.__version__}
    for method in ("GET", "POST"):  # vLLM's /ping answers as /health
        r = httpx.request(method, f"{server}/ping")
        assert r.status_code == 200 and r.json() == httpx.get(f"{server}/health").json()


def test_cli_version(capsys):
    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ppspec {ppspec.__version__}"


def test_access_log_line_per_request(server, engine, caplog):
    with caplog.at_level(logging.INFO, logger="ppspec.router.access"):
        ok = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "seed": 2})
        bad = _post(server, "/v1/completions", {"prompt": "hi", "temperature": -1})
        streamed = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 3, "stream": True})
        httpx.get(f"{server}/health")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "ppspec.router.access"]
    assert len(lines) == 4, lines
    usage = ok.json()["usage"]
    assert f'"POST /v1/completions" 200 prompt_tokens={usage["prompt_tokens"]} ' \
           f'completion_tokens={usage["completion_tokens"]} ' in lines[0]
    assert bad.status_code == 400 and '"POST /v1/completions" 400 - ' in lines[1]
    assert streamed.status_code == 200
    chat_tokens = sum(len(v) for v in engine.outputs.values()) - usage["completion_tokens"]
    assert f'"POST /v1/chat/completions" 200 prompt_tokens=' in lines[2]
    assert f"completion_tokens={chat_tokens} " in lines[2]
    assert '"GET /health" 200 - ' in lines[3]
    assert all(line.endswith("s") and line.startswith("127.0.0.1:") for line in lines)


def test_openai_client_with_extra_body(server, engine):
    """The SDK's ``extra_body`` (how clients send vLLM's fields) reaches the server."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, metadata={"a": "b"}, store=False,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "include_stop_str_in_output": True})
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_prompt_logprobs_against_transformers(make_ckpt, stream):
    """``echo`` with ``logprobs`` on a real engine (PP2 over in-process stages, prefill in
    chunks of 5 tokens so that the stage's chunk boundary is crossed): the prompt tokens'
    log-probabilities and top alternatives are transformers' on the same checkpoint."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppspec.router.engine import Engine
    from ppspec.router.pipeline import InProcessPipeline

    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio1")
    tok = AutoTokenizer.from_pretrained(path)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    k = 2
    with torch.no_grad():
        ref = torch.log_softmax(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(
            torch.tensor([prompt])).logits[0].float(), dim=-1)
    pipe = InProcessPipeline.build(path, 2, max_rows=4, kv_tokens=256)

    async def run():
        engine = Engine(pipe, model_name="t", tokenizer=tok, chunk_size=5)
        await engine.start()
        app = build_app(engine, "t")
        body = dict(prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=k, stream=stream)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            r = await c.post("/v1/completions", json=body)
        for t in engine._tasks:
            t.cancel()
        return r

    r = asyncio.run(run())
    assert r.status_code == 200, r.text
    if stream:
        choices = [c for ev in _events(r.text) for c in ev["choices"]]
        lp = {key: [x for c in choices if c["logprobs"] for x in c["logprobs"][key]]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        text = "".join(c["text"] for c in choices)
    else:
        lp, text = r.json()["choices"][0]["logprobs"], r.json()["choices"][0]["text"]
    n = len(prompt)
    assert len(lp["token_logprobs"]) == n + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref[j - 1, prompt[j]].item() for j in range(1, n)]
    assert lp["token_logprobs"][1:n] == pytest.approx(want, abs=2e-4)
    for j in range(1, n):
        top = torch.topk(ref[j - 1], k)
        want_top: dict = {}
        for i, v in zip(top.indices.tolist(), top.values.tolist()):  # first of tokens that read alike
            want_top.setdefault(tok.decode([i]), v)
        want_top.setdefault(tok.decode([prompt[j]]), ref[j - 1, prompt[j]].item())
        got = lp["top_logprobs"][j]
        assert got.keys() == want_top.keys() and list(got.values()) == pytest.approx(list(want_top.values()), abs=2e-4)
    assert text.startswith(tok.decode(prompt))  # vLLM's echo of ids: special tokens written out
    assert lp["text_offset"][:n] == sorted(lp["text_offset"][:n])  # offsets walk through the prompt text


def test_generation_config_gives_the_sampling_defaults(tmp_path):
    """vLLM's ``--generation-config auto`` (its default): the checkpoint's
    generation_config.json fields that differ from transformers' defaults become the
    sampling of requests that leave them out; ``max_new_tokens`` the default ``max_tokens``."""
    from ppspec.router.start import generation_defaults

    assert generation_defaults(str(tmp_path)) == ({}, None)  # no file: vLLM's own defaults
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.0,
        "eos_token_id": [2, 0], "max_new_tokens": 77}))
    assert generation_defaults(str(tmp_path)) == ({"temperature": 0.6, "top_p": 0.95, "top_k": 20}, 77)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 2}))
    assert generation_defaults(str(tmp_path)) == ({}, None)


def test_sampling_defaults_apply_to_fields_a_request_leaves_out(tokenizer):
    """A request without ``temperature`` / ``top_p`` / ``top_k`` / ``min_p`` /
    ``repetition_penalty`` samples with the server's defaults (the checkpoint's
    generation_config.json); a field the request gives, 0 included, is the request's."""
    engine = FakeEngine(tokenizer)
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.05}
    app = build_app(engine, served_model_name=MODEL, sampling_defaults=defaults, max_tokens_cap=9)
    with run_server(app) as url:
        r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 1})
        assert r.status_code == 200, r.text
        ((_, params),) = engine.calls.values()
        assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
            (0.6, 0.95, 20, 0.01, 1.05)
        assert params.max_tokens == 9
        engine.reset()
        r = _post(url, "/v1/completions", {"prompt": "hi", "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0,
                                           "repetition_penalty": 1, "max_tokens": 12})
        assert r.status_code == 200, r.text
        ((_, params),) = engine.calls.values()
        assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
            (0.0, 1.0, -1, 0.0, 1.0)
        assert params.max_tokens == 12


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_without_include_usage_adds_no_usage(server, path):
    """vLLM reads ``continuous_usage_stats`` only with ``include_usage`` (its
    ``include_continuous_usage = include_usage and continuous_usage_stats``): alone, no chunk
    carries a usage, as without stream_options."""
    body = {"max_tokens": 8, "seed": 3, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    body |= {"messages": [{"role": "user", "content": "the fox"}]} if "chat" in path else {"prompt": "the fox"}
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    events = _events(r.text)
    assert events and all(ev.get("usage") is None for ev in events), events
    assert all(ev["choices"] for ev in events)  # and no usage chunk
