"""The stage-client interface: how the engine reaches the pipeline's stages.

:class:`Pipeline` is the one interface; two implementations: :class:`InProcessPipeline`
(stage runners in this process, for the single-process API and tests) and
``router.grpc_pipeline.GrpcPipeline`` (one gRPC process per stage). A step goes to the
first stage and comes back from the last; a commit and a release go to every stage.
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
from typing import Callable

from ppspec.proto.messages import (
    Commit, Release, StageInfo, StepInput, StepOutput, fill_following, note_round, with_left_out,
)

from .types import StageDownError


class Pipeline(abc.ABC):
    """What the engine (``router.engine.Engine``) calls. Stages order a step or release of
    rows after the pending commit of those rows (docs/DESIGN.md, "Ordering"), so the
    engine sends a commit and goes on without waiting for it.

    The ownership calls (one router per pipeline: ``check_start``, ``start_monitor``,
    ``owns_stages``, ``recovered``, ``leave``) matter only where other processes can
    reach the stages; in one process they do nothing.
    """

    # set by the engine: a stage restarted (``f(stage, detail)``), another router claimed
    # the stages (``f(detail)``)
    on_restart: Callable[[int, str], None] | None = None
    on_displaced: Callable[[str], None] | None = None
    # step() takes the commit of the micro-batch's last verify along (each stage applies it
    # before the step): a verify round then needs no CommitAccept call of its own
    commits_ride_steps = False

    @abc.abstractmethod
    async def info(self) -> list[StageInfo]:
        """Every stage's ``Info``, in PP-rank order."""

    @abc.abstractmethod
    async def step(self, inp: StepInput) -> StepOutput:
        """One micro-batch through every stage: the last stage's output, with
        ``stage_seconds`` (compute seconds per stage). Raises ValueError when a stage
        refused it (nothing changed), StageDownError / OSError when a stage failed."""

    @abc.abstractmethod
    async def commit_accept(self, c: Commit) -> list[float] | None:
        """``c`` applied on every stage, the last included; each stage's seconds, or None."""

    @abc.abstractmethod
    async def release(self, r: Release) -> list[float] | None:
        """Free ``r``'s rows on every stage once their pending commits are applied; with
        ``abandon`` (no commit will come: the round failed) without waiting for them.
        ``r.commit`` is applied first on each stage, as :meth:`commit_accept` applies it;
        returns its seconds per stage, or None."""

    async def prepare_grammar(self, grammar: str) -> None:
        """Compile a structured output's grammar (xgrammar EBNF) on the last stage before
        the request's first step; raises ValueError (the reason) when it does not compile."""

    @abc.abstractmethod
    def health(self) -> tuple[bool, str]:
        """(serving, detail)."""

    @abc.abstractmethod
    async def close(self) -> None:
        ...

    async def check_start(self, infos: list[StageInfo]) -> list[StageInfo]:
        """Before serving: the stages are this router's to use; returns fresh infos."""
        return infos

    def start_monitor(self) -> None:
        """Watch the stages' health from now on."""

    def recovered(self, infos: list[StageInfo]) -> None:
        """The engine resumed serving the stages as ``infos`` describe them."""

    async def owns_stages(self) -> bool:
        """Whether no other router has claimed the stages since this one did."""
        return True

    async def leave(self) -> None:
        """On a clean exit: tell the stages this router is gone."""


