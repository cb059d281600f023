"""The ``Steps`` stream (``stage.proto``): Forward and Verify on one long-lived gRPC call.

A unary Forward / Verify per micro-batch costs a new HTTP/2 stream, its headers and the
call's setup on both sides; a message on an open stream costs a fraction of that
(docs/PERFORMANCE.md, "CPU: served against in process"). The router keeps one stream to
stage 0, each stage one to the next. Many steps are in flight on a stream at once (lanes,
async scheduling): each ``StepRequest`` carries a ``call_id`` and its ``StepResult`` names
it, in whatever order the steps end.

A step on the stream means what the unary call means: :class:`StepStream` raises
``grpc.aio.AioRpcError`` with the code and details the unary call would have ended with (a
refusal, UNAVAILABLE when the stream broke, DEADLINE_EXCEEDED past the step's timeout), and
a cancelled caller cancels the step on the stage (a ``cancel`` message), which cancels its
relay to the next stage in turn. :func:`serve_steps` is the stage's side.
"""
from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from .stubs import pb

log = logging.getLogger("ppspec.stage")

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a unary call ending with ``code`` and ``details`` raises."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Open:
    """One open Steps call, the steps waiting for their answer on it, and its outbox (one
    writer task writes it in order: a caller never awaits a write, so a cancelled caller
    cannot cancel the call mid-write, which would end every step on it)."""

    def __init__(self, call):
        self.call = call
        self.waiting: dict[int, asyncio.Future] = {}
        self.error: grpc.aio.AioRpcError | None = None  # set once the call ended
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.reader: asyncio.Task | None = None
        self.writer: asyncio.Task | None = None


class _Expired(Exception):
    """A step's timeout passed (set on its future by a timer)."""


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


class StepStream:
    """The client of one stage's Steps stream, opened at the first step and again after it
    broke.

    Args:
        stub: ``pb_grpc.StageStub`` of the stage.
        metadata: sent once, when the stream opens (the pipeline key, ``ppspec.auth``).
    """

    def __init__(self, stub, metadata: tuple = ()):
        self.stub, self.metadata = stub, tuple(metadata)
        self._open: _Open | None = None
        self._ids = itertools.count(1)

    async def step(self, request: pb.StepRequest, timeout: float) -> pb.StepResult:
        """Send ``request`` (its ``call_id`` is set here) and return its answer.

        Raises:
            grpc.aio.AioRpcError: as the unary Forward / Verify would.
        """
        op = self._open
        if op is None or op.error is not None:
            op = self._open = _Open(self.stub.Steps(metadata=self.metadata))
            op.reader = asyncio.ensure_future(self._read(op))
            op.writer = asyncio.ensure_future(self._write(op))
        cid = next(self._ids)
        request.call_id = cid
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        op.waiting[cid] = fut
        op.outbox.put_nowait(request)
        timer = loop.call_later(timeout, _expire, fut)  # not wait_for: no extra future and task wake-up
        try:
            return await fut
        except _Expired:
            self._cancel(op, cid)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:
            self._cancel(op, cid)
            raise
        finally:
            timer.cancel()
            op.waiting.pop(cid, None)

    async def _write(self, op: _Open) -> None:
        try:
            while True:
                await op.call.write(await op.outbox.get())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            # the call ended: every waiting step fails with its status
            await self._ended(op)

    def _cancel(self, op: _Open, cid: int) -> None:
        """Tell the stage to cancel step ``cid`` (best effort: a broken stream ended it)."""
        op.waiting.pop(cid, None)
        if op.error is None:
            op.outbox.put_nowait(pb.StepRequest(call_id=cid, cancel=True))

    async def _read(self, op: _Open) -> None:
        try:
            async for res in op.call:
                fut = op.waiting.pop(res.call_id, None)
                if fut is None or fut.done():
                    continue  # a step its caller gave up on
                if res.error_code:
                    fut.set_exception(rpc_error(_CODES.get(res.error_code, grpc.StatusCode.UNKNOWN), res.error))
                else:
                    fut.set_result(res)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            await self._ended(op)

    async def _ended(self, op: _Open) -> None:
        """The call ended: every step still waiting on it fails with its status."""
        if op.error is None:
            code, details = grpc.StatusCode.UNAVAILABLE, "the stage ended the Steps stream"
            if op.call.done():
                c = await op.call.code()
                if c != grpc.StatusCode.OK:
                    code, details = c, await op.call.details()
            op.error = rpc_error(code, details)
            for t in (op.reader, op.writer):
                if t is not None and t is not asyncio.current_task():
                    t.cancel()
            op.call.cancel()
        for fut in op.waiting.values():
            if not fut.done():
                fut.set_exception(op.error)
        op.waiting.clear()

    def close(self) -> None:
        if self._open is not None:
            self._open.call.cancel()


