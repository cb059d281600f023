"""The OpenAI-compatible HTTP layer (router/api/), driven by the official ``openai`` client.

The engine is a fake that really generates: it walks the token ids of a fixed text (with
multi-byte characters and EOS markers) from a position drawn from (prompt, seed), a few
tokens per update as speculation would, with made-up log-probabilities. The tokenizer is a
tiny byte-level BPE trained here with ``tokenizers`` (ChatML template, ``<|im_end|>`` EOS),
so nothing is downloaded. The app is served by uvicorn (uvloop) on a free loopback port in a
background thread. Expected values are always derived from the engine's record of what it
generated and from the tokenizer, never written down.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ppspec.router.api import build_app, serve_http
from ppspec.router.detokenize import TextStream, TokenPieces, window_decoder
from ppspec.router.protocol import AsyncEngine, CompletionRequest
from ppspec.router.types import (
    ContextLengthError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
    StageDownError,
    TokenLogprob,
)

pytestmark = pytest.mark.timeout(120)

MODEL = "ppspec-test"
MAX_MODEL_LEN = 384
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The BPE merges are learnt from mostly-ASCII text, so the CJK characters and emoji of the
# generated text stay split over several byte tokens.
TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog while the pipeline commits its state.",
    "Every stage keeps a recurrent state per request and writes it to a stable row.",
    "Speculative decoding verifies several draft tokens in one forward pass.",
    "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9, \u00fcber gr\u00f6\u00dfe.",
] * 4
GEN_TEXT = (
    "Every stage commits the accepted state of its own micro-batch. "
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3082\u5c11\u3057\u3042\u308a\u307e\u3059\u3002 Caf\u00e9 cr\u00e8me \u2713 done. "
    "<|im_end|>"
    "The quick brown fox \U0001f98a jumps over the lazy dog \U0001f436, twice \u2014 \u00fcber schnell. "
    "\u6570\u5b66\u3068\u8a00\u8449\u3002 Rows are stable; positions are not. \u2605\u2605 "
    "<|im_end|>"
    "Speculation verifies drafts: \u03b1\u03b2\u03b3 \u0434\u0430 \u043d\u0435\u0442, r\u00e9sum\u00e9 na\u00efve. "
    "\u4e2d\u6587\u5b57\u7b26\u4e32\u3002 The end is near \U0001f680 but not yet. "
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    return hf


class FakeEngine:
    """Deterministic stand-in for router/engine.py, with fault switches."""

    def __init__(self, tokenizer):
        self.model_name = "fake/tiny-chatml"
        self.tokenizer = tokenizer
        self.max_model_len = MAX_MODEL_LEN
        self.text_ids = tokenizer.encode(GEN_TEXT)
        self.eos_id = tokenizer.eos_token_id
        self.vocab = len(tokenizer)
        self.health_loops: list[str] = []
        self.reset()

    def reset(self) -> None:
        self.delay = 0.0  # seconds per update
        self.queue_full = False
        self.stage_down_after: int | None = None  # tokens yielded before StageDownError
        self.healthy = (True, "3 of 3 stages up")
        self.sampled_outside_top = False  # logprobs: the sampled token ranks below the top k
        self.calls: dict[str, tuple[list[int], SamplingParams]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[TokenLogprob]] = {}
        self.finish: dict[str, str] = {}
        self.aborted: list[str] = []
        self.active: set[str] = set()
        self._abort_flags: set[str] = set()
        self._unseeded = 0

    def _rng(self, prompt, params: SamplingParams) -> random.Random:
        if params.temperature == 0:
            key = ("greedy", tuple(prompt))
        elif params.seed is not None:
            key = ("seeded", tuple(prompt), params.seed)
        else:
            self._unseeded += 1
            key = ("unseeded", self._unseeded)
        return random.Random(repr(key))

    def _logprob(self, tid: int, k: int) -> TokenLogprob:
        lp = -0.05 - 0.1 * (tid % 13)
        top = [(tid, lp)] + [((tid + 7 * j) % self.vocab, lp - 0.25 * j) for j in range(1, k)]
        if self.sampled_outside_top:  # a temperature draw of an unlikely token
            top = [((tid + 7 * j) % self.vocab, lp + 0.25 * j) for j in range(k, 0, -1)]
        return TokenLogprob(tid, lp, top[:k])

    async def generate(self, request_id, prompt_token_ids, params: SamplingParams):
        if self.queue_full:
            raise QueueFullError("request queue is full (8 waiting)")
        if self.stage_down_after == 0:
            raise StageDownError("stage 1 (127.0.0.1:50052) is unreachable")
        params.validate()
        prompt = list(prompt_token_ids)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ContextLengthError(len(prompt), params.max_tokens, self.max_model_len)
        self.calls[request_id] = (prompt, params)
        self.outputs[request_id] = []
        self.logprobs[request_id] = []
        self.active.add(request_id)
        rng = self._rng(prompt, params)
        pos = rng.randrange(len(self.text_ids))
        made = self.outputs[request_id]
        try:
            while True:
                await asyncio.sleep(self.delay)
                if request_id in self._abort_flags:
                    self.finish[request_id] = "abort"
                    yield RequestOutput(request_id, [], "abort", len(prompt), len(made))
                    return
                if self.stage_down_after is not None and len(made) >= self.stage_down_after:
                    raise StageDownError("stage 1 (127.0.0.1:50052) stopped answering")
                new, finish = [], None
                for _ in range(rng.choice([1, 1, 2, 3])):
                    tid = self.text_ids[pos % len(self.text_ids)]
                    pos += 1
                    new.append(tid)
                    made.append(tid)
                    counts = len(made) >= params.min_tokens
                    if counts and ((tid == self.eos_id and not params.ignore_eos) or tid in params.stop_token_ids):
                        finish = "stop"
                    elif len(made) >= params.max_tokens:
                        finish = "length"
                    if finish:
                        break
                lps = None
                if params.logprobs is not None:
                    lps = [self._logprob(t, params.logprobs) for t in new]
                    self.logprobs[request_id] += lps
                if finish:
                    self.finish[request_id] = finish
                yield RequestOutput(request_id, new, finish, len(prompt), len(made), lps)
                if finish:
                    return
        finally:
            self.active.discard(request_id)

    async def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        self.aborted.append(request_id)
        self._abort_flags.add(request_id)

    def health(self):
        self.health_loops.append(type(asyncio.get_running_loop()).__module__)
        return self.healthy

    # test helpers
    def only_call(self) -> tuple[str, list[int], SamplingParams]:
        assert len(self.calls) == 1, list(self.calls)
        rid, (prompt, params) = next(iter(self.calls.items()))
        return rid, prompt, params


@contextlib.contextmanager
def run_server(app):
    """uvicorn (uvloop) on a free loopback port in a daemon thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, loop="uvloop", log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_for(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture(scope="module")
def server(engine):
    with run_server(build_app(engine, served_model_name=MODEL, max_request_bytes=1 << 20)) as url:
        yield url


@pytest.fixture(autouse=True)
def _fresh_engine(engine):
    engine.reset()
    yield


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=30)


