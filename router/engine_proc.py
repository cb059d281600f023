"""The engine in a process of its own, the HTTP server in front of it (docs/DESIGN.md,
"Processes").

One event loop used to do both halves of the router: the scheduler driving the stages
(forming micro-batches, the gRPC streams, commits), and per output token the HTTP work
(detokenization, stop strings, one SSE write per token through the ASGI stack). At
concurrency 64 the second half was more than half of that process's CPU (py-spy on the
CPU checkpoint of ``served_vs_engine --tiny``), on the loop a stage waits on between
micro-batches. So ``ppspec router`` runs the :class:`~router.engine.Engine` in a child process
(:func:`run_engine_process`) and serves HTTP in the parent through :class:`EngineClient`,
which has the ``AsyncEngine`` shape of ``router/protocol.py``; the two exchange pickled
messages over a Unix socket pair, the outputs of one micro-batch's requests in one message.

Messages (tuples; the first item names them):

client -> engine: ``("add", request_id, prompt_token_ids, params)``,
``("abort", request_id, finish_reason)``, ``("call", call_id, name)`` (``flush_cache``,
``first_token_rows``, ``metrics``), ``("shutdown", reason)``, ``("close",)``.

engine -> client: ``("ready", facts)`` or ``("failed", message)`` once at start,
``("out", [(request_id, RequestOutput's fields as a tuple, or error), ...])`` (a tuple
pickles and loads in about half the time of the dataclass: ~35 against ~78 us each way for
64 outputs), ``("health", ok, detail)`` when
it changes, ``("reply", call_id, value)``.

Errors cross as :class:`_Error` records and are raised again as the same ``EngineError``
class with the same message, ``param`` and ``code`` (HTTP status and body unchanged).
The engine process ends when the client closes the socket, whatever way the client ended:
it then releases its rows on every stage, as a router leaving does. Split, the engine
process spends 0.37x the one process's CPU per output token on the 2-core CPU host; on
the H200's host neither bounds a served round, the stage does (docs/PERFORMANCE.md).
``--api-server-count N`` adds N - 1 HTTP servers (:class:`HttpServers`), clients of the
same engine process.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import operator
import os
import pickle
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from typing import Any, AsyncIterator, Callable

from ppspec.heap import freeze_startup_heap
from ppspec.lifetime import die_with
from ppspec.sockets import unread_bytes

from . import types as _types
from .types import EngineError, RequestOutput, SamplingParams, StageDownError, request_outputs

log = logging.getLogger("ppspec.router")

_LEN = struct.Struct("!I")
_output_fields = operator.attrgetter(*(f.name for f in fields(RequestOutput)))
"""A RequestOutput's fields in order, a tuple: its form in an ``out`` message."""
HEALTH_PERIOD_S = 0.05  # how often the engine process checks whether its health changed
HEARTBEAT_S = 1.0  # the engine process says its health at least this often, changed or not
ENGINE_SILENT_S = 10.0
"""Seconds the HTTP server waits without a word from its engine process (not even the
heartbeat) before it takes the engine for hung (stopped, deadlocked): ``/health`` turns 503
naming it and new requests and engine calls (a cache flush, a metrics scrape) get 503,
where they used to wait for ever behind a 200."""
ENGINE_HUNG_S = 30.0
"""Seconds without a word from the engine process after which the HTTP server ends the
requests and calls it has in flight with StageDownError (HTTP 503; a stream: its error
event) naming the silence, and asks the engine to abort them (read once it runs again, so
their rows come back). A healthy engine is never silent past ``HEARTBEAT_S``, however slow
its steps: the heartbeat comes from its event loop, which waits for the stages' compute
and does none itself. The bound is several times ``ENGINE_SILENT_S`` so that a process only
paused for a moment (a debugger, a frozen container) loses no request. An engine process
that ended needs no bound: its socket closes and everything in flight ends at once."""


