"""``ppspec stage``: one pipeline stage as a gRPC server (grpc.aio on uvloop).

Compute runs on one worker thread, off the event loop, in the order this server admits
it. A non-last stage relays each step to the next stage with its hidden states and
returns the next stage's answer, so activations go stage to stage and the last stage's
result travels back up the chain to the router. The hidden states travel on the data plane
agreed with the next stage (``dataplane.py``: shared memory, CUDA IPC, torch.distributed
point-to-point between hosts, or inline bytes).

**Ordering.** ``CommitAccept(mb, r)`` and ``Verify(mb, r + 1)`` come from different
senders (the router, the previous stage) and may arrive in either order. A verify marks
its rows *pending* with its ``(micro_batch_id, round)``; any later step or release that
names a pending row waits until the commit of that round has been applied. A commit must
name exactly the micro-batch and round its rows are pending on, or it is refused. Once
admitted, a commit is applied and accounted for even when its call is cancelled.

**Bad input** is refused with a status naming the field before anything changes (see
:class:`StageServicer`); every stage refuses the same malformed step, the first before any
stage ran it. Each step is checked against its rows' state: a row starts with a prefill at
``seq_lens`` 0, and every later step must name the length the row holds.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import sys
import time
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ppspec.argtypes import add_control_channel_arg, add_cuda_graph_args, add_gc_freeze_arg, add_inline_steps_arg, add_data_plane_arg, address, cuda_graph_max_bs, device, nonneg_int, port, positive_finite_float, positive_float, positive_int
from ppspec.auth import KeyCheck, KeyFileError, client_interceptors, key_metadata, read_key_file
from ppspec.heap import freeze_startup_heap
from ppspec.proto.codec import (
    GRPC_OPTIONS, RECONNECT_OPTIONS, commit_from_pb, commit_to_pb, info_to_pb, release_from_pb, result_from_pb,
    result_to_pb, result_tokens, SpecMemo, step_from_pb, step_to_pb,
)
from ppspec.argtypes import DTYPES, resolve_dtype
from ppspec.proto.messages import (
    PREFILL, VERIFY, Commit, StepInput, fill_following, note_round, with_left_out,
)
from ppspec.proto.local import StepChannel, host_id, same_host, serve_socket, socket_name
from ppspec.proto.stream import StepAbort, StepStream, serve_steps
from ppspec.proto.stubs import STAGE_SERVICE, pb, pb_grpc

from . import dataplane
from .compute import ComputeQueue, inline_steps
from .dataplane_dist import DistInbox, DistLink, backend_for, peer_host
from .config import CheckpointError
from .pools import PoolExhaustedError
from .rounds import SampledRounds
from .runner import RowStateError, brief
from .warmup import warm_rows, warm_up

log = logging.getLogger("ppspec.stage")

ROUTER_MEMORY_S = 60.0  # routers Info reports: those that asked within this many seconds
REPLACED_MEMORY = 256  # routers a claim took this stage from, remembered (the oldest forgotten first)
NEXT_CHECK_S = 2.0  # how often a stage re-reads its next stage's Info (a restart changes it)



class _CommitFailed(Exception):
    """The commit of a commit-and-step job (``StageServicer._commit_and_run``) raised
    ``error``; the step did not run."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class StageServicer(pb_grpc.StageServicer):
    """gRPC front of a :class:`~ppspec.stage_server.runner.StageRunner`.

    Bad input is refused before anything changes, with a status naming the field:
    INVALID_ARGUMENT (malformed), FAILED_PRECONDITION (does not fit the rows' state or
    pending commits), RESOURCE_EXHAUSTED (no KV page: the pools are left as they were);
    INTERNAL for an unexpected failure while a step runs (rows it started are released,
    rows it continued refused until released). When a later stage refuses a step this
    stage already ran, this stage undoes what it can the same way: a verify's pending
    marks are dropped, rows a prefill started are released, and rows a decode or prefill
    continued are refused until released (their state went one step ahead of the
    later stages).

    Args:
        runner: the stage's runner.
        next_stage: ``host:port`` of stage ``pp_rank + 1`` (None on the last stage).
        relay_timeout: seconds a relayed step may take downstream before it fails.
        order_timeout: seconds a step or release waits for a pending commit.
    """

    # a later stage answered with one of these: it changed nothing (or undid it); denied:
    # another router owns that stage (a takeover reached it first)
    REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
               grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.PERMISSION_DENIED)
    # a relay that ended with one of these may have had no answer from the next stage, which
    # may still read the data-plane slot: the slot is retired, not reused
    UNANSWERED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                  grpc.StatusCode.UNKNOWN)

    def __init__(self, runner, next_stage: str | None, relay_timeout: float = 600.0, order_timeout: float = 600.0,
                 data_plane: str = "auto", key: bytes | None = None, inline: str = "auto"):
        self.runner = runner
        self.keyed = key is not None  # with a pipeline key, every mutating call names its router
        self.next_stage = next_stage
        self.relay_timeout, self.order_timeout = relay_timeout, order_timeout
        # the compute thread, and short steps inline when it is idle (compute.py)
        self.compute = ComputeQueue(f"stage{runner.pp_rank}", inline_steps(inline, str(runner.device)))
        self.pending: dict[int, tuple[int, int]] = {}
        self.committing: set[int] = set()  # rows whose commit is being applied
        self._settling: set[asyncio.Task] = set()  # admitted commits not yet accounted for (_settle_commit)
        self.instance_id = uuid.uuid4().hex[:12]  # this process; a restarted stage has another
        self.next_instance_id = ""  # the next stage's, as the wiring check last saw it
        # the next stage process that the data plane (``self.link``) was agreed with: one
        # that stops answering for a while (paused, busy) and answers again is the same
        # process, its mappings of this stage's slots alive, and steps in flight on the link:
        # only a new process (or a link it lost) is attached again
        self.attached_instance = ""
        # why the stage service is NOT_SERVING ("" while it serves), for Info: the router's
        # /health names it
        self.not_serving = "" if next_stage is None else f"the next stage at {next_stage} has not answered yet"
        self.routers: dict[str, float] = {}  # router_id -> monotonic time of its last Info
        self.owner = ""  # the router that last claimed this stage (Info with claim)
        # router -> the router whose claim took this stage from it: refused for good, also
        # once the new owner has left (a paused router must not come back to the stage)
        self.replaced: dict[str, str] = {}
        self.cond = asyncio.Condition()
        self.sampled = SampledRounds()  # the first stage: each micro-batch's last rounds (async scheduling)
        self.specs = SpecMemo()  # each row's last sampling spec, decoded once (codec.SpecMemo)
        # data plane: what this stage offers its next stage, the link agreed (bytes until the
        # attach), and the links of the stages that send to this one
        self.data_plane = dataplane.choose(data_plane, str(runner.device))
        self.dist_if_remote = data_plane == "auto"  # a slot transport's offer turns dist across hosts
        self.link = dataplane.BytesLink()
        self.transport_detail = ""
        self.receiver = dataplane.Receiver(str(runner.device), dist_inbox=DistInbox)
        self.hold = None  # test aid: awaited before each step of a Steps stream (DelayInterceptor.hold)
        # the control channel (proto/local.py): this stage's step socket ("" none), its host
        self.control_socket, self.host = "", host_id()
        self._next = self._relay = None
        if next_stage:
            self._channel = grpc.aio.insecure_channel(next_stage, options=GRPC_OPTIONS + RECONNECT_OPTIONS,
                                                      interceptors=client_interceptors(key))
            self._next = pb_grpc.StageStub(self._channel)
            # steps to the next stage: on its socket once the attach gave one, else the gRPC stream
            self._relay = StepChannel(StepStream(self._next, key_metadata(key)), key,
                                      who=f"stage {runner.pp_rank} -> stage {runner.pp_rank + 1}")

    @property
    def executor(self):
        return self.compute.executor

    @executor.setter
    def executor(self, executor) -> None:  # test aid: a spy around the worker
        self.compute.executor = executor

    async def _compute(self, fn, *args, inline: bool = False):
        """``fn(*args)`` on the compute queue, after every job admitted before it; with
        ``inline`` (a short step) on this thread when nothing is queued (compute.py)."""
        return await self.compute.run(fn, *args, inline=inline)

    @staticmethod
    def _short(inp: StepInput) -> bool:
        """A step that may run inline: decode or verify rows only (no prefill chunk)."""
        return inp.mode != PREFILL and not inp.num_prefill

    @staticmethod
    def _code(e: BaseException) -> grpc.StatusCode:
        if isinstance(e, (RowStateError, dataplane.NotAttachedError)):
            return grpc.StatusCode.FAILED_PRECONDITION
        if isinstance(e, (ValueError, IndexError)):
            return grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(e, PoolExhaustedError):
            return grpc.StatusCode.RESOURCE_EXHAUSTED
        return grpc.StatusCode.INTERNAL

    async def _fail(self, context, e: BaseException, what: str):
        code = self._code(e)
        if code == grpc.StatusCode.INTERNAL:
            log.error("stage %d: %s failed", self.runner.pp_rank, what, exc_info=e)
        await context.abort(code, f"stage {self.runner.pp_rank}: {e}")

    async def _wait_committed(self, rows, context, what: str, mark: tuple[int, int] | None = None,
                              marked: list[int] | None = None) -> bool:
        """Wait until no row is pending a commit; then, with ``mark``, mark ``marked`` (by
        default all of them) pending on it (in the same turn: no other step can slip in
        between)."""
        try:
            async with self.cond:
                if any(r in self.pending for r in rows):  # else no timer: the common case waits for nothing
                    async with asyncio.timeout(self.order_timeout):  # no task of its own, as wait_for makes
                        await self.cond.wait_for(lambda: not any(r in self.pending for r in rows))
                if mark is not None:
                    for r in rows if marked is None else marked:
                        self.pending[r] = mark
            return True
        except asyncio.TimeoutError:
            stuck = {r: self.pending[r] for r in rows if r in self.pending}
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"stage {self.runner.pp_rank}: {what} waited {self.order_timeout:.0f}s for commits of {brief(stuck)}",
            )
            return False

    def _denied(self, router_id: str, what: str) -> str | None:
        """Why a request from ``router_id`` is refused, or None: another router owns this
        stage, or a claim took the stage from that router. Without a pipeline key a request
        that names no router (a tool) is not fenced, nor one to a stage no router owns; with
        one, a request must name its router (the key says who may call, the router id which
        caller owns the rows)."""
        rank = self.runner.pp_rank
        if self.keyed and not router_id:
            return f"stage {rank}: {what} names no router (router_id is empty): refused, nothing changed"
        if router_id in self.replaced:
            return (f"stage {rank}: {what} from router {router_id}, but router {self.replaced[router_id]} took this "
                    f"stage over from it: refused, nothing changed")
        if router_id and self.owner and router_id != self.owner:
            return (f"stage {rank}: {what} from router {router_id}, but router {self.owner} owns this stage (the "
                    f"last to claim it): refused, nothing changed")
        return None

    async def _check_router(self, router_id: str, context, what: str) -> None:
        """Abort with PERMISSION_DENIED when :meth:`_denied` refuses the request."""
        why = self._denied(router_id, what)
        if why:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    async def _step(self, request: pb.StepRequest, context, verify: bool) -> pb.StepResult:
        """One step; on the first stage also async scheduling's part
        (docs/DESIGN.md, "Async scheduling"): a step that follows an earlier round of its
        micro-batch takes from that round's result what the router could not know (its
        continuing requests' input ids; for a following verify also their positions and the
        followed verify's commit), and every result (this stage's own at PP 1, the relay's
        answer else) is noted for the round after it."""
        if self.runner.pp_rank != 0:
            return await self._step_once(request, context, verify)
        key = (request.router_id, request.micro_batch_id)
        n, noted, ended = len(request.req_pool_indices), None, False
        self.sampled.begin(key, request.round)
        try:
            left_out, inp, commit = await self._follow(request, context, key) if request.follows_round \
                else ([], None, None)
            if verify and inp is not None and inp.mode == PREFILL:
                # a mixed verify whose verify requests all ended in the followed round: its
                # prefill chunks alone, a prefill (StepInput.without), run as a Forward
                verify = False
            # requests that ended in the followed round are not run: they emit nothing
            runs = (inp.req_pool_indices if inp is not None else request.req_pool_indices) or not left_out
            ran = await self._step_once(request, context, verify, inp, commit) if runs else None
            # the step as it ran (``request`` itself is filled in only where it is relayed)
            step = inp if inp is not None else request
            noted = note_round(step, *result_tokens(ran)) if ran else {}
            if left_out:
                ran = result_to_pb(with_left_out(ran and result_from_pb(ran), n, left_out, request.micro_batch_id,
                                                 request.round))
            woke = await self.sampled.ended(key, request.round, noted)
            ended = True
            if woke:
                # the step that follows this round goes first, to the compute thread, and
                # this result's write after it (the router does not wait for this one to
                # send the next: it went already)
                await asyncio.sleep(0)
            return ran
        finally:  # an abort, a cancelled call, an error: the round failed
            if not ended:
                await self.sampled.ended(key, request.round, noted)

    async def _follow(self, request: pb.StepRequest, context,
                      key: tuple[str, int]) -> tuple[list[int], StepInput, Commit | None]:
        """Fill the step in from round ``follows_round``'s result, once that round ended
        here (``fill_following``: FOLLOWS ids, a following verify's positions and the
        followed verify's commit, which the step then carries), and take out the requests
        that round ended (a stop id). Returns the indices of those taken out, the step
        filled in and decoded (not decoded again), and the commit it carries (None: none
        added here). Where the step is relayed, ``request`` is filled in too (without
        ``follows_round``, the commit in ``request.commit``); on the last stage (PP 1) it
        is left as it came."""
        rank, what = self.runner.pp_rank, f"round {request.round} of micro-batch {request.micro_batch_id}"
        try:
            # the first stage's step: no hidden states to decode; decoded while the round it
            # follows still runs
            unfilled = step_from_pb(request, self.specs)
            noted = await self.sampled.wait(key, request.follows_round, self.order_timeout)
            inp, left_out, commit = fill_following(unfilled, noted, self.pending)
            if commit is not None and request.HasField("commit"):
                raise ValueError(f"it follows the verify of round {request.follows_round}, whose commit the first "
                                 f"stage adds, and carries a commit of its own")
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"stage {rank}: {what} waited {self.order_timeout:.0f}s for round "
                                f"{request.follows_round}, which it follows")
        except ValueError as e:  # that round failed (FollowError), or malformed: refused, nothing changed
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stage {rank}: {what}: {e}")
        if self._next is None:
            return left_out, inp, commit
        if left_out:
            router_id, carried = request.router_id, None
            if request.HasField("commit"):  # relayed with the step (a copy: CopyFrom clears the original)
                carried = pb.CommitRequest()
                carried.CopyFrom(request.commit)
            request.CopyFrom(step_to_pb(inp))
            request.router_id = router_id
            if carried is not None:
                request.commit.CopyFrom(carried)
        else:  # in place: cheaper than encoding the step again
            for name in ("input_ids", "seq_lens", "output_lens", "num_drafts"):
                field = getattr(request, name)
                del field[:]
                field.extend(getattr(inp, name))
            request.follows_round = 0
        if commit is not None:
            request.commit.CopyFrom(commit_to_pb(commit, request.router_id))
        return left_out, inp, None

    async def _step_once(self, request: pb.StepRequest, context, verify: bool,
                         inp: StepInput | None = None, commit: Commit | None = None) -> pb.StepResult:
        """``inp``: ``request`` decoded already (by ``_follow``), else None; ``commit``: the
        commit the step carries when ``_follow`` added it and left ``request`` as it came
        (else ``request.commit``, if any)."""
        rank = self.runner.pp_rank
        what = f"{request.mode or 'step'} of micro-batch {request.micro_batch_id}"
        await self._check_router(request.router_id, context, what)
        # the commit of the micro-batch's last verify, if the step carries it: checked before
        # the step's own checks, and applied before the step runs (docs/DESIGN.md, "Commit rule")
        if commit is None and request.HasField("commit"):
            commit = commit_from_pb(request.commit)
        if commit is not None:
            await self._check_commit(commit, context)
        try:
            try:
                inp = step_from_pb(request, self.specs) if inp is None else inp
            except ValueError as e:
                raise StepAbort(grpc.StatusCode.INVALID_ARGUMENT, f"stage {rank}: {e}") from None
            if (inp.mode == VERIFY) != verify:
                raise StepAbort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"stage {rank}: mode {inp.mode!r} sent to {'Verify' if verify else 'Forward'} "
                                f"(Verify takes verify, Forward prefill and decode)")
            try:  # refuse a malformed step before it waits for commits or marks rows
                self.runner.check_input(inp, hidden=False)
            except (ValueError, IndexError) as e:
                raise StepAbort(self._code(e), f"stage {rank}: {e}") from None
        except StepAbort as e:  # the step is refused; the commit it carried applies all the same
            if commit is not None:
                await self._apply_commit(commit, context)
            await context.abort(e.code, e.details)
        # on the data plane: read on the compute thread with the step, no hand-off of its own
        ref = request.hidden_ref if request.HasField("hidden_ref") else None
        mark = (inp.micro_batch_id, inp.round) if verify else None
        if commit is not None and self._fusable(commit, inp.req_pool_indices):
            # the commit and the step in one job of the compute thread: nothing else can
            # wait for the rows between them (the usual case: a verify's commit riding on
            # its rows' next step)
            return await self._commit_and_run(request, context, inp, ref, commit, mark)
        commit_seconds = await self._apply_commit(commit, context) if commit is not None else None
        rows = inp.req_pool_indices
        # a verify's rows wait for its commit (not the prefill chunks of a mixed one)
        await self._wait_committed(rows, context, what, mark=mark, marked=inp.verify_rows)
        why = self._denied(request.router_id, what)  # again: another router may have claimed it while it waited
        if why:
            await self._unmark(inp.verify_rows, verify)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        link = self.link  # the link this step's tensor goes on (a re-attach may replace it meanwhile)
        try:
            out, sent = await self._compute(self._run, inp, link, ref, inline=self._short(inp))
        except Exception as e:
            await self._unmark(inp.verify_rows, verify)
            await self._fail(context, e, f"{inp.mode} of micro-batch {inp.micro_batch_id}")
        return await self._answer(request, context, inp, verify, out, sent, link, commit_seconds)

    def _fusable(self, c: Commit, rows: list[int]) -> bool:
        """Whether commit ``c`` and a step of ``rows`` may run as one job: once ``c``
        applies, no row of the step is pending a commit, and no row of either is being
        committed."""
        key, named = (c.micro_batch_id, c.round), set(c.req_pool_indices)
        pending = self.pending
        return (all(r not in pending or (pending[r] == key and r in named) for r in rows)
                and not self.committing.intersection(rows) and not self.committing.intersection(named))

    async def _commit_and_run(self, request, context, inp: StepInput, ref, c: Commit,
                              mark: tuple[int, int] | None) -> pb.StepResult:
        """Apply commit ``c`` then run ``inp`` in one job of the compute thread (one hand-off
        where two were): as :meth:`_apply_commit` then the step, with the same pending marks
        once each is done. A refused commit leaves the rows pending as they were and runs
        nothing; a step that fails after the commit applied keeps it applied."""
        verify = mark is not None
        key, rows = (c.micro_batch_id, c.round), c.req_pool_indices
        marked = inp.verify_rows if verify else []
        before = {r: self.pending.get(r) for r in marked}
        # no await since the checks (``_fusable``): the marks the two would leave, at once
        self.committing.update(rows)
        for r in marked:
            self.pending[r] = mark
        link = self.link

        def job():
            t0 = time.perf_counter()
            try:
                self.runner.commit_accept(c.micro_batch_id, c.round, rows, c.accept_lengths)
            except Exception as e:
                raise _CommitFailed(e) from e
            seconds = time.perf_counter() - t0
            return (seconds, *self._run(inp, link, ref))

        async def settle(committed: bool) -> None:
            async with self.cond:
                self.committing.difference_update(rows)
                for r in rows:  # committed: the commit's own marks go (those the step re-marked stay)
                    if committed and self.pending.get(r) == key:
                        del self.pending[r]
                if not committed:  # refused: as before the step
                    for r, was in before.items():
                        if was is None:
                            self.pending.pop(r, None)
                        else:
                            self.pending[r] = was
                self.cond.notify_all()

        async def finish() -> tuple:
            """Await the job, then account for it (a task of its own, as _settle_commit:
            a cancelled call leaves it to finish, so no row stays committing and a queued
            job still runs). Returns (the commit's error, the step's error, the job's result)."""
            try:
                result = await ran
            except _CommitFailed as failed:
                await settle(False)
                if not isinstance(failed.error, (ValueError, IndexError)):  # refused before writing, else undefined
                    await self._compute(self.runner.mark_broken, rows)
                return failed.error, None, None
            except Exception as e:
                await settle(True)
                return None, e, None
            await settle(True)
            return None, None, result

        ran = self.compute.submit(job, inline=self._short(inp))  # queued now, in admission order
        finished = asyncio.ensure_future(finish())
        self._settling.add(finished)  # referenced until done: the call may not wait for it
        finished.add_done_callback(self._settling.discard)
        commit_error, step_error, result = await asyncio.shield(finished)
        if commit_error is not None:
            await self._fail(context, commit_error, f"commit of micro-batch {key[0]} round {key[1]}")
        if step_error is not None:
            await self._unmark(inp.verify_rows, verify)
            await self._fail(context, step_error, f"{inp.mode} of micro-batch {inp.micro_batch_id}")
        commit_seconds, out, sent = result
        return await self._answer(request, context, inp, verify, out, sent, link, commit_seconds)

    async def _answer(self, request, context, inp: StepInput, verify: bool, out, sent, link,
                      commit_seconds: float | None) -> pb.StepResult:
        """The step's result: this stage's own on the last stage, else the next stage's
        answer to the relayed step."""
        rank = self.runner.pp_rank
        if self._next is None:
            out.stage_seconds = [out.compute_seconds]
            res = result_to_pb(out)
            if commit_seconds is not None:
                res.commit_seconds.append(commit_seconds)
            return res
        sent.fill(request)
        answered = False  # by the next stage: then it is done with the data-plane slot
        try:
            res = await self._relay.step(request, self.relay_timeout)
            answered = True
        except grpc.aio.AioRpcError as e:
            code = e.code()
            answered = code not in self.UNANSWERED
            if code in self.REFUSED:
                await self._undo(inp, verify)
            if code == grpc.StatusCode.FAILED_PRECONDITION and "AttachDataPlane" in (e.details() or ""):
                self.forget_next()  # the next stage lost this link: the wiring check attaches again
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                msg = f"stage {rank + 1} at {self.next_stage}: {e.details()}"
            else:
                msg = e.details()
            await context.abort(code, msg)
        finally:
            link.done(sent, answered)
        res.stage_seconds[:] = [out.compute_seconds] + list(res.stage_seconds)
        if commit_seconds is not None:
            res.commit_seconds[:] = [commit_seconds] + list(res.commit_seconds)
        return res

    def _run(self, inp, link, ref=None) -> tuple:
        """On the compute thread: the hidden states ``ref`` names on the data plane (checked
        against the step: a mismatch refuses it, nothing changed), the step, then (not on the
        last stage) its hidden states into ``link`` (ordered after the kernels that wrote them)."""
        if ref is not None:
            inp.hidden_states = self.receiver.read(ref, inp.micro_batch_id, inp.round)
        out = self.runner.step(inp)
        if self._next is None:
            return out, None
        try:
            return out, link.put(out.hidden_states, inp.micro_batch_id, inp.round)
        except (OSError, ValueError) as e:  # e.g. /dev/shm full: this step goes as bytes
            log.warning("stage %d: %s data plane failed (%s); micro-batch %d goes as bytes", self.runner.pp_rank,
                        link.transport, e, inp.micro_batch_id)
            if link.transport == "dist":  # a group that failed stays failed: the wiring check builds a fresh one
                self.forget_next()
            return out, dataplane.BytesLink().put(out.hidden_states, inp.micro_batch_id, inp.round)

    def forget_next(self) -> None:
        """The data plane to the next stage is to be attached again at the wiring check's next
        period: its process is new to this stage, or lost the link (or its group failed)."""
        self.next_instance_id = self.attached_instance = ""

    async def AttachDataPlane(self, request: pb.AttachRequest, context):
        reply = await self._compute(self.receiver.attach, request, peer_host(context.peer()))
        if same_host(request.host_id, self.host):  # steps from it may come on this stage's socket
            reply.control_socket = self.control_socket
        level = logging.INFO if not reply.detail else logging.WARNING
        log.log(level, "stage %d: the previous stage (instance %s) offered %s: %s%s", self.runner.pp_rank,
                request.sender_id, request.transport, reply.transport, f" ({reply.detail})" if reply.detail else "")
        return reply

    async def attach_next(self) -> None:
        """Agree on the data plane with the next stage (at start, and whenever it is a new
        process: its mappings of this stage's slots died with the old one). Falls back to
        bytes and says why when the next stage refuses the offer or has no data plane.

        Raises:
            grpc.aio.AioRpcError: the next stage did not answer (try again later).
        """
        rank, offer = self.runner.pp_rank, self.data_plane
        req = pb.AttachRequest(sender_id=self.instance_id, host_id=dataplane.host_id(), transport=offer,
                               dist_if_remote=self.dist_if_remote, dist_backend=backend_for(self.runner.device))
        link, probe, transport, detail = dataplane.BytesLink(), None, "bytes", ""
        if offer in ("shm", "cuda_ipc"):
            try:
                link = dataplane.SlotLink(offer, self.instance_id, str(self.runner.device))
                probe, req.nonce = await self._compute(dataplane.make_probe, link)
                req.probe.CopyFrom(probe.ref)
            except Exception as e:  # noqa: BLE001 - no shared memory here, no IPC export: bytes, and why
                link.close()
                link, req.transport, detail = dataplane.BytesLink(), "bytes", f"this stage cannot export {offer}: {e}"
        store_port, control = 0, ""
        try:
            reply = await self._next.AttachDataPlane(req, timeout=10.0)
            transport, detail, store_port = reply.transport, detail or reply.detail, reply.store_port
            control = reply.control_socket
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                link.close()
                raise
            detail = "the next stage has no data plane (an older ppspec)"
        # the steps' control messages: on the next stage's socket when it offered one (this host)
        self._relay.use(control, "" if control else "the next stage offers no step socket (another host, or its "
                                                    "--control-channel grpc)")
        if probe is not None:
            link.done(probe, answered=True)
        if transport != link.transport:
            link.close()
            link = dataplane.BytesLink()
        if transport == "dist":  # the next stage hosts the group's store: join it
            try:
                link = await self._compute(DistLink, self.instance_id, str(self.runner.device),
                                           peer_host(self.next_stage), store_port)
            except Exception as e:  # noqa: BLE001 - no route, no NCCL: bytes, and why
                transport, detail = "bytes", f"this stage cannot join the next stage's dist group: {e}"
        old, self.link, self.transport_detail = self.link, link, detail
        old.close()
        if detail:
            log.warning("stage %d: data plane to stage %d at %s: bytes (fell back from %s: %s)", rank, rank + 1,
                        self.next_stage, "dist" if store_port else offer, detail)
        else:
            log.info("stage %d: data plane to stage %d at %s: %s", rank, rank + 1, self.next_stage, transport)

    async def _undo(self, inp, verify: bool) -> None:
        """A later stage refused a step this stage ran: drop a verify's pending marks (its
        committed state is as before); release rows a prefill started; refuse rows a
        decode or prefill continued until released."""
        await self._unmark(inp.verify_rows, verify)
        rest = [p for p in inp.parts() if p.mode != VERIFY]  # a mixed verify's prefill chunks
        new = [r for p in rest if p.mode == PREFILL for r, s in zip(p.req_pool_indices, p.seq_lens) if s == 0]
        cont = [r for p in rest for r in p.req_pool_indices if r not in new]
        if new:
            await self._compute(self.runner.release, new)
        if cont:
            await self._compute(self.runner.mark_broken, cont)
            log.warning("stage %d: rows %s ran a %s that a later stage refused; refused until released",
                        self.runner.pp_rank, cont, inp.mode)

    async def _unmark(self, rows, verify):
        if verify:
            async with self.cond:
                for r in rows:
                    self.pending.pop(r, None)
                self.cond.notify_all()

    async def Forward(self, request, context):
        return await self._step(request, context, verify=False)

    async def Verify(self, request, context):
        return await self._step(request, context, verify=True)

    def run_step(self, request: pb.StepRequest, context):
        """One message of a Steps stream or of the step socket: a Forward or a Verify by its
        mode, or the CommitAccept or Release it carries (``commit_call``, ``release_call``)."""
        if request.HasField("commit_call") or request.HasField("release_call"):
            return self._call_on_channel(request, context)
        return self._step(request, context, verify=request.mode == VERIFY)

    async def _call_on_channel(self, request: pb.StepRequest, context) -> pb.StepResult:
        """A CommitAccept or a Release on the step channel, answered as the unary call (the
        same handler; a refusal through ``context.abort``), its commit's seconds in
        ``commit_seconds``: a unary call cost this stage ~400 us of CPU on the 2-core host
        and the router ~220 us, a frame on the socket a fraction (docs/PERFORMANCE.md,
        "Commits and releases on the step channel")."""
        if request.HasField("commit_call"):
            return pb.StepResult(commit_seconds=[(await self.CommitAccept(request.commit_call, context)).seconds])
        rep = await self.Release(request.release_call, context)
        return pb.StepResult(commit_seconds=[rep.commit_seconds] if request.release_call.HasField("commit") else [])

    async def Steps(self, requests, context):
        # Forward and Verify on one long-lived call (proto/stream.py), told apart by mode
        await serve_steps(requests, context, self.run_step, self.hold)

    async def CommitAccept(self, request: pb.CommitRequest, context):
        await self._check_router(request.router_id, context, self._commit_what(request))
        return pb.CommitReply(seconds=await self._apply_commit(commit_from_pb(request), context))

    @staticmethod
    def _commit_what(request: pb.CommitRequest) -> str:
        return f"commit of micro-batch {request.micro_batch_id} round {request.round}"

    async def _check_commit(self, c, context) -> None:
        """Abort the call when commit ``c`` is refused: malformed, or its rows are not all
        pending on its verify, or being committed already. Changes nothing."""
        rows, acc = c.req_pool_indices, c.accept_lengths
        key = (c.micro_batch_id, c.round)
        rank = self.runner.pp_rank
        what = f"commit of micro-batch {key[0]} round {key[1]}"
        d = self.runner.num_steps + 1
        bad = None
        if len(rows) != len(acc):
            bad = f"{len(rows)} req_pool_indices but {len(acc)} accept_lengths"
        elif len(set(rows)) != len(rows):
            bad = f"req_pool_indices repeat rows {brief(rows)}"
        elif any(not 1 <= a <= d for a in acc):
            bad = f"accept_lengths must be in [1, {d}], got {brief(acc)}"
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stage {rank}: {what}: {bad}")
        wrong = {r: self.pending.get(r) for r in rows if self.pending.get(r) != key}
        if wrong:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stage {rank}: {what} names rows not pending on it: {brief(wrong)}",
            )
        busy = [r for r in rows if r in self.committing]
        if busy:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"stage {rank}: {what}: rows {brief(busy)} are being committed already")

    async def _apply_commit(self, c, context) -> float:
        """Check and apply one commit (a CommitAccept, or the one a step carries): the rows
        must be pending on its verify; returns the stage's seconds for it. Aborts the call
        when refused (the rows stay pending for a valid commit). Once admitted, a commit is
        applied and accounted for even when its call is cancelled meanwhile (its router
        gone, the stream it rode on broken): see :meth:`_settle_commit`."""
        await self._check_commit(c, context)
        rows, acc = c.req_pool_indices, c.accept_lengths
        key = (c.micro_batch_id, c.round)
        what = f"commit of micro-batch {key[0]} round {key[1]}"
        self.committing.update(rows)  # no await since the checks: a second commit sees them

        def timed_commit():
            # timed on the worker thread: queueing behind other micro-batches is not commit time
            t0 = time.perf_counter()
            self.runner.commit_accept(c.micro_batch_id, c.round, rows, acc)
            return time.perf_counter() - t0

        # queued now, in the order the stage admitted it (before any later step or release)
        ran = self.compute.submit(timed_commit, inline=True)
        settle = asyncio.ensure_future(self._settle_commit(ran, key, rows))
        self._settling.add(settle)  # referenced until done: the call may not wait for it
        settle.add_done_callback(self._settling.discard)
        seconds, error = await asyncio.shield(settle)  # cancelled, the call leaves it to finish
        if error is not None:
            await self._fail(context, error, what)
        return seconds

    async def _settle_commit(self, ran: asyncio.Future, key: tuple[int, int], rows) -> tuple[float, Exception | None]:
        """Await an admitted commit's compute ``ran``, then account for it: its rows are no
        longer being committed and, once it wrote, no longer pending on ``key``; the steps
        and releases waiting for them are woken. A task of its own, which the commit's call
        never cancels: the bookkeeping waits for the condition's lock (a step waiting for a
        commit holds it across a turn), and a call cancelled there left its rows committing
        for good (the next commit of those rows was refused as "being committed already").
        Returns the commit's seconds and the error that failed it (None: applied)."""
        seconds, error, done = 0.0, None, True
        try:
            seconds = await ran
        except (ValueError, IndexError) as e:
            done, error = False, e  # refused before writing: the rows stay pending for a valid commit
        except Exception as e:
            error = e
            await self._compute(self.runner.mark_broken, rows)
        finally:
            async with self.cond:
                self.committing.difference_update(rows)
                if done:
                    for r in rows:
                        if self.pending.get(r) == key:
                            del self.pending[r]
                self.cond.notify_all()
        return seconds, error

    async def Release(self, request: pb.ReleaseRequest, context):
        await self._check_router(request.router_id, context, "release")
        rel = release_from_pb(request)
        rows = rel.req_pool_indices
        n = self.runner.max_rows
        bad = [r for r in rows if not 0 <= r < n]
        if bad:  # before anything, abandoned marks included, is dropped
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"stage {self.runner.pp_rank}: release: req_pool_indices {brief(bad)} outside [0, {n})")
        seconds = 0.0
        if rel.commit is not None:  # the rows' pending commit, applied first (as CommitAccept)
            if rel.abandon:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"stage {self.runner.pp_rank}: release: abandon with a commit to apply")
            await self._check_router(request.commit.router_id, context, self._commit_what(request.commit))
            seconds = await self._apply_commit(rel.commit, context)
        if rel.abandon:
            async with self.cond:
                dropped = {r: self.pending.pop(r) for r in rows if r in self.pending}
                self.cond.notify_all()
            if dropped:
                log.warning("release abandons the pending commits of rows %s", dropped)
        await self._wait_committed(rows, context, f"release after micro-batch {rel.micro_batch_id} round {rel.round}")
        await self._check_router(request.router_id, context, "release")  # again, after the wait
        try:
            await self._compute(self.runner.release, rows, rel.snapshot_slots, rel.drop_slots)
        except Exception as e:
            await self._fail(context, e, "release")
        return pb.ReleaseReply(commit_seconds=seconds)

    async def PrepareGrammar(self, request: pb.GrammarRequest, context):
        """Compile a request's grammar ahead of its steps (``StageRunner.prepare_grammar``:
        in a compile child process, ``stage_server/grammar.py``, not on the step executor,
        so steps run on meanwhile)."""
        await self._check_router(request.router_id, context, "prepare grammar")
        try:
            await asyncio.wrap_future(self.runner.prepare_grammar(request.grammar))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stage {self.runner.pp_rank}: {e}")
        return pb.GrammarReply()

    async def Info(self, request, context):
        i = self.runner.info()
        now = time.monotonic()
        seen = {r: now - t for r, t in self.routers.items() if r != request.router_id and now - t < ROUTER_MEMORY_S}
        if request.router_id and request.leaving:
            self.routers.pop(request.router_id, None)
            if self.owner == request.router_id:
                self.owner = ""
        elif request.router_id:
            self.routers = {r: t for r, t in self.routers.items() if now - t < ROUTER_MEMORY_S}
            self.routers[request.router_id] = now
            if request.claim and request.router_id not in self.replaced:  # a replaced router never again
                if self.owner and self.owner != request.router_id:
                    log.warning("stage %d: router %s takes over from router %s", self.runner.pp_rank,
                                request.router_id, self.owner)
                    self.replaced[self.owner] = request.router_id
                    while len(self.replaced) > REPLACED_MEMORY:
                        del self.replaced[next(iter(self.replaced))]
                self.owner = request.router_id
        return info_to_pb({
            **i, "instance_id": self.instance_id, "next_instance_id": self.next_instance_id, "routers": seen,
            "not_serving": self.not_serving, "replaced": request.router_id in self.replaced,
            "owner_router_id": self.owner, "pending_commits": len(self.pending),
            "transport": "" if self._next is None else self.link.transport, "transport_detail": self.transport_detail,
            "control_socket": self.control_socket, "host_id": self.host,
            "control": "" if self._relay is None else self._relay.transport,
            "control_detail": "" if self._relay is None else self._relay.detail,
            "inline_jobs": self.compute.inline_runs,
        })