class InProcessPipeline(Pipeline):
    """Stages as ``StageRunner`` objects in this process, chained in order.

    Construct from runners, or with :meth:`build` from a checkpoint (one runner per PP
    rank). The router never touches ``hidden_states``: each runner's output is handed to
    the next runner as is.

    The async API computes on one worker thread, so that an HTTP server in the same event
    loop keeps answering; with ``inline`` (``LLM``, whose loop serves nothing else) on the
    loop's thread, without a thread hand-off per call.

    ``order_timeout``: seconds a step or release waits for the pending commit of its rows
    (as a stage server's ``order_timeout``); past it the call raises StageDownError naming
    the rows and the rounds whose commits never came, and the engine recovers (its release
    of every row abandons them) instead of waiting for ever.
    """

    def __init__(self, runners: list, order_timeout: float = 600.0):
        if not runners:
            raise ValueError("a pipeline needs at least one stage")
        if not order_timeout > 0:
            raise ValueError(f"order_timeout must be > 0 seconds, got {order_timeout}")
        self.runners = runners
        self.order_timeout = order_timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ppspec-inproc")
        # async API: rows whose verify awaits its commit -> (micro_batch_id, round). The
        # driver sends a commit in the background and may step the lane again first; as a
        # stage server does, a step or release of such a row waits for the commit.
        self._pending: dict[int, tuple[int, int]] = {}
        self._cond: asyncio.Condition | None = None  # made in the driver's event loop
        from ppspec.stage_server.rounds import SampledRounds

        # each micro-batch's last round, for a step that follows it (async scheduling), as
        # the first stage server keeps them
        self.sampled = SampledRounds()
        self.inline = False
        # micro-batches that may still start (None: any number): ``LLM.step`` lets one go
        self._permits: int | None = None
        self._gate: asyncio.Condition | None = None
        self.stepping = 0  # micro-batches past the gate, not yet back

    @classmethod
    def build(cls, model_dir: str, pp_size: int = 1, device: str = "cpu", order_timeout: float = 600.0,
              **runner_kwargs) -> "InProcessPipeline":
        """One ``StageRunner`` per PP rank. ``device``: one device for every stage, or a
        comma-separated device per stage (``"cuda:0,cuda:1"``: each stage on its GPU, the
        hidden states copied between them). Raises ValueError for a list of another length."""
        from ppspec.argtypes import stage_devices
        from ppspec.stage_server.runner import StageRunner

        devices = stage_devices(device, pp_size, spread_cuda=False)
        return cls([StageRunner(model_dir, k, pp_size, device=devices[k], **runner_kwargs) for k in range(pp_size)],
                   order_timeout)

    # ---- synchronous API (single-process driver)
    def info_sync(self) -> list[StageInfo]:
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
        if self.inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def allow_steps(self, n: int | None) -> None:
        """From now on at most ``n`` more micro-batches start (None: no limit); the others
        wait in :meth:`step`."""
        if self._gate is None:
            self._gate = asyncio.Condition()
        async with self._gate:
            self._permits = n
            self._gate.notify_all()

    async def _admit(self) -> None:
        if self._permits is None:
            return
        async with self._gate:
            await self._gate.wait_for(lambda: self._permits is None or self._permits > 0)
            if self._permits is not None:
                self._permits -= 1

    async def info(self) -> list[StageInfo]:
        return await self._run(self.info_sync)

    async def prepare_grammar(self, grammar: str) -> None:
        # on the last stage's grammar thread, beside the steps
        await asyncio.wrap_future(self.runners[-1].prepare_grammar(grammar))

    @property
    def _committed(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _wait_committed(self, rows: list[int], what: str) -> None:
        """Until no row of ``rows`` awaits a commit; StageDownError after ``order_timeout``
        seconds (a commit that never came: the rows' state is unknown)."""
        try:
            # asyncio.timeout, not wait_for: no task of its own, so the lanes' steps and
            # commits interleave on the loop exactly as without a bound (the fault tests'
            # interleavings depend on it)
            async with asyncio.timeout(self.order_timeout), self._committed:
                await self._committed.wait_for(lambda: not any(r in self._pending for r in rows))
        except TimeoutError:
            stuck = sorted((r, self._pending[r]) for r in rows if r in self._pending)
            shown = ", ".join(f"row {r} (micro-batch {m} round {k})" for r, (m, k) in stuck[:8])
            more = f" and {len(stuck) - 8} more" if len(stuck) > 8 else ""
            raise StageDownError(f"in-process stages: {what} waited {self.order_timeout:g}s for the commits of "
                                 f"{shown}{more}") from None

    async def step(self, inp: StepInput) -> StepOutput:
        key, noted, n, left_out = ("", inp.micro_batch_id), None, len(inp.req_pool_indices), []
        self.sampled.begin(key, inp.round)
        await self._admit()
        self.stepping += 1
        try:
            if inp.follows_round:  # what the router could not know: that round's result's (as stage 0 fills it)
                inp, left_out, commit = fill_following(inp, await self.sampled.wait(key, inp.follows_round, None),
                                                      self._pending)
                if commit is not None:  # the followed verify's, before the step, as the stages apply it
                    await self.commit_accept(commit)
            await self._wait_committed(inp.req_pool_indices, f"{inp.mode} of micro-batch {inp.micro_batch_id} "
                                                              f"round {inp.round}")
            if self.inline:
                # the other lanes' steps, the commits and the output task run between two
                # steps, in the order a pipeline of stage servers meets them
                await asyncio.sleep(0)
            out = await self._run(self.step_sync, inp) if inp.req_pool_indices else None
            self._pending.update((r, (inp.micro_batch_id, inp.round)) for r in inp.verify_rows)
            noted = note_round(inp, out.output_ids, out.drafts or []) if out is not None else {}
            if left_out:
                out = with_left_out(out, n, left_out, inp.micro_batch_id, inp.round)
            return out
        finally:  # None: the round failed, a step that follows it is refused
            self.stepping -= 1
            await self.sampled.ended(key, inp.round, noted)

    async def commit_accept(self, c: Commit) -> None:
        try:
            await self._run(self.commit_accept_sync, c)
        finally:
            await self._done(c.req_pool_indices, (c.micro_batch_id, c.round))

    async def release(self, r: Release) -> list[float] | None:
        rows = r.req_pool_indices
        secs = await self.commit_accept(r.commit) if r.commit is not None else None
        if r.abandon:
            await self._done(rows, None)
        await self._wait_committed(rows, f"release of rows {rows[:8]}{' ...' if len(rows) > 8 else ''}")
        await self._run(self.release_sync, rows, r.snapshot_slots, r.drop_slots)
        return secs

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