def extra(obj, name):
    """A ppspec extension field of an openai response object."""
    return (obj.model_extra or {}).get(name)


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def collect_completion_stream(stream):
    texts, ids, finish, usage, chunks = {}, {}, {}, None, []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(extra(c, "token_ids") or [])
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, ids, finish, usage, chunks


def collect_chat_stream(stream):
    texts, ids, finish, usage, chunks, roles = {}, {}, {}, None, [], {}
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
                assert c.index not in texts, "role must come in the first chunk of a choice"
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            ids.setdefault(c.index, []).extend(extra(c, "token_ids") or [])
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, ids, finish, usage, chunks, roles


# --------------------------------------------------------------------------------------
# Basics
# --------------------------------------------------------------------------------------


def test_fake_engine_satisfies_protocol(engine):
    assert isinstance(engine, AsyncEngine)


def test_models_health_metrics(client, server, engine):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")

    r = httpx.get(server + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    engine.healthy = (False, "stage 2 (10.0.0.3:50051) is down")
    r = httpx.get(server + "/health")
    assert r.status_code == 503
    body = r.json()
    assert body["detail"] == engine.healthy[1]
    assert body["error"]["message"] == engine.healthy[1] and body["error"]["type"] == "service_unavailable"

    for path in ("/metrics", "/metrics/"):
        r = httpx.get(server + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert "# HELP" in r.text
        r = httpx.post(server + path, content=b"x")
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
        assert "not allowed" in r.json()["error"]["message"]
    assert httpx.head(server + "/metrics").status_code == 200
    engine.healthy = (True, "ok")
    r = httpx.head(server + "/health")
    assert r.status_code == 200 and r.content == b""
    engine.healthy = (False, "stage 2 (10.0.0.3:50051) is down")
    assert httpx.head(server + "/health").status_code == 503


def test_completion_params_usage_and_token_ids(client, engine, tokenizer):
    prompt = "The quick brown fox"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0.7, top_p=0.9, seed=5,
        presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={"5": 2.5, "17": -100},
        extra_body={"top_k": 20, "min_p": 0.05, "min_tokens": 3, "ignore_eos": True, "return_token_ids": True,
                    "stop_token_ids": [7], "repetition_penalty": 1.1})
    rid, prompt_ids, params = engine.only_call()
    assert prompt_ids == tokenizer.encode(prompt)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (0.7, 0.9, 20, 0.05, 5)
    assert (params.max_tokens, params.min_tokens, params.ignore_eos, params.stop_token_ids) == (12, 3, True, [7])
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.25, 1.1)
    assert params.logit_bias == {5: 2.5, 17: -100.0}
    assert params.logprobs is None

    (choice,) = r.choices
    ids = extra(choice, "token_ids")
    assert ids == engine.outputs[rid]
    assert extra(choice, "prompt_token_ids") == prompt_ids
    assert choice.text == decode(tokenizer, ids)
    assert choice.finish_reason == engine.finish[rid]
    assert (choice.finish_reason == "length") == (len(ids) == 12)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == len(prompt_ids) + len(ids)
    assert r.model == MODEL and r.object == "text_completion" and r.id.startswith("cmpl-")


def test_defaults_temperature_and_max_tokens(client, engine, tokenizer):
    r = client.completions.create(model=MODEL, prompt="Every stage", extra_body={"ignore_eos": True})
    rid, prompt_ids, params = engine.only_call()
    assert params.temperature == 1.0 and params.seed is None
    assert params.max_tokens == MAX_MODEL_LEN - len(prompt_ids)  # the context left
    assert r.usage.completion_tokens == params.max_tokens == len(engine.outputs[rid])
    assert r.choices[0].finish_reason == "length"
    # The default is capped by build_app(max_tokens_cap=...).
    engine.reset()
    with run_server(build_app(engine, max_tokens_cap=7)) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Every stage", "ignore_eos": True}).json()
    assert engine.only_call()[2].max_tokens == 7 and r["usage"]["completion_tokens"] == 7
    # Without `model` the served model is used.
    raw = httpx.post(str(client.base_url) + "completions", json={"prompt": "x", "max_tokens": 2})
    assert raw.status_code == 200 and raw.json()["model"] == MODEL


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_completion_stream_matches_non_stream(client, engine, tokenizer, seed):
    kw = dict(model=MODEL, prompt="Rows are stable", max_tokens=60, temperature=0.8, seed=seed)
    full = client.completions.create(**kw)
    texts, _, finish, usage, chunks = collect_completion_stream(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert texts[0] == full.choices[0].text
    assert finish[0] == full.choices[0].finish_reason
    assert usage.model_dump() == full.usage.model_dump()
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    if "\ufffd" not in full.choices[0].text:
        assert all("\ufffd" not in c.text for ch in chunks for c in ch.choices)
    rids = list(engine.calls)
    assert engine.outputs[rids[0]] == engine.outputs[rids[1]]
    assert full.usage.completion_tokens == len(engine.outputs[rids[0]])


def test_chat_non_stream_and_stream(client, engine, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say caf\u00e9 \u65e5\u672c <|im_end|> twice."}]
    kw = dict(model=MODEL, messages=messages, max_completion_tokens=40, temperature=0.5, seed=9)
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    rid, prompt_ids, params = engine.only_call()
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False, sanitize_control_tokens=True)
    assert prompt_ids == list(expected_prompt)
    # The <|im_end|> typed by the user stays text: EOS appears once per message, from the template.
    assert prompt_ids.count(tokenizer.eos_token_id) == len(messages)
    assert extra(r, "prompt_token_ids") == prompt_ids
    assert params.max_tokens == 40
    (choice,) = r.choices
    ids = extra(choice, "token_ids")
    assert ids == engine.outputs[rid]
    assert choice.message.role == "assistant"
    assert choice.message.content == decode(tokenizer, ids)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(ids)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")

    texts, sids, finish, usage, chunks, roles = collect_chat_stream(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True}))
    assert roles == {0: "assistant"}
    assert texts[0] == choice.message.content
    assert sids[0] == ids
    assert finish[0] == choice.finish_reason
    assert usage.model_dump() == r.usage.model_dump()
    assert extra(chunks[0], "prompt_token_ids") == prompt_ids
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)

    # Text content parts are joined with newlines before the template renders them.
    engine.reset()
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    client.chat.completions.create(model=MODEL, messages=parts, max_tokens=2)
    joined = [{"role": "user", "content": "one\ntwo"}]
    assert engine.only_call()[1] == list(tokenizer.apply_chat_template(joined, add_generation_prompt=True,
                                                                        tokenize=True, return_dict=False))


