"""The router's engine: the scheduler driven over a pipeline, one asyncio task per lane.

Each lane (micro-batch slot) loops: form a micro-batch, send it through the pipeline,
apply the last stage's result to the scheduler, then — without waiting — send
``CommitAccept`` for that micro-batch's rows and round to every stage and release
finished rows. Stages order a commit before the next verify of the same rows, so the
lane goes straight on to its next round.

Overlap with compute (docs/DESIGN.md, "Scheduling"): there is one more lane than stages
by default, so while micro-batch i runs the router has already formed and sent micro-batch
i + 1 of another lane, and a stage that finishes one finds the next queued instead of
waiting for the router. Within a lane, async scheduling
(docs/DESIGN.md, "Async scheduling") forms and sends round r + 1 while round r is in
flight: a continuing request's input ids are what round r emits (a decode's token; with
MTP the bonus token and round r's drafts, its position and round r's commit too), which
the first stage fills in; so at concurrency 1 too a stage finds the next round queued.
What a result means to clients (tokens to the request streams, whose detokenization,
stop-string search and SSE writing follow, and the metrics) is handed to one output task
through a queue, after the lane has sent its next micro-batch.

Implements the ``AsyncEngine`` shape the HTTP layer (``router.api``) serves; ``LLM``
(``router.llm``) drives the same engine from its own event loop (``submit``, ``settle``,
``interrupted``).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from typing import AsyncIterator, Callable

from ppspec.proto.messages import Commit, Release, StageInfo

from .first_tokens import FirstTokens
from .metrics import RouterMetrics
from .pipeline import Pipeline
from .prefix_cache import PrefixCache
from .scheduler import Scheduler, Update, default_token_budget, kv_budget
from .types import (
    EngineError, InvalidRequestError, RequestOutput, SamplingParams, StageDownError, StepRefusedError, bad_words_token_ids,
    request_outputs,
)

log = logging.getLogger("ppspec.router")


# what the router scheduled by at start: a stage that comes back must still say the same.
# snapshot_slots: the prefix cache hands out slots below the fewest any stage had, and the
# recovery drops every slot of every stage; a stage back with fewer (no --prefix-cache-gb)
# refuses that release, and the router stayed down naming the failure from before
_STAGE_SHAPE = ("pp_rank", "pp_size", "layer_start", "layer_end", "num_layers", "num_speculative_steps", "has_mtp",
                "vocab_size", "max_rows", "max_context", "kv_tokens", "eos_token_ids", "snapshot_slots")


def compute_units(infos: list[StageInfo]) -> int:
    """How many of the stages can compute at once: one per accelerator (stages reporting
    the same ``device_uuid`` share one and take turns on it), one per CPU stage."""
    uuids = [i.get("device_uuid", "") for i in infos]
    return len({u for u in uuids if u}) + sum(1 for u in uuids if not u)


def default_lanes(units: int) -> int:
    """Micro-batches in flight by default: one per unit of ``units`` stages that compute at
    once (:func:`compute_units`), with or without speculation. A forward costs about the
    same at 32 rows as at 64 where it reads every weight once (a GPU) or where its fixed cost
    outweighs its rows' (a small model), so splitting the running requests over more lanes
    than units costs throughput, more than a stage idle while a synchronous round (a verify,
    or no async scheduling) goes round the router costs it. H200, 1.46B, PP1 at concurrency
    64 without speculation: 7658 tok/s with one lane against 6199 with two. CPU, MTP,
    concurrency 16, one lane against two (`served_vs_engine --variant`): the demo 419 against
    358 tok/s, the tiny checkpoint 843 against 650 (PP2: 718 with one, 668 with two, 541
    with three); docs/PERFORMANCE.md, "One lane per unit, with speculation too"."""
    return units


def default_in_flight(lanes: int) -> int:
    """Micro-batches of every lane in flight at most by default: two per lane (async
    scheduling: a lane's next round beside its last). Fewer (``--max-in-flight``) makes a
    lane send its next round beside the one in flight only while other lanes are idle: on
    the CPU, two lanes over one stage with MTP, one per lane cut the micro-batches ahead of
    a hitting request's first from 1.55-1.66 to 1.00 but not its TTFT, the stage waiting
    for each lane's turn round the router instead (docs/PERFORMANCE.md)."""
    return 2 * lanes


def _all_slots(infos: list[StageInfo]) -> dict:
    """Release's fields that drop every prefix-cache snapshot slot of any stage."""
    n = max((i.get("snapshot_slots", 0) for i in infos), default=0)
    return {"drop_slots": list(range(n))} if n else {}


def _changed_stages(before: list[StageInfo], now: list[StageInfo]) -> str:
    """'' when every stage reports the settings it started with, else what changed."""
    if len(before) != len(now):
        return f"{len(now)} stages answer, {len(before)} at start"
    diffs = []
    for k, (a, b) in enumerate(zip(before, now)):
        for key in _STAGE_SHAPE:
            if a.get(key) != b.get(key):
                diffs.append(f"stage {k} {key} is {b.get(key)!r}, was {a.get(key)!r}")
    return "; ".join(diffs)


class Engine:
    """Async engine over ``pipeline`` (a ``router.pipeline.Pipeline``: ``GrpcPipeline`` or
    ``InProcessPipeline``).

    Call :meth:`start` (reads every stage's ``Info``) before serving.

    Args:
        model_name: served model id. tokenizer: the checkpoint's HF tokenizer.
        speculative_algorithm: ``none``, ``ngram`` or ``mtp``, or None to infer it from
            the stages (an MTP head on the last stage: mtp; drafts without one: ngram).
        num_micro_batches: lanes, micro-batches in flight at most (default
            :func:`default_lanes`).
        wedge_timeout: seconds a micro-batch may stay outstanding before ``health``
            reports the pipeline wedged.
        stall_timeout: seconds a stage may fail the pipeline's health checks while
            micro-batches are in flight before those fail (StageDownError, HTTP 503) and
            their lanes stop waiting: a stage that hangs without dying ends its requests
            then, not at the step RPC's timeout.
        async_scheduling: form a lane's next micro-batch before its last one's result
            (``Scheduler``'s ``async_scheduling``); False: each round after the last's result.
        drafter: ``f(request, k) -> drafts`` replacing the n-gram lookup (``Scheduler``).
        on_round: called after each micro-batch's outputs went to their streams (``LLM.step``).
        max_in_flight: micro-batches of every lane in flight at most (default
            :func:`default_in_flight`): a lane sends its next round beside its one in flight
            only below it.
    """

    def __init__(self, pipeline: Pipeline, *, model_name: str, tokenizer, speculative_algorithm: str | None = None,
                 num_micro_batches: int | None = None, max_batch_size: int = 64,
                 max_num_batched_tokens: int | None = None, mixed_prefill_tokens: int | None = None,
                 chunk_size: int | None = None,
                 max_waiting: int = 4096, wedge_timeout: float = 60.0, stall_timeout: float = 10.0,
                 metrics: RouterMetrics | None = None, enable_prefix_caching: bool | None = None,
                 async_scheduling: bool = True, drafter=None, on_round: Callable[[], None] | None = None,
                 max_logprobs: int = 20, max_in_flight: int | None = None):
        self.pipeline = pipeline
        self.max_in_flight_arg = max_in_flight
        self.max_in_flight = 2
        self.max_logprobs = max_logprobs
        self.async_scheduling = async_scheduling
        self.drafter, self.on_round = drafter, on_round
        self.enable_prefix_caching = enable_prefix_caching  # None: on where every stage has a prefix cache
        self._cache_counted = (0, 0)  # prefix-cache token counters the metrics have (queried, hit)
        self.model_name, self.tokenizer = model_name, tokenizer
        self.spec = speculative_algorithm
        self.num_micro_batches = num_micro_batches
        self.max_batch_size, self.chunk_size, self.max_waiting = max_batch_size, chunk_size, max_waiting
        self.max_num_batched_tokens, self.mixed_prefill_tokens = max_num_batched_tokens, mixed_prefill_tokens
        self.wedge_timeout, self.stall_timeout = wedge_timeout, stall_timeout
        self.metrics = metrics
        self.scheduler: Scheduler | None = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.outstanding: dict[int, float] = {}  # lane -> send time of its oldest micro-batch in flight
        self._flights: dict[int, collections.deque] = {}  # lane -> its micro-batches in flight (_lane_loop)
        # lane -> the commit of its last verify, held for the lane's next step to carry
        # (Pipeline.commits_ride_steps), sent alone when no step forms at once
        self._riding: dict[int, Commit] = {}
        self.failure: str | None = None
        self.closing = False  # shutdown(): requests end, nothing new starts, no recovery
        self.displaced: str | None = None  # another router claimed the stages: down for good
        self._stale_rows: list[int] = []  # rows of failed requests, freed once recovered
        self._recover_error: str | None = None  # last recovery failure logged
        self._recovering = asyncio.Lock()
        self._wake = asyncio.Event()
        self._stopping = False  # _stop_lanes: the lane loops end
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        # request id -> its grammar's compile on the last stage (submit), cancelled when the
        # request ends first: the stage drops or stops a compile nobody waits for
        self._compiling: dict[str, asyncio.Task] = {}
        # (batch, result, update, seconds in flight) of each processed micro-batch, for the
        # output task; None wakes it to end
        self._outbox: asyncio.Queue = asyncio.Queue()
        self.max_model_len = 0
        self.vocab_size = 0  # the model's (config.json's vocab_size), once started
        self.stage_infos: list[StageInfo] = []
        self.first_tokens = FirstTokens()  # each request's path to its first token (router/first_tokens.py)

    async def start(self) -> None:
        infos = await self.pipeline.info()
        self.stage_infos = infos
        last = infos[-1]
        steps = last["num_speculative_steps"]
        inferred = "mtp" if last["has_mtp"] else ("ngram" if steps else "none")
        spec = self.spec or inferred
        if spec != inferred and not (spec == "ngram" and inferred == "mtp"):
            raise ValueError(f"--speculative-algorithm {spec} but the stages run {inferred}")
        if len({i["num_speculative_steps"] for i in infos}) != 1:
            raise ValueError("stages disagree on --speculative-num-steps")
        ranges = [(i["layer_start"], i["layer_end"]) for i in infos]
        if ranges[0][0] != 0 or ranges[-1][1] != infos[0]["num_layers"] or any(
            a[1] != b[0] for a, b in zip(ranges, ranges[1:])
        ):
            raise ValueError(f"stage layer ranges {ranges} do not chain over {infos[0]['num_layers']} layers")
        self.spec = spec
        self.max_model_len = min(i["max_context"] for i in infos)
        units = compute_units(infos)
        lanes = self.num_micro_batches or default_lanes(units)
        self.max_in_flight = self.max_in_flight_arg or default_in_flight(lanes)
        kv_tokens, page_size = kv_budget(infos)
        budget, mixed = default_token_budget(infos, self.max_batch_size, steps if spec != "none" else 0)
        self.scheduler = Scheduler(
            max_rows=min(i["max_rows"] for i in infos), kv_tokens=kv_tokens, page_size=page_size,
            max_context=self.max_model_len, num_lanes=lanes, max_batch_size=self.max_batch_size,
            max_num_batched_tokens=self.max_num_batched_tokens or budget,
            mixed_prefill_tokens=self.mixed_prefill_tokens or mixed,
            chunk_size=self.chunk_size, speculative_algorithm=spec, num_steps=steps,
            eos_token_ids=last["eos_token_ids"], max_waiting=self.max_waiting,
            prefix_cache=self._prefix_cache(infos, page_size), async_scheduling=self.async_scheduling,
            drafter=self.drafter, max_logprobs=self.max_logprobs, vocab_size=last["vocab_size"],
        )
        self.eos, self.vocab_size = last["eos_token_ids"], last["vocab_size"]
        infos = await self.pipeline.check_start(infos)  # gRPC: one router per pipeline, the relay chain
        self.pipeline.on_restart = self._on_stage_restart
        self.pipeline.on_displaced = self._on_displaced
        if self.scheduler.context_limited_by_kv:
            log.warning("the stages' KV pool (%d tokens) holds less than their context (%d tokens): requests are "
                        "limited to %d tokens", kv_tokens, self.max_model_len, self.scheduler.max_context)
        self.max_model_len = self.scheduler.max_context
        await self._reset_stages(infos)
        self.pipeline.start_monitor()
        self._stopping = False
        self._lane_gen = [0] * lanes
        self._loop = asyncio.get_running_loop()
        self._start_tasks()

    def _start_tasks(self) -> None:
        """A loop per lane, the stats and stall watches, the output task (on the engine's
        loop: ``interrupted`` runs while it is stopped)."""
        run = self._loop.create_task
        self._tasks = [self._run_lane(k) for k in range(self.scheduler.num_lanes)]
        self._tasks += [run(self._stats_loop()), run(self._stall_watch()), run(self._output_loop())]

    def _run_lane(self, lane: int) -> asyncio.Task:
        """Lane ``lane``'s loop as a task whose unexpected end (an exception out of the
        scheduler or the result's processing, not a failed step, which ``_complete``
        handles) fails the requests in flight and starts the lane again (``_lane_ended``),
        instead of leaving them to wait for ever."""
        t = self._loop.create_task(self._lane_loop(lane))
        t.add_done_callback(functools.partial(self._lane_ended, lane))
        return t

    def _lane_ended(self, lane: int, t: asyncio.Task) -> None:
        e = None if t.cancelled() else t.exception()
        if self._stopping or not isinstance(e, Exception):
            return  # cancelled (a stall, shutdown), replaced, or interrupted (LLM's KeyboardInterrupt)
        log.error("lane %d stopped on %s: %s; its requests fail and the lane starts again", lane,
                  type(e).__name__, e, exc_info=e)
        self._fail(f"lane {lane} stopped: {type(e).__name__}: {e}")
        if self._tasks and self._tasks[lane] is t:
            self._lane_gen[lane] += 1
            self._tasks[lane] = self._run_lane(lane)

    def _prefix_cache(self, infos: list[StageInfo], page_size: int) -> PrefixCache | None:
        """The prefix cache over the stages' snapshot slots (the fewest any stage has). With
        ``enable_prefix_caching`` None (the default): on when every stage has a prefix cache."""
        if self.enable_prefix_caching is False:
            return None
        none = [i["pp_rank"] for i in infos if not i.get("snapshot_slots")]
        if none and self.enable_prefix_caching is None:
            log.info("prefix caching off: stage %d has no prefix cache (--prefix-cache-gb)", none[0])
            return None
        if none:
            raise ValueError(f"--enable-prefix-caching, but stage {none[0]} has no prefix cache: start every stage "
                             f"with --prefix-cache-gb")
        return PrefixCache(min(i["snapshot_slots"] for i in infos), page_size)

    @property
    def prefix_caching(self) -> bool:
        """Whether prompts are looked up in a prefix cache: known once :meth:`start` read
        the stages (``enable_prefix_caching`` None turns it on there where every stage has
        one, as ``ppspec serve`` starts them)."""
        return self.scheduler is not None and self.scheduler.cache is not None

    async def flush_cache(self) -> int:
        """Evict every cached prefix no micro-batch uses now, on every stage (requests may
        run meanwhile). Returns the slots dropped.

        Raises StageDownError (HTTP 503), saying why: the pipeline is down now (nothing is
        evicted), or the stages did not confirm the drop within ``stall_timeout`` seconds
        (a stage that hangs) or failed it. The evicted slots are handed out again only once
        every stage has dropped them: when a late drop comes back, or at the recovery,
        which drops every slot."""
        if self.scheduler is None or self.scheduler.cache is None:
            return 0
        ok, detail = self.health()
        if not ok:
            raise StageDownError(f"prefix-cache flush refused: {detail}")
        self.scheduler.flush_cache()
        # the slots taken now, with the eviction: a drop that runs before this one's task
        # (a release's) would take them, and this one answer 0 before any stage dropped them.
        # The drop goes on in the background past the answer: only a stage's answer, or the
        # recovery, may free its slots
        drop = self._spawn(self._drop_evicted(self.scheduler.take_dropped_slots()))
        done, _ = await asyncio.wait({drop}, timeout=self.stall_timeout)
        if not done:
            raise StageDownError(f"prefix-cache flush not confirmed: the stages did not answer its drop within "
                                 f"{self.stall_timeout:g} s ({self.health()[1]}); its snapshots stay unused until "
                                 f"they do")
        dropped = drop.result()
        if isinstance(dropped, str):  # this drop's own failure, whatever the pipeline's state now
            raise StageDownError(f"prefix-cache flush failed: {dropped}")
        return dropped

    async def first_token_rows(self) -> dict:
        """The requests' paths to their first token (``FirstTokens.rows``)."""
        return self.first_tokens.rows()

    async def _drop_evicted(self, slots: list[int] | None = None) -> int | str:
        """Drop the prefix-cache slots evicted since the last call (or ``slots``, taken
        already) on every stage, then free them (their KV charge back). Returns how many, or
        why the drop failed (the pipeline then fails: the recovery drops every slot)."""
        if slots is None:
            slots = self.scheduler.take_dropped_slots()
        if not slots:
            return 0
        try:
            await self.pipeline.release(Release([], drop_slots=slots))
        except (StageDownError, OSError, EngineError, ValueError) as e:
            why = f"dropping prefix-cache snapshots: {e}"
            self._fail(why)  # the recovery drops every slot
            return why
        self.scheduler.slots_dropped(slots)
        self._record_cache()  # a flush's drop may come back late, with no step to follow it
        self._wake.set()
        return len(slots)

    # ------------------------------------------------------------------ client side
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream=None):
        """Queue a request; its outputs, then its final output or the error that ended it,
        go to ``stream`` (anything with ``put_nowait``; default a new ``asyncio.Queue``),
        which is returned. Raises before allocating anything."""
        q = asyncio.Queue() if stream is None else stream
        if params.bad_words and params.bad_words_token_ids is None:
            params.validate(self.scheduler.max_logprobs, self.scheduler.vocab_size)  # the words' types first
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        # a structured output's request waits for its grammar's compile on the last stage,
        # so that no step waits for one (stage_server/grammar.py)
        self.scheduler.add(request_id, prompt_token_ids, params, ready=params.grammar is None)
        self.queues[request_id] = q
        if self.metrics:
            self.metrics.on_request_arrived(request_id)
        if params.grammar is not None:
            # not a background task: settle() (LLM.step) does not wait for a compile
            t = self._loop.create_task(self._prepare_grammar(request_id, params.grammar))  # LLM: from outside it
            self._compiling[request_id] = t
            t.add_done_callback(lambda t: self._compiling.get(request_id) is t and self._compiling.pop(request_id))
        self._wake.set()
        return q

    async def _prepare_grammar(self, request_id: str, grammar: str) -> None:
        """Compile the request's grammar on the last stage, then let the scheduler admit it;
        one that does not compile ends the request with InvalidRequestError (HTTP 400:
        no row was taken)."""
        try:
            await self.pipeline.prepare_grammar(grammar)
        except ValueError as e:
            error: EngineError = InvalidRequestError(f"structured output: {e}", param="grammar")
        except EngineError as e:
            error = e
        except Exception as e:  # noqa: BLE001 -- any other fault ends the request, never leaves it waiting
            log.exception("compiling the grammar of request %s", request_id)
            error = EngineError(f"structured output: the grammar could not be prepared ({type(e).__name__}: {e})")
        else:
            self.scheduler.ready(request_id)
            self._wake.set()
            return
        req = self.scheduler.preparing.get(request_id)  # not yet ended by an abort or a failure
        if req is not None:
            self.scheduler.abort(request_id)  # no row: nothing to release
            self._end_dropped([req], lambda rid: error)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self.failure is not None or not self.pipeline.health()[0]:
            raise StageDownError(self.health()[1])
        q = self.submit(request_id, prompt_token_ids, params)
        outs = request_outputs(q, lambda: self.abort(request_id), lambda: self.queues.pop(request_id, None))
        async with contextlib.aclosing(outs):
            async for item in outs:
                yield item

    async def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        """Stop a request and free its rows (no-op for unknown or finished ids).
        ``finish_reason``: how it is counted, ``stop`` for a stop string the HTTP layer matched."""
        if self.scheduler is None:
            return
        req = self.scheduler.requests.get(request_id)
        waiting = req is not None and req.row < 0
        rows = self.scheduler.abort(request_id, finish_reason)
        self._cancel_compile(request_id)
        if rows:
            self._spawn(self._release_or_fail(rows, req.lane, self.scheduler.rounds[req.lane], "release after an abort"))
        if waiting or rows:
            self._finished(request_id, RequestOutput(request_id, [], finish_reason, len(req.prompt_ids), len(req.output_ids)))
        self._wake.set()

    def _cancel_compile(self, request_id: str) -> None:
        """The request ended before its grammar compiled: stop waiting for the compile
        (cancelling ``PrepareGrammar``, which the last stage takes as this request's giving
        up: ``GrammarRows.prefetch``)."""
        t = self._compiling.pop(request_id, None)
        if t is not None:
            t.cancel()

    def health(self) -> tuple[bool, str]:
        ok, detail = self.pipeline.health()
        if not ok:
            return False, detail
        if self.failure is not None:
            return False, self.failure
        now = time.monotonic()
        for lane, t0 in self.outstanding.items():
            if now - t0 > self.wedge_timeout:
                return False, f"pipeline wedged: micro-batch {lane} outstanding for {now - t0:.0f}s"
        return True, detail

    # ------------------------------------------------------------------ lanes
    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._background.add(t)
        t.add_done_callback(self._forget)
        return t

    def _forget(self, t: asyncio.Task) -> None:
        self._background.discard(t)
        exc = None if t.cancelled() else t.exception()
        # a KeyboardInterrupt went to the driver already (LLM: interrupted())
        if exc is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            log.error("background task %s failed", t.get_coro().__qualname__, exc_info=exc)

    def _deliver(self, out: RequestOutput) -> None:
        q = self.queues.get(out.request_id)
        if self.metrics and out.new_token_ids and out.request_id in self.queues:
            # (a request ended since its micro-batch came back, by an abort or a stop string
            # the HTTP layer matched: counted already)
            self.metrics.on_tokens(out.request_id, len(out.new_token_ids))
        if out.finished:
            self._finished(out.request_id, out)
        elif q is not None:
            q.put_nowait(out)

    def _finished(self, request_id: str, out: RequestOutput) -> None:
        q = self.queues.pop(request_id, None)
        if self.metrics:
            try:
                self.metrics.on_request_finished(request_id, out.finish_reason)
            except (KeyError, ValueError):
                pass
        if q is not None:
            q.put_nowait(out)

    async def _lane_loop(self, lane: int) -> None:
        """Drive lane ``lane``: keep up to two of its micro-batches in flight (the second while
        fewer than ``max_in_flight`` of every lane are), the next formed
        and sent as soon as the last one is (async scheduling, docs/DESIGN.md): its
        continuing requests' input ids come from the round in flight, which the first stage
        fills in, so a stage never waits a router round trip between two rounds of a lane.
        Results are processed in round order."""
        gen = self._lane_gen[lane]
        flights = self._flights[lane] = collections.deque()  # (batch, step task, sent at), oldest first
        try:
            # not ``while True``: on Python 3.11 wait_for can swallow a cancel (when the wake
            # lands in the same loop iteration), and the lane would run on beside its successor
            while not self._stopping and self._lane_gen[lane] == gen:
                if self.failure is not None and not flights:
                    await self._recover()
                    continue
                batch = self._schedule(lane) if (len(flights) < 2 and self.failure is None
                                                 and (not flights or self._may_send_follower())) else None
                commit = self._riding.pop(lane, None)
                # a step carries the commit only for rows all in it: refused, it fails them all
                # and their release abandons the commit on every stage (none is left pending);
                # and not a following verify, which carries the commit the first stage adds
                rides = commit is not None and batch is not None and not batch.fills_commit and \
                    set(commit.req_pool_indices) <= set(batch.rows)
                if commit is not None and not rides and self.failure is None:
                    self._spawn(self._commit(commit))
                if batch is not None:
                    inp = batch.step_input(self.eos)
                    step = self.pipeline.step(inp, commit) if rides else self.pipeline.step(inp)
                    sent = time.monotonic()
                    if batch.first:
                        ahead = sum(map(len, self._flights.values()))
                        for r in batch.first:
                            r.sent_at, r.sent_behind = sent, ahead
                    flights.append((batch, asyncio.ensure_future(step), sent))
                    self._set_in_flight(lane)
                    continue  # the next one at once, if one can form before this one's result
                if not flights:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass
                    continue
                await self._complete(lane, *flights[0])
                flights.popleft()
                self._set_in_flight(lane)
        finally:  # cancelled (a stall, shutdown): the steps still in flight go too
            for _, task, _ in flights:
                task.cancel()
            flights.clear()
            self._set_in_flight(lane)

    def _may_send_follower(self) -> bool:
        """Whether a lane with a micro-batch in flight may send its next round beside it
        (async scheduling): while fewer than ``max_in_flight`` micro-batches of every lane
        are in flight."""
        return sum(map(len, self._flights.values())) < self.max_in_flight

    def _schedule(self, lane: int):
        """The lane's next micro-batch (None: nothing to run now), after sending the releases
        of requests it preempted and the drops of prefix-cache slots it evicted."""
        sched = self.scheduler
        batch = sched.schedule(lane)
        preempted = sched.take_preempted()
        if preempted:
            if self.metrics:
                self.metrics.on_preemptions(len(preempted))
            self._spawn(self._release_or_fail(preempted, lane, sched.rounds[lane], "release after a preemption"))
        if sched.cache is not None and sched.cache.to_drop:
            self._spawn(self._drop_evicted())
        if batch is not None and self.metrics:
            now = time.monotonic()
            for r in batch.first:
                self.metrics.on_request_scheduled(r.request_id, len(r.prompt_ids), now)
        return batch

    async def _complete(self, lane: int, batch, task: asyncio.Future, started: float) -> None:
        """Await one micro-batch's result and apply it: the commit and releases go out in the
        background, the outputs to the output task."""
        try:
            res = await task
        except ValueError as e:  # a stage refused this micro-batch; the others go on
            self._fail_batch(batch, str(e))
            return
        except (StageDownError, OSError) as e:
            self._fail(f"{e}")
            return
        except Exception as e:  # noqa: BLE001  (anything else must not end this lane's task silently)
            log.exception("micro-batch of lane %d failed", lane)
            self._fail(f"{type(e).__name__}: {e}")
            return
        back = time.monotonic()
        up = self.scheduler.process(batch, res.output_ids, res.drafts, res.logprobs, res.prompt_logprobs)
        for b in range(batch.first_chunk, len(batch.requests)):
            r = batch.requests[b]
            # the chunk that ends its prompt samples its first token (not a recomputed one's)
            if batch.sample[b] and r.output_ids and r.prefill_batches:
                self.first_tokens.record(r, back)
        if up.commit is not None and not up.release_rows and self.pipeline.commits_ride_steps:
            self._riding[lane] = up.commit  # the lane's next step carries it (_lane_loop)
        elif up.commit is not None or up.release_rows:
            self._spawn(self._commit_and_release(up))
        # the lane forms and sends its next micro-batch before anything else of this one
        self._outbox.put_nowait((batch, res, up, time.monotonic() - started))
        self._wake.set()

    async def _output_loop(self) -> None:
        """Deliver each processed micro-batch's outputs to the request streams and record
        its metrics, off the lanes' path (in the order the results came)."""
        while True:
            item = await self._outbox.get()
            if item is None:
                return
            batch, res, up, seconds = item
            try:
                self._set_in_flight()
                if self.metrics and seconds is not None:
                    self.metrics.on_pipeline_step("verify" if batch.mode == "verify" else "forward", seconds,
                                                  sum(batch.extend_lens))
                self._record(batch, res, up)
                for out in up.outputs:
                    self._deliver(out)
                if self.on_round is not None:
                    self.on_round()
            except Exception:  # noqa: BLE001  (a metrics error must not stop every stream)
                log.exception("delivering micro-batch %d round %d failed", batch.micro_batch_id, batch.round)

    async def _commit_and_release(self, up: Update) -> None:
        """The commit of a micro-batch's verify and the release of its rows that ended: one
        call to each stage when both (the release carries the commit, which each stage
        applies first), else the one there is."""
        if up.release_rows:
            await self._release_or_fail(up.release_rows, up.micro_batch_id, up.round, commit=up.commit)
        else:
            await self._commit(up.commit)

    async def _commit(self, c: Commit) -> None:
        """CommitAccept ``c`` on every stage."""
        try:
            self._record_commit(await self.pipeline.commit_accept(c))
        except (StageDownError, OSError, EngineError, ValueError) as e:
            # a stage died or refused the commit: the rows' state is unknown, the full
            # recovery releases them
            self._fail(str(e))

    def _record_commit(self, secs: list[float] | None) -> None:
        if self.metrics and secs:
            for k, s in enumerate(secs):
                self.metrics.on_stage_rpc(k, "commit", s)

    async def _release_or_fail(self, rows: list[int], micro_batch_id: int, round: int, what: str = "",
                               abandon: bool = False, commit: Commit | None = None) -> None:
        """Release ``rows`` on every stage (``abandon``: without waiting for their commits;
        ``commit``: their pending commit, which each stage applies first), then make them
        free. When a stage fails the release (or refuses the commit), the rows wait for the
        recovery's release of every row (until then they are neither free nor held by a
        request: a row returned to the free list here could reach a stage that still holds it)."""
        if not rows:
            return
        try:
            snap = self.scheduler.release_snapshots(rows)
            self._record_commit(await self.pipeline.release(
                Release(rows, micro_batch_id, round, abandon, snapshot_slots=snap or [], commit=commit)))
        except (StageDownError, OSError, EngineError, ValueError) as e:
            self._stale_rows = self._stale_rows + rows
            self._fail(f"{what}: {e}" if what else str(e))
            return
        self.scheduler.free(rows)
        if self.scheduler.cache is not None and self.scheduler.cache.to_drop:
            await self._drop_evicted()
        self._wake.set()

    def _record(self, batch, res, up: Update) -> None:
        if not self.metrics:
            return
        mode = "verify" if batch.mode == "verify" else "forward"
        for k, s in enumerate(res.stage_seconds):
            self.metrics.on_stage_rpc(k, mode, s)
        self._record_commit(res.commit_seconds)  # the commit the step carried
        if batch.mode == "verify":
            self.metrics.on_verify_requests(up.num_drafts, up.accept_lengths)
        self._record_cache()
        self.metrics.set_queue(self.scheduler.num_running, self.scheduler.num_waiting)

    def _record_cache(self) -> None:
        """The prefix cache's tokens looked up and hit since the last call, and its slots'
        use now (after each step, and after a flush or a recovery: no step may follow it soon)."""
        c = self.scheduler.cache
        if not self.metrics or c is None:
            return
        seen = self._cache_counted
        self.metrics.on_prefix_cache(c.queried_tokens - seen[0], c.hit_tokens - seen[1], c.num_used / c.num_slots)
        self._cache_counted = (c.queried_tokens, c.hit_tokens)

    def _set_in_flight(self, lane: int | None = None) -> None:
        """After lane ``lane``'s micro-batches in flight changed: ``outstanding`` (the send
        time of its oldest) and the in-flight gauge (micro-batches of every lane)."""
        flights = self._flights.get(lane)
        if flights:
            self.outstanding[lane] = flights[0][2]
        elif lane is not None:
            self.outstanding.pop(lane, None)
        if self.metrics:
            self.metrics.set_in_flight(sum(map(len, self._flights.values())))

    # ------------------------------------------------------------------ failures
    def _on_stage_restart(self, stage: int, detail: str) -> None:
        """A stage answers as a new process (it restarted between two health checks): the
        requests it held are gone; recover as after a failure, which also checks that it
        came back with the settings the router scheduled by."""
        if not self.closing:
            self._fail(detail)

    def _on_displaced(self, detail: str) -> None:
        """Another router claimed the stages: end every request and never resume (its rows
        are no longer this router's; recovery would release the new owner's)."""
        self.displaced = detail
        self._fail(detail)

    def _fail(self, reason: str) -> None:
        """A stage failed: end every request with StageDownError, keep the router up."""
        if self.failure is None:
            (log.info if self.closing else log.error)("pipeline failure: %s", reason)
            self.failure = reason
        dropped, rows = self.scheduler.fail_all()
        for r in dropped:
            self._cancel_compile(r.request_id)
        self._stale_rows = self._stale_rows + rows
        self._riding.clear()  # the recovery releases those rows, abandoning their commits
        self._end_dropped(dropped, lambda rid: StageDownError(f"request {rid} failed: {reason}"))
        self.outstanding.clear()

    async def _stall_watch(self, period: float = 0.25) -> None:
        """Fail the in-flight micro-batches once the pipeline has been unhealthy (a stage
        not answering its health checks) for ``stall_timeout`` seconds with them
        outstanding; their lanes' step RPCs are cancelled (down the relay chain) and the
        lanes restart, to recover once every stage serves again."""
        down_since = None
        while True:
            await asyncio.sleep(period)
            ok, detail = self.pipeline.health()
            if ok or not self.outstanding or self.closing or self.displaced:
                down_since = None
                continue
            now = time.monotonic()
            down_since = down_since or now
            if now - down_since < self.stall_timeout:
                continue
            down_since = None
            stuck = sorted(self.outstanding)
            self._fail(f"{detail} (micro-batches in flight for {self.stall_timeout:g}s)")
            for lane in stuck:
                self._lane_gen[lane] += 1  # the old loop ends even if its cancel is swallowed
                self._tasks[lane].cancel()
                self._tasks[lane] = self._run_lane(lane)

    def _end_dropped(self, dropped, error) -> None:
        """Hand each dropped request's stream its error (``error(request_id)``); count it aborted."""
        for r in dropped:
            q = self.queues.pop(r.request_id, None)
            if q is not None:
                q.put_nowait(error(r.request_id))
            if self.metrics:
                try:
                    self.metrics.on_request_finished(r.request_id, "abort")
                except (KeyError, ValueError):
                    pass
        if self.metrics:  # no step may follow to update the gauges (_record)
            self.metrics.set_queue(self.scheduler.num_running, self.scheduler.num_waiting)

    def _fail_batch(self, batch, reason: str) -> None:
        """A stage refused one micro-batch (INVALID_ARGUMENT / RESOURCE_EXHAUSTED): end its
        requests with an internal error (HTTP 500) and release their rows everywhere,
        abandoning the commit the stages before the refusing one wait for. Requests of
        other micro-batches are not touched."""
        log.error("micro-batch %d round %d refused, failing its %d requests: %s",
                  batch.micro_batch_id, batch.round, len(batch.requests), reason)
        dropped, rows = self.scheduler.fail_requests(batch.requests)
        self._end_dropped(dropped, lambda rid: StepRefusedError(f"request {rid} failed: a pipeline stage refused its step: {reason}"))
        if rows:
            self._spawn(self._release_or_fail(rows, batch.micro_batch_id, batch.round,
                                              "release after a refused micro-batch", abandon=True))


    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """End every request now with StageDownError(reason) (HTTP 503; a stream gets the
        error event and ``[DONE]``) and accept nothing new. Called when the process is asked
        to stop, before the HTTP server closes its connections."""
        self.closing = True
        self._fail(reason)
        # the process may end as soon as the HTTP server closes (uvicorn re-raises the
        # signal): give the stages their rows back now, within the drain time
        self._spawn(self._stop_lanes())

    # ------------------------------------------------------------------ the in-process driver
    def settled(self) -> bool:
        """No commit, release or output of a micro-batch that came back is left to do."""
        return not self._background and self._outbox.empty()

    async def settle(self) -> None:
        """Until :meth:`settled` (``LLM`` between its calls: every row back on every stage)."""
        while not self.settled():
            if self._background:
                await asyncio.wait(list(self._background))
            else:
                await asyncio.sleep(0)  # the output task delivers

    def interrupted(self, reason: str) -> None:
        """The driver's event loop was cut (Ctrl-C inside ``LLM``): any task may have
        stopped anywhere, so end every request as after a stage failure, drop the commits
        and releases under way (the recovery releases every row on every stage, abandoning
        their commits), and restart the engine's tasks. Call :meth:`recover` next; called
        while the loop is stopped, before a task the interrupt woke runs on."""
        steps = [t for flights in self._flights.values() for _, t, _ in flights]
        for t in list(self._background) + self._tasks + steps:
            t.cancel()
            if t.done() and not t.cancelled():
                t.exception()  # a task the interrupt ended: retrieved, not logged at exit
        self._fail(reason)
        self._stale_rows = self._stale_rows + self.scheduler.releasing_rows()
        self._lane_gen = [g + 1 for g in self._lane_gen]
        self._start_tasks()

    async def recover(self) -> None:
        """Recover now after a failure (no-op without one); :attr:`failure` stays set when
        a stage does not serve yet or came back with other settings."""
        await self._recover(delay=0)

    async def _stop_lanes(self) -> None:
        """Stop the lane tasks (an in-flight step's RPC is cancelled down the relay chain),
        then release this router's rows on every stage."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if not self.closing and self.scheduler is not None:  # close() without shutdown(): end the requests first
            self.closing = True
            self._fail("the engine is closing")
        await self._release_own_rows()
        await self.pipeline.leave()

    async def _recover(self, delay: float = 0.5) -> None:
        """Once every stage serves again, release all rows everywhere and resume.

        Every lane calls this while the router is down; one recovers at a time, and a lane
        that finds the router recovered does nothing: a second release of every row,
        landing after serving resumed, would take rows from new requests."""
        await asyncio.sleep(delay)
        async with self._recovering:
            if self.failure is None:
                return
            await self._recover_once()

    async def _recover_once(self) -> None:
        if self.closing or self.displaced or not self.pipeline.health()[0]:
            return
        try:
            infos = await self.pipeline.info()
            changed = _changed_stages(self.stage_infos, infos)
            if changed:
                # a stage restarted with other settings (no MTP, other layers, a smaller pool):
                # serving on would silently change what the router schedules; stay down
                msg = f"pipeline not resumed: {changed}; restart the stage with its original settings"
                if msg != self._recover_error:
                    self._recover_error = msg
                    log.error("%s", msg)
                self.failure = msg
                return
            # the failed rounds' commits will never be sent: abandon them, or a stage that
            # survived would wait for them forever
            await self.pipeline.release(Release(list(range(min(i["max_rows"] for i in infos))), abandon=True,
                                                **_all_slots(infos)))
            self.pipeline.recovered(infos)
        except (StageDownError, OSError, EngineError) as e:
            if str(e) != self._recover_error:
                self._recover_error = str(e)
                log.warning("recovery attempt failed (retrying): %s", e)
            return
        self._recover_error = None
        if self.failure is not None:
            self.scheduler.clear_cache()  # every stage dropped every snapshot
            self._record_cache()  # no step may follow soon: the gauge would keep the usage of before
            self.scheduler.free(sorted(set(self._stale_rows)))
            self._stale_rows = []
            log.info("pipeline recovered after: %s", self.failure)
            self.failure = None

    async def _reset_stages(self, infos: list[StageInfo]) -> None:
        """A new router owns no row: rows the stages still hold, and verifies still pending
        their commit, belong to an earlier router (killed, or restarted mid-stream). Release
        them all (abandoning those commits) before serving, or the first request on such a
        row is refused ("still in use") or waits forever for a commit that never comes."""
        held = [(i["pp_rank"], i["rows_in_use"], i.get("pending_commits", 0), i.get("snapshots_in_use", 0))
                for i in infos if i["rows_in_use"] or i.get("pending_commits", 0) or i.get("snapshots_in_use", 0)]
        if not held:
            return
        log.warning("stages hold rows of an earlier router (stage, rows, pending commits, prefix snapshots): %s; "
                    "releasing them", held)
        await self.pipeline.release(Release(list(range(self.scheduler.max_rows)), abandon=True, **_all_slots(infos)))

    async def _release_own_rows(self, timeout: float = 5.0) -> None:
        """On close: give back on every stage the rows this router holds (its failed and
        finishing requests; best effort, ``timeout`` seconds), abandoning their pending
        commits, so that the stages are left as a new router expects them. Only its own:
        another router may already serve these stages."""
        if self.scheduler is None or self.displaced:  # a displaced router's rows are the new owner's
            return
        rows = sorted(set(self._stale_rows) | set(self.scheduler.releasing_rows()))
        if not rows:
            return
        if not await self.pipeline.owns_stages():
            log.warning("another router claimed the stages: this one releases nothing on close")
            return
        try:
            await asyncio.wait_for(self.pipeline.release(Release(rows, abandon=True)), timeout)
        except (asyncio.TimeoutError, StageDownError, OSError, EngineError, ValueError) as e:
            log.warning("could not release the stages' rows on close: %s", e)
            return
        self._stale_rows = []
        self.scheduler.free([r for r in rows if r in self.scheduler.releasing_rows()])

    async def _stats_loop(self, period: float = 2.0) -> None:
        """Stage busy fraction and pool usage for the metrics, from each stage's Info."""
        prev: dict[int, tuple[float, float]] = {}
        while True:
            await asyncio.sleep(period)
            if not self.metrics or self.failure is not None:
                continue
            try:
                infos = await self.pipeline.info()
            except (StageDownError, OSError, EngineError):
                continue
            now = time.monotonic()
            for i in infos:
                k = i["pp_rank"]
                if k in prev:
                    t0, b0 = prev[k]
                    self.metrics.set_stage_busy(k, min(1.0, max(0.0, (i["busy_seconds"] - b0) / max(1e-9, now - t0))))
                prev[k] = (now, i["busy_seconds"])
                self.metrics.set_pool_usage(k, "rows", i["rows_in_use"] / max(1, i["max_rows"]))
                if i["kv_pages_total"]:
                    self.metrics.set_pool_usage(k, "kv", i["kv_pages_used"] / i["kv_pages_total"])
                self.metrics.set_pool_usage(k, "state", i["rows_in_use"] / max(1, i["max_rows"]))
                self.metrics.set_stage_forwards(k, i.get("forwards", {}))

    async def close(self) -> None:
        for rid in list(self._compiling):
            self._cancel_compile(rid)
        await self._stop_lanes()
        await self.pipeline.close()
