"""The HTTP edge (``router/api/edge.py``, ``router/api/tokenize.py``): no client can stall the
server or another client. The real ``serve_http`` (uvicorn with ``EdgeProtocol``) in front of
the app on the fake engine of ``tests/test_api.py``; raw sockets for the framing cases. No
wall-clock window is asserted: each answer must come before a generous bound (the read
timeout plus many times a recorded baseline round trip), and the server serves afterwards."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvloop

from cluster import free_port, wait_health
from ppspec.router.api import build_app
from ppspec.router.api.app import serve_http
from ppspec.router.api.edge import MAX_HEAD_BYTES, edge_protocol
from test_api import MODEL, FakeEngine, make_tokenizer

READ_TIMEOUT = 1.0
MAX_BODY = 1 << 20


class EdgeServer:
    """``serve_http`` on a free port in a thread of its own, stopped through its ``shutdown`` event."""

    def __init__(self, engine, parser: str = "auto"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(engine, served_model_name=MODEL, max_request_bytes=MAX_BODY)
        self.loop = uvloop.new_event_loop()  # as the router runs it
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, daemon=True, args=(serve_http(
            self.app, "127.0.0.1", self.port, log_level="warning", shutdown=self.stop,
            http=edge_protocol(READ_TIMEOUT, MAX_BODY, parser)),))

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert self.thread.is_alive() and time.monotonic() < deadline, "serve_http did not start"
            time.sleep(0.05)

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(15)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module", params=["httptools", "h11"])
def edge(tokenizer, request):
    """The server on each parser's edge protocol (httptools: the default where installed)."""
    engine = FakeEngine(tokenizer)
    with EdgeServer(engine, request.param) as srv:
        srv.engine = engine
        yield srv


def completion_ok(url) -> float:
    """One normal request; returns its round trip in seconds."""
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=dict(model=MODEL, prompt="hello", max_tokens=3), timeout=30)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def raw(port, data: bytes, bound: float, then: bytes = b"") -> bytes:
    """Send ``data`` (then ``then`` after the first answer bytes, if any) on a fresh
    connection and read until the server closes it, failing past ``bound`` seconds."""
    with socket.create_connection(("127.0.0.1", port), timeout=bound) as s:
        s.sendall(data)
        out = b""
        deadline = time.monotonic() + bound
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                raise AssertionError(f"no close within {bound:.1f} s; got {out[:200]!r}") from None
            except ConnectionResetError:
                return out
            if not chunk:
                return out
            out += chunk


def parse(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), head
    return status, json.loads(body)


CASES = {
    # name: (bytes sent, status, a fragment of the error message)
    "headers never end": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app", 408, "did not arrive"),
    "nothing sent": (b"", 408, "did not arrive"),
    "body shorter than Content-Length": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        b'{"model": ', 408, "request body did not arrive"),
    "Content-Length over the limit": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000000000\r\n\r\n", 413, "larger than 1048576 bytes"),
    "Content-Length and Transfer-Encoding": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 400, "ambiguous"),
    "malformed request line": (b"GARBAGE\r\n\r\n", 400, "malformed HTTP request"),
    "headers over the limit": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 3 * MAX_HEAD_BYTES,
                               431, "larger than"),
}


@pytest.mark.parametrize("case", CASES)
def test_framing_and_stalls_are_answered_and_the_server_serves_on(edge, case):
    data, status, fragment = CASES[case]
    base = completion_ok(edge.url)
    bound = READ_TIMEOUT + 5.0 + 20 * base  # generous: a hang shows as no answer at all
    reply = raw(edge.port, data, bound)
    got, body = parse(reply)
    assert got == status and fragment in body["error"]["message"], (got, body)
    assert body["error"]["type"] == "invalid_request_error"
    assert reply.count(b"HTTP/1.1 ") == 1, reply  # nothing after the refusal was served
    completion_ok(edge.url)


def test_a_slow_but_steady_client_is_still_bounded(edge):
    """A client dribbling header bytes keeps no connection past the read deadline."""
    base = completion_ok(edge.url)
    with socket.create_connection(("127.0.0.1", edge.port)) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        out = b""
        for _ in range(int((READ_TIMEOUT + 5.0 + 20 * base) / 0.1)):
            try:
                s.sendall(b"X-Pad: 1\r\n")
            except OSError:
                break
            s.settimeout(0.1)
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        assert out.startswith(b"HTTP/1.1 408"), (out[:100], time.monotonic() - t0)
    completion_ok(edge.url)