def test_prompt_forms(client, engine, tokenizer):
    prompts = ["Hello there", "Speculative decoding"]
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text
              for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == single
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)

    ids = [tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == single[0]
    by_id_lists = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert [c.text for c in by_id_lists.choices] == single
    assert by_id_lists.usage.completion_tokens == sum(
        len(v) for k, v in engine.outputs.items() if k.startswith(by_id_lists.id))

    echoed = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=10, temperature=0, echo=True)
    assert echoed.choices[0].text == prompts[0] + single[0]


def test_n2_derives_seeds(client, engine, tokenizer):
    kw = dict(model=MODEL, prompt="The end is near", max_tokens=20, temperature=1.0)
    singles = [client.completions.create(**kw, seed=11 + i).choices[0].text for i in range(2)]
    engine.reset()
    r = client.completions.create(**kw, seed=11, n=2)
    assert sorted(p.seed for _, p in engine.calls.values()) == [11, 12]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == singles
    assert r.usage.completion_tokens == sum(len(v) for v in engine.outputs.values())
    assert r.usage.prompt_tokens == len(tokenizer.encode(kw["prompt"]))  # counted once

    texts, _, finish, usage, _ = collect_completion_stream(
        client.completions.create(**kw, seed=11, n=2, stream=True, stream_options={"include_usage": True}))
    assert [texts[0], texts[1]] == singles and set(finish) == {0, 1}
    assert usage.completion_tokens == r.usage.completion_tokens

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, seed=3,
                                          max_tokens=8)
    assert [c.index for c in chat.choices] == [0, 1]


DEMO_CHECKPOINT = pathlib.Path(__file__).resolve().parent.parent / "models" / "qwen35-demo"


TOKENIZERS_UNDER_TEST = [
    pytest.param(make_tokenizer, id="tiny-bpe"),
    pytest.param(lambda: AutoTokenizer.from_pretrained(str(DEMO_CHECKPOINT), local_files_only=True),
                 id="qwen35-demo"),
]


@pytest.mark.parametrize("load", TOKENIZERS_UNDER_TEST)
def test_detokenizer_units(load):
    """TextStream releases exactly decode(ids), one whole character at a time; TokenPieces
    gives each token's exact bytes (byte-level tokenizers)."""
    tok = load()
    prompt = tok.encode("Prompt: ")
    ids = tok.encode(GEN_TEXT.replace("<|im_end|>", " "))
    full = decode(tok, ids)
    stream = TextStream(tok, prompt, [])
    parts = []
    for t in ids:
        stream.add(t)
        parts.append(stream.take())
    parts.append(stream.finish())
    assert "".join(parts) == full
    assert all("\ufffd" not in p for p in parts)
    pieces = TokenPieces(tok)
    if pieces.byte_level:
        assert b"".join(bytes(pieces(t)[1]) for t in ids) == full.encode("utf-8")
    # A stop string made of a multi-byte character cuts the text right before it.
    char = next(c for c in full if len(c.encode()) == 3)
    stream = TextStream(tok, prompt, [char])
    out = []
    for t in ids:
        if stream.add(t):
            break
        out.append(stream.take())
    out.append(stream.take())
    assert "".join(out) == full[:full.index(char)] and stream.stop_str == char
    # a round's several tokens at once (MTP): the same text; a stop string ends the choice at
    # the token that completes it, past min_tokens only
    rng = random.Random(1)
    for stops, min_tokens in (([], 0), ([char], 0), ([char], len(ids))):
        stream, parts, i, taken = TextStream(tok, prompt, stops, min_tokens=min_tokens), [], 0, []
        while i < len(ids) and not stream.stopped:
            chunk = ids[i: i + rng.randrange(1, 6)]
            taken.append(stream.add_many(chunk))
            i += taken[-1]
            parts.append(stream.take())
        parts.append(stream.finish())
        if stops and not min_tokens:
            stop_at = next(k for k in range(1, len(ids) + 1) if char in decode(tok, ids[:k]))
            assert i == stop_at and "".join(parts) == full[:full.index(char)]
        else:
            assert i == len(ids) and "".join(parts) == full and not stream.stopped
        assert all("\ufffd" not in p for p in parts)


@pytest.mark.parametrize("load", TOKENIZERS_UNDER_TEST)
def test_the_window_decoder_is_the_tokenizers_decode(load):
    """``window_decoder`` (the backend's decode on streaming's hot path) gives what
    ``tokenizer.decode`` gives, special tokens kept or skipped, on random windows of ids; a
    tokenizer class with its own ``decode`` is called through it."""
    tok = load()
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for skip in (True, False):
        fast = window_decoder(tok, skip)
        for _ in range(300):
            ids = [rng.choice(special) if special and rng.random() < 0.1 else rng.randrange(len(tok))
                   for _ in range(rng.randrange(1, 12))]
            assert fast(ids) == tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), ids

    class Shouting(type(tok)):
        def decode(self, ids, **kw):
            return super().decode(ids, **kw).upper()

    tok.__class__ = Shouting
    assert window_decoder(tok, True)(tok.encode("abc def")) == "ABC DEF"


