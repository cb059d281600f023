"""The Steps stream on a Unix-domain socket, for a caller on the stage's host.

A step's control message between two processes of one host (the router and stage 0, stage
k and stage k + 1) went as a message on the gRPC ``Steps`` stream: HTTP/2 framing, gRPC's
core and its completion queue on both sides, a reader task woken per answer (~200-300 us a
hop on the CPU host, docs/PERFORMANCE.md, "CPU: served against in process"). On one host the
same messages go on a Unix-domain socket instead: each frame is a 4-byte little-endian
length then the serialized protobuf message (``StepRequest`` one way, ``StepResult`` the
other, exactly what the stream carries: ``call_id``, ``cancel``, ``error_code``), read in
the event loop's own callback (``asyncio.Protocol``: no task per read, no thread).

- **Who has one.** A stage listens on an abstract socket named after its process
  (``@ppspec-steps-PID-INSTANCE``: no file, gone with the process) unless started with
  ``--control-channel grpc``; its ``Info`` says the name and its host
  (``control_socket``, ``host_id``), and ``AttachDataPlane`` answers a previous stage on
  the same host with it. A caller on the same host (kernel boot id) uses it; any other
  caller stays on gRPC. Besides steps the router sends its CommitAccept and Release calls
  on it (``StepRequest.commit_call`` / ``release_call``); every other call (Info, health,
  AttachDataPlane, PrepareGrammar) stays on gRPC.
- **Opening.** The caller's first frame is the pipeline key (empty without one); the stage
  answers an empty frame, or the reason it refuses and closes (a wrong key, compared in
  constant time as ``ppspec.auth`` does). Steps are fenced by ``router_id`` as on gRPC.
- **Failure.** A step on the socket means what it means on the stream
  (:class:`~ppspec.proto.stream.StepStream`): a refusal raises the ``AioRpcError`` the
  stream would, a closed socket fails the steps in flight with UNAVAILABLE, a cancelled
  caller sends ``cancel``. The next step opens the socket again; a socket that cannot be
  opened (the stage gone, another network namespace) sends the steps on the gRPC stream
  from then on, with the reason (:attr:`StepChannel.detail`), until the caller is given a
  socket again (a restarted stage has a new one) or, every ``RETRY_S``, the same socket
  opens after all.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import socket
import struct
import time

import grpc

from .codec import MAX_MESSAGE_BYTES
from .stream import StepServer, StepStream, _CODES, _expire, _Expired, rpc_error
from .stubs import pb

log = logging.getLogger("ppspec.control")

FRAME = struct.Struct("<I")  # the length of the message that follows
HELLO_MAX = 4096  # the opening frame (the key) is at most this long
OPEN_TIMEOUT_S = 2.0  # connect and the stage's answer to the opening frame
RETRY_S = 30.0  # a socket that could not be opened is tried again after this long (a stage that was busy)


def host_id() -> str:
    """``hostname/boot id``. Two processes are on one host when their kernel boot ids agree
    (two containers of one host have other hostnames but one kernel); whether they share a
    network namespace (the socket) or ``/dev/shm`` (the data plane) the first use finds out."""
    if os.environ.get("PPSPEC_HOST_ID"):  # test aid: a process that acts as if on another host
        return os.environ["PPSPEC_HOST_ID"]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def same_host(a: str, b: str) -> bool:
    """Whether two :func:`host_id` values name one kernel."""
    return bool(a) and bool(b) and a.rsplit("/", 1)[-1] == b.rsplit("/", 1)[-1]


def socket_name(instance_id: str) -> str:
    """The abstract socket of a stage process (``@`` stands for the leading NUL byte)."""
    return f"@ppspec-steps-{os.getpid()}-{instance_id}"


def _address(name: str) -> str:
    return "\0" + name[1:] if name.startswith("@") else name


def _frame(body: bytes) -> bytes:
    return FRAME.pack(len(body)) + body


class _Frames(asyncio.Protocol):
    """Splits the byte stream into frames and hands each to :meth:`frame`."""

    limit = MAX_MESSAGE_BYTES

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        if not buf and len(data) >= 4 and FRAME.unpack_from(data)[0] == len(data) - 4:
            self.frame(data[4:])  # the usual case: one whole message in one read
            return
        buf += data
        while len(buf) >= 4:
            n = FRAME.unpack_from(buf)[0]
            if n > self.limit:
                self.transport.close()
                return
            if len(buf) < 4 + n:
                return
            body = bytes(buf[4:4 + n])
            del buf[:4 + n]
            self.frame(body)
            if self.transport.is_closing():
                return

    def frame(self, body: bytes) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------------------- the stage
class _Serving(_Frames):
    """One caller's socket on the stage: the opening frame, then its steps
    (:class:`~ppspec.proto.stream.StepServer`, as the gRPC stream serves them)."""

    limit = HELLO_MAX  # until the caller has shown the key

    def __init__(self, run_step, key: bytes | None, hold):
        super().__init__()
        self.run_step, self.key, self.hold = run_step, key, hold
        self.steps: StepServer | None = None

    async def _write(self, res: pb.StepResult) -> None:
        if self.transport.is_closing():
            raise ConnectionError("the caller closed the step socket")
        self.transport.write(_frame(res.SerializeToString()))

    def frame(self, body: bytes) -> None:
        if self.steps is None:
            if self.key is not None and not hmac.compare_digest(body, self.key):
                why = "step socket: a wrong or no pipeline key (--pipeline-key-file): refused, nothing read"
                self.transport.write(_frame(why.encode()))
                self.transport.close()
                return
            self.limit = MAX_MESSAGE_BYTES
            self.steps = StepServer(self.run_step, self._write, self.hold)
            self.transport.write(_frame(b""))
            return
        try:
            request = pb.StepRequest.FromString(body)
        except Exception:  # noqa: BLE001 - not a step: this caller is broken, close it
            log.warning("step socket: a frame that is no StepRequest; closing the caller's socket")
            self.transport.close()
            return
        self.steps.submit(request)

    def connection_lost(self, exc) -> None:
        if self.steps is not None:  # the caller went away: its steps go too, as on the stream
            self.steps.cancel_all()


async def serve_socket(name: str, run_step, key: bytes | None = None, hold=None) -> asyncio.AbstractServer:
    """Listen on the abstract socket ``name`` and serve steps through ``run_step`` (as
    :func:`~ppspec.proto.stream.serve_steps` does on the gRPC stream)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_address(name))
        sock.listen(64)
        sock.setblocking(False)
        return await asyncio.get_running_loop().create_unix_server(lambda: _Serving(run_step, key, hold), sock=sock)
    except BaseException:
        sock.close()
        raise


