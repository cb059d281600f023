"""One streaming request to an OpenAI-compatible server, and its timings.

Timing definitions (the ones vLLM's serving benchmark uses):

* TTFT: from just before the request is sent to the arrival of the first chunk that
  carries generated text (a chat stream's opening role-only chunk does not count).
* ITL: the gaps between successive text-carrying chunks, one sample per gap. A chunk
  may carry several tokens (speculative decoding emits every accepted token of a
  verify round at once, and servers may coalesce), so ITL is a per-*chunk* latency:
  with speculation it is roughly TPOT times the tokens per chunk. ``tokens_per_chunk``
  in the result says how many tokens a chunk carried on average.
* End-to-end latency: from sending the request to the last text-carrying chunk, so that
  e2e = TTFT + sum(ITL) for every request.
* TPOT: (e2e - TTFT) / (output_tokens - 1), per request (undefined for 1 token).

Output tokens are the server's ``usage.completion_tokens`` (we request
``stream_options.include_usage``); failing that, the generated text counted with
``--tokenizer``, or as whitespace words.

Every timestamp is read from ``clock`` (``time.perf_counter``), the one clock of the client and
the runner, so a test can inject its own.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field

import aiohttp

_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")

clock = time.perf_counter  # seconds; module-level so that tests can replace it

# A stream without text is a failed request (as vLLM's benchmark counts it: no TTFT). When
# the usage says tokens were generated, they decode to nothing: ids past the tokenizer's
# vocabulary (a random checkpoint whose vocab_size exceeds its tokenizer's, as bench
# gpu_bench's 1.46B: 32000 ids, the demo tokenizer's 8192) or special tokens. That is the
# checkpoint's output, not a server error; the error says which.
NO_TEXT = "the stream ended without any generated text"
NO_TEXT_TOKENS = (", though the server generated tokens (usage): ids that decode to no text "
                  "(past the tokenizer's vocabulary, or special tokens)")


@dataclass
class RequestResult:
    success: bool = False
    error: str | None = None
    ttft: float | None = None  # seconds
    e2el: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per chunk gap
    num_chunks: int = 0  # chunks that carried text
    parts: list[str] = field(default_factory=list)  # generated text, chunk by chunk
    prompt_tokens: int | None = None  # server usage
    completion_tokens: int | None = None  # server usage
    cached_tokens: int | None = None  # server usage: prompt_tokens_details.cached_tokens (a prefix cache)
    start: float = 0.0  # clock() at send, seconds
    non_openai: bool = False  # the answer was not an OpenAI-style response at all

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _snippet(body: str, n: int = 120) -> str:
    s = " ".join(body.split())
    return repr(s[:n] + ("..." if len(s) > n else ""))


def describe_http_error(e: BaseException) -> str:
    """One line for a transport-level failure (no traceback): an ``aiohttp.ClientError`` or
    a timeout."""
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return "connection timed out"
    if isinstance(e, aiohttp.ClientConnectorError):
        if isinstance(e.os_error, ConnectionRefusedError):
            return "connection refused (is the server running on that port?)"
        if isinstance(e.os_error, socket.gaierror):
            return f"cannot resolve the host name ({e.os_error.strerror or e.os_error})"
        return f"cannot connect ({e.os_error or e})"
    if isinstance(e, (TimeoutError, aiohttp.ServerTimeoutError)):
        return "timed out waiting for the server"
    if isinstance(e, aiohttp.ClientResponseError):  # never raised for a status here: a malformed answer
        what = " ".join(str(e.message).split()[:3])  # aiohttp's parser message spans lines
        return f"the server broke the HTTP protocol ({what}); is it an HTTP server?"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the server closed the connection before it answered"
    text = " ".join(str(e).split())  # one line
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def error_message(status: int, body: str) -> str:
    """One line for a non-200 answer; uses the OpenAI error body when there is one."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return f"HTTP {status}: {err}"
    return f"HTTP {status}: {_snippet(body)}"


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if chat:
        delta = c.get("delta") or {}
        parts = [delta.get(k) for k in ("content", "reasoning_content", "reasoning")]
        return "".join(p for p in parts if isinstance(p, str))
    t = c.get("text")
    return t if isinstance(t, str) else ""


DRAIN_S = 1.0
"""Seconds the client waits after ``[DONE]`` for the response body's end."""