@pytest.mark.parametrize("load", TOKENIZERS_UNDER_TEST)
def test_stop_strings_count_only_after_min_tokens(load):
    """vLLM's rule: an occurrence of a stop string that a token within the first
    ``min_tokens`` completes does not stop; the first one completed later does."""
    tok = load()
    prompt = tok.encode("Prompt: ")
    ids = tok.encode(GEN_TEXT.replace("<|im_end|>", " "))
    full = decode(tok, ids)
    stop = "e"
    ends = [i + 1 for i, c in enumerate(full) if c == stop]
    assert len(ends) >= 3
    for min_tokens in (0, 5, len(ids) // 2, len(ids)):
        held = len(decode(tok, ids[:min_tokens]))  # text of the first min_tokens tokens
        later = [e for e in ends if e > held]
        stream = TextStream(tok, prompt, [stop], min_tokens=min_tokens)
        out = []
        for t in ids:
            if stream.add(t):
                break
            out.append(stream.take())
        out.append(stream.take() if stream.stopped else stream.finish())
        if later:
            assert "".join(out) == full[:later[0] - 1] and stream.stop_str == stop, min_tokens
        else:
            assert "".join(out) == full and not stream.stopped, min_tokens


def test_a_stop_string_within_min_tokens_stays_ignored_beside_a_longer_one():
    """Stop strings of different lengths: one completed within ``min_tokens`` must not be
    found by the next token's search (only matches ending in the new text count)."""

    class Chars:  # token i decodes to the text TEXTS[i]
        TEXTS = ["ab", "c", "d"]

        def decode(self, ids, **kw):
            return "".join(self.TEXTS[i] for i in ids)

        def convert_ids_to_tokens(self, ids):
            return [self.TEXTS[i] for i in ids]

    for stops in (["ab"], ["ab", "zzzzz"], ["zzzzz", "ab"]):
        stream = TextStream(Chars(), [], stops, min_tokens=1)
        assert not any(stream.add(t) for t in (0, 1, 2)), stops
        assert stream.take() + stream.finish() == "abcd" and not stream.stopped, stops


# --------------------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------------------


def _baseline(client, tokenizer, prompt, seed, max_tokens=80):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=seed,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = extra(r.choices[0], "token_ids")
    assert r.choices[0].text == decode(tokenizer, ids)
    return r.choices[0].text, ids


def _tokens_until(tokenizer, ids, stop):
    """How many tokens the engine must produce before ``stop`` appears in the text."""
    return next(m for m in range(1, len(ids) + 1) if stop in decode(tokenizer, ids[:m]))


def _check_stop(client, engine, tokenizer, prompt, seed, stops, full, ids, max_tokens=80):
    first = min((full.find(s), s) for s in stops if s in full)
    expected_text = full[:first[0]]
    m = _tokens_until(tokenizer, ids, first[1])
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=seed, stop=stops,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    engine.reset()
    r = client.completions.create(**kw)
    (choice,) = r.choices
    rid = next(iter(engine.calls))
    assert choice.text == expected_text
    assert choice.finish_reason == "stop"
    assert extra(choice, "stop_reason") == first[1]
    assert extra(choice, "token_ids") == ids[:m]
    assert r.usage.completion_tokens == m
    assert rid in engine.aborted
    assert wait_for(lambda: rid not in engine.active)

    engine.reset()
    texts, sids, finish, usage, chunks = collect_completion_stream(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert texts[0] == expected_text and finish[0] == "stop" and sids[0] == ids[:m]
    assert usage.completion_tokens == m
    assert all("\ufffd" not in c.text for ch in chunks for c in ch.choices)
    assert next(iter(engine.calls)) in engine.aborted

    engine.reset()
    chat_kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, seed=seed,
                   extra_body={"ignore_eos": True, "return_token_ids": True})
    base = client.chat.completions.create(**chat_kw)
    cfull = base.choices[0].message.content
    hits = [(cfull.find(s), s) for s in stops if s in cfull]
    engine.reset()
    cr = client.chat.completions.create(**chat_kw, stop=stops)
    if hits:
        assert cr.choices[0].message.content == cfull[:min(hits)[0]] and cr.choices[0].finish_reason == "stop"
    else:
        assert cr.choices[0].message.content == cfull
    return expected_text


def test_stop_string_spanning_two_tokens(client, engine, tokenizer):
    prompt = "Every stage"
    for seed in range(20):
        full, ids = _baseline(client, tokenizer, prompt, seed)
        for k in range(2, len(ids)):
            head = decode(tokenizer, ids[:k])
            if (not head or head.endswith("\ufffd") or len(full) <= len(head)
                    or decode(tokenizer, ids[:k - 1]) == head or not full.startswith(head)):
                continue
            stop = head[-1] + full[len(head)]  # last char of token k-1, first char of token k
            if full.find(stop) == len(head) - 1 and "\ufffd" not in stop:
                text = _check_stop(client, engine, tokenizer, prompt, seed, [stop], full, ids)
                assert len(text) == len(head) - 1
                return
    pytest.fail("no stop string spanning two tokens found")


def test_stop_string_multibyte_character(client, engine, tokenizer):
    prompt = "Speculation verifies"
    for seed in range(40):
        full, ids = _baseline(client, tokenizer, prompt, seed)
        for k in range(1, len(ids)):
            head = decode(tokenizer, ids[:k])
            if not head.endswith("\ufffd"):
                continue
            at = len(head.rstrip("\ufffd"))  # a character whose bytes span tokens k-1 and k
            char = full[at]
            if len(char.encode("utf-8")) < 2 or at + 1 >= len(full):
                continue
            # the character alone, and the character with the next one
            _check_stop(client, engine, tokenizer, prompt, seed, [char], full, ids)
            _check_stop(client, engine, tokenizer, prompt, seed, [full[at:at + 2]], full, ids)
            return
    pytest.fail("no multi-byte character split over tokens found")


def test_stop_strings_earliest_wins_and_held_back_text_is_released(client, engine, tokenizer):
    prompt = "The quick"
    full, ids = _baseline(client, tokenizer, prompt, seed=4)
    a, b = full[10:13], full[30:33]
    assert a not in full[:10], "the fake engine's text must not repeat here (it is deterministic)"
    _check_stop(client, engine, tokenizer, prompt, 4, [b, a], full, ids)

    # A stop string that starts like the text but never completes: all text arrives, no stop.
    never = full[5:9] + "\x00never"
    engine.reset()
    texts, _, finish, _, _ = collect_completion_stream(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=80, seed=4, stop=never, stream=True,
        extra_body={"ignore_eos": True}))
    assert texts[0] == full and finish[0] == "length"
    assert not engine.aborted

    # held-back text makes no empty chunk: each chunk carries text or the finish reason
    engine.reset()
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=80, seed=4, stop=never,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks and all(c.choices[0].text or c.choices[0].finish_reason for c in chunks)


