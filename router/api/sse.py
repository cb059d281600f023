"""The streaming endpoints' server-sent events on raw ASGI: frames, chunk templates, the response.

Streaming is the router's hot path: every generated token of every client goes through
here (docs/PERFORMANCE.md, "CPU: the router's cost per streamed token"). So a frame is
bytes built once (``frame``), a plain text chunk is spliced into a template that pydantic
rendered once per choice (``TextChunk``), and ``SSEResponse`` hands each frame to the
ASGI ``send`` as it is, one message per frame, without a task, lock or timer per event.

The framing is OpenAI's and vLLM's, byte for byte: ``data: <json>\\n\\n`` per event and
``data: [DONE]\\n\\n`` last (clients that split on a blank line, ``\\n\\n``, read it; the
``\\r\\n\\r\\n`` of the sse-starlette writer this replaced they did not). Beyond vLLM, a
``: ping - <UTC time>`` comment goes out every 15 s, frames or not (proxies close idle
connections; SSE clients skip comment lines).
"""
from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel
from pydantic_core import to_json
from starlette.background import BackgroundTask
from starlette.responses import Response

log = logging.getLogger("ppspec.router.api")

PING_S = 15.0
"""Seconds between keep-alive comments (proxies close idle connections)."""

DONE = b"data: [DONE]\n\n"


def frame(data: bytes) -> bytes:
    """One SSE event carrying ``data`` (one line: JSON has no raw line breaks)."""
    return b"data: " + data + b"\n\n"


def ping_frame(now: datetime.datetime) -> bytes:
    """The keep-alive comment at ``now`` (a comment line: clients skip it)."""
    return f": ping - {now}\n\n".encode()


class TextChunk:
    """``model_dump_json`` of one choice's chunks that differ only in one string field.

    ``build(s)`` makes the chunk with ``s`` in that field; it is rendered once by pydantic
    with a marker there, and each chunk is the rendering with the marker's JSON replaced by
    the text's, encoded by ``pydantic_core.to_json`` (the encoder ``model_dump_json`` uses),
    so the bytes are those pydantic would write. Raises ValueError when the marker does not
    appear exactly once (a field whose value is not rendered as the string given)."""

    _MARK = "\u2063ppspec-text\u2063"

    def __init__(self, build: Callable[[str], BaseModel]):
        parts = build(self._MARK).model_dump_json().encode().split(to_json(self._MARK))
        if len(parts) != 2:
            raise ValueError("the chunk does not render its string field once")
        self.head, self.tail = parts

    def __call__(self, text: str) -> bytes:
        return self.head + to_json(text) + self.tail


class SSEResponse(Response):
    """A ``text/event-stream`` response that sends each frame of ``frames`` as it comes.

    Three tasks run per response: the writer (frames, then the closing empty body), the
    disconnect watcher (``receive`` until ``http.disconnect``) and the pinger (a comment
    every ``ping_s`` seconds; 0: none). The first of writer and watcher to end ends the
    others; then ``frames.aclose()`` runs the generator's cleanup whether it ended, failed or
    was cut off by the client (an engine request left running frees its rows there), then
    ``background``. An error of the writer (a bug: the generator's own errors are its
    events) is raised after that, as any app error. At server exit a stream runs until its
    engine requests end (the router's ``on_exit`` ends them first, ``serve_http``) or
    uvicorn's graceful-shutdown timeout cancels it (the same cleanup runs)."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], background: BackgroundTask | None = None,
                 ping_s: float = PING_S):
        self.frames = frames
        self.status_code = 200
        self.background = background
        self.ping_s = ping_s
        self.init_headers({"cache-control": "no-store", "connection": "keep-alive", "x-accel-buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        writer = asyncio.ensure_future(self._write(send))
        watcher = asyncio.ensure_future(self._until_disconnect(receive))
        tasks = [writer, watcher]
        if self.ping_s > 0:
            tasks.append(asyncio.ensure_future(self._ping(send)))
        try:
            await asyncio.wait((writer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.frames.aclose()
        if not writer.cancelled() and writer.exception() is not None:
            raise writer.exception()  # type: ignore[misc]
        if self.background is not None:
            await self.background()

    async def _write(self, send: Any) -> None:
        async for data in self.frames:
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _until_disconnect(receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _ping(self, send: Any) -> None:
        while True:
            await asyncio.sleep(self.ping_s)
            await send({"type": "http.response.body", "body": ping_frame(datetime.datetime.now(datetime.timezone.utc)),
                        "more_body": True})