# ------------------------------------------------------------------ framing
async def _read(reader: asyncio.StreamReader) -> Any:
    """One message; raises ``asyncio.IncompleteReadError`` at the end of the stream."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return pickle.loads(await reader.readexactly(n))


def _write(writer: asyncio.StreamWriter, msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LEN.pack(len(data)) + data)


@dataclass
class _Error:
    """An exception on the wire: an ``EngineError`` subclass by name (anything else
    becomes ``EngineError``) with its message and attributes."""

    kind: str
    message: str
    attrs: dict

    @classmethod
    def of(cls, e: BaseException) -> "_Error":
        if not isinstance(e, EngineError):
            return cls("EngineError", f"{type(e).__name__}: {e}", {})
        attrs = {k: v for k, v in vars(e).items() if isinstance(v, (str, int, float, type(None)))}
        return cls(type(e).__name__, str(e), attrs)

    def exception(self) -> EngineError:
        kind = getattr(_types, self.kind, EngineError)
        if not (isinstance(kind, type) and issubclass(kind, EngineError)):
            kind = EngineError
        e = kind.__new__(kind)
        Exception.__init__(e, self.message)
        e.message, e.param, e.code = self.message, None, None
        vars(e).update(self.attrs)
        return e


# ------------------------------------------------------------------ the engine's side
class _Outlet:
    """A request's stream inside the engine process (what ``Engine.submit`` puts outputs
    into): each item goes into the next ``out`` message."""

    __slots__ = ("server", "request_id")

    def __init__(self, server: "EngineServer", request_id: str):
        self.server, self.request_id = server, request_id

    def put_nowait(self, item) -> None:
        self.server.emit(self.request_id, item)


class EngineServer:
    """Serves one :class:`~router.engine.Engine` (started) to one client over ``reader`` /
    ``writer``. Outputs delivered in one pass of the event loop (one micro-batch's
    requests) leave in one message.

    ``owner``: the client that started the engine process (the router's first HTTP server);
    its end closes the engine. Another client's end (an extra HTTP server,
    ``--api-server-count``) aborts the requests it left running."""

    def __init__(self, engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, registry=None,
                 owner: bool = True):
        self.engine, self.reader, self.writer, self.registry, self.owner = engine, reader, writer, registry, owner
        self._pending: list[tuple[str, Any]] = []
        self._health: tuple[bool, str] | None = None
        self._running: set[str] = set()  # requests of this client not ended yet

    def emit(self, request_id: str, item) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        if isinstance(item, BaseException):
            item = _Error.of(item)
        if isinstance(item, _Error) or item.finished:
            self._running.discard(request_id)
        self._pending.append((request_id, item if isinstance(item, _Error) else _output_fields(item)))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self.writer.is_closing():
            _write(self.writer, ("out", pending))

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        e = self.engine
        try:
            if e.failure is not None or not e.pipeline.health()[0]:
                raise StageDownError(e.health()[1])
            e.submit(request_id, prompt_token_ids, params, stream=_Outlet(self, request_id))
            self._running.add(request_id)
        except Exception as exc:  # noqa: BLE001  (the request's error, to its stream)
            self.emit(request_id, exc)

    async def _call(self, call_id: int, name: str) -> None:
        try:
            if name == "flush_cache":
                value = await self.engine.flush_cache()
            elif name == "first_token_rows":
                value = await self.engine.first_token_rows()
            elif name == "metrics":
                from prometheus_client import generate_latest

                value = generate_latest(self.registry).decode() if self.registry is not None else ""
            else:
                raise EngineError(f"no engine call {name!r}")
        except Exception as exc:  # noqa: BLE001
            value = _Error.of(exc)
        _write(self.writer, ("reply", call_id, value))

    async def _watch_health(self) -> None:
        said = time.monotonic()
        while True:
            h = self.engine.health()
            now = time.monotonic()
            if h != self._health or now - said >= HEARTBEAT_S:  # unchanged: the heartbeat
                self._health, said = h, now
                _write(self.writer, ("health", *h))
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def serve(self) -> None:
        """Say ``ready``, then serve until the client closes the socket or says ``close``;
        then close the engine (``owner``) or abort this client's requests."""
        e = self.engine
        _write(self.writer, ("ready", {"max_model_len": e.max_model_len, "spec": e.spec,
                                       "prefix_caching": e.prefix_caching, "health": e.health(),
                                       "eos": list(getattr(e, "eos", None) or []),
                                       "vocab_size": getattr(e, "vocab_size", 0),
                                       "frozen": gc.get_freeze_count()}))  # this process's heap (ppspec.heap)
        watch = asyncio.ensure_future(self._watch_health())
        calls: set[asyncio.Task] = set()
        try:
            while True:
                try:
                    msg = await _read(self.reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    log.info("engine process: the HTTP server went away")
                    break
                op = msg[0]
                if op == "add":
                    self._add(*msg[1:])
                elif op == "abort":
                    await self.engine.abort(*msg[1:])
                elif op == "call":
                    t = asyncio.ensure_future(self._call(*msg[1:]))
                    calls.add(t)
                    t.add_done_callback(calls.discard)
                elif op == "shutdown":
                    self.engine.shutdown(*msg[1:])
                elif op == "close":
                    break
        finally:
            watch.cancel()
            self._flush()
            try:
                if self.owner:
                    await self.engine.close()
                else:
                    for rid in list(self._running):
                        await self.engine.abort(rid)
            finally:
                self.writer.close()


def run_engine_process(args, fd: int) -> int:
    """``ppspec router --engine-fd FD``: the engine of ``args`` served over the socket ``fd``
    (what :class:`EngineClient` starts), and to every client that connects to the listening
    socket ``--engine-listen-fd`` where given (the router's extra HTTP servers). SIGINT and
    SIGTERM are left to the HTTP server, which tells this process to shut down and close;
    the end of the socket ``fd`` closes it too. Until the engine serves, a SIGTERM (the HTTP
    server stopped or died: it starts this process with ``die_with``) ends the start, exit 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)

    async def main() -> int:
        from .start import EngineStartError, start_engine

        reader, writer = await asyncio.open_unix_connection(sock=sock)
        loop = asyncio.get_running_loop()
        starting = asyncio.ensure_future(start_engine(args))
        loop.add_signal_handler(signal.SIGTERM, starting.cancel)
        try:
            engine, metrics = await starting
        except asyncio.CancelledError:
            log.warning("stopped while starting (SIGTERM)")
            return 1
        except EngineStartError as e:
            _write(writer, ("failed", str(e)))
            try:
                await writer.drain()
            except ConnectionError:
                pass  # the HTTP server is gone already (ppspec serve stopping)
            return 2
        finally:
            loop.remove_signal_handler(signal.SIGTERM)  # which restores SIG_DFL
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        freeze_startup_heap("engine process", args.gc_freeze)  # started, its stages warm: what lives on
        others = None
        if args.engine_listen_fd is not None:
            async def serve_other(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                await EngineServer(engine, r, w, metrics.registry, owner=False).serve()

            # held for the process's life: an unreferenced server is closed when the garbage
            # collector takes it, and the extra HTTP servers' connections then wait unaccepted
            others = await asyncio.start_unix_server(serve_other, sock=socket.socket(fileno=args.engine_listen_fd))
        try:
            await EngineServer(engine, reader, writer, metrics.registry).serve()
        finally:
            if others is not None:
                others.close()
        return 0

    return _run(main())


def _run(coro) -> int:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# ------------------------------------------------------------------ the HTTP server's side
class EngineClient:
    """The ``AsyncEngine`` of the HTTP layer, over an engine process started with
    ``ppspec router ARGV --engine-fd N`` (:meth:`start`).

    ``registry``: a Prometheus registry whose collector yields the engine process's metrics
    as :meth:`refresh_metrics` last fetched them (the app fetches them before each scrape).
    """

    def __init__(self, argv: list[str], tokenizer, model_name: str, owner: bool = True):
        from prometheus_client import CollectorRegistry

        self.argv, self.tokenizer, self.model_name, self.owner = argv, tokenizer, model_name, owner
        self.max_model_len, self.spec, self.prefix_caching = 0, None, False
        self.vocab_size = 0  # the model's, once the engine said ready
        self.eos: list[int] | None = None  # the engine's EOS ids, once it said ready
        self.frozen = 0  # the engine process's startup heap frozen (objects), once it said ready
        self.queues: dict[str, asyncio.Queue] = {}
        self._health: tuple[bool, str] = (False, "the engine process is starting")
        self._heard = time.monotonic()  # the last message from the engine process
        self._replies: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._metrics_text = ""
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RemoteMetrics(self))
        self.proc: subprocess.Popen | None = None
        self._reader_task: asyncio.Task | None = None
        self._silence_task: asyncio.Task | None = None
        self.closing = False  # close() called: the engine's end is expected
        self.lost: str | None = None  # why the engine went away unasked (None: it did not)
        self.on_lost: Callable[[], None] | None = None  # called then (the router stops serving)

    async def start(self, listen: socket.socket | None = None) -> None:
        """Start the engine process and wait until its engine serves (it reached every
        stage); it also serves the clients that connect to ``listen`` (the other HTTP
        servers). Raises ``EngineStartError`` with the engine's message when it cannot."""
        mine, theirs = socket.socketpair()
        argv, fds = [*self.argv, "--engine-fd", str(theirs.fileno())], [theirs.fileno()]
        if listen is not None:
            argv += ["--engine-listen-fd", str(listen.fileno())]
            fds.append(listen.fileno())
        try:
            # SIGTERM when this process dies, however it dies: an engine process still
            # starting has no socket it reads yet, and would wait out its stages' timeout
            self.proc = subprocess.Popen([sys.executable, "-m", "ppspec.cli", "router", *argv], pass_fds=fds,
                                         preexec_fn=die_with(os.getpid()))
        finally:
            theirs.close()
        await self.connect(mine)

    async def connect(self, sock: socket.socket) -> None:
        """Serve through the engine at the other end of ``sock`` (an :class:`EngineServer`),
        once it says ``ready``. Raises ``EngineStartError`` with its message when it fails."""
        from .start import EngineStartError

        self.reader, self.writer = await asyncio.open_unix_connection(sock=sock)
        try:
            msg = await _read(self.reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            msg = ("failed", "the engine process ended at start"
                   + (f" (exit status {await self._wait()})" if self.proc is not None else ""))
        if msg[0] != "ready":
            self.writer.close()
            if self.proc is not None:
                await self._wait()
            raise EngineStartError(msg[1])
        facts = msg[1]
        self.max_model_len, self.spec, self.prefix_caching = facts["max_model_len"], facts["spec"], facts["prefix_caching"]
        self.eos = facts.get("eos") or None
        self.vocab_size = facts.get("vocab_size", 0)
        self.frozen = facts.get("frozen", 0)
        self._health = tuple(facts["health"])
        self._heard = time.monotonic()
        self._reader_task = asyncio.ensure_future(self._read_loop())
        self._silence_task = asyncio.ensure_future(self._watch_silence())

    def _silent(self) -> float:
        """Seconds since the engine process last said anything (its heartbeat included).

        0 while what it said waits unread in the socket: then this process was the one
        not listening (the HTTP server paused, SIGSTOP then SIGCONT, runs its due timers
        before its reads), and the engine is not silent; without this, a pause of the HTTP
        server past ``ENGINE_HUNG_S`` ended its requests in flight with 503 "the engine
        process has not answered ... hung or stopped" and aborted them in a healthy engine."""
        silent = time.monotonic() - self._heard
        if silent > HEARTBEAT_S and unread_bytes(self.writer) > 0:
            return 0.0
        return silent

    async def _watch_silence(self) -> None:
        """End what is in flight once the engine has been silent ``ENGINE_HUNG_S`` seconds
        (:meth:`_end_in_flight`); checked every ``HEARTBEAT_S``."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            silent = self._silent()
            if silent > ENGINE_HUNG_S and (self.queues or self._replies):
                self._end_in_flight(f"the engine process has not answered for {silent:.0f} s (its heartbeat comes "
                                    f"every {HEARTBEAT_S:g} s): hung or stopped; the request was aborted")

    def _end_in_flight(self, reason: str) -> None:
        """Every request and call in flight ends with StageDownError(reason); the requests
        are aborted in the engine too (the message waits in the socket until it reads),
        so that an engine that resumes frees their rows instead of generating for nobody."""
        queues, self.queues = self.queues, {}
        log.error("%s: ending %d requests and %d calls in flight", reason, len(queues), len(self._replies))
        for rid, q in queues.items():
            q.put_nowait(StageDownError(reason))
            self._send(("abort", rid, "abort"))
        self._fail_calls(reason)

    async def _wait(self) -> int:
        return await asyncio.get_running_loop().run_in_executor(None, self.proc.wait)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await _read(self.reader)
                self._heard = time.monotonic()
                op = msg[0]
                if op == "out":
                    queues = self.queues
                    for rid, item in msg[1]:
                        q = queues.get(rid)
                        if q is not None:
                            q.put_nowait(item.exception() if isinstance(item, _Error) else RequestOutput(*item))
                elif op == "health":
                    self._health = (msg[1], msg[2])
                elif op == "reply":
                    fut = self._replies.pop(msg[1], None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg[2])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        self._gone("the engine process ended")
        if not self.closing:
            status = None if self.proc is None else await _exit_status(self.proc)
            self.lost = "the engine process ended" + (f" (exit status {status})" if status is not None else "")
            log.error("%s: the HTTP server stops", self.lost)
            if self.on_lost is not None:
                self.on_lost()

    def _gone(self, reason: str) -> None:
        """The engine process is gone: every request and call ends with StageDownError."""
        if self._silence_task is not None:  # no request or call will wait on it now
            self._silence_task.cancel()
        self._end_all(reason)
        self._fail_calls(reason)

    def _fail_calls(self, reason: str) -> None:
        for fut in self._replies.values():
            if not fut.done():
                fut.set_result(_Error.of(StageDownError(reason)))
        self._replies.clear()

    def _end_all(self, reason: str) -> None:
        """Every request of this client ends with StageDownError(reason), and new ones get it."""
        self._health = (False, reason)
        for q in self.queues.values():
            q.put_nowait(StageDownError(reason))

    def _send(self, msg) -> None:
        if not self.writer.is_closing():
            _write(self.writer, msg)

    async def _call(self, name: str):
        if self._reader_task is None or self._reader_task.done():  # no reply would come
            raise StageDownError(self._health[1])
        if self._silent() > ENGINE_SILENT_S:  # none would come soon, if ever
            raise StageDownError(self.health()[1])
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[call_id] = fut
        self._send(("call", call_id, name))
        value = await fut
        if isinstance(value, _Error):
            raise value.exception()
        return value

    # -------------------------------------------------------------- AsyncEngine
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        ok, detail = self.health()
        if not ok:
            raise StageDownError(detail)
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        self._send(("add", request_id, list(prompt_token_ids), params))
        outs = request_outputs(q, lambda: self.abort(request_id), lambda: self.queues.pop(request_id, None))
        async with contextlib.aclosing(outs):
            async for item in outs:
                yield item

    async def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        self._send(("abort", request_id, finish_reason))

    def health(self) -> tuple[bool, str]:
        silent = self._silent()
        if self._health[0] and silent > ENGINE_SILENT_S:
            return False, (f"the engine process has not answered for {silent:.0f} s (its heartbeat comes every "
                           f"{HEARTBEAT_S:g} s): hung or stopped")
        return self._health

    async def flush_cache(self) -> int:
        return await self._call("flush_cache")

    async def first_token_rows(self) -> dict:
        return await self._call("first_token_rows")

    async def refresh_metrics(self) -> None:
        """Fetch the engine process's metrics (before a scrape)."""
        try:
            self._metrics_text = await self._call("metrics")
        except EngineError:
            pass  # the engine is gone: the last figures stay

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """At the first SIGINT / SIGTERM of this HTTP server: the owner shuts the engine down
        (``Engine.shutdown``: every request ends with 503 now); another HTTP server ends
        its own requests so (the engine serves the others on)."""
        if self.owner:
            self._send(("shutdown", reason))
        else:
            self._end_all(reason)

    async def close(self, timeout: float = 30.0) -> None:
        """Ask the engine process to close (it releases its rows on every stage) and wait
        for it; killed after ``timeout`` seconds."""
        self.closing = True
        self._send(("close",))
        if self.proc is not None:
            try:
                await asyncio.wait_for(self._wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("the engine process did not end in %.0f s: killed", timeout)
                self.proc.kill()
                await self._wait()
        self.writer.close()
        for t in (self._reader_task, self._silence_task):
            if t is not None:
                t.cancel()


async def _exit_status(proc: subprocess.Popen, timeout: float = 5.0) -> int | None:
    """``proc``'s exit status once it ends, None if it runs on after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.run_in_executor(None, proc.wait), timeout)
    except asyncio.TimeoutError:
        return None


class _RemoteMetrics:
    """The engine process's metrics, from the text :meth:`EngineClient.refresh_metrics`
    fetched (parsed back into families: the exposition is the same text)."""

    def __init__(self, client: EngineClient):
        self.client = client

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families

        return text_string_to_metric_families(self.client._metrics_text)


class HttpServers:
    """The router's HTTP servers after the first (``--api-server-count N``): N - 1 processes
    (``ppspec router ARGV --engine-address A --http-fd F``) accepting on the first one's
    listening socket, each an :class:`EngineClient` of the engine process through the Unix
    socket :attr:`listen` (abstract namespace, Linux). Each ends with the first (SIGTERM
    when it dies, however it dies)."""

    def __init__(self, argv: list[str], count: int):
        self.argv, self.count = argv, count
        self.address = f"ppspec-engine-{os.getpid()}-{secrets.token_hex(6)}"
        self.listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listen.bind("\0" + self.address)
        self.listen.listen(count)
        self.procs: list[subprocess.Popen] = []

    async def spawn(self, http: socket.socket, timeout: float = 300.0) -> None:
        """Start them, serving the listening HTTP socket ``http``, and wait until each has
        its app built and its engine reached (a byte on the pipe ``--ready-fd``), so that
        ``/health`` turns 200 with every server ready. Raises ``EngineStartError`` when one
        ends first or is not ready in ``timeout`` seconds."""

        from .start import EngineStartError

        ready, tell = os.pipe()
        try:
            for _ in range(self.count - 1):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "ppspec.cli", "router", *self.argv, "--engine-address", self.address,
                     "--http-fd", str(http.fileno()), "--ready-fd", str(tell)],
                    pass_fds=(http.fileno(), tell), preexec_fn=die_with(os.getpid())))
        finally:
            os.close(tell)  # the children hold it: the pipe ends when all of them have ended
        loop = asyncio.get_running_loop()
        try:
            got = await asyncio.wait_for(loop.run_in_executor(None, _read_bytes, ready, self.count - 1), timeout)
        except asyncio.TimeoutError:
            got = b""
        finally:
            os.close(ready)
        if len(got) < self.count - 1:
            raise EngineStartError(f"{self.count - 1 - len(got)} of the {self.count - 1} extra HTTP servers did not "
                                   f"start (their output says why)")

    async def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM each (they drain their streams), SIGKILL after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                await asyncio.wait_for(loop.run_in_executor(None, p.wait), timeout)
            except asyncio.TimeoutError:
                p.kill()
                await loop.run_in_executor(None, p.wait)
        self.listen.close()


def _read_bytes(fd: int, n: int) -> bytes:
    """Up to ``n`` bytes of the pipe ``fd``; fewer when it ends first."""
    got = b""
    while len(got) < n:
        part = os.read(fd, n - len(got))
        if not part:
            break
        got += part
    return got


async def connect_engine(address: str, tokenizer, model_name: str) -> EngineClient:
    """An :class:`EngineClient` of the engine process listening at ``address`` (an extra
    HTTP server's, :class:`HttpServers`). Raises ``EngineStartError``."""
    from .start import EngineStartError

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + address)
    except OSError as e:
        sock.close()
        raise EngineStartError(f"cannot reach the engine process at {address}: {e}") from None
    client = EngineClient([], tokenizer, model_name, owner=False)
    await client.connect(sock)
    return client