# --------------------------------------------------------------------------------------
# Logprobs and token ids
# --------------------------------------------------------------------------------------


def test_completion_top_logprobs_hold_the_sampled_token(client, engine):
    """OpenAI's legacy completions: "the API will always return the logprob of the sampled
    token, so there may be up to logprobs+1 elements": also when it is not among the top k."""
    engine.sampled_outside_top = True
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, seed=3, temperature=0.7, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    for tok, top, value in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
        assert tok in top and len(top) <= 3 and max(top.values()) > value  # two likelier ones, then it
        if "\ufffd" not in tok:  # byte pieces of different ids share the text "\ufffd"
            assert top[tok] == pytest.approx(value)


def test_completion_logprobs_shape(client, engine, tokenizer):
    kw = dict(model=MODEL, prompt="Caf\u00e9", max_tokens=15, seed=2, logprobs=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**kw)
    rid, _, params = engine.only_call()
    assert params.logprobs == 3
    (choice,) = r.choices
    lp = choice.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs == pytest.approx([x.logprob for x in engine.logprobs[rid]])
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, top, value, off in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, lp.text_offset):
        assert top[tok] == pytest.approx(value)  # the fake ranks the sampled token first
        if "\ufffd" not in tok:
            assert choice.text[off:].startswith(tok)

    engine.reset()
    stream_tokens, stream_lps = [], []
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.logprobs:
                stream_tokens += c.logprobs.tokens
                stream_lps += c.logprobs.token_logprobs
    assert stream_tokens == lp.tokens and stream_lps == pytest.approx(lp.token_logprobs)