def test_a_prompt_too_long_in_characters_takes_no_tokenizer_worker(edge):
    """Four ~0.9 MB prompts against a 384-token context: each refused (400,
    context_length_exceeded) from its length alone, no encode run; a normal request
    meanwhile is served."""
    pool = edge.app.state.server.tokens
    encoded, orig = [], pool._encode
    pool._encode = lambda texts, add: encoded.append(sum(map(len, texts))) or orig(texts, add)
    long_prompt = "hello world, this is a long prompt. " * 25000
    try:
        async def run():
            async with httpx.AsyncClient(base_url=edge.url, timeout=60) as c:
                longs = [c.post("/v1/completions", json=dict(model=MODEL, prompt=long_prompt, max_tokens=5))
                         for _ in range(4)]
                chat = c.post("/v1/chat/completions", json=dict(model=MODEL, max_tokens=5, messages=[
                    {"role": "user", "content": long_prompt}]))
                short = c.post("/v1/completions", json=dict(model=MODEL, prompt="hi", max_tokens=3))
                return await asyncio.gather(*longs, chat, short)

        *refused, short = asyncio.run(run())
    finally:
        pool._encode = orig
    for r in refused:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert f"no token of this tokenizer stands for more than {pool.max_token_chars} characters" in r.text
    assert short.status_code == 200 and max(encoded) < 100, encoded


