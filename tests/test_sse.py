"""The SSE writer of the streaming endpoints (``router/api/sse.py``).

Chunks spliced into a template are the bytes pydantic renders for the same chunk; a served
stream's frames are each a chunk's own pydantic rendering; keep-alive comments go out while
a stream waits; a client gone mid-stream cancels the stream, runs its cleanup and, over the
real engine, frees every row of every stage.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import threading

import httpx
import pytest
import uvloop

from cluster import free_port
from ppspec.router.api import build_app, serve_http
from ppspec.router.api.sse import DONE, SSEResponse, TextChunk, frame
from ppspec.router.protocol import (
    ChatCompletionChunk,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
)
from test_api import MODEL, FakeEngine, make_tokenizer, run_server, wait_for

pytestmark = pytest.mark.timeout(120)

TEXTS = ["", "a", " the", "\u00e9\n\t\r\x00\x1f\x7f", '"\\/', "\u2028\u2029", "\u65e5\u672c\u8a9e", "\U0001f600",
         "</script>", "data: [DONE]\r\n\r\n", "\ufffd\ufeff"]


def _random_texts(n: int) -> list[str]:
    rng = random.Random(0)
    pool = [c for c in range(0x30000) if not 0xD800 <= c < 0xE000]  # every scalar value up to plane 2
    return ["".join(chr(rng.choice(pool if rng.random() < 0.5 else range(0x80))) for _ in range(rng.randrange(12)))
            for _ in range(n)]


BUILDS = {
    "completion": lambda s: CompletionChunk(id="cmpl-1", created=1700000000, model="m/\u00e9",
                                            choices=[CompletionChoice(index=3, text=s)]),
    "chat content": lambda s: ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[
        ChatStreamChoice(index=0, delta=ChatDelta(content=s))]),
    "chat reasoning": lambda s: ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[
        ChatStreamChoice(index=1, delta=ChatDelta(reasoning_content=s))]),
}


@pytest.mark.parametrize("kind", list(BUILDS))
def test_text_chunks_are_the_bytes_pydantic_renders(kind):
    build = BUILDS[kind]
    template = TextChunk(build)
    for text in TEXTS + _random_texts(300):
        assert template(text) == build(text).model_dump_json().encode(), repr(text)


def test_a_template_of_a_field_not_rendered_as_given_is_refused():
    with pytest.raises(ValueError):
        TextChunk(lambda s: CompletionChunk(id="x", created=1, model="m", choices=[]))


def _frames(body: bytes) -> list[bytes]:
    """The events of a stream as a client that splits on a blank line (``\\n\\n``) reads
    them: OpenAI's and vLLM's framing, ``data: <json>\\n\\n``, with no ``\\r`` anywhere."""
    assert body.endswith(b"\n\n") and b"\r" not in body
    return body[:-2].split(b"\n\n")


@pytest.mark.parametrize("path,model", [("/v1/completions", CompletionChunk),
                                        ("/v1/chat/completions", ChatCompletionChunk)])
@pytest.mark.parametrize("extra", [{}, {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                                   {"return_token_ids": True, "n": 2}, {"stop": ["\u00e8"]}])
def test_served_frames_are_each_chunk_as_pydantic_renders_it(path, model, extra):
    engine = FakeEngine(make_tokenizer())
    body = {"model": MODEL, "max_tokens": 40, "seed": 5, "stream": True, **extra}
    body.update({"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    with run_server(build_app(engine, served_model_name=MODEL)) as url:
        r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.headers["cache-control"] == "no-store" and r.headers["x-accel-buffering"] == "no"
    frames = _frames(r.content)
    assert frames[-1] + b"\n\n" == DONE == b"data: [DONE]\n\n" and len(frames) > 3
    texts = ""
    for f in frames[:-1]:
        assert f.startswith(b"data: ")
        data = f[len(b"data: "):]
        chunk = model.model_validate_json(data)
        assert chunk.model_dump_json().encode() == data
        for c in chunk.choices:
            texts += c.text if model is CompletionChunk else (c.delta.content or "")
    assert texts  # what the text is: tests/test_api.py (streamed equal to whole answers)


def test_an_error_mid_stream_is_one_frame_then_done():
    """An engine failure after the first tokens: an error event, then ``data: [DONE]``, each
    framed ``data: ...\\n\\n`` as every other event."""
    engine = FakeEngine(make_tokenizer())
    engine.stage_down_after = 5
    body = {"model": MODEL, "max_tokens": 50, "stream": True, "prompt": "hi", "ignore_eos": True}
    with run_server(build_app(engine, served_model_name=MODEL)) as url:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200
    frames = _frames(r.content)
    assert frames[-1] == b"data: [DONE]" and all(f.startswith(b"data: {") for f in frames[:-1])
    error = json.loads(frames[-2][len(b"data: "):])
    assert error["error"]["message"] == "stage 1 (127.0.0.1:50052) stopped answering", error
    assert all("choices" in json.loads(f[len(b"data: "):]) for f in frames[:-2]) and len(frames) >= 3


class _Asgi:
    """A fake ASGI server side: records what is sent; ``receive`` waits for ``gone``."""

    def __init__(self):
        self.sent: list[dict] = []
        self.gone = asyncio.Event()
        self.on_send = None

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if self.on_send is not None:
            self.on_send(message)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


PING = re.compile(rb": ping - \d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\+00:00\n\n")


def test_pings_go_out_while_the_stream_waits():
    async def run():
        asgi = _Asgi()
        pinged = asyncio.Event()
        asgi.on_send = lambda m: m.get("body", b"").startswith(b": ping") and pinged.set()

        async def frames():
            yield frame(b'{"a":1}')
            await pinged.wait()  # the next frame comes only after a ping
            yield frame(b'{"b":2}')

        await asyncio.wait_for(SSEResponse(frames(), ping_s=0.01)({"type": "http"}, asgi.receive, asgi.send), 30)
        return asgi

    asgi = asyncio.run(run())
    assert asgi.sent[0]["type"] == "http.response.start" and asgi.sent[0]["status"] == 200
    bodies = asgi.bodies()
    assert bodies[0] == b'data: {"a":1}\n\n'
    assert all(PING.fullmatch(b) for b in bodies[1:-2]) and len(bodies) >= 4
    assert bodies[-2:] == [b'data: {"b":2}\n\n', b""]
    assert asgi.sent[-1]["more_body"] is False


def test_a_client_gone_mid_stream_cancels_it_and_runs_its_cleanup():
    async def run():
        asgi = _Asgi()
        asgi.on_send = lambda m: m.get("body") and asgi.gone.set()  # the client leaves after the first frame
        done: list[str] = []

        async def frames():
            try:
                yield frame(b"1")
                await asyncio.Event().wait()  # the engine has nothing more yet
                yield frame(b"2")
            finally:
                done.append("frames closed")

        async def background():
            done.append("background")

        from starlette.background import BackgroundTask

        await asyncio.wait_for(SSEResponse(frames(), BackgroundTask(background))({"type": "http"}, asgi.receive,
                                                                               asgi.send), 30)
        return asgi, done

    asgi, done = asyncio.run(run())
    assert asgi.bodies() == [b"data: 1\n\n"]
    assert done == ["frames closed", "background"]


def test_a_client_gone_mid_stream_frees_its_rows_on_every_stage(make_ckpt):
    """The real engine over two in-process stages behind ``serve_http``: a client that reads
    two chunks and closes aborts its request, which leaves no request or row on any stage."""
    import torch
    from transformers import AutoTokenizer

    from ppspec.router.engine import Engine
    from ppspec.router.pipeline import InProcessPipeline

    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio1")
    pipe = InProcessPipeline.build(path, 2, max_rows=4, kv_tokens=512)
    port = free_port()
    loop = uvloop.new_event_loop()
    stop = asyncio.Event()
    engines: list[Engine] = []
    aborts: list[tuple[str, str]] = []

    async def serve():
        engine = Engine(pipe, model_name="t", tokenizer=AutoTokenizer.from_pretrained(path))
        engines.append(engine)
        abort = engine.abort

        async def recorded_abort(request_id: str, finish_reason: str = "abort") -> None:
            aborts.append((request_id, finish_reason))
            await abort(request_id, finish_reason)

        engine.abort = recorded_abort  # type: ignore[method-assign]
        await engine.start()
        try:
            await serve_http(build_app(engine, "t"), "127.0.0.1", port, log_level="warning", shutdown=stop)
        finally:
            await engine.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(up, timeout=60)
        body = {"prompt": [3, 1, 4, 1, 5, 9, 2, 6], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got: list[dict] = []
            for line in lines:
                if line.startswith("data: {"):
                    got.append(json.loads(line[6:]))
                if len(got) == 2:
                    break
        assert [c["choices"][0]["finish_reason"] for c in got] == [None, None]
        engine = engines[0]

        def freed() -> bool:
            return (all(not r.rows_in_use for r in pipe.runners) and not engine.scheduler.requests
                    and not engine.scheduler.waiting)

        assert wait_for(freed, timeout=60), [r.rows_in_use for r in pipe.runners]
        # ended by the client's leaving (the pump's abort, and the engine's own as its stream closes), not by max_tokens
        assert {reason for _, reason in aborts} == {"abort"}
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
    assert not thread.is_alive()


def test_a_stream_cancelled_by_the_server_runs_its_cleanup():
    """uvicorn's graceful-shutdown timeout cancels the response's task: the generator's
    cleanup (where an engine request left running is aborted) still runs."""
    async def run():
        asgi = _Asgi()
        sent = asyncio.Event()
        asgi.on_send = lambda m: m.get("body") and sent.set()
        done: list[str] = []

        async def frames():
            try:
                yield frame(b"1")
                await asyncio.Event().wait()
            finally:
                done.append("frames closed")

        task = asyncio.ensure_future(SSEResponse(frames())({"type": "http"}, asgi.receive, asgi.send))
        await asyncio.wait_for(sent.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return done

    assert asyncio.run(run()) == ["frames closed"]
