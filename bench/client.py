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

import httpx

_SSE_FIELDS = ("data:", "event:", "id:", "retry:", ":")

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


def _causes(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def describe_http_error(e: httpx.HTTPError) -> str:
    """One line for a transport-level failure (no traceback)."""
    if isinstance(e, httpx.ConnectTimeout):
        return "connection timed out"
    if isinstance(e, httpx.ConnectError):
        for c in _causes(e):
            if isinstance(c, ConnectionRefusedError):
                return "connection refused (is the server running on that port?)"
            if isinstance(c, socket.gaierror):
                return f"cannot resolve the host name ({c.strerror or c})"
        return f"cannot connect ({e})" if str(e) else "cannot connect"
    if isinstance(e, httpx.TimeoutException):
        return "timed out waiting for the server"
    if isinstance(e, httpx.RemoteProtocolError):
        return f"the server broke the HTTP protocol ({e}); is it an HTTP server?"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


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


async def stream_request(
    client: httpx.AsyncClient, url: str, payload: dict, chat: bool, headers: dict | None = None
) -> RequestResult:
    """POST ``payload`` with ``stream: true`` and time the server-sent events."""
    r = RequestResult()
    r.start = st = clock()
    last = st
    seen_event = False
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            ctype = resp.headers.get("content-type", "")
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                r.error = error_message(resp.status_code, body)
                r.non_openai = "html" in ctype
                return r
            if "html" in ctype:
                body = (await resp.aread()).decode("utf-8", "replace")
                r.error = f"not an OpenAI-compatible response (content-type {ctype}): {_snippet(body)}"
                r.non_openai = True
                return r
            lines = resp.aiter_lines()
            async for line in lines:
                line = line.strip()
                if not line:
                    continue
                if not line.startswith(_SSE_FIELDS):
                    r.error = (
                        f"not a server-sent-event stream (content-type {ctype or 'none'}): "
                        f"{_snippet(line)}"
                    )
                    r.non_openai = True
                    return r
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    await _drain(lines)
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    r.error = f"malformed JSON in the stream: {_snippet(data)}"
                    r.non_openai = True
                    return r
                if not isinstance(chunk, dict):
                    r.error = f"unexpected stream event: {_snippet(data)}"
                    r.non_openai = True
                    return r
                seen_event = True
                if chunk.get("error"):
                    r.error = error_message(200, data)
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
    except httpx.HTTPError as e:
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