class StepAbort(Exception):
    """A step on the stream refused: what ``context.abort`` of its unary call would send."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _StepContext:
    """The per-step stand-in for a unary call's ``context``: ``abort`` ends the step only."""

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise StepAbort(code, details)


class StepServer:
    """The stage's side of one caller's steps, whatever carries them (the gRPC stream,
    :func:`serve_steps`; a Unix socket, ``local.py``): each step runs as its own task, as a
    unary call would, through ``run_step(request, context)`` (the unary handler's body; its
    ``context.abort`` refuses that step only); its answer or refusal goes back with its
    ``call_id`` through ``write``. A ``cancel`` message cancels its step.

    Args:
        run_step: ``async (pb.StepRequest, context) -> pb.StepResult``.
        write: ``async (pb.StepResult) -> None``, one answer to the caller.
        hold: test aid, ``async () -> None`` awaited before each step (injected delays).
    """

    def __init__(self, run_step, write, hold=None):
        self.run_step, self.write, self.hold = run_step, write, hold
        self.tasks: dict[int, asyncio.Task] = {}
        self.lock = asyncio.Lock()

    def submit(self, request: pb.StepRequest) -> None:
        """A message from the caller: a step to run, or the cancel of one."""
        if request.cancel:
            t = self.tasks.pop(request.call_id, None)
            if t is not None:
                t.cancel()
        else:
            self.tasks[request.call_id] = asyncio.ensure_future(self._one(request))

    async def _one(self, request: pb.StepRequest) -> None:
        cid = request.call_id  # before a relay reuses the message with its own id
        try:
            if self.hold is not None:
                await self.hold()
            try:
                res = await self.run_step(request, _StepContext())
                res.call_id = cid
            except StepAbort as e:
                res = pb.StepResult(call_id=cid, error_code=e.code.value[0], error=e.details)
            except Exception as e:  # noqa: BLE001 - what a unary handler's crash answers (UNKNOWN)
                log.error("step of micro-batch %d failed", request.micro_batch_id, exc_info=e)
                res = pb.StepResult(call_id=cid, error_code=grpc.StatusCode.UNKNOWN.value[0],
                                    error=f"Unexpected {type(e).__name__}: {e}")
            try:
                async with self.lock:
                    await self.write(res)
            except Exception as e:  # noqa: BLE001 - the caller went away: no one to answer
                log.debug("step of micro-batch %d not answered: %s", request.micro_batch_id, e)
        finally:
            self.tasks.pop(cid, None)

    async def drain(self) -> None:
        """Wait for every step sent so far (the caller half-closed: answer what it sent)."""
        if self.tasks:
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def cancel_all(self) -> None:
        """The caller went away: its steps go too."""
        for t in list(self.tasks.values()):
            t.cancel()


async def serve_steps(requests, context, run_step, hold=None) -> None:
    """The stage's side of a Steps call (:class:`StepServer` over the call): the caller
    going away cancels every step.

    Args:
        requests: the call's request iterator.
        context: the call's context (``write``).
        run_step: ``async (pb.StepRequest, context) -> pb.StepResult``.
        hold: test aid, ``async () -> None`` awaited before each step (injected delays).
    """
    steps = StepServer(run_step, context.write, hold)
    try:
        async for request in requests:
            steps.submit(request)
        await steps.drain()
    finally:
        steps.cancel_all()