def test_a_chat_of_many_short_messages_renders_off_the_loop_and_is_refused_unencoded(edge):
    """400 empty messages: their texts are nothing, their rendering (~9200 characters) is
    more than a 384-token context can hold whatever its tokens: refused (400,
    context_length_exceeded) from the rendered length, rendered on a tokenizer worker, never
    encoded (a 6 MB body of 200k such messages held the event loop ~20 s on 2 cores: a
    render and an encode of 1M tokens); ``/tokenize``, which has no context bound, still
    counts it."""
    pool = edge.app.state.server.tokens
    where, encoded = [], []
    orig_render, orig_encode = pool._render_chat, pool.pieces.encode

    def render(*args):
        where.append(threading.current_thread().name)
        return orig_render(*args)

    pool._render_chat = render
    pool.pieces.encode = lambda tok, text: encoded.append(len(text)) or orig_encode(tok, text)
    messages = [{"role": "user", "content": ""}] * 400
    try:
        r = httpx.post(edge.url + "/v1/chat/completions", json=dict(model=MODEL, max_tokens=5, messages=messages),
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert encoded == [] and where and where[0].startswith("ppspec-tokenize"), (encoded, where)
        t = httpx.post(edge.url + "/tokenize", json=dict(model=MODEL, messages=messages), timeout=60)
        assert t.status_code == 200 and t.json()["count"] > 384, t.text
    finally:
        pool._render_chat, pool.pieces.encode = orig_render, orig_encode
    completion_ok(edge.url)


def test_the_character_bound_never_refuses_a_prompt_that_fits(tokenizer):
    """``max_token_chars`` bounds every token of the vocabulary (and added tokens), so a
    text that fits is never refused by its length: the densest texts, runs of the longest
    token, encode to at least len / bound tokens."""
    from ppspec.router.api.tokenize import TokenizerPool

    pool = TokenizerPool(tokenizer, workers=1)
    vocab = tokenizer.get_vocab()
    longest = max(vocab, key=len)
    text = tokenizer.convert_tokens_to_string([longest]) * 50
    n = len(tokenizer.encode(text, add_special_tokens=False))
    assert len(text) <= n * pool.max_token_chars
    pool.check_fits(len(text), n)  # fits exactly: not refused
    with pytest.raises(ValueError, match="maximum context length is 3 tokens"):
        pool.check_fits(3 * pool.max_token_chars + 1, 3)
    pool.executor.shutdown()


def test_long_encodes_leave_a_worker_to_short_requests(tokenizer):
    """With a context that admits them, long prompts (over SHORT_CHARS) run on all
    tokenizer workers but one, so a short request never queues behind them: with more long
    prompts than workers in flight, the recorded encode spans never overlap more than
    workers - 1 long ones, and the short request is answered."""
    from ppspec.router.api.tokenize import SHORT_CHARS, TOKENIZE_WORKERS

    engine = FakeEngine(tokenizer)
    engine.max_model_len = 1 << 24
    with EdgeServer(engine) as srv:
        pool = srv.app.state.server.tokens
        spans, began, orig = [], [], pool._encode

        def timed(texts, add):
            t0 = time.monotonic()
            began.append(t0)
            out = orig(texts, add)
            spans.append((sum(map(len, texts)), t0, time.monotonic()))
            return out

        pool._encode = timed
        long_prompt = "hello world, this is a long prompt. " * (4 * SHORT_CHARS // 36)
        assert len(long_prompt) > SHORT_CHARS

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as c:
                longs = [asyncio.ensure_future(c.post("/v1/completions", json=dict(
                    model=MODEL, prompt=long_prompt, max_tokens=5))) for _ in range(TOKENIZE_WORKERS + 1)]
                while not began:
                    await asyncio.sleep(0.01)
                short = await c.post("/v1/completions", json=dict(model=MODEL, prompt="hi", max_tokens=3))
                return short, await asyncio.gather(*longs)

        short, longs = asyncio.run(run())
    assert short.status_code == 200 and all(r.status_code == 200 for r in longs), [r.text for r in longs]
    long_spans = [(t0, t1) for n, t0, t1 in spans if n > SHORT_CHARS]
    assert len(long_spans) == TOKENIZE_WORKERS + 1
    most = max(sum(a <= t0 < b for a, b in long_spans) for t0, _ in long_spans)
    assert most <= TOKENIZE_WORKERS - 1, long_spans


def test_short_texts_encode_on_the_event_loop_long_ones_on_workers(tokenizer):
    """Texts up to ``INLINE_CHARS`` are encoded and rendered on the calling thread (the event
    loop, with a tokenizer copy of its own); longer ones on a worker thread. Either way the
    ids are the tokenizer's own, and a tokenizer that cannot be copied is never used on the
    loop beside its one worker."""
    from ppspec.router.api.tokenize import INLINE_CHARS, TokenizerPool

    pool = TokenizerPool(tokenizer, workers=2)
    seen: list[tuple[int, str]] = []
    orig_encode, orig_render = pool._encode, pool._render_chat

    def encode(texts, add):
        seen.append((sum(map(len, texts)), threading.current_thread().name))
        return orig_encode(texts, add)

    def render(messages, tools, kwargs, *rest):
        seen.append((sum(len(m["content"]) for m in messages), threading.current_thread().name))
        return orig_render(messages, tools, kwargs, *rest)

    pool._encode, pool._render_chat = encode, render
    short, long_text = "hello world " * 10, "hello world " * (INLINE_CHARS // 6)
    assert len(short) <= INLINE_CHARS < len(long_text)
    messages = [{"role": "user", "content": short}]

    async def run():
        loop_thread = threading.current_thread().name
        got = [await pool.encode([short]), await pool.encode([long_text]), await pool.encode([short], False),
               await pool.render_chat(messages), await pool.render_chat([{"role": "user", "content": long_text}])]
        return loop_thread, got

    loop_thread, got = asyncio.run(run())
    assert got[0] == [tokenizer.encode(short)] and got[1] == [tokenizer.encode(long_text)]
    assert got[2] == [tokenizer.encode(short, add_special_tokens=False)]
    assert got[3] == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
    where = [name for _, name in seen]
    assert where[0] == where[2] == where[3] == loop_thread
    assert where[1] != loop_thread and where[4] != loop_thread and where[1].startswith("ppspec-tokenize")
    pool.executor.shutdown()

    class Uncopyable:  # the tokenizer's calls, but no deepcopy
        def __init__(self, inner):
            self.inner = inner

        def __deepcopy__(self, memo):
            raise TypeError("no copies")

        def __getattr__(self, name):
            return getattr(self.inner, name)

    shared = TokenizerPool(Uncopyable(tokenizer), workers=4)
    names: list[str] = []
    orig = shared._encode
    shared._encode = lambda texts, add: names.append(threading.current_thread().name) or orig(texts, add)
    assert asyncio.run(shared.encode([short])) == [tokenizer.encode(short)]
    assert names and names[0].startswith("ppspec-tokenize")  # its one worker, never the loop
    shared.executor.shutdown()



_PAUSABLE_SERVER = """import sys
sys.path.insert(0, sys.argv[1])
import uvloop
from test_api import MODEL, FakeEngine, make_tokenizer
from ppspec.router.api import build_app
from ppspec.router.api.app import serve_http
from ppspec.router.api.edge import edge_protocol
app = build_app(FakeEngine(make_tokenizer()), served_model_name=MODEL)
uvloop.run(serve_http(app, "127.0.0.1", int(sys.argv[2]), log_level="warning", timeout_keep_alive=1,
                      http=edge_protocol(30.0, 1 << 20, sys.argv[3])))
"""


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_a_request_sent_while_the_server_is_paused_is_answered(parser):
    """A kept-alive connection's next request, sent while the HTTP server is paused (SIGSTOP)
    past uvicorn's keep-alive timeout, is answered once it resumes (SIGCONT). On resume
    uvloop runs its due timers before it reads the socket, and the keep-alive timeout
    closed the connection with the request unread: the client got a reset and no answer
    (the chat clients of a paused router saw ``ReadError`` for POSTs they cannot retry).
    The server is the real ``serve_http`` on the fake engine, in a process of its own."""
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _PAUSABLE_SERVER, os.path.dirname(os.path.abspath(__file__)),
                             str(port), parser])
    body = json.dumps(dict(model=MODEL, prompt="hello", max_tokens=3)).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))

    def answer(s: socket.socket) -> bytes:
        """One whole response, or what came before the server closed the connection."""
        out = b""
        while True:
            head, sep, rest = out.partition(b"\r\n\r\n")
            if sep and len(rest) >= int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):
                return out
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return out + b"<reset>"
            if not chunk:
                return out + b"<closed>"
            out += chunk

    try:
        wait_health(f"http://127.0.0.1:{port}", 200, timeout=60)
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(request)
            assert answer(s).startswith(b"HTTP/1.1 200"), "the first request"
            for _ in range(3):  # where the pause lands is up to the scheduler: a few times
                proc.send_signal(signal.SIGSTOP)
                while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
                    time.sleep(0.01)  # stopped before the request reaches it
                s.sendall(request)  # on the kept-alive connection, while the server is paused
                time.sleep(2.5)  # past its keep-alive timeout (1 s)
                proc.send_signal(signal.SIGCONT)
                reply = answer(s)
                assert reply.startswith(b"HTTP/1.1 200"), f"the request sent during the pause: {reply[:200]!r}"
            s.sendall(request)  # and the connection serves on
            assert answer(s).startswith(b"HTTP/1.1 200")
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