def test_chat_logprobs_shape(client, engine, tokenizer):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "emoji please"}], max_tokens=30, seed=8,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.chat.completions.create(**kw)
    rid, _, params = engine.only_call()
    assert params.logprobs == 2
    (choice,) = r.choices
    content = choice.logprobs.content
    ids = extra(choice, "token_ids")
    assert len(content) == len(ids) == r.usage.completion_tokens
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in engine.logprobs[rid]])
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    special = set(tokenizer.all_special_ids)
    text_bytes = b"".join(bytes(c.bytes) for c, t in zip(content, ids) if t not in special)
    assert text_bytes == choice.message.content.encode("utf-8")  # exact bytes, even of split characters

    engine.reset()
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                streamed += c.logprobs.content
    assert [(c.token, c.bytes) for c in streamed] == [(c.token, c.bytes) for c in content]

    engine.reset()
    plain = client.chat.completions.create(model=MODEL, messages=kw["messages"], max_tokens=5, logprobs=True)
    assert engine.only_call()[2].logprobs == 0
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_completion_tokens": 0, "echo": False}, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0, "echo": True},
     "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ("completions", {"prompt": "hi", "structured_outputs": {"regex": "a+", "structural_tag": "{}"}},
     "structured_outputs"),
    ("completions", {"prompt": "hi", "structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ("completions", {"prompt": "hi", "guided_json": 3}, "guided_json"),
    ("completions", {"prompt": "hi", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ("completions", {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": "x"},
     "chat_template_kwargs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs"),
    ("chat/completions", {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
                          "add_generation_prompt": False}, "continue_final_message"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "no"},
     "add_generation_prompt"),
    ("completions", {"prompt": []}, None),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [10**6]}, "prompt"),
    ("completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 5}, "min_tokens"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, None),
    ("completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"prompt": "\ud800"}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("chat/completions", {"messages": "hello"}, "messages"),
    ("completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 1000}, "n"),
    ("completions", {"prompt": "hi", "seed": "x"}, "seed"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"prompt": "hi", "stop": ["a"] * 17}, "stop"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("completions", {"prompt": "hi", "presence_penalty": -3}, "presence_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "hi", "logit_bias": {"-1": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"100000": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"7" * 5000: 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "repetition_penalty": 1e-40}, "repetition_penalty"),
    ("completions", {"prompt": "hi", "min_tokens": 100000}, "min_tokens"),
    ("completions", {"prompt": "hi", "best_of": 3}, None),
    ("completions", {"prompt": "hi", "suffix": "x"}, None),
    ("completions", {"prompt": 42}, "prompt"),
    ("completions", {"prompt": [[]]}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 3, "max_completion_tokens": 3}, None),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format"),
    ("chat/completions", {}, "messages"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_bad_requests_get_400(server, path, body, param):
    # json.dumps escapes non-ASCII, so a lone surrogate travels as the JSON escape "\\ud800".
    r = httpx.post(f"{server}/v1/{path}", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert not err["message"].startswith("Value error")
    if param is not None:
        assert err["param"] == param
        assert f"{param}: {param}:" not in err["message"], err["message"]  # the location named once


@pytest.mark.parametrize("raw,ctype", [
    (b"{not json", "application/json"),
    (b'{"prompt": "\xff\xfe"}', "application/json"),
    (b'{"prompt": "hi"}', "text/plain"),
    (b"[1, 2]", "application/json"),
    (b'{"prompt": "hi", "temperature": NaN}', "application/json"),
    (b"", "application/json"),
])
def test_unparseable_bodies_get_400(server, client, raw, ctype):
    r = httpx.post(f"{server}/v1/completions", content=raw, headers={"content-type": ctype})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    if raw == b"":
        assert "body is missing" in r.json()["error"]["message"]
    # ... and the server still answers.
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_cache_flush_without_a_prefix_cache_says_what_turns_it_on(server):
    r = httpx.post(f"{server}/v1/cache/flush")  # the fake engine has no prefix cache
    assert r.status_code == 400
    assert "every stage started with --prefix-cache-gb" in r.json()["error"]["message"]


def test_large_body_gets_413(server):
    r = httpx.post(f"{server}/v1/completions", content=b'{"prompt": "' + b"a" * (10 << 20) + b'"}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_context_length_error(client, engine, tokenizer):
    long_prompt = "stage " * MAX_MODEL_LEN
    n_prompt = len(tokenizer.encode(long_prompt))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert f"{n_prompt} in the prompt" in err["message"] and "5 for the completion" in err["message"]
    assert str(MAX_MODEL_LEN) in err["message"]

    msgs = [{"role": "user", "content": "hello"}]
    n_chat = len(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_MODEL_LEN)
    assert f"{n_chat} in the messages" in e.value.body["message"] or f"{n_chat} in the prompt" in e.value.body["message"]
    assert f"{MAX_MODEL_LEN} for the completion" in e.value.body["message"]
    assert e.value.body["param"] == "max_tokens"  # the prompt fits: the completion asked too much
    assert not engine.calls  # rejected before the engine allocated anything


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-5" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}], stream=True)


@pytest.mark.parametrize("body,status", [
    ({"prompt": "Hello", "model": "\ud800"}, 404),
    ({"prompt": "Hello", "model": "a\udfff\ud800b"}, 404),
    ({"prompt": "Hello", "\ud800": 1}, 400),
    ({"prompt": "Hello", "stop": ["\udc80"]}, 400),
    ({"prompt": "Hello", "logit_bias": {"\ud800": 1}}, 400),
])
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_lone_surrogates_in_any_field_never_break_the_answer(server, path, body, status):
    """A JSON string may hold a lone surrogate, which UTF-8 cannot encode: an error message
    quoting it must still render (a 4xx, not a 500), and the connection keeps serving."""
    if path == "chat/completions":
        body = {k: v for k, v in body.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=server) as http:  # one keep-alive connection for both requests
        r = http.post(f"/v1/{path}", content=json.dumps(body | {"max_tokens": 2}),
                      headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
        if r.status_code == 404:
            assert err["code"] == "model_not_found" and "\\ud800" in err["message"]
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "Hello", "bad_words": ["ok", "b\ud800"]}, "bad_words"),
    ("/v1/completions", {"prompt": "Hello", "guided_choice": ["yes", "n\udfffo"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "Hello", "structured_outputs": {"choice": ["\ud800"]}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi\ud800"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "\udc80"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": "\ud800"}},
     "chat_template_kwargs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi\ud800"}]}, "messages"),
])
def test_lone_surrogates_in_text_the_server_reads_are_a_400_before_the_engine(server, engine, path, body, param):
    """Every field whose text reaches the tokenizer, the chat template or a grammar is
    checked as the prompt is: a lone surrogate (which UTF-8 cannot encode) is a 400 naming
    the field, before the engine sees the request, not a 500 from the tokenizer nor a choice
    constraint of text that no token sequence spells."""
    r = httpx.post(f"{server}{path}", content=json.dumps(body | {"max_tokens": 2}),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] == f"{param} is not valid UTF-8 text", err
    assert not engine.calls
    # surrogate pairs (an emoji written as two escapes, as json.dumps writes it) are text
    ok = httpx.post(f"{server}/v1/completions", content=json.dumps({"prompt": "hi \U0001f680", "max_tokens": 2,
                                                                    "bad_words": ["\U0001f680"]}),
                    headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_bad_words_beyond_their_character_bound_are_a_400_before_the_engine(server, engine, path):
    """Every step of a request carries its bad words' token sequences to every stage and the
    last stage matches each at every verified position: 1024 words of ~460 characters (a
    0.5 MB body, valid under every other bound) slowed every other request 15x. Their
    characters in all are bounded (protocol.MAX_BAD_WORDS_CHARS): beyond, a 400 naming
    bad_words before the engine sees the request; at the bound, served."""
    from ppspec.router.protocol import MAX_BAD_WORDS_CHARS

    base = {"prompt": "Hello"} if path == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    word = "x" * 16
    at_bound = [word] * (MAX_BAD_WORDS_CHARS // len(word))
    assert sum(map(len, at_bound)) == MAX_BAD_WORDS_CHARS
    for words in ([word * 30] * 1024, at_bound[:-1] + [word + "y"]):
        r = httpx.post(f"{server}/v1/{path}", json=base | {"max_tokens": 2, "bad_words": words})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "bad_words" and f"at most {MAX_BAD_WORDS_CHARS} characters" in err["message"], err
        assert not engine.calls
    ok = httpx.post(f"{server}/v1/{path}", json=base | {"max_tokens": 2, "bad_words": at_bound})
    assert ok.status_code == 200, ok.text


def test_api_key_401(engine):
    with run_server(build_app(engine, served_model_name=MODEL, api_key="sekrit")) as url:
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        right = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        assert right.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
        assert httpx.get(url + "/health").status_code == 200  # probes need no key


@pytest.mark.parametrize("stream", [False, True])
def test_queue_full_429(client, engine, stream):
    engine.queue_full = True
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=stream)
    assert e.value.status_code == 429 and "queue is full" in e.value.body["message"]
    assert e.value.body["type"] == "rate_limit_error"


@pytest.mark.parametrize("stream", [False, True])
def test_stage_down_503_before_first_token(client, engine, stream):
    engine.stage_down_after = 0
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream)
    assert e.value.status_code == 503
    assert e.value.body["type"] == "service_unavailable" and "stage 1" in e.value.body["message"]


def test_stage_down_mid_stream(client, server, engine):
    engine.stage_down_after = 5
    got = []
    with pytest.raises(openai.APIError) as e:
        for chunk in client.completions.create(model=MODEL, prompt="hi", max_tokens=50, stream=True,
                                               extra_body={"ignore_eos": True}):
            got.append(chunk)
    assert got and "stage 1" in e.value.message

    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=10,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert err["type"] == "service_unavailable" and "stage 1" in err["message"]
    assert all("choices" in json.loads(d) for d in data[:-2])

    # Non-streaming: the whole request fails with 503.
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=50, extra_body={"ignore_eos": True})
    assert e.value.status_code == 503


# --------------------------------------------------------------------------------------
# Disconnects
# --------------------------------------------------------------------------------------


def test_streaming_client_disconnect_aborts(client, engine):
    engine.delay = 0.02
    stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=300, n=2, stream=True,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)
    stream.close()
    rids = set(engine.calls)
    assert len(rids) == 2
    assert wait_for(lambda: rids <= set(engine.aborted)), engine.aborted
    assert wait_for(lambda: not engine.active)
    assert all(len(engine.outputs[r]) < 300 for r in rids)


