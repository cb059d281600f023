"""The HTTP edge: uvicorn's h11 protocol with the limits no client may stretch.

uvicorn (as of 0.55) bounds neither the time a client takes to send its request headers nor
its body: a connection that sends half a request line, or a body shorter than its
``Content-Length``, holds a connection and an ASGI task for ever. h11 also takes a request
with both ``Content-Length`` and ``Transfer-Encoding`` (RFC 9112, 6.1: the latter wins), which
lets a proxy in front and this server disagree on where a request ends. ``EdgeProtocol``
(``uvicorn.Config(http=...)``) adds, per connection:

* a read deadline: ``read_timeout`` seconds from a request's first byte (or from the
  connection's start) until its whole body has arrived; past it, 408 and the connection
  closes (the app waiting for the body sees a disconnect);
* 400 for ``Content-Length`` with ``Transfer-Encoding``, and 413 for a declared
  ``Content-Length`` over ``max_body`` bytes, both before any byte of the body is read;
* OpenAI-style JSON bodies for these and for h11's own malformed-request answers.

Keep-alive idleness between requests stays uvicorn's (``timeout_keep_alive``).
"""
from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body
from .guard import DEFAULT_MAX_REQUEST_BYTES

READ_TIMEOUT_S = 30.0
"""Seconds a client may take to send one request, headers and body."""

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 413: b"Content Too Large", 431: b"Request Header Fields Too Large"}


class _EdgeError(h11.RemoteProtocolError):
    """A request refused at the edge (uvicorn answers h11's errors with ``send_400_response``)."""


class _StrictConnection(h11.Connection):
    """h11's server side, refusing ambiguous framing and declared oversized bodies as soon as
    the request head is parsed; remembers the last protocol error for the JSON answer."""

    def __init__(self, max_body: int, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_body = max_body
        self.refusal: tuple[int, str] | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.refusal = (e.error_status_hint, f"malformed HTTP request: {e}")
            raise
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _ in event.headers}
            if b"transfer-encoding" in names and b"content-length" in names:
                self.refusal = (400, "a request with both Content-Length and Transfer-Encoding is ambiguous")
                raise _EdgeError(self.refusal[1])
            for name, value in event.headers:
                if name.lower() == b"content-length" and int(value) > self.max_body:  # h11 checked it is digits
                    self.refusal = (413, f"request body is larger than {self.max_body} bytes "
                                         f"(Content-Length {value.decode()})")
                    raise _EdgeError(self.refusal[1])
        return event


class EdgeProtocol(H11Protocol):
    """``H11Protocol`` with a per-request read deadline, strict framing and JSON refusals."""

    def __init__(self, *args: Any, read_timeout: float = READ_TIMEOUT_S, max_body: int = DEFAULT_MAX_REQUEST_BYTES,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.conn = _StrictConnection(max_body, h11.SERVER, self.conn._max_incomplete_event_size)
        self.read_timeout = read_timeout
        self._deadline: asyncio.TimerHandle | None = None

    # ---- the read deadline: armed while a request is incomplete
    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout, self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that sends nothing is a request that never comes

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._arm()
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()  # the request is in (or the connection is done)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # between requests: uvicorn's keep-alive timeout
            self._disarm()
        elif self.conn.their_state is h11.SEND_BODY:  # a pipelined request, its body still coming
            self._arm()

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        cycle = self.cycle
        what = "request body" if self.conn.their_state is h11.SEND_BODY else "request"
        if cycle is None or not cycle.response_started:
            self._refuse(408, f"the {what} did not arrive within {self.read_timeout:g} s")
        if cycle is not None:  # the app waiting for the body gets a disconnect
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    # ---- answers written here, not by the app
    def _refuse(self, status: int, message: str) -> None:
        body = json.dumps(error_body(message, "invalid_request_error")).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % (status, _REASONS.get(status, b"Error"), len(body)))
        self.transport.write(head + body)

    def send_400_response(self, msg: str) -> None:
        status, message = self.conn.refusal or (400, msg)
        self._refuse(status if status in _REASONS else 400, message)
        self._disarm()
        self.transport.close()


def edge_protocol(read_timeout: float = READ_TIMEOUT_S, max_body: int = DEFAULT_MAX_REQUEST_BYTES) -> Any:
    """The protocol class to pass as ``uvicorn.Config(http=...)``."""
    return functools.partial(EdgeProtocol, read_timeout=read_timeout, max_body=max_body)
