"""The HTTP edge: uvicorn's HTTP protocol with the limits no client may stretch.

uvicorn (as of 0.55) bounds neither the time a client takes to send its request headers nor
its body: a connection that sends half a request line, or a body shorter than its
``Content-Length``, holds a connection and an ASGI task for ever. h11 also takes a request
with both ``Content-Length`` and ``Transfer-Encoding`` (RFC 9112, 6.1: the latter wins), which
lets a proxy in front and this server disagree on where a request ends. The edge protocols
(``uvicorn.Config(http=...)``, :func:`edge_protocol`) add, per connection:

* a read deadline: ``read_timeout`` seconds from a request's first byte (or from the
  connection's start) until its whole body has arrived; past it, 408 and the connection
  closes (the app waiting for the body sees a disconnect);
* 400 for ``Content-Length`` with ``Transfer-Encoding``, and 413 for a declared
  ``Content-Length`` over ``max_body`` bytes, both before any byte of the body is read;
* 431 for a request line and headers over ``MAX_HEAD_BYTES`` (h11's own bound);
* OpenAI-style JSON bodies for these and for the parser's own malformed-request answers.

Two parsers, the same limits: ``HttpToolsEdgeProtocol`` over uvicorn's httptools protocol
(llhttp; the default, where httptools is installed: a streamed token's ``send`` is a few
byte joins there, against h11's event objects and state machine; see
docs/PERFORMANCE.md, "CPU: the router's cost per streamed token"), and ``EdgeProtocol``
over its h11 protocol.
Keep-alive idleness between requests stays uvicorn's (``timeout_keep_alive``), except that a connection
whose next request is already waiting in its socket is not closed for idleness (a stalled loop
runs its due timers before it reads: ``_Deadline.timeout_keep_alive_handler``).
"""
from __future__ import annotations

import asyncio
import functools
import json
import sys
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ppspec.sockets import unread_bytes

from .errors import error_body
from .guard import DEFAULT_MAX_REQUEST_BYTES

READ_TIMEOUT_S = 30.0
"""Seconds a client may take to send one request, headers and body."""

MAX_HEAD_BYTES = 16 * 1024
"""Bytes of a request line and headers (uvicorn's default bound for h11)."""

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
            if e.error_status_hint == 431:
                self.refusal = (431, f"request line and headers are larger than {self._max_incomplete_event_size} bytes")
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


_READ_GRACE_S = 0.05
"""Seconds a read deadline that found its request waiting unread gives the loop to read it."""