# ---------------------------------------------------------------------------------- the caller
class _Client(_Frames):
    """The caller's side of one open socket: the steps waiting for their answer."""

    def __init__(self):
        super().__init__()
        self.waiting: dict[int, asyncio.Future] = {}
        self.opened: asyncio.Future = asyncio.get_running_loop().create_future()  # the stage's answer
        self.error: grpc.aio.AioRpcError | None = None  # set once the socket closed

    def frame(self, body: bytes) -> None:
        if not self.opened.done():
            self.opened.set_result(body.decode(errors="replace"))
            return
        res = pb.StepResult.FromString(body)
        fut = self.waiting.pop(res.call_id, None)
        if fut is None or fut.done():
            return  # a step its caller gave up on
        if res.error_code:
            fut.set_exception(rpc_error(_CODES.get(res.error_code, grpc.StatusCode.UNKNOWN), res.error))
        else:
            fut.set_result(res)

    def connection_lost(self, exc) -> None:
        self.error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the stage closed the step socket")
        if not self.opened.done():
            self.opened.set_exception(ConnectionError("the stage closed the step socket at once"))
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(self.error)
        self.waiting.clear()

    def send(self, request: pb.StepRequest) -> None:
        self.transport.write(_frame(request.SerializeToString()))


async def _open(name: str, key: bytes | None) -> _Client:
    """Connect to the stage's socket and show the key. Raises OSError (no such socket, the
    stage refused, no answer in time)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client = None
    try:
        sock.setblocking(False)
        await asyncio.wait_for(loop.sock_connect(sock, _address(name)), OPEN_TIMEOUT_S)
        _, client = await loop.create_unix_connection(_Client, sock=sock)
        client.transport.write(_frame(key or b""))
        refused = await asyncio.wait_for(client.opened, OPEN_TIMEOUT_S)
    except BaseException as e:
        if client is not None:
            client.transport.close()
        sock.close()
        if isinstance(e, asyncio.TimeoutError):
            raise ConnectionError("the stage did not answer in time") from None
        raise
    if refused:
        client.transport.close()
        raise ConnectionRefusedError(refused)
    return client


class StepChannel:
    """Where a caller sends its steps to one stage: the stage's socket when it was given one
    (:meth:`use`), else, and from the moment the socket cannot be opened, the gRPC
    ``Steps`` stream ``grpc_steps``. Same interface as :class:`StepStream`.

    Args:
        grpc_steps: the stage's :class:`StepStream`.
        key: the pipeline key (the socket's opening frame).
        who: names this hop in the log ("router -> stage 0").
    """

    def __init__(self, grpc_steps: StepStream, key: bytes | None = None, who: str = ""):
        self.grpc, self.key, self.who = grpc_steps, key, who
        self.name = ""  # the stage's socket ("": none given)
        self.detail = ""  # why the steps go on gRPC where a socket was given or declined
        self._client: _Client | None = None
        self._opening: asyncio.Future | None = None
        self._ids = itertools.count(1)
        self._retry: tuple[str, float] | None = None  # (a socket that failed to open, when to try it again)

    @property
    def transport(self) -> str:
        """``socket`` or ``grpc``: what the next step goes on."""
        return "socket" if self.name else "grpc"

    def use(self, name: str, detail: str = "") -> None:
        """From now on the stage's socket ``name`` ("": gRPC, ``detail`` says why)."""
        if name != self.name:
            self._close_client()
            if name:
                log.info("%s: steps on the stage's socket %s", self.who or "steps", name)
            elif detail:
                log.info("%s: steps on gRPC (%s)", self.who or "steps", detail)
        self.name, self.detail, self._retry = name, detail, None

    async def step(self, request: pb.StepRequest, timeout: float) -> pb.StepResult:
        """Send ``request`` and return its answer, on the socket or the gRPC stream.

        Raises:
            grpc.aio.AioRpcError: as :meth:`StepStream.step` would.
        """
        if not self.name and self._retry is not None and time.monotonic() > self._retry[1]:
            self.name = self._retry[0]  # try the socket that failed again (the detail stays until it opens)
        if self.name:
            client = self._client
            if client is None or client.error is not None:
                client = await self._connect()
            if client is not None:
                return await self._step(client, request, timeout)
        return await self.grpc.step(request, timeout)

    async def _connect(self) -> _Client | None:
        """The open socket, opened once for every step waiting for it; None: it cannot be
        opened, and from now on the steps go on gRPC."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._try_open(self.name))
        opening = self._opening
        try:
            return await asyncio.shield(opening)
        finally:
            if self._opening is opening and opening.done():
                self._opening = None

    async def _try_open(self, name: str) -> _Client | None:
        try:
            client = await _open(name, self.key)
        except OSError as e:
            if self.name == name:  # not replaced meanwhile
                detail = f"the stage's socket {name} cannot be opened ({e}); steps on gRPC"
                if detail != self.detail:  # said once, not at every retry
                    log.warning("%s: %s", self.who or "steps", detail)
                self.name, self.detail, self._retry = "", detail, (name, time.monotonic() + RETRY_S)
            return None
        if self.name != name:  # a new socket was given meanwhile: this one is stale
            client.transport.close()
            return None
        self._close_client()
        self._client, self.detail, self._retry = client, "", None
        return client

    async def _step(self, client: _Client, request: pb.StepRequest, timeout: float) -> pb.StepResult:
        cid = next(self._ids)
        request.call_id = cid
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        client.waiting[cid] = fut
        client.send(request)
        timer = loop.call_later(timeout, _expire, fut)
        try:
            return await fut
        except _Expired:
            self._cancel(client, cid)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:
            self._cancel(client, cid)
            raise
        finally:
            timer.cancel()
            client.waiting.pop(cid, None)

    @staticmethod
    def _cancel(client: _Client, cid: int) -> None:
        client.waiting.pop(cid, None)
        if client.error is None and not client.transport.is_closing():
            client.send(pb.StepRequest(call_id=cid, cancel=True))

    def _close_client(self) -> None:
        if self._client is not None:
            self._client.transport.close()
            self._client = None

    def close(self) -> None:
        self._close_client()
        self.grpc.close()
