"""The stage server's path of a verify round between its event loop and its compute thread
(docs/DESIGN.md, "Ordering" and "Async scheduling"), on a StageServicer in this process:

- a step that carries the commit of its rows' last verify runs that commit and itself in
  one job of the compute thread (one hand-off, where a commit job and a step job were two),
  with the tokens, drafts and pending marks of the commit applied on its own first;
- a refused carried commit still leaves the rows pending on their verify and runs nothing;
- at PP 1 a following verify (round r + 1 sent before round r's result) reaches the compute
  thread before round r's answer leaves the step handler, so that the stage does not wait
  for round r's result to be written before it starts round r + 1.
"""
from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
import torch

from ppspec.proto.codec import commit_to_pb, result_from_pb, step_to_pb
from ppspec.proto.messages import FOLLOWS, Commit, SamplingSpec, StepInput
from ppspec.proto.stream import StepAbort, _StepContext
from ppspec.stage_server.runner import StageRunner
from ppspec.stage_server.server import StageServicer

STEPS = 3
D = STEPS + 1
PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("qwen3_5_ratio1")


class Counting(concurrent.futures.ThreadPoolExecutor):
    """The stage's compute thread, counting its jobs (``log``: names of the jobs, in order)."""

    def __init__(self, log: list):
        super().__init__(1)
        self.log = log

    def submit(self, fn, *a, **kw):
        self.log.append(getattr(fn, "__name__", "job"))
        return super().submit(fn, *a, **kw)


def servicer(ckpt, log: list) -> StageServicer:
    torch.set_num_threads(1)
    runner = StageRunner(ckpt, 0, 1, max_rows=4, kv_tokens=512, num_speculative_steps=STEPS, use_mtp=True,
                         strict_lengths=True)
    s = StageServicer(runner, None)
    s.executor.shutdown()
    s.executor = Counting(log)
    return s


def prefill(row: int, mb: int = 1, rnd: int = 1) -> StepInput:
    return StepInput(mb, rnd, "prefill", [row], [0], [len(PROMPT)], PROMPT, sampling=[SamplingSpec()])


def verify(row: int, seq: int, emitted: list[int], drafts: list[int], mb: int, rnd: int, out_len: int) -> StepInput:
    return StepInput(mb, rnd, "verify", [row], [seq], [D], [emitted[-1]] + drafts[:STEPS], num_drafts=[STEPS],
                     sampling=[SamplingSpec()], output_lens=[out_len])


async def step(s: StageServicer, inp, commit: Commit | None = None):
    m = step_to_pb(inp) if isinstance(inp, StepInput) else inp
    if commit is not None:
        m.commit.CopyFrom(commit_to_pb(commit, ""))
    return result_from_pb(await s._step(m, _StepContext(), verify=m.mode == "verify"))


def three_rounds(s: StageServicer, carried: bool, row: int = 0):
    """Prefill, verify (round 2), verify (round 3) with round 2's commit carried on it (or
    sent as a CommitAccept before it). Returns round 3's tokens and drafts and the jobs of
    the compute thread during round 3 (its commit included)."""
    async def run():
        p = await step(s, prefill(row))
        v = await step(s, verify(row, len(PROMPT), p.output_ids[0], p.drafts[0], 1, 2, 1))
        acc = len(v.output_ids[0])
        c = Commit(1, 2, [row], [acc])
        third = verify(row, len(PROMPT) + acc, v.output_ids[0], v.drafts[0], 1, 3, 1 + acc)
        n = len(s.executor.log)
        if carried:
            out = await step(s, third, c)
        else:
            await s._apply_commit(c, _StepContext())
            out = await step(s, third)
        jobs = s.executor.log[n:]
        assert s.pending == {row: (1, 3)} and not s.committing
        return (out.output_ids, out.drafts), jobs
    return asyncio.run(run())


def test_a_carried_commit_and_its_step_run_as_one_job_with_the_same_tokens(ckpt):
    log: list = []
    alone, jobs_alone = three_rounds(servicer(ckpt, log), carried=False)
    together, jobs = three_rounds(servicer(ckpt, log), carried=True)
    assert jobs_alone == ["timed_commit", "_run"]
    assert jobs == ["job"]  # the commit, then the step: one hand-off
    assert together == alone


