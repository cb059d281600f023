"""The stage's compute queue (stage_server/compute.py): jobs one at a time in submission
order; a short step inline on the event loop's thread only while no job is queued or
running on the worker, also when the caller of a running job was cancelled."""
import asyncio
import threading

import pytest

from ppspec.stage_server.compute import ComputeQueue, inline_steps


def test_inline_choice_follows_the_device():
    assert inline_steps("auto", "cuda:1") and not inline_steps("auto", "cpu")
    assert inline_steps("on", "cpu") and not inline_steps("off", "cuda:0")
    with pytest.raises(ValueError, match="--inline-steps 'sometimes'"):
        inline_steps("sometimes", "cpu")


def test_an_idle_queue_runs_a_short_job_on_the_loop_thread_and_a_busy_one_after_the_queued():
    async def main():
        q = ComputeQueue("t", inline=True)
        loop_thread = threading.get_ident()
        ran = []

        def job(name):
            ran.append((name, threading.get_ident()))
            return name

        assert await q.run(job, "alone", inline=True) == "alone"
        gate = threading.Event()
        first = q.submit(gate.wait)  # the worker is busy until the gate opens
        second = q.submit(job, "behind", inline=True)  # must not jump the queue
        third = q.submit(job, "not short")
        await asyncio.sleep(0.05)
        assert ran == [("alone", loop_thread)]
        gate.set()
        assert await first and await second == "behind" and await third == "not short"
        await asyncio.sleep(0)  # the count-down of the last job, on the loop
        assert [n for n, _ in ran] == ["alone", "behind", "not short"]
        assert all(t != loop_thread for _, t in ran[1:])
        assert q.queued == 0 and q.inline_runs == 1
        assert await q.run(job, "idle again", inline=True) == "idle again"
        assert ran[-1] == ("idle again", loop_thread) and q.inline_runs == 2
        q.shutdown()
    asyncio.run(main())


def test_a_cancelled_callers_running_job_keeps_the_next_short_job_off_the_loop():
    """The caller of a job the worker is running is cancelled (its router gone): the job
    runs on, so a short job after it must wait for it on the worker, not run beside it."""
    async def main():
        q = ComputeQueue("t", inline=True)
        started, gate, order = threading.Event(), threading.Event(), []

        def long_job():
            started.set()
            gate.wait()
            order.append("long")

        caller = asyncio.ensure_future(q.run(long_job))
        while not started.is_set():
            await asyncio.sleep(0.001)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        short = q.submit(lambda: order.append("short"), inline=True)
        assert order == [] and q.inline_runs == 0
        gate.set()
        await short
        assert order == ["long", "short"]
        q.shutdown()
    asyncio.run(main())


def test_an_inline_jobs_error_reaches_its_caller_and_the_queue_serves_on():
    async def main():
        q = ComputeQueue("t", inline=True)

        def bad():
            raise ValueError("rows 3, 4 are not held")
        with pytest.raises(ValueError, match="rows 3, 4"):
            await q.run(bad, inline=True)
        assert await q.run(lambda: 7, inline=True) == 7 and q.queued == 0
        q.shutdown()
    asyncio.run(main())


def test_without_inline_every_job_goes_to_the_worker():
    async def main():
        q = ComputeQueue("t", inline=False)
        here = threading.get_ident()
        assert await q.run(threading.get_ident, inline=True) != here and q.inline_runs == 0
        q.shutdown()
    asyncio.run(main())
