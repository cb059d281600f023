"""A commit whose call is cancelled once the stage admitted it (its router killed, the
stream it rode on broken) is applied and accounted for all the same
(``StageServicer._apply_commit``; docs/DESIGN.md, "Ordering").

The stage's bookkeeping after a commit (its rows no longer *committing*, their pending mark
dropped, the waiters woken) takes the lock of the stage's condition, which a step waiting
for a commit holds across an event-loop turn. A call cancelled while it waited for that
lock left its rows marked as being committed for good: the next router's first commit of
such a row was refused ("rows [...] are being committed already": seen in
test_chaos_soak_short and test_a_new_router_resets_the_stages_an_old_one_left_mid_stream
under CPU load). A call cancelled while its compute still waited for the compute thread
dropped the compute but not the row's pending mark: the row looked committed and was not.
Here both interleavings are injected in one process.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from ppspec.proto.codec import result_from_pb, step_to_pb
from ppspec.proto.messages import SamplingSpec, StepInput
from ppspec.proto.stubs import pb
from ppspec.stage_server.runner import StageRunner
from ppspec.stage_server.server import StageServicer

STEPS = 3
D = STEPS + 1
PROMPT = list(range(10, 30))


class Refused(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    """A unary call's context: ``abort`` ends the call with its status."""

    async def abort(self, code, details=""):
        raise Refused(code, details)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _servicer(make_ckpt) -> StageServicer:
    runner = StageRunner(make_ckpt("qwen3_5_ratio1"), max_rows=4, kv_tokens=256, num_speculative_steps=STEPS,
                         use_mtp=True, max_context=200, strict_lengths=True)
    return StageServicer(runner, None)  # PP1: the first stage and the last


async def _prefill_verify(s: StageServicer, row: int, mb: int, rnd: int):
    """Prefill ``PROMPT`` on ``row``, then verify its MTP drafts as round ``rnd`` of
    micro-batch ``mb`` (pending its commit). Returns the verify's accept length."""
    spec = [SamplingSpec(logprobs=3)]
    p = result_from_pb(await s.Forward(step_to_pb(StepInput(mb, rnd - 1, "prefill", [row], [0], [len(PROMPT)], PROMPT,
                                                            sampling=spec)), Context()))
    ids = [p.output_ids[0][0]] + p.drafts[0]
    v = result_from_pb(await s.Verify(step_to_pb(StepInput(mb, rnd, "verify", [row], [len(PROMPT)], [D], ids,
                                                           num_drafts=[len(p.drafts[0])], sampling=spec,
                                                           output_lens=[1])), Context()))
    assert s.pending == {row: (mb, rnd)}
    return len(v.output_ids[0]), v.output_ids[0][-1]


async def _decode(s: StageServicer, row: int, mb: int, rnd: int, seq: int, token: int):
    out = result_from_pb(await s.Forward(step_to_pb(StepInput(mb, rnd, "decode", [row], [seq], [1], [token],
                                                              sampling=[SamplingSpec(logprobs=3)])), Context()))
    return out.output_ids, out.logprobs


def _commit(mb, rnd, rows, acc):
    return pb.CommitRequest(micro_batch_id=mb, round=rnd, req_pool_indices=rows, accept_lengths=acc)


@pytest.mark.parametrize("when", ["settling", "queued"])
def test_a_commit_cancelled_once_admitted_is_applied_and_leaves_no_row_committing(make_ckpt, when):
    """The commit's call is cancelled (its router went away) once the stage admitted it:
    ``settling``: its compute ended while a step holds the condition's lock, which its
    bookkeeping waits for; ``queued``: its compute waits behind another on the compute
    thread. Either way the row is committed (its decode equals that of the same request
    committed without a cancel), nothing stays pending or committing, and a new router that
    takes the row over (release with abandon, a new request) commits it as usual."""
    s = _servicer(make_ckpt)
    gate = threading.Event()

    async def scenario():
        # the reference: the same request on row 1, its commit not cancelled
        acc, last = await _prefill_verify(s, 1, mb=2, rnd=5)
        await s.CommitAccept(_commit(2, 5, [1], [acc]), Context())
        want = await _decode(s, 1, 2, 6, len(PROMPT) + acc, last)
        await s.Release(pb.ReleaseRequest(req_pool_indices=[1]), Context())

        acc0, last0 = await _prefill_verify(s, 0, mb=1, rnd=9)
        assert (acc0, last0) == (acc, last)  # the same request
        if when == "settling":
            await s.cond.acquire()  # a step waiting for a commit holds the lock across a turn
        else:
            # the compute thread runs something else meanwhile
            busy = asyncio.get_running_loop().run_in_executor(s.executor, gate.wait)
        call = asyncio.ensure_future(s.CommitAccept(_commit(1, 9, [0], [acc0]), Context()))
        await asyncio.sleep(0)  # admitted: its compute queued
        assert s.committing == {0}
        if when == "settling":
            await s._compute(lambda: None)  # the compute thread is FIFO: the commit ran
            for _ in range(3):
                await asyncio.sleep(0)
            assert not call.done()  # its bookkeeping waits for the lock
        call.cancel()  # the router that sent it went away
        if when == "settling":
            s.cond.release()
        else:
            gate.set()
            await busy
        with pytest.raises(asyncio.CancelledError):
            await call
        await s._compute(lambda: None)  # after the commit's compute, if it still ran
        for _ in range(3):  # anything the cancelled call left to finish
            await asyncio.sleep(0)
        assert (s.committing, s.pending) == (set(), {})
        got = await _decode(s, 0, 1, 10, len(PROMPT) + acc0, last0)
        assert got == want

        # a new router resets the stage and reuses the row: its commit applies
        await s.Release(pb.ReleaseRequest(req_pool_indices=[0], abandon=True), Context())
        acc2, _ = await _prefill_verify(s, 0, mb=1, rnd=3)
        await s.CommitAccept(_commit(1, 3, [0], [acc2]), Context())
        assert (s.committing, s.pending) == (set(), {})
        await s.Release(pb.ReleaseRequest(req_pool_indices=[0]), Context())

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    except Refused as e:
        pytest.fail(f"{e.code}: {e.details}")
    finally:
        gate.set()
        s.executor.shutdown()