async def _lines(body: aiohttp.StreamReader):
    """The body's lines (bytes, without the newline), however long: aiohttp's own line
    iteration refuses a line over its read buffer, and a chunk with log-probabilities of a
    long round can exceed it."""
    rest = b""
    async for data in body.iter_any():
        *lines, rest = (rest + data).split(b"\n")
        for line in lines:
            yield line
    if rest:
        yield rest


async def _drain(lines) -> None:
    """Read what follows ``[DONE]`` to the body's end (at most ``DRAIN_S`` seconds): a
    response closed before its end cannot give its connection back, and the next request
    would open a new one (~50 ms on a busy client at concurrency 64, docs/PERFORMANCE.md
    "A closed loop's turnaround"; the OpenAI SDK reads a stream to its end too). A server
    that keeps the stream open past ``[DONE]`` costs its connection, not a hung request."""
    try:
        async with asyncio.timeout(DRAIN_S):
            async for _ in lines:
                pass
    except TimeoutError:
        pass


def run(coro):
    """Run the client's coroutine ``coro`` to its end on a new event loop: uvloop's where
    it is installed (the client's own CPU per streamed token is what a benchmark must keep
    below the server's), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def session(timeout: float = 600.0, connect_timeout: float = 10.0) -> aiohttp.ClientSession:
    """The benchmark's HTTP client (call inside the event loop that uses it): connections
    kept alive and opened as needed, never shared by two requests at once (a request finds
    an idle one or opens its own: none waits for another's stream to end); ``timeout``
    seconds without a byte from the server fail a request, ``connect_timeout`` a connect.
    aiohttp, as vLLM's serving benchmark: at concurrency 64 it spent 7-8 us of the client's
    CPU per streamed token where httpx spent 16-17 (docs/PERFORMANCE.md, "The benchmark
    client")."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout),
        connector=aiohttp.TCPConnector(limit=0))


async def stream_request(
    client: aiohttp.ClientSession, url: str, payload: dict, chat: bool, headers: dict | None = None
) -> RequestResult:
    """POST ``payload`` with ``stream: true`` and time the server-sent events."""
    r = RequestResult()
    r.start = st = clock()
    last = st
    seen_event = False
    try:
        async with client.post(url, json=payload, headers=headers) as resp:
            ctype = resp.headers.get("content-type", "")
            if resp.status != 200:
                body = (await resp.read()).decode("utf-8", "replace")
                r.error = error_message(resp.status, body)
                r.non_openai = "html" in ctype
                return r
            if "html" in ctype:
                body = (await resp.read()).decode("utf-8", "replace")
                r.error = f"not an OpenAI-compatible response (content-type {ctype}): {_snippet(body)}"
                r.non_openai = True
                return r
            lines = _lines(resp.content)
            async for line in lines:
                line = line.strip()
                if not line:
                    continue
                if not line.startswith(_SSE_FIELDS):
                    r.error = (
                        f"not a server-sent-event stream (content-type {ctype or 'none'}): "
                        f"{_snippet(line.decode('utf-8', 'replace'))}"
                    )
                    r.non_openai = True
                    return r
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    await _drain(lines)
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    r.error = f"malformed JSON in the stream: {_snippet(data.decode('utf-8', 'replace'))}"
                    r.non_openai = True
                    return r
                if not isinstance(chunk, dict):
                    r.error = f"unexpected stream event: {_snippet(data.decode('utf-8', 'replace'))}"
                    r.non_openai = True
                    return r
                seen_event = True
                if chunk.get("error"):
                    r.error = error_message(200, data.decode("utf-8", "replace"))
                    return r
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    r.prompt_tokens = usage.get("prompt_tokens", r.prompt_tokens)
                    r.completion_tokens = usage.get("completion_tokens", r.completion_tokens)
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                        r.cached_tokens = details["cached_tokens"]
                text = _chunk_text(chunk, chat)
                if text:
                    ts = clock()
                    if r.num_chunks == 0:
                        r.ttft = ts - st
                    else:
                        r.itl.append(ts - last)
                    last = ts
                    r.num_chunks += 1
                    r.parts.append(text)
    except (aiohttp.ClientError, TimeoutError) as e:
        r.error = describe_http_error(e)
        return r
    if not seen_event:
        r.error = "empty response: no server-sent events"
        r.non_openai = True
        return r
    if r.num_chunks == 0:
        r.error = NO_TEXT
        if r.completion_tokens:  # the server did generate: tokens that decode to no text
            r.error += NO_TEXT_TOKENS
        return r
    r.e2el = last - st
    r.success = True
    return r
