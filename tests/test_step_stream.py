"""The Steps stream (``proto/stream.py``) against a stage stand-in on loopback: steps in
flight at once answer in the order they end, each to its own caller; a refused step raises
what its unary call would and leaves the stream to the others; a step past its timeout or
whose caller is cancelled is cancelled on the stage; a stage that goes away fails the steps
waiting on it, and the next step opens a new stream to the stage that came back."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster import free_port
from ppspec.proto.stream import StepStream, serve_steps
from ppspec.proto.stubs import pb, pb_grpc


class Stand(pb_grpc.StageServicer):
    """Each step waits until its micro-batch's gate opens, then answers with its
    micro_batch_id as the token, or (mode "bad") refuses it."""

    def __init__(self):
        self.gates: dict[int, asyncio.Event] = {}
        self.cancelled: list[int] = []
        self.streams = 0

    def gate(self, mb: int) -> asyncio.Event:
        return self.gates.setdefault(mb, asyncio.Event())

    async def _step(self, req, context):
        mb = req.micro_batch_id
        try:
            await self.gate(mb).wait()
        except asyncio.CancelledError:
            self.cancelled.append(mb)
            raise
        if req.mode == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"micro-batch {mb} refused")
        return pb.StepResult(micro_batch_id=mb, round=req.round, output_flat=[mb], output_lens=[1])

    async def Steps(self, requests, context):
        self.streams += 1
        await serve_steps(requests, context, self._step)


async def start(stand: Stand, port: int):
    server = grpc.aio.server()
    pb_grpc.add_StageServicer_to_server(stand, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def step(mb: int, mode: str = "decode") -> pb.StepRequest:
    return pb.StepRequest(micro_batch_id=mb, round=7, mode=mode)


async def until(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_steps_in_flight_refusals_timeouts_cancels_and_a_stage_that_came_back():
    async def scenario():
        port = free_port()
        stand = Stand()
        server = await start(stand, port)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        ss = StepStream(pb_grpc.StageStub(channel))
        try:
            # three at once, ending in reverse order, the middle one refused
            calls = [asyncio.ensure_future(ss.step(step(mb, "bad" if mb == 2 else "decode"), 30)) for mb in (1, 2, 3)]
            await until(lambda: len(stand.gates) == 3)
            for mb in (3, 2, 1):
                stand.gate(mb).set()
                await asyncio.sleep(0.05)
            assert [c.done() for c in calls] == [True, True, True]
            assert calls[2].result().micro_batch_id == 3 and list(calls[2].result().output_flat) == [3]
            assert calls[0].result().micro_batch_id == 1 and list(calls[0].result().output_flat) == [1]
            e = calls[1].exception()
            assert isinstance(e, grpc.aio.AioRpcError)
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details() == "micro-batch 2 refused"

            # past its timeout: DEADLINE_EXCEEDED here, cancelled on the stage
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await ss.step(step(5), 0.2)
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: 5 in stand.cancelled)
            # a cancelled caller: its step cancelled on the stage
            task = asyncio.ensure_future(ss.step(step(6), 30))
            await until(lambda: 6 in stand.gates)
            task.cancel()
            await until(lambda: 6 in stand.cancelled)
            # the stream served all of it
            stand.gate(8).set()
            assert (await ss.step(step(8), 30)).micro_batch_id == 8
            assert stand.streams == 1 and stand.cancelled == [5, 6]

            # the stage goes away with a step waiting: it fails; the next step, once the
            # stage is back on its port, opens a new stream
            waiting = asyncio.ensure_future(ss.step(step(9), 30))
            await until(lambda: 9 in stand.gates)
            await server.stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await waiting
            assert ei.value.code() != grpc.StatusCode.OK
            back = Stand()
            server = await start(back, port)
            back.gate(10).set()
            for _ in range(50):  # the channel reconnects within its backoff
                try:
                    res = await ss.step(step(10), 30)
                    break
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                    await asyncio.sleep(0.1)
            assert res.micro_batch_id == 10 and back.streams >= 1
        finally:
            ss.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(scenario())