class _SocketTransport:
    """The transport of an edge protocol under test, over one end of a socket pair: the
    socket for ``unread_bytes``, what is written and whether it was closed."""

    def __init__(self, sock):
        self.sock, self.closed, self.written = sock, False, b""

    def get_extra_info(self, name, default=None):
        return self.sock if name == "socket" else default

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def write(self, data):
        self.written += data


def _uvicorn_config(**kw):
    """A loaded uvicorn config whose app is never called (the tests parse no request)."""
    from uvicorn.config import Config

    async def app(scope, receive, send):
        raise AssertionError

    config = Config(app, **kw)
    config.load()
    return config


@contextlib.contextmanager
def _edge_over_socketpair(parser, config, loop, waiting: bool):
    """An edge protocol whose transport is one end of a socket pair; with ``waiting``, a
    whole request sits unread in it (what a paused server finds when it runs again)."""
    from uvicorn.server import ServerState

    a, b = socket.socketpair()
    with a, b:
        if waiting:
            b.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 2\r\n\r\n{}")
        proto = edge_protocol(30.0, MAX_BODY, parser)(config=config, server_state=ServerState(), app_state={},
                                                     _loop=loop)
        proto.transport = _SocketTransport(a)
        yield proto


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_the_keep_alive_timeout_leaves_a_connection_with_a_request_waiting(parser):
    """The mechanism under the test above, without the scheduler's say: the keep-alive
    timeout firing on a connection whose next request is already in its socket, unread (a
    loop that stalled runs its due timers before it reads), leaves the connection open for
    that read; on an idle connection it closes it as uvicorn does."""
    config = _uvicorn_config(timeout_keep_alive=1)
    loop = asyncio.new_event_loop()
    try:
        for waiting in (True, False):
            with _edge_over_socketpair(parser, config, loop, waiting) as proto:
                proto.timeout_keep_alive_handler()
                assert proto.transport.closed is not waiting, f"request waiting: {waiting}"
    finally:
        loop.close()


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_the_read_deadline_reads_a_request_waiting_in_the_socket_before_it_refuses(parser):
    """The read deadline firing on a connection whose request is already in its socket,
    unread (the HTTP server paused past ``read_timeout``: its due timers run before its
    read), gives the loop that read instead of a 408 "did not arrive"; only once per
    deadline, so that a client is still held to the deadline. A connection with nothing
    waiting gets its 408 at once."""
    config = _uvicorn_config()
    loop = asyncio.new_event_loop()
    try:
        for waiting in (True, False):
            with _edge_over_socketpair(parser, config, loop, waiting) as proto:

                def deadline_fires():  # what the loop does when the armed deadline is due
                    timer = proto._deadline
                    callback, args = timer._callback, timer._args or ()
                    timer.cancel()
                    callback(*args)

                proto._arm()
                deadline_fires()
                if waiting:
                    assert not proto.transport.closed and not proto.transport.written, "refused a request that came"
                    assert proto._deadline is not None, "no deadline left for the read it waits for"
                    deadline_fires()  # the read did not complete it: the deadline holds
                assert proto.transport.written.startswith(b"HTTP/1.1 408") and proto.transport.closed, waiting
    finally:
        loop.close()
