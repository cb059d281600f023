"""The step socket (``proto/local.py``) against a stage stand-in: steps in flight at once
answer each to its caller in the order they end; a refused step raises what it raises on the
gRPC stream; a step past its timeout or whose caller is cancelled is cancelled on the stage; a
wrong pipeline key, a socket that cannot be opened and a stage that goes away send the steps
to the gRPC stream (with why), and a socket given again takes them back. The real-process
side (PP2 over the sockets, a restart, a hop on gRPC, tokens against PP1) is in
``tests/test_pipeline.py``."""
from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from ppspec.proto import local
from ppspec.proto.local import StepChannel, serve_socket
from ppspec.proto.stubs import pb

_names = itertools.count()


class Stand:
    """Each step waits until its micro-batch's gate opens, then answers with its
    micro_batch_id as the token, or (mode "bad") refuses it."""

    def __init__(self):
        self.gates: dict[int, asyncio.Event] = {}
        self.cancelled: list[int] = []
        self.seen: list[int] = []

    def gate(self, mb: int) -> asyncio.Event:
        return self.gates.setdefault(mb, asyncio.Event())

    async def step(self, req, context):
        mb = req.micro_batch_id
        self.seen.append(mb)
        try:
            await self.gate(mb).wait()
        except asyncio.CancelledError:
            self.cancelled.append(mb)
            raise
        if req.mode == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"micro-batch {mb} refused")
        return pb.StepResult(micro_batch_id=mb, round=req.round, output_flat=[mb], output_lens=[1])


class GrpcStandIn:
    """The gRPC stream's stand-in: answers every step with token -1 and counts them."""

    def __init__(self):
        self.steps: list[int] = []
        self.closed = False

    async def step(self, req, timeout):
        self.steps.append(req.micro_batch_id)
        return pb.StepResult(micro_batch_id=req.micro_batch_id, output_flat=[-1], output_lens=[1])

    def close(self):
        self.closed = True


def step(mb: int, mode: str = "decode") -> pb.StepRequest:
    return pb.StepRequest(micro_batch_id=mb, round=7, mode=mode)


def name() -> str:
    return f"@ppspec-steps-test-{local.os.getpid()}-{next(_names)}"


async def until(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")


def test_steps_answer_in_the_order_they_end_and_a_refusal_is_the_streams():
    async def main():
        stand, fallback = Stand(), GrpcStandIn()
        sock = name()
        server = await serve_socket(sock, stand.step)
        ch = StepChannel(fallback, who="test")
        ch.use(sock)
        assert ch.transport == "socket"
        calls = [asyncio.ensure_future(ch.step(step(mb), 10.0)) for mb in (1, 2, 3)]
        await until(lambda: len(stand.seen) == 3)
        stand.gate(3).set()
        assert list((await calls[2]).output_flat) == [3]
        assert not calls[0].done() and not calls[1].done()
        stand.gate(1).set()
        stand.gate(2).set()
        assert [(await c).micro_batch_id for c in calls[:2]] == [1, 2]
        bad = asyncio.ensure_future(ch.step(step(4, "bad"), 10.0))
        stand.gate(4).set()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await bad
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "micro-batch 4 refused"
        stand.gate(5).set()
        assert (await ch.step(step(5), 10.0)).micro_batch_id == 5  # the socket serves on
        assert fallback.steps == [] and ch.transport == "socket"
        ch.close()
        server.close()

    asyncio.run(main())


def test_a_step_past_its_timeout_or_cancelled_is_cancelled_on_the_stage():
    async def main():
        stand = Stand()
        sock = name()
        server = await serve_socket(sock, stand.step)
        ch = StepChannel(GrpcStandIn())
        ch.use(sock)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ch.step(step(1), 0.2)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: stand.cancelled == [1])
        call = asyncio.ensure_future(ch.step(step(2), 10.0))
        await until(lambda: 2 in stand.seen)
        call.cancel()
        await until(lambda: stand.cancelled == [1, 2])
        ch.close()
        server.close()

    asyncio.run(main())


def test_a_wrong_key_sends_the_steps_to_grpc_with_why():
    async def main():
        stand = Stand()
        stand.gate(1).set()
        sock = name()
        server = await serve_socket(sock, stand.step, key=b"right")
        wrong = StepChannel(GrpcStandIn(), key=b"wrong")
        wrong.use(sock)
        assert list((await wrong.step(step(1), 5.0)).output_flat) == [-1]  # the gRPC stand-in's
        assert wrong.transport == "grpc" and "wrong or no pipeline key" in wrong.detail and stand.seen == []
        fallback = GrpcStandIn()
        right = StepChannel(fallback, key=b"right")
        right.use(sock)
        assert list((await right.step(step(1), 5.0)).output_flat) == [1]
        assert fallback.steps == [] and stand.seen == [1]
        wrong.close()
        right.close()
        server.close()

    asyncio.run(main())


def test_a_stage_gone_fails_its_steps_then_grpc_until_a_new_socket_is_given(monkeypatch):
    """The stage's socket closes with a step in flight: that step fails UNAVAILABLE (as on a
    broken stream); the next finds no socket and goes on gRPC, saying why; a socket given
    again (a restarted stage's) takes the steps back."""
    opened = []

    class Recorded(local._Serving):
        def connection_made(self, transport):
            super().connection_made(transport)
            opened.append(transport)

    monkeypatch.setattr(local, "_Serving", Recorded)

    async def main():
        stand, fallback = Stand(), GrpcStandIn()
        sock = name()
        server = await serve_socket(sock, stand.step)
        ch = StepChannel(fallback, who="test")
        ch.use(sock)
        call = asyncio.ensure_future(ch.step(step(1), 10.0))
        await until(lambda: 1 in stand.seen)
        server.close()  # the stage goes away: no listener, and its side of the socket closed
        for t in opened:
            t.close()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        await until(lambda: stand.cancelled == [1])  # its step went with the caller's socket
        out = await ch.step(step(2), 5.0)
        assert list(out.output_flat) == [-1] and fallback.steps == [2]
        assert ch.transport == "grpc" and "cannot be opened" in ch.detail
        again = name()
        server2 = await serve_socket(again, stand.step)
        ch.use(again)
        stand.gate(3).set()
        assert list((await ch.step(step(3), 5.0)).output_flat) == [3]
        assert fallback.steps == [2] and ch.transport == "socket" and ch.detail == ""
        ch.close()
        server2.close()

    asyncio.run(main())


def test_a_socket_that_failed_to_open_is_tried_again(monkeypatch):
    """A socket that did not open (a stage too busy to answer in time, say) is tried again
    after ``RETRY_S``: the steps come back to it once it opens."""
    monkeypatch.setattr(local, "RETRY_S", 0.0)

    async def main():
        stand, fallback = Stand(), GrpcStandIn()
        stand.gate(2).set()
        sock = name()
        ch = StepChannel(fallback)
        ch.use(sock)  # nothing listens yet
        assert list((await ch.step(step(1), 5.0)).output_flat) == [-1]
        assert ch.transport == "grpc" and "cannot be opened" in ch.detail
        server = await serve_socket(sock, stand.step)
        assert list((await ch.step(step(2), 5.0)).output_flat) == [2]
        assert fallback.steps == [1] and ch.transport == "socket" and ch.detail == ""
        ch.close()
        server.close()

    asyncio.run(main())
