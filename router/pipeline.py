"""The stage-client interface: how the driver reaches the pipeline's stages.

Two implementations behind the same methods: :class:`InProcessPipeline` (stage runners
in this process, for the single-process API and tests) and
``router.grpc_pipeline.GrpcPipeline`` (one gRPC process per stage). A step goes to the
first stage and comes back from the last; a commit and a release go to every stage.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time

from ppspec.proto.messages import StepInput, StepOutput

from .scheduler import Commit


class InProcessPipeline:
    """Stages as ``StageRunner`` objects in this process, chained in order.

    Construct from runners, or with :meth:`build` from a checkpoint (one runner per PP
    rank). The router never touches ``hidden_states``: each runner's output is handed to
    the next runner as is.
    """

    def __init__(self, runners: list):
        if not runners:
            raise ValueError("a pipeline needs at least one stage")
        self.runners = runners
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ppspec-inproc")
        # async API: rows whose verify awaits its commit -> (micro_batch_id, round). The
        # driver sends a commit in the background and may step the lane again first; as a
        # stage server does, a step or release of such a row waits for the commit.
        self._pending: dict[int, tuple[int, int]] = {}
        self._cond: asyncio.Condition | None = None  # made in the driver's event loop

    @classmethod
    def build(cls, model_dir: str, pp_size: int = 1, device: str = "cpu", **runner_kwargs) -> "InProcessPipeline":
        """One ``StageRunner`` per PP rank. ``device``: one device for every stage, or a
        comma-separated device per stage (``"cuda:0,cuda:1"``: each stage on its GPU, the
        hidden states copied between them). Raises ValueError for a list of another length."""
        from ppspec.argtypes import stage_devices
        from ppspec.stage_server.runner import StageRunner

        devices = stage_devices(device, pp_size, spread_cuda=False)
        return cls([StageRunner(model_dir, k, pp_size, device=devices[k], **runner_kwargs) for k in range(pp_size)])

    # ---- synchronous API (single-process driver)
    def info_sync(self) -> list[dict]:
        return [r.info() for r in self.runners]

    def step_sync(self, inp: StepInput) -> StepOutput:
        times = []
        out = None
        for r in self.runners:
            out = r.step(inp)
            times.append(out.compute_seconds)
            inp.hidden_states = out.hidden_states
        inp.hidden_states = None
        out.stage_seconds = times
        return out

    def commit_accept_sync(self, c: Commit) -> None:
        for r in self.runners:
            r.commit_accept(c.micro_batch_id, c.round, c.req_pool_indices, c.accept_lengths)

    def release_sync(self, rows: list[int], snapshot_slots: list[int] = (), drop_slots: list[int] = ()) -> None:
        """Release ``rows`` on every stage (``StageRunner.release``: first snapshotting those
        with a slot in ``snapshot_slots``), then drop the prefix-cache ``drop_slots``."""
        if rows or drop_slots:
            extra = (snapshot_slots, drop_slots) if (snapshot_slots or drop_slots) else ()
            for r in self.runners:
                r.release(rows, *extra)

    # ---- asynchronous API (the router's driver), compute on one worker thread
    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def info(self) -> list[dict]:
        return await self._run(self.info_sync)

    @property
    def _committed(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _wait_committed(self, rows: list[int]) -> None:
        async with self._committed:
            await self._committed.wait_for(lambda: not any(r in self._pending for r in rows))

    async def step(self, inp: StepInput) -> StepOutput:
        await self._wait_committed(inp.req_pool_indices)
        out = await self._run(self.step_sync, inp)
        if inp.mode == "verify":
            self._pending.update((r, (inp.micro_batch_id, inp.round)) for r in inp.req_pool_indices)
        return out

    async def commit_accept(self, c: Commit) -> None:
        try:
            await self._run(self.commit_accept_sync, c)
        finally:
            await self._done(c.req_pool_indices, (c.micro_batch_id, c.round))

    async def release(self, rows: list[int], micro_batch_id: int = 0, round: int = 0, abandon: bool = False,
                      snapshot_slots: list[int] = (), drop_slots: list[int] = ()) -> None:
        """Free rows on every stage once their commits are applied; with ``abandon`` (no
        commit will come: the round failed) without waiting for them. ``snapshot_slots`` /
        ``drop_slots``: as :meth:`release_sync`."""
        if abandon:
            await self._done(rows, None)
        await self._wait_committed(rows)
        await self._run(self.release_sync, rows, snapshot_slots, drop_slots)

    async def _done(self, rows: list[int], key: tuple[int, int] | None) -> None:
        """Rows' pending commit settled (``key`` None: whatever round it was)."""
        async with self._committed:
            for r in rows:
                if r in self._pending and (key is None or self._pending[r] == key):
                    del self._pending[r]
            self._committed.notify_all()

    def health(self) -> tuple[bool, str]:
        return True, "in-process stages"

    async def close(self) -> None:
        self._pool.shutdown(wait=False)


def now() -> float:
    return time.monotonic()