def test_non_streaming_client_disconnect_aborts(server, engine):
    engine.delay = 0.02
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/chat/completions", timeout=0.5,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "ignore_eos": True})
    assert wait_for(lambda: len(engine.calls) == 1)
    rid = next(iter(engine.calls))
    assert wait_for(lambda: rid in engine.aborted)
    assert wait_for(lambda: not engine.active)


def test_streaming_client_gone_before_its_first_token_aborts(server, engine):
    """One choice is pulled by its writer's task (``Fanout._pull``): a client that leaves
    while the server still waits for the first token cancels that pull, which aborts the
    engine request; the close that follows waits for it and leaves nothing running."""
    engine.delay = 1.0
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", f"{server}/v1/completions", timeout=0.3,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True,
                                "ignore_eos": True}) as r:
            r.read()
    assert wait_for(lambda: len(engine.calls) == 1)
    rid = next(iter(engine.calls))
    assert wait_for(lambda: rid in engine.aborted)
    assert wait_for(lambda: not engine.active)
    assert len(engine.outputs.get(rid, [])) < 3


def test_concurrent_requests_and_disconnects_leave_nothing_running(server, engine, tokenizer):
    engine.delay = 0.005

    async def main():
        ai = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=30)

        async def whole(i):
            r = await ai.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=20, seed=i,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            return r.choices[0].text, extra(r.choices[0], "token_ids"), r.usage.completion_tokens

        async def streamed(i):
            text = ""
            async for chunk in await ai.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=20, seed=i,
                    stream=True, extra_body={"ignore_eos": True}):
                text += "".join(c.delta.content or "" for c in chunk.choices)
            return text

        async def leaver(i):
            stream = await ai.completions.create(model=MODEL, prompt=f"leaver {i}", max_tokens=300, stream=True,
                                                 extra_body={"ignore_eos": True})
            async for _ in stream:
                break
            await stream.close()

        results = await asyncio.gather(*[whole(i) for i in range(12)], *[streamed(i) for i in range(12)],
                                       *[leaver(i) for i in range(6)])
        await ai.close()
        return results

    results = asyncio.run(main())
    for text, ids, n in results[:12]:
        assert text == decode(tokenizer, ids) and n == len(ids) == 20
    assert all(isinstance(t, str) and t for t in results[12:24])
    assert wait_for(lambda: not engine.active), engine.active
    leavers = {rid for rid, (prompt, _) in engine.calls.items() if decode(tokenizer, prompt).startswith("leaver")}
    assert len(leavers) == 6 and set(engine.aborted) == leavers


# --------------------------------------------------------------------------------------
# serve_http
# --------------------------------------------------------------------------------------


def test_serve_http_runs_on_uvloop(engine):
    import uvloop

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    stop = threading.Event()

    async def main():
        shutdown = asyncio.Event()
        server = asyncio.ensure_future(serve_http(build_app(engine), "127.0.0.1", port, log_level="warning",
                                                  shutdown=shutdown))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        shutdown.set()
        await asyncio.wait_for(server, 10)

    thread = threading.Thread(target=uvloop.run, args=(main(),), daemon=True)
    thread.start()
    try:
        def up():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(up, timeout=15)
        assert engine.health_loops[-1].startswith("uvloop")
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models")
        assert r.json()["data"][0]["id"] == engine.model_name
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()  # serve_http returned once `shutdown` was set


def test_a_value_of_no_union_form_names_the_forms(server):
    """``prompt`` is a string, a list of strings, of token ids or of token-id lists: a number
    matches none, and the message says what would (not only the first branch's complaint)."""
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": 123})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["message"].startswith("prompt: expected "), err
    assert "str" in err["message"] and "list[int]" in err["message"], err


def test_chat_history_with_a_tool_call_and_null_content(client, engine, tokenizer):
    """An assistant turn that only called a tool (``content: null``, as OpenAI clients send
    it) renders as an empty turn, not the text "None" or a template error; the call's JSON
    ``arguments`` reach the template as the object they encode."""
    from ppspec.router.protocol import ChatMessage

    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert r.choices[0].message.content is not None
    (prompt, _), = engine.calls.values()
    text = tokenizer.decode(prompt)
    assert text == ("<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
                    "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n"), text
    rendered = ChatMessage(**messages[1]).to_template()
    assert rendered["content"] == "" and rendered["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # the request is not modified
    for raw in ("[1, 2]", "not json"):  # not an object: passed as sent
        m = ChatMessage(role="assistant", tool_calls=[{"function": {"name": "f", "arguments": raw}}]).to_template()
        assert m["tool_calls"][0]["function"]["arguments"] == raw


def test_chat_history_holding_a_returned_message_dump(client, engine, tokenizer):
    """The OpenAI SDK pattern of appending ``choices[0].message`` (or its ``model_dump()``,
    which carries refusal / annotations / audio / function_call as null) to the history:
    accepted, and rendered as the plain message."""
    first = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    for turn in (dumped, first.choices[0].message):
        engine.reset()
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}, turn, {"role": "user", "content": "Then?"}],
            max_tokens=4)
        assert r.choices[0].message.content is not None
        (prompt, _), = engine.calls.values()
        assert tokenizer.decode(prompt) == (
            f"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n{first.choices[0].message.content}<|im_end|>\n"
            "<|im_start|>user\nThen?<|im_end|>\n<|im_start|>assistant\n")


