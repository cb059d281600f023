"""The stage's compute queue: one worker thread that runs jobs (steps, commits, releases)
one at a time in the order the stage admits them, and the inline step.

A job handed to the worker thread costs two thread hand-offs on its way: the event loop
wakes the worker, the worker's result wakes the event loop. On the H200's host each took
80-120 us (``python -m ppspec.bench.hop_trace --model M --stage-args "--device cuda:0"``:
"hand-off to the compute thread", "hand-off back to the event loop"), about 200 us of
every round at concurrency 1 and twice that at PP2, where a decode round of the 1.46B
checkpoint is ~1.8 ms. A decode or verify step that finds the queue empty therefore runs
*inline*, on the event loop's thread, with no hand-off: nothing runs beside it (the loop
submits every job, and none is queued or running), so the one-at-a-time order holds. While
steps overlap (async scheduling, several lanes) each finds the one before it queued or
running and goes to the worker, as before, so the worker picks the next step up the moment
the last one ends. Both ways hold once taken: a step that arrives while an inline one runs
is read only when it ends, and then finds the queue idle and runs inline too, its read and
checks (~100 us) between the two on the device where the worker would have overlapped them
(``--inline-steps off`` keeps every step on the worker). Inline is only for short steps on
a CUDA stage (a graph launch, and on the last stage the wait for its sampled tokens): a
prefill, or a CPU stage's forward, would hold the event loop (health, commits, the next
step's read) for its whole compute (docs/DESIGN.md, "Control channel").
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from ppspec.argtypes import INLINE_STEPS


def inline_steps(choice: str, device: str) -> bool:
    """Whether short steps may run inline for ``--inline-steps choice`` on ``device``
    (``auto``: on a CUDA stage)."""
    if choice not in INLINE_STEPS:
        raise ValueError(f"--inline-steps {choice!r}: one of {', '.join(INLINE_STEPS)}")
    return choice == "on" or (choice == "auto" and str(device).startswith("cuda"))


class ComputeQueue:
    """Jobs of one stage, one at a time in submission order: on the worker thread, or
    inline (see the module's docstring). Call from the event loop's thread only."""

    def __init__(self, name: str, inline: bool = False):
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.inline = inline
        self.queued = 0  # jobs submitted to the worker whose run has not ended
        self.inline_runs = 0  # jobs run inline (Info, tests)

    def submit(self, fn, *args, inline: bool = False) -> asyncio.Future:
        """Queue ``fn(*args)`` now (in admission order) and return its future. With
        ``inline`` (a short step) and an empty queue, it runs here and now instead."""
        loop = asyncio.get_running_loop()
        if inline and self.inline and self.queued == 0:
            done = loop.create_future()
            self.inline_runs += 1
            try:
                done.set_result(fn(*args))
            except Exception as e:  # noqa: BLE001  (the caller awaits it, as a worker's error)
                done.set_exception(e)
            return done
        cf = self.executor.submit(fn, *args)
        self.queued += 1
        # counted down once the job's run has ended (or it was cancelled before it ran), on
        # the loop: a caller cancelled while its job runs must not let an inline job start
        cf.add_done_callback(lambda _: self._ended(loop))
        return asyncio.wrap_future(cf, loop=loop)

    async def run(self, fn, *args, inline: bool = False):
        return await self.submit(fn, *args, inline=inline)

    def _ended(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._count_down)
        except RuntimeError:  # the loop is closed: the stage is exiting
            pass

    def _count_down(self) -> None:
        self.queued -= 1

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=cancel_futures)