class _Deadline:
    """The read deadline and the JSON refusal of both edge protocols (their ``loop``,
    ``transport``, ``read_timeout``), armed from a connection's start; placed before the
    uvicorn protocol in the bases. ``_on_deadline`` is each parser's."""

    _deadline: asyncio.TimerHandle | None = None
    _deferred = False  # the deadline found the request waiting unread once and gave the loop a read

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()  # a connection that sends nothing is a request that never comes

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout, self._deadline_due)  # type: ignore[attr-defined]

    def _disarm(self) -> None:
        self._deferred = False
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_due(self) -> None:
        """The read deadline, unless what it waits for is already in the socket, unread: a
        loop that stalled past ``read_timeout`` (the HTTP server paused) runs its due timers
        before it reads, and answered 408 "did not arrive" to a request that had arrived
        whole during the stall. Such a connection gets this loop iteration's read (once per
        deadline: a client is still held to ``read_timeout`` and a few milliseconds)."""
        self._deadline = None
        if not self._deferred and unread_bytes(self.transport) > 0:  # type: ignore[attr-defined]
            self._deferred = True
            self._deadline = self.loop.call_later(_READ_GRACE_S, self._deadline_due)  # type: ignore[attr-defined]
            return
        self._deferred = False
        self._on_deadline()

    def _on_deadline(self) -> None:
        raise NotImplementedError

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's keep-alive timeout, unless a request is already waiting in the socket.

        A loop that stalled past ``timeout_keep_alive`` (the HTTP server paused, SIGSTOP
        then SIGCONT) runs its due timers before it reads the socket (libuv's order; the
        wait that SIGCONT interrupts returns no events): uvicorn then closed a kept-alive
        connection whose next request had arrived during the stall, unread, and the
        client got a reset for a request it cannot retry (a POST). Such a request is read
        in this loop iteration instead, and answered; an idle connection still closes."""
        if unread_bytes(self.transport) > 0:  # type: ignore[attr-defined]
            self.timeout_keep_alive_task = None
            return
        super().timeout_keep_alive_handler()  # type: ignore[misc]

    def _refuse(self, status: int, message: str) -> None:
        body = json.dumps(error_body(message, "invalid_request_error")).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % (status, _REASONS.get(status, b"Error"), len(body)))
        self.transport.write(head + body)  # type: ignore[attr-defined]


class EdgeProtocol(_Deadline, H11Protocol):
    """``H11Protocol`` with a per-request read deadline, strict framing and JSON refusals."""

    def __init__(self, *args: Any, read_timeout: float = READ_TIMEOUT_S, max_body: int = DEFAULT_MAX_REQUEST_BYTES,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.conn = _StrictConnection(max_body, h11.SERVER, self.conn._max_incomplete_event_size)
        self.read_timeout = read_timeout

    # ---- the read deadline: armed while a request is incomplete

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
    def send_400_response(self, msg: str) -> None:
        status, message = self.conn.refusal or (400, msg)
        self._refuse(status if status in _REASONS else 400, message)
        self._disarm()
        self.transport.close()


try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # h11 alone
    httptools = HttpToolsProtocol = None  # type: ignore[assignment,misc]


class _Refused(Exception):
    """A request refused at the edge, raised from a parser callback (httptools turns it
    into the ``HttpParserError`` that uvicorn answers with ``send_400_response``)."""


if HttpToolsProtocol is not None:

    class HttpToolsEdgeProtocol(_Deadline, HttpToolsProtocol):
        """``HttpToolsProtocol`` with the limits of ``EdgeProtocol``.

        llhttp refuses ``Content-Length`` beside ``Transfer-Encoding`` itself; its leniency
        for that is on so that the refusal is this one's (every header is checked as it is
        parsed, and the request refused at the second of the two)."""

        def __init__(self, *args: Any, read_timeout: float = READ_TIMEOUT_S,
                     max_body: int = DEFAULT_MAX_REQUEST_BYTES, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True, lenient_chunked_length=True)
            self.read_timeout, self.max_body = read_timeout, max_body
            self.refusal: tuple[int, str] | None = None
            self._reading = True  # a request is expected or partly in: from the connection's start
            self._in_head = False  # a request has begun and its head is not complete
            self._in_body = False
            self._head_bytes = 0
            self._framing: set[bytes] = set()

        def data_received(self, data: bytes) -> None:
            self._arm()
            super().data_received(data)
            if not self._reading:
                self._disarm()  # the request is in (or the connection is done)
            elif self._in_head and not self.transport.is_closing():
                # a head still incomplete after this read (llhttp holds a header being read
                # whole, unbounded): the read counts whole (a pipelined request's tail in it
                # too: an over-count, never an under-count)
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self.refusal = (431, f"request line and headers are larger than {MAX_HEAD_BYTES} bytes")
                    self.send_400_response("")

        # ---- parser callbacks: what a request has sent so far
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._reading, self._in_head, self._in_body, self._head_bytes = True, True, False, 0
            self._framing = set()

        def on_header(self, name: bytes, value: bytes) -> None:
            lower = name.lower()
            if lower in (b"content-length", b"transfer-encoding"):
                self._framing.add(lower)
                if len(self._framing) == 2:
                    self._refusing(400, "a request with both Content-Length and Transfer-Encoding is ambiguous")
                if lower == b"content-length" and value.strip().isdigit() and int(value) > self.max_body:
                    self._refusing(413, f"request body is larger than {self.max_body} bytes "
                                        f"(Content-Length {value.decode()})")
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head, self._in_body = False, True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._reading = self._in_head = self._in_body = False

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._reading:  # a pipelined request, still coming
                self._arm()
            else:  # between requests: uvicorn's keep-alive timeout
                self._disarm()

        def _refusing(self, status: int, message: str) -> None:
            self.refusal = (status, message)
            raise _Refused(message)

        def _on_deadline(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or not self._reading:
                return
            cycle = self.cycle  # in the body: this request's; in the head: the one before, or None
            what = "request body" if self._in_body else "request"
            if cycle is None or not cycle.response_started or (not self._in_body and cycle.response_complete):
                self._refuse(408, f"the {what} did not arrive within {self.read_timeout:g} s")
            if self._in_body and cycle is not None:  # the app waiting for the body gets a disconnect
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            if self.refusal is None:  # uvicorn calls this while it handles the parser's error
                error = sys.exc_info()[1]
                self.refusal = (400, f"malformed HTTP request: {error or msg}")
            status, message = self.refusal
            self._refuse(status if status in _REASONS else 400, message)
            self._disarm()
            self.transport.close()


def edge_protocol(read_timeout: float = READ_TIMEOUT_S, max_body: int = DEFAULT_MAX_REQUEST_BYTES,
                  parser: str = "auto") -> Any:
    """The protocol class to pass as ``uvicorn.Config(http=...)``. ``parser``: ``httptools``,
    ``h11``, or ``auto`` (httptools where it is installed). Raises ValueError for httptools
    when it is not installed, or another name."""
    if parser == "auto":
        parser = "h11" if HttpToolsProtocol is None else "httptools"
    if parser == "httptools" and HttpToolsProtocol is not None:
        return functools.partial(HttpToolsEdgeProtocol, read_timeout=read_timeout, max_body=max_body)
    if parser == "h11":
        return functools.partial(EdgeProtocol, read_timeout=read_timeout, max_body=max_body)
    raise ValueError(f"HTTP parser {parser!r}: httptools is not installed" if parser == "httptools"
                     else f"unknown HTTP parser {parser!r} (auto, httptools or h11)")