class DelayInterceptor(grpc.aio.ServerInterceptor):
    """Test aid: hold every incoming call for a random 0..max_ms milliseconds, so that
    commits and relayed verifies arrive in random order (``PPSPEC_INJECT_DELAY_MS``)."""

    def __init__(self, max_ms: float, seed: int):
        self.max_s = max_ms / 1000.0
        self.rng = random.Random(seed)

    async def hold(self) -> None:
        """The delay of one call, or of one step on a Steps stream (a call of many steps)."""
        await asyncio.sleep(self.rng.random() * self.max_s)

    async def intercept_service(self, continuation, handler_call_details):
        await self.hold()
        return await continuation(handler_call_details)


async def serve_stage(args) -> int:
    import torch

    from .runner import StageRunner

    key = args.pipeline_key
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    spec = args.speculative_algorithm
    steps = args.speculative_num_steps if spec != "none" else 0
    try:
        runner = StageRunner(
            args.model, args.pp_rank, args.pp_size, max_rows=args.max_rows, kv_tokens=args.kv_tokens,
            num_speculative_steps=steps, use_mtp=spec == "mtp", max_context=args.max_context,
            dtype=getattr(torch, resolve_dtype(args.dtype, args.device)), device=args.device, fault=args.inject_fault,
            memory_budget=int(args.memory_budget_gb * 2**30) if args.memory_budget_gb else None,
            commit_design=args.commit_design, strict_lengths=True, cuda_graph_max_bs=cuda_graph_max_bs(args),
            prefix_cache_gb=args.prefix_cache_gb or 0.0,
        )
    except (CheckpointError, ValueError) as e:
        print(f"ppspec stage {args.pp_rank}: {e}", file=sys.stderr)
        return 2
    # before the port opens: the router (and /health) sees this stage only once it is warm
    try:
        runner.warmup_seconds = warm_up(runner)
    except PoolExhaustedError as e:  # the only pool it can exhaust is the KV pool (or MTP's, also --kv-tokens)
        print(f"ppspec stage {args.pp_rank}: --kv-tokens {args.kv_tokens} is too small: the stage's warm-up (a "
              f"micro-batch of {len(warm_rows(runner))} short sequences, as serving runs them) does not fit: {e}",
              file=sys.stderr)
        return 2
    log.info("stage %d: warm-up took %.2f s", args.pp_rank, runner.warmup_seconds)
    last = args.pp_rank == args.pp_size - 1
    interceptors = [KeyCheck(key, args.pp_rank)] if key else []  # first: a refused call waits for nothing
    if not key:
        log.warning("stage %d: no --pipeline-key-file: any process that reaches %s:%d can change this stage",
                    args.pp_rank, args.host, args.port)
    delay = float(os.environ.get("PPSPEC_INJECT_DELAY_MS", "0") or 0)
    delayer = DelayInterceptor(delay, seed=args.pp_rank) if delay > 0 else None
    if delayer is not None:
        interceptors.append(delayer)
    # no SO_REUSEPORT (gRPC's default on Linux): a second stage on a served port must fail,
    # not share the port and take over the first one's traffic unnoticed
    server = grpc.aio.server(options=GRPC_OPTIONS + [("grpc.so_reuseport", 0)], interceptors=interceptors)
    servicer = StageServicer(runner, None if last else args.next_stage, data_plane=args.data_plane, key=key,
                             inline=args.inline_steps)
    servicer.hold = delayer and delayer.hold
    swept = dataplane.sweep_dead_segments()
    if swept:
        log.info("stage %d: removed %d shared-memory segments of dead processes", args.pp_rank, len(swept))
    pb_grpc.add_StageServicer_to_server(servicer, server)
    sockets = None
    if args.control_channel == "auto":  # steps from callers on this host on a Unix socket (proto/local.py)
        name = socket_name(servicer.instance_id)
        try:
            sockets = await serve_socket(name, servicer.run_step, key, servicer.hold)
            servicer.control_socket = name
        except OSError as e:
            log.warning("stage %d: no step socket (%s): steps come on gRPC only", args.pp_rank, e)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    addr = f"{args.host}:{args.port}"
    try:
        bound = server.add_insecure_port(addr)
    except RuntimeError as e:
        print(f"ppspec stage {args.pp_rank}: cannot listen on {addr}: {e}", file=sys.stderr)
        return 2
    await server.start()
    stop = asyncio.Event()
    wiring_error: list[str] = []

    async def serving() -> None:
        await health_servicer.set(STAGE_SERVICE, health_pb2.HealthCheckResponse.SERVING)

    # "" (the process is up) at once; STAGE_SERVICE (it can take steps) on the last stage at
    # once, on the others once the next stage answers as stage pp_rank + 1
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if last:
        await serving()
    else:
        await health_servicer.set(STAGE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

        async def attached() -> bool:
            try:
                await servicer.attach_next()
                return True
            except grpc.aio.AioRpcError as e:
                servicer.forget_next()
                servicer.not_serving = f"the next stage at {args.next_stage} did not attach: {e.code().name}"
                await health_servicer.set(STAGE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
                return False

        async def check_next() -> None:
            # at start a wrong next stage ends this one; later (the next stage died, or
            # restarted with other settings) this stage stops serving until it is right
            # again: the router resumes only once this stage's own channel reaches it
            first = True
            while True:
                err, instance = await verify_next_stage(servicer._next, args.next_stage, runner, quiet=not first)
                if err and first:
                    wiring_error.append(err)
                    stop.set()
                    return
                if err:
                    if servicer.next_instance_id:
                        log.error("stage %d: %s; not serving until it is", runner.pp_rank, err)
                    servicer.next_instance_id = ""
                    servicer.not_serving = err
                    await health_servicer.set(STAGE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
                elif instance != servicer.attached_instance and not await attached():
                    pass  # the next stage went away meanwhile: try again next period
                else:
                    if instance != servicer.attached_instance:  # attached just now
                        if not first:
                            log.info("stage %d: the next stage at %s is a new process (%s)", runner.pp_rank,
                                     args.next_stage, instance)
                        servicer.attached_instance = instance
                    elif instance != servicer.next_instance_id:
                        log.info("stage %d: the next stage at %s answers again (the same process: its data plane "
                                 "kept)", runner.pp_rank, args.next_stage)
                    servicer.next_instance_id = instance
                    servicer.not_serving = ""
                    await serving()
                first = False
                await asyncio.sleep(NEXT_CHECK_S)

        checker = asyncio.ensure_future(check_next())
    mem = runner.memory_report()
    frozen = freeze_startup_heap(f"stage {args.pp_rank}", args.gc_freeze)  # loaded, warm, listening: what lives on
    print(
        f"ppspec stage {args.pp_rank}/{args.pp_size} layers [{runner.model.start}, {runner.model.end}) "
        f"listening on {args.host}:{bound}{f' and {servicer.control_socket}' if servicer.control_socket else ''}; "
        f"commit design {runner.commit_design}; prefill attention "
        f"{runner.prefill_attention}; warm-up {runner.warmup_seconds:.2f} s; startup heap frozen ({frozen} "
        f"objects); pools (bytes): {mem}",
        flush=True,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if not last:
        checker.cancel()
    await health_servicer.enter_graceful_shutdown()
    if sockets is not None:
        sockets.close()
    await server.stop(grace=2)
    servicer.compute.shutdown(wait=False, cancel_futures=True)
    servicer.link.close()
    if servicer._relay is not None:
        servicer._relay.close()
    if wiring_error:
        print(f"ppspec stage {args.pp_rank}: {wiring_error[0]}", file=sys.stderr)
        return 2
    return 0


def _same_endpoint(a: str, b: str) -> bool:
    loopback = {"127.0.0.1", "localhost", "0.0.0.0", "::1", "[::1]"}
    (ha, _, pa), (hb, _, pb_) = a.rpartition(":"), b.rpartition(":")
    return pa == pb_ and (ha == hb or (ha in loopback and hb in loopback))


async def verify_next_stage(stub, addr: str, runner, note_every: float = 10.0,
                            quiet: bool = False) -> tuple[str | None, str]:
    """Wait until the stage at ``addr`` answers ``Info``; return ``(None, its instance_id)``
    when it is stage ``pp_rank + 1`` of the same ``pp_size`` and starts at this stage's last
    layer + 1, else ``(what is wrong, its instance_id)`` (a stage wired to itself, to
    another stage, or to a stage of another pipeline would otherwise relay steps to the
    wrong layers). ``quiet`` (the periodic re-check): no waiting; a next stage that does not
    answer is ``(what is wrong, "")`` at once (this stage cannot relay a step meanwhile)."""
    me = runner.pp_rank
    start = time.monotonic()
    next_note = start + note_every
    while True:
        try:
            r = await stub.Info(pb.InfoRequest(), timeout=2.0)
            break
        except grpc.aio.AioRpcError as e:
            if quiet:
                return f"the next stage at {addr} does not answer ({e.code().name})", ""
            now = time.monotonic()
            if now > next_note:
                log.warning("stage %d: waiting for the next stage at %s (%.0f s): %s", me, addr, now - start,
                            e.code().name)
                next_note = now + note_every
        await asyncio.sleep(0.5)
    want = (me + 1, runner.pp_size, runner.model.end)
    got = (r.pp_rank, r.pp_size, r.layer_start)
    if got != want:
        return (f"--next-stage {addr} is stage {r.pp_rank} of {r.pp_size} starting at layer {r.layer_start}; "
                f"expected stage {want[0]} of {want[1]} starting at layer {want[2]}"), r.instance_id
    if not quiet:
        log.info("stage %d: next stage at %s is stage %d of %d", me, addr, r.pp_rank, r.pp_size)
    return None, r.instance_id


def build_parser() -> argparse.ArgumentParser:
    from ppspec.argtypes import DEMO_MODEL

    from ppspec.argtypes import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(prog="ppspec stage", description="run one pipeline stage (gRPC)",
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default=DEMO_MODEL, help="checkpoint folder (default: the demo model)")
    ap.add_argument("--pp-rank", type=nonneg_int, default=0, help="this stage's PP rank, 0 to pp_size - 1 (default: 0)")
    ap.add_argument("--pp-size", type=positive_int, default=1, help="pipeline stages in all (default: 1)")
    ap.add_argument("--host", default="127.0.0.1", help="address the gRPC server binds (default: 127.0.0.1)")
    ap.add_argument("--port", type=port, default=50051, help="gRPC port (default: 50051)")
    ap.add_argument("--next-stage", type=address, default=None,
                    help="host:port of stage pp_rank + 1 (every stage but the last; default: none, the last stage)")
    ap.add_argument("--max-rows", "--max-num-seqs", type=positive_int, default=64,
                    help="request rows (concurrent requests)")
    ap.add_argument("--kv-tokens", type=positive_int, default=65536, help="KV cache budget in tokens")
    ap.add_argument("--max-context", "--max-model-len", type=positive_int, default=None,
                    help="context limit in tokens (default: the checkpoint's)")
    ap.add_argument("--speculative-algorithm", default="none", choices=["none", "ngram", "mtp"],
                    help="draft source: ngram, or mtp (the last stage runs the checkpoint's MTP head) "
                         "(default: none)")
    ap.add_argument("--speculative-num-steps", type=positive_int, default=3,
                    help="drafts per round, a verify checks K + 1 tokens (default: 3)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="weights and activations; auto: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    ap.add_argument("--memory-budget-gb", type=positive_finite_float, default=None,
                    help="GiB this stage may use for weights, pools and CUDA graphs (stages sharing a GPU; "
                         "default: no check, the pools are as --max-rows and --kv-tokens size them)")
    ap.add_argument("--commit-design", default=None, choices=["copy", "replay"],
                    help="GDN verify commit: copy (per-step state scratch) or replay (step inputs, replayed "
                         "by the next verify); default replay on CUDA, copy on CPU")
    add_data_plane_arg(ap)
    add_control_channel_arg(ap)
    add_inline_steps_arg(ap)
    add_gc_freeze_arg(ap)
    add_cuda_graph_args(ap)
    ap.add_argument("--prefix-cache-gb", type=positive_finite_float, default=None,
                    help="GiB for prefix-cache snapshots of the recurrent state (default: no prefix cache on this "
                         "stage; their KV pages come from --kv-tokens)")
    ap.add_argument("--num-threads", type=nonneg_int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--pipeline-key-file", default=None,
                    help="file holding the secret shared with the router and the other stages: calls that change "
                         "this stage must carry it (default: none, any caller may)")
    ap.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``ppspec stage`` options, checked together (argparse's usage error, exit 2, otherwise)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.pp_rank >= args.pp_size:
        ap.error(f"--pp-rank {args.pp_rank} is not below --pp-size {args.pp_size}")
    last = args.pp_rank == args.pp_size - 1
    if last and args.next_stage:
        ap.error(f"--next-stage given to the last stage (--pp-rank {args.pp_rank} of --pp-size {args.pp_size}): "
                 f"it returns its results to the router")
    if not last and not args.next_stage:
        ap.error("--next-stage is required on every stage but the last")
    if args.next_stage and _same_endpoint(args.next_stage, f"{args.host}:{args.port}"):
        ap.error(f"--next-stage {args.next_stage} is this stage's own address")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.pipeline_key = None
    if args.pipeline_key_file:
        try:
            args.pipeline_key = read_key_file(args.pipeline_key_file)
        except KeyFileError as e:
            print(f"ppspec stage {args.pp_rank}: {e}", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        return uvloop.run(serve_stage(args))
    except ImportError:
        return asyncio.run(serve_stage(args))