def test_a_refused_carried_commit_leaves_its_rows_pending_and_runs_nothing(ckpt):
    """A carried commit that accepts more tokens than its verify had drafts passes the
    server's checks and is refused by the runner inside the commit-and-step job: the step
    does not run, the row stays pending on its verify at the length it held, and the right
    commit carried after it gives the tokens of a stage that never saw the refused one."""
    def run(s: StageServicer, refused_first: bool):
        async def go():
            p = await step(s, prefill(1))
            v0 = verify(1, len(PROMPT), p.output_ids[0], p.drafts[0], 1, 2, 1)
            v0.num_drafts = [1]  # one real draft: at most 2 tokens accepted
            v0.input_ids = v0.input_ids[:2] + [0] * (STEPS - 1)
            v = await step(s, v0)
            acc = len(v.output_ids[0])
            third = verify(1, len(PROMPT) + acc, v.output_ids[0], v.drafts[0], 1, 3, 1 + acc)
            if refused_first:
                lens = dict(s.runner.row_lens)
                n = len(s.executor.log)
                with pytest.raises(StepAbort) as e:
                    await step(s, third, Commit(1, 2, [1], [3]))
                assert "verified with 1 drafts" in e.value.details, e.value.details
                assert s.executor.log[n:] == ["job"]
                assert s.pending == {1: (1, 2)} and not s.committing and s.runner.row_lens == lens
            out = await step(s, third, Commit(1, 2, [1], [acc]))
            assert s.pending == {1: (1, 3)} and not s.committing
            return out.output_ids, out.drafts
        return asyncio.run(go())

    assert run(servicer(ckpt, []), True) == run(servicer(ckpt, []), False)


def test_a_following_verify_reaches_the_compute_thread_before_the_round_it_follows_answers(ckpt):
    """PP 1: round 3 follows round 2 (all its ids FOLLOWS, sent before round 2's result).
    Once round 2 ends, round 3 is filled in and handed to the compute thread (with round
    2's commit, in one job) before round 2's step handler returns its answer (which the
    stream then writes); round 3 gives the tokens of the same verify sent after round 2's
    result with the commit carried."""
    log: list = []
    s = servicer(ckpt, log)
    order: list = []
    want, _ = three_rounds(servicer(ckpt, []), carried=True)

    async def run():
        p = await step(s, prefill(0))
        second = verify(0, len(PROMPT), p.output_ids[0], p.drafts[0], 1, 2, 1)
        # the router's bounds: every token of round 2 accepted
        third = StepInput(1, 3, "verify", [0], [len(PROMPT) + D], [D], [FOLLOWS] * D, num_drafts=[STEPS],
                          sampling=[SamplingSpec()], output_lens=[1 + D], follows_round=2)

        async def round2():
            r = await step(s, second)
            order.append("round 2 answered")
            return r

        submit = s.executor.submit

        def spied(fn, *a, **kw):
            order.append(f"job {fn.__name__}")
            return submit(fn, *a, **kw)
        s.executor.submit = spied
        t2 = asyncio.ensure_future(round2())
        await asyncio.sleep(0)  # round 2 arrives first
        t3 = asyncio.ensure_future(step(s, third))
        _, r3 = await asyncio.gather(t2, t3)
        return (r3.output_ids, r3.drafts)

    got = asyncio.run(run())
    assert order == ["job _run", "job job", "round 2 answered"], order
    assert got == want


def test_a_step_cancelled_while_its_commit_and_run_job_runs_leaves_no_row_being_committed(ckpt):
    """The call of a step that carries a commit is cancelled (the router gave up on it)
    while its one job runs on the compute thread: the commit's rows are not left being
    committed (a later commit of theirs would be refused as a second one) and not pending on
    that commit, as after a cancelled CommitAccept; the verify's own marks stay for the
    router's release."""
    import threading

    s = servicer(ckpt, [])
    gate, inside = threading.Event(), threading.Event()

    async def run():
        p = await step(s, prefill(0))
        v = await step(s, verify(0, len(PROMPT), p.output_ids[0], p.drafts[0], 1, 2, 1))
        acc = len(v.output_ids[0])
        third = verify(0, len(PROMPT) + acc, v.output_ids[0], v.drafts[0], 1, 3, 1 + acc)
        run_step = s.runner.step

        def held(inp):  # round 3's step waits on the compute thread until the call is cancelled
            inside.set()
            gate.wait(60)
            return run_step(inp)
        s.runner.step = held
        t = asyncio.ensure_future(step(s, third, Commit(1, 2, [0], [acc])))
        while not inside.is_set():
            await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        gate.set()
        await asyncio.gather(*s._settling)  # what the cancelled call left to finish (the job, its accounting)
        return s.committing, dict(s.pending)

    committing, pending = asyncio.run(run())
    assert committing == set() and pending == {0: (1, 3)}