def test_a_grammar_is_built_off_the_event_loop(client, engine, monkeypatch):
    """A big schema's grammar takes seconds to build (xgrammar, which releases the GIL; a
    600k-entry enum: 4-7 s) and used to build on the event loop, holding every other
    client's stream meanwhile. The build is held on a gate that opens once a plain
    request has been answered: on the event loop it would hold that request, and the gate
    would time out."""
    import ppspec.router.structured as structured

    answered, events = threading.Event(), []
    build = structured._json_grammar

    def held(schema):
        events.append("build starts")
        events.append("plain answered" if answered.wait(20) else "gate timed out")
        return build(schema)

    monkeypatch.setattr(structured, "_json_grammar", held)
    with ThreadPoolExecutor(1) as pool:
        constrained = pool.submit(client.completions.create, model=MODEL, prompt="hi", max_tokens=4,
                                  extra_body={"guided_json": {"type": "object"}})
        assert wait_for(lambda: events, 10)
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
        answered.set()
        constrained.result()
    assert events == ["build starts", "plain answered"]
    grammars = [p.grammar for _, p in engine.calls.values() if p.grammar is not None]
    assert grammars == [structured.request_grammar(CompletionRequest(prompt="hi", guided_json={"type": "object"}))]


@pytest.mark.parametrize("path,body,nulls", [
    ("completions", {"prompt": "hi"}, ("stream", "n", "echo", "logprobs")),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, ("stream", "n", "logprobs", "top_logprobs")),
])
def test_an_explicit_null_of_a_nullable_openai_field_means_its_default(server, path, body, nulls):
    """OpenAI's API (and vLLM's) take ``null`` for ``stream``, ``n``, ``logprobs`` and
    completions' ``echo``: clients that write every field (OpenAPI-generated ones) send them
    so. The answer is the one without the fields."""
    base = dict(body, model=MODEL, max_tokens=4, seed=3, temperature=1.0)
    want = httpx.post(f"{server}/v1/{path}", json=base, timeout=30)
    got = httpx.post(f"{server}/v1/{path}", json=dict(base, **{k: None for k in nulls}), timeout=30)
    assert want.status_code == 200, want.text
    assert got.status_code == 200, got.text
    w, g = want.json(), got.json()
    assert g["object"] == w["object"] and len(g["choices"]) == len(w["choices"]) == 1
    assert g["choices"] == w["choices"] and g["usage"] == w["usage"]


@pytest.mark.parametrize("choice", ["bogus", {"type": "function"}, {"type": "function", "function": {}}, 5])
def test_a_bad_tool_choice_says_which_forms_are_accepted(server, choice):
    r = httpx.post(f"{server}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": choice,
        "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice", err
    assert err["message"].startswith('tool_choice: expected "none", "auto", "required" or {"type": "function", '
                                     '"function": {"name": ...}}'), err


@pytest.mark.parametrize("include", [False, True])
def test_the_token_that_stops_a_choice_is_not_in_its_text(client, engine, tokenizer, include):
    """As vLLM: the stop token (EOS, or one of ``stop_token_ids``) that ends a choice stays
    in its token ids and log-probabilities but not in its text, unless
    ``include_stop_str_in_output`` (then its text ends the choice's text)."""
    stop_id = engine.text_ids[len(engine.text_ids) // 2]  # a token of the generated text
    stopped = 0
    for skip in (True, False):
        for stream in (False, True):
            for seed in range(6):
                body = {"ignore_eos": True, "stop_token_ids": [stop_id], "return_token_ids": True,
                        "include_stop_str_in_output": include, "skip_special_tokens": skip}
                kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=60, temperature=1.0, seed=seed,
                          logprobs=1, extra_body=body)
                if stream:
                    texts, ids, finish, _, _ = collect_completion_stream(client.completions.create(stream=True, **kw))
                    text, ids, finish = texts[0], ids[0], finish[0]
                else:
                    (choice,) = client.completions.create(**kw).choices
                    text, ids, finish = choice.text, extra(choice, "token_ids"), choice.finish_reason
                rid = list(engine.calls)[-1]
                assert ids == engine.outputs[rid]
                kept = ids if (include or finish != "stop") else ids[:-1]
                assert finish != "stop" or ids[-1] == stop_id
                want = tokenizer.decode(kept, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
                assert text == want, (seed, stream, finish)
                stopped += finish == "stop"
    assert stopped  # some seeds met the stop token
    # EOS, written out (skip_special_tokens false): the same rule
    eos_stops = 0
    for seed in range(6):
        (choice,) = client.completions.create(
            model=MODEL, prompt="The quick brown fox", max_tokens=300, temperature=1.0, seed=seed,
            extra_body={"return_token_ids": True, "skip_special_tokens": False,
                        "include_stop_str_in_output": include}).choices
        ids = extra(choice, "token_ids")
        if choice.finish_reason == "stop":
            eos_stops += 1
            assert ids[-1] == tokenizer.eos_token_id
            want = tokenizer.decode(ids if include else ids[:-1], skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False)
            assert choice.text == want, seed
    assert eos_stops  # and some met EOS


def test_top_logprobs_0_without_logprobs_is_accepted(server, engine):
    """vLLM refuses ``top_logprobs`` without ``logprobs: true`` only when it asks for
    alternatives (more than 0): clients that write ``top_logprobs: 0`` with ``logprobs:
    false`` get an answer without log-probabilities."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "seed": 1,
            "temperature": 1.0}
    want = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    got = httpx.post(f"{server}/v1/chat/completions", json=dict(body, logprobs=False, top_logprobs=0), timeout=30)
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == want.json()["choices"]
    assert got.json()["choices"][0]["logprobs"] is None
    assert [p.logprobs for _, p in engine.calls.values()] == [None, None]
