"""The scheduler: continuous batching over micro-batch lanes, with stable request rows.

There is one scheduler. The single-process API (``router.llm``) and the pipeline router
(``router.engine``) both drive it through the same three calls::

    batch = scheduler.schedule(lane)              # a micro-batch for this lane, or None
    result = pipeline.step(batch.step_input())    # through every stage
    update = scheduler.process(batch, result)     # tokens, commit, rows to release
    pipeline.commit_accept(update.commit)         # every stage, the last included
    pipeline.release(update.release_rows)

A *lane* is one micro-batch slot of the pipeline (``micro_batch_id``); up to
``num_lanes`` micro-batches are in flight. A request belongs to one lane for its whole
life, so micro-batches in flight never share rows. Each request owns one
``req_pool_index`` from admission to release: every stage addresses its state, scratch
and KV by that row.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field

from ppspec.proto.messages import FOLLOWS, Commit, SamplingSpec, StageInfo, StepInput, stops_in

from .drafter import ngram_draft
from .kv_ledger import Letting, PageLedger
from .types import ContextLengthError, InvalidRequestError, RequestOutput, SamplingParams, TokenLogprob

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
# a prefill chunk ends where a prompt branches off a cached sequence when that caches at
# least this many tokens more than its hit: prompts that merely start alike (a chat
# template's opening and a first word: ShareGPT first turns share 1-5 tokens) get no split
MIN_BRANCH_TOKENS = 8
# branch points (prefixes where a prompt left a cached sequence) remembered, by hash: a
# chunk ends at one only when an earlier request branched there too (docs/DESIGN.md,
# "Prefix caching")
MAX_BRANCHES_SEEN = 4096


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=lambda: time.monotonic())
    row: int = -1
    lane: int = -1
    status: str = WAITING
    num_computed: int = 0          # tokens whose KV / state every stage holds
    output_ids: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # drafts for the next round
    finish_reason: str | None = None
    aborted: bool = False
    abort_reason: str = "abort"
    in_flight: int = 0             # micro-batches in flight that hold it (2 at most: async scheduling)
    # async scheduling: the round of its latest micro-batch in flight when the next may be
    # formed before that one's result (Scheduler._may_follow), 0 else; the tokens that
    # micro-batch adds to its row at most (a verify's D: its accept length is not known);
    # whether it verifies there (the next round's position and the commit come from its
    # result); and the round whose commit the first stage adds to the following step
    follows_round: int = 0
    follows_ext: int = 0
    follows_verify: bool = False
    commit_follows: int = 0
    held_row: int = -1             # ended while a later micro-batch in flight holds its row
    seed: int = 0
    reserved_tokens: int = 0       # KV tokens (whole pages) held for it on every stage
    order: int = 0                 # admission priority: lower is older (preempted last)
    # tokens of all_ids to prefill: the prompt, or after a preemption the prompt and every
    # output but the last (that one is the next decode's input, as after a first prefill)
    prefill_len: int = -1
    num_preemptions: int = 0
    output_counts: dict[int, int] = field(default_factory=dict)  # token -> times generated
    scheduled: bool = False  # has been in a micro-batch (a preempted one stays so)
    restore_slot: int = -1   # prefix-cache snapshot its next prefill chunk starts from
    cached_tokens: int = 0   # prompt tokens found in the prefix cache: the start of its first micro-batch
    branch_at: int = 0       # a prefill chunk ends here: the snapshot there serves the next request that shares it
    branch_key: int = 0      # hash of its tokens up to branch_at (+1: the filing key), while branch_at is set
    prompt_lps: list | None = None  # prompt_logprobs collected so far (None once sent)
    # its path to the first token (router/first_tokens.py): admitted into a lane, its first
    # micro-batch formed and sent (time.monotonic()), micro-batches it was in until then
    admitted_at: float = 0.0
    formed_at: float = 0.0
    sent_at: float = 0.0
    sent_behind: int = 0  # micro-batches of every lane in flight when its first was sent
    prefill_batches: int = 0
    _spec: SamplingSpec | None = field(default=None, repr=False, compare=False)  # spec()

    def __post_init__(self):
        if self.params.prompt_logprobs is not None:
            self.prompt_lps = []
        if self.prefill_len < 0:
            self.prefill_len = len(self.prompt_ids)

    @functools.cached_property
    def distinct_prompt_ids(self) -> list[int]:
        return sorted(set(self.prompt_ids))

    def spec(self, eos_token_ids: list[int]) -> SamplingSpec:
        """The request's sampling spec without what a step adds (the outputs its penalties
        and bad words count, its grammar, prompt logprobs: ``ScheduledBatch.step_input``),
        built once: never changed after, so that the router encodes it once
        (codec.SpecMemo)."""
        if self._spec is None:
            p = self.params
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            spec = SamplingSpec(p.temperature, p.top_p, p.top_k, p.min_p, self.seed, p.logprobs, p.min_tokens, banned,
                                p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            if p.repetition_penalty != 1.0:
                spec.prompt_token_ids = self.distinct_prompt_ids
            if p.logit_bias:
                spec.logit_bias_ids, spec.logit_bias_values = list(p.logit_bias), list(p.logit_bias.values())
            if p.allowed_token_ids:
                spec.allowed_token_ids = p.allowed_token_ids
            if p.bad_words_token_ids:
                spec.bad_word_lens = [len(w) for w in p.bad_words_token_ids]
                spec.bad_word_ids = [t for w in p.bad_words_token_ids for t in w]
            self._spec = spec
        return self._spec

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prefill_len

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class ScheduledBatch:
    """One micro-batch of one lane and round: what the stages receive.

    ``mode`` is that of its first ``len(requests) - num_prefill`` requests; the last
    ``num_prefill`` are prefill chunks sharing the forward (a mixed micro-batch, see
    ``StepInput.parts``); a ``prefill`` batch is all chunks (``num_prefill`` 0)."""

    micro_batch_id: int
    round: int
    mode: str
    requests: list[Request]
    seq_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]
    num_drafts: list[int]
    sample: list[bool]
    next_token_ids: list[int]
    num_prefill: int = 0
    rows: list[int] = field(default_factory=list)
    first: list[Request] = field(default_factory=list)  # requests in their first micro-batch
    output_lens: list[int] = field(default_factory=list)  # tokens generated before this round
    follows_round: int = 0  # async scheduling: the round whose tokens its FOLLOWS ids are (0: none)
    restore_slots: list[int] = field(default_factory=list)   # prefix cache, per request (-1: none, every non-chunk) or empty
    snapshot_slots: list[int] = field(default_factory=list)

    def __post_init__(self):
        # Rows are fixed when the micro-batch forms: a request that finishes in this round
        # gives its row back, but the commit still names the row it ran in.
        self.rows = [r.row for r in self.requests]
        self.first = [r for r in self.requests if not r.scheduled]
        if not self.output_lens:
            self.output_lens = [len(r.output_ids) for r in self.requests]
        if self.first:
            now = time.monotonic()
            for r in self.first:
                r.scheduled, r.formed_at = True, now

    @property
    def req_pool_indices(self) -> list[int]:
        return list(self.rows)

    @property
    def num_verify(self) -> int:
        """Requests this micro-batch verifies (its first ones; 0 unless mode is verify)."""
        return len(self.requests) - self.num_prefill if self.mode == "verify" else 0

    @property
    def fills_commit(self) -> bool:
        """A verify that follows a round in flight (async scheduling with MTP): the first
        stage adds the commit of the verify it follows (``fill_following``), so it carries
        none of the router's."""
        return bool(self.follows_round) and self.mode == "verify"

    @property
    def first_chunk(self) -> int:
        """Index of its first prefill chunk: 0 in a prefill batch, a mixed one's tail, or
        ``len(requests)`` when it has none (``StepInput.is_prefill``)."""
        return 0 if self.mode == "prefill" else len(self.requests) - self.num_prefill

    def step_input(self, eos_token_ids: list[int]) -> StepInput:
        """The stage message of this micro-batch (rows, lengths, tokens, sampling)."""
        specs = []
        first_chunk = self.first_chunk
        for b, (r, seq, ext) in enumerate(zip(self.requests, self.seq_lens, self.extend_lens)):
            chunk = b >= first_chunk  # a prefill chunk (a prefill batch, or a mixed one's tail)
            p, spec = r.params, r.spec(eos_token_ids)
            step = {}  # what this step adds to the request's spec
            if spec.penalized:  # what the penalties count: the history before this step
                step["output_token_ids"], step["output_token_counts"] = list(r.output_counts), list(r.output_counts.values())
            if spec.bad_word_lens:
                k = max(spec.bad_word_lens) - 1  # the outputs the longest word can need
                if k:
                    step["recent_output_ids"] = list(r.output_ids[-k:])
            if p.grammar is not None and chunk and seq + ext == r.prefill_len:
                # once per row, with the chunk that ends its prefill (the first sample, or a
                # recomputed request's next decode, needs it), whatever the chunk's start;
                # a recomputed request's outputs are the grammar's already
                step["grammar"], step["grammar_accepted_ids"] = p.grammar, list(r.output_ids)
            if chunk and p.prompt_logprobs is not None and r.prompt_lps is not None:
                step["prompt_logprobs"] = p.prompt_logprobs  # until they are sent (a recompute asks none)
            # the same object from round to round where nothing is added (codec.SpecMemo)
            specs.append(dataclasses.replace(spec, **step) if step else spec)
        return StepInput(
            self.micro_batch_id, self.round, self.mode, self.req_pool_indices, list(self.seq_lens),
            list(self.extend_lens), list(self.input_ids), list(self.num_drafts), list(self.sample),
            list(self.next_token_ids), specs, list(self.output_lens),
            restore_slots=list(self.restore_slots), snapshot_slots=list(self.snapshot_slots),
            num_prefill=self.num_prefill, follows_round=self.follows_round,
        )


@dataclass
class Update:
    """What a processed step result means: outputs to deliver, the commit every stage
    must apply, and rows to release once committed."""

    outputs: list[RequestOutput]
    commit: Commit | None
    release_rows: list[int]
    accept_lengths: list[int]
    num_drafts: list[int]
    micro_batch_id: int = 0
    round: int = 0


class Scheduler:
    """Admission, row allocation, micro-batch formation and result processing.

    Args:
        max_rows: request rows every stage holds (``req_pool_index`` range).
        kv_tokens: KV budget (tokens) of the smallest stage pool. A request holds whole
            pages for what its next micro-batch writes (:meth:`_kv_need`), grown before each
            one; when the pool is short, the youngest requests not in flight are preempted
            (their rows released on every stage, their tokens recomputed by a prefill when
            readmitted, as vLLM's recompute preemption), so the oldest always progress. A
            request whose whole life (``prompt + max_tokens``) cannot fit is refused at
            :meth:`add`.
        page_size: tokens per KV page of the stages (their pools hand out whole pages).
        max_context: longest sequence in tokens (prompt + completion); lowered to what the
            KV pool holds when that is less (``self.max_context`` is the limit in force).
        num_lanes: micro-batches in flight.
        max_batch_size: requests per micro-batch.
        max_num_batched_tokens: tokens per micro-batch (vLLM's token budget per forward):
            decode and verify rows first, then prefill chunks in the rest, in one forward
            (chunked prefill mixed with decode). At least one verify micro-batch
            (``max_batch_size * D``) and one KV page, else ValueError.
        mixed_prefill_tokens: prompt-chunk tokens of a micro-batch that also decodes or
            verifies (default: the budget). A lone prompt takes the whole budget, whose large
            chunks keep the GEMMs at the matrix units' rate; with decodes sharing the forward
            its chunks stay small enough that their inter-token latency stays near a
            decode's. A whole prompt of at most this many tokens joins beside decodes in the
            rest of the budget, past this cap.
        chunk_size: prompt tokens of one request per micro-batch at most (default: the
            whole budget, so that a lone long prompt runs in chunks as large as it).
        speculative_algorithm: ``none``, ``ngram`` or ``mtp``; num_steps drafts per round.
        eos_token_ids: ids that end a request unless ``ignore_eos``.
        max_waiting: queue bound; beyond it ``add`` raises QueueFullError.
        prefix_cache: a :class:`~ppspec.router.prefix_cache.PrefixCache` (None: off). An
            admitted request starts from the deepest snapshot of its prefill tokens; prefill
            chunks that end inside the prompt and finished requests leave snapshots. Their
            KV pages count in the KV budget; they are evicted (superseded ones first, then
            least recently used: ``PrefixCache``) before any request is preempted. The
            driver drops evicted slots (:meth:`take_dropped_slots`, then
            :meth:`slots_dropped`) and releases finished rows with :meth:`release_snapshots`.
        async_scheduling: form a lane's next micro-batch while its last one is in flight
            (docs/DESIGN.md, "Async scheduling"; the async ``Engine`` sets it): a request
            whose micro-batch in flight decodes, verifies MTP drafts or ends its prompt
            (:meth:`_may_follow`) continues in the next one, its input ids
            :data:`~ppspec.proto.messages.FOLLOWS`: the first stage fills in what that
            micro-batch's result says (``fill_following``: the token it emits; with MTP
            also the drafts, the position and the commit of that verify). A request that
            ends in the first gets its row released only after the second, whose tokens
            for it are dropped.
    """

    def __init__(
        self,
        *,
        max_rows: int,
        kv_tokens: int,
        max_context: int,
        page_size: int = 1,
        num_lanes: int = 1,
        max_batch_size: int = 64,
        max_num_batched_tokens: int = 2048,
        mixed_prefill_tokens: int | None = None,
        chunk_size: int | None = None,
        speculative_algorithm: str = "none",
        num_steps: int = 3,
        eos_token_ids: list[int] | None = None,
        max_waiting: int = 4096,
        ngram_min: int = 1,
        ngram_max: int = 4,
        drafter=None,
        prefix_cache=None,
        async_scheduling: bool = False,
        max_logprobs: int = 20,
        vocab_size: int | None = None,
    ):
        if speculative_algorithm not in ("none", "ngram", "mtp"):
            raise ValueError(f"unknown speculative algorithm {speculative_algorithm!r}")
        chunk_size = max_num_batched_tokens if chunk_size is None else chunk_size
        mixed_prefill_tokens = max_num_batched_tokens if mixed_prefill_tokens is None else mixed_prefill_tokens
        for name, v in (("max_rows", max_rows), ("num_lanes", num_lanes), ("max_batch_size", max_batch_size),
                        ("max_num_batched_tokens", max_num_batched_tokens), ("chunk_size", chunk_size),
                        ("mixed_prefill_tokens", mixed_prefill_tokens),
                        ("max_context", max_context)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if speculative_algorithm != "none" and num_steps < 1:
            raise ValueError(f"speculative algorithm {speculative_algorithm} needs num_steps >= 1, got {num_steps}")
        self.spec = speculative_algorithm
        self.num_steps = num_steps if speculative_algorithm != "none" else 0
        self.D = self.num_steps + 1
        self.max_rows, self.kv_tokens = max_rows, kv_tokens
        self.page_size = max(1, page_size)
        check_token_budget(max_num_batched_tokens, max_batch_size, self.D, self.page_size)
        self.max_num_batched_tokens, self.mixed_prefill_tokens = max_num_batched_tokens, mixed_prefill_tokens
        # the longest sequence one request may reach: the stages' context, or less when the
        # smallest KV pool cannot hold a sequence that long plus its verify / draft overhang
        # (else every request near the context limit, the API's default max_tokens included,
        # would be refused by admission)
        pool_limit = (kv_tokens // self.page_size) * self.page_size - self.D - self.num_steps
        if pool_limit < 2:
            raise ValueError(f"the KV pool ({kv_tokens} tokens) cannot hold a single request (a 1-token prompt "
                             f"and 1 token out need {2 + self.D + self.num_steps}); start the stages with more --kv-tokens")
        self.max_context = min(max_context, pool_limit)
        self.context_limited_by_kv = pool_limit < max_context
        self.num_lanes, self.max_batch_size, self.chunk_size = num_lanes, max_batch_size, chunk_size
        self.eos = list(eos_token_ids or [])
        self.max_logprobs, self.vocab_size = max_logprobs, vocab_size  # SamplingParams.validate
        self.max_waiting = max_waiting
        self.ngram = (ngram_min, ngram_max)
        # drafter(request, k) -> up to k draft tokens; replaces the n-gram lookup when given
        self.drafter = drafter
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.kv = PageLedger(self.page_size)  # KV pages held for rows and snapshots (router/kv_ledger.py)
        self._releasing: set[int] = set()  # rows of ended requests, until every stage released them
        self._preempted: list[int] = []  # rows of preempted requests, for the driver to release
        self._short: set[str] = set()  # running requests that sat out a round for want of KV
        self.num_preemptions = 0
        self.waiting: deque[Request] = deque()
        self.preparing: dict[str, Request] = {}  # added, waiting for their grammar's compile
        self.lanes: list[list[Request]] = [[] for _ in range(num_lanes)]
        self.requests: dict[str, Request] = {}
        self.rounds = [0] * num_lanes
        self._ids = itertools.count()
        self.cache = prefix_cache
        self._row_snapshots: dict[int, tuple[int, list[int]]] = {}  # row -> (slot, key) taken at its release
        self._branches: dict[int, None] = {}  # hashes of branch points seen (insertion-ordered, bounded)
        self._snapshots_sent: set[int] = set()  # rows whose release names their snapshot slot
        self.async_scheduling = async_scheduling
        self._held: dict[int, Request] = {}  # row -> its ended request, until its last micro-batch in flight returns

    # ------------------------------------------------------------------ admission
    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, ready: bool = True) -> Request:
        """Queue a request; not ``ready`` (its grammar compiling), it waits apart, passed by
        the others, until :meth:`ready`. Raises InvalidRequestError / ContextLengthError
        (nothing allocated) or QueueFullError."""
        from .types import QueueFullError

        params.validate(self.max_logprobs, self.vocab_size, self.eos)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        # the model's vocabulary (the embedding's rows), which the tokenizer's length is
        # not: an id past it would reach the first stage, which refuses the whole step and
        # so fails every request of the micro-batch
        if self.vocab_size is not None and (min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size):
            t = next(t for t in prompt_ids if not 0 <= t < self.vocab_size)
            raise InvalidRequestError(f"prompt: token id {t} is outside the vocabulary [0, {self.vocab_size})",
                                      param="prompt")
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise ContextLengthError(len(prompt_ids), params.max_tokens, self.max_context)
        # a request a free row will take at the next admission is not queued behind the
        # running ones: a burst into an idle server fills its rows before the bound counts.
        # A row being released counts as free: it is back a stage round trip after its
        # request's answer went out, and a client's next request may arrive before that
        if self.num_waiting >= self.max_waiting + len(self.free_rows) + len(self._releasing):
            raise QueueFullError(f"the queue is full ({self.max_waiting} requests waiting for a row)")
        need = len(prompt_ids) + params.max_tokens + self.D + self.num_steps
        need = -(-need // self.page_size) * self.page_size
        if need > self.kv_tokens:
            raise InvalidRequestError(
                f"the request needs {need} KV tokens but the pool holds {self.kv_tokens}", param="max_tokens"
            )
        req = Request(request_id, list(prompt_ids), params, order=next(self._ids))
        # the API takes any int64 (and n > 1 adds the choice index); stages take a uint64:
        # the same bits, two's complement
        req.seed = params.seed % (1 << 64) if params.seed is not None else random.getrandbits(62)
        self.requests[request_id] = req
        if ready:
            self.waiting.append(req)
        else:
            self.preparing[request_id] = req
        return req

    def ready(self, request_id: str) -> None:
        """A request added not ready may be admitted now (no-op once it ended)."""
        req = self.preparing.pop(request_id, None)
        if req is not None:
            self.waiting.append(req)

    def _kv_need(self, r: Request, extend: int, start: int | None = None) -> int:
        """KV tokens, in whole pages, that ``r`` must hold on every stage for a micro-batch
        adding ``extend`` tokens to its ``num_computed`` (or to ``start``): those, then
        verify's D - 1 tokens past the committed length and the MTP chain's ``num_steps - 1``
        (the stage's ``RowTable.reserve_pages``), never more than its whole life needs."""
        n = min((r.num_computed if start is None else start) + extend,
                len(r.prompt_ids) + r.params.max_tokens) + self.D + self.num_steps
        return -(-n // self.page_size) * self.page_size

    @property
    def _headroom(self) -> int:
        """KV tokens, in whole pages, that every running request keeps free for its next
        round (a verify's D tokens)."""
        return -(-self.D // self.page_size) * self.page_size

    def _own_need(self, r: Request, hit: int) -> int:
        """KV tokens a waiting request ``r`` takes of its own for its first chunk when it
        starts after ``hit`` cached tokens (whose whole pages it shares)."""
        return self._kv_need(r, min(self.chunk_size, r.prefill_len - hit), hit) - (hit // self.page_size) * self.page_size

    def _evict_ahead(self) -> None:
        """Evict cached prefixes before the KV they hold is wanted: enough that one round's
        growth of every running request, and the prompts at the head of the queue that would
        be admitted were the cache empty (in queue order, as many as rows are free), fit once
        the drops under way are done; the snapshots those prompts hit are spared. A prompt
        that could not fit beside the running requests even then waits for them, and so do
        those behind it: nothing is evicted for them.

        A dropped snapshot's pages are free only once every stage has dropped it (a Release,
        then the next micro-batch), so evicting just what one request lacks when it lacks it
        (``_admit``, ``_grow``) made each admission and each page a running request grows into
        wait that long while the pool was full of cached prefixes: a burst of N prompts
        waited N such turns one after the other (H200, demo with MTP, a closed loop of 64
        ShareGPT clients: 97 of 578 requests waited 0.3-1.1 s to be admitted;
        docs/PERFORMANCE.md, "Admission behind a full prefix cache")."""
        if self.cache is None or not self.cache.nodes:
            return
        headroom = self._headroom
        heads = [r for r in itertools.islice(self.waiting, len(self.free_rows)) if not r.aborted]
        # the headroom _admit keeps for every running request and a page more (its next
        # round may cross into a new page)
        want = (headroom + self.page_size) * self.num_running
        most = want + sum(self._own_need(r, 0) + headroom for r in heads)
        free = self.kv_tokens - self.kv_reserved
        if free >= most:
            return  # enough even with no hit, and no drop under way counted: the round's usual case
        free += self._coming()
        if free >= most:
            return
        room = self._room_beside_running()
        keep = set()
        for r in heads:
            slot, n = self.cache.lookup(r.all_ids[: r.prefill_len]) if r.prompt_lps is None else (-1, 0)
            need = self._own_need(r, n) + headroom
            if want + need > room:
                break  # it waits for running requests to end, with or without the cache
            if slot >= 0:
                keep.add(slot)
            want += need
        if free < want:
            # and a sixteenth of the pool more: the running requests' growth then takes
            # several rounds to use it up, so that this evicts once in those rounds, not in
            # each (an eviction sorts every cached snapshot: with hundreds cached that was
            # half the engine's CPU a round; docs/PERFORMANCE.md, "Admission behind a full
            # prefix cache")
            self.cache.evict(want - free + self.kv_tokens // 16, keep=keep, plan=self._drop_plan())

    def _room_beside_running(self) -> int:
        """KV tokens of the pool less the running requests' own reservations: what a new
        request could have were no snapshot cached (a page two rows share counted twice:
        a bound from below)."""
        return self.kv_tokens - sum(r.reserved_tokens for lane in self.lanes for r in lane)

    def _admit(self, lane: int | None = None) -> None:
        # ``lane``: the lane forming its micro-batch now (schedule's)
        # Not while a running request waits for KV (it would lose the pages it waits for);
        # each running one keeps room for its next verify round, so that an admission does
        # not preempt at once the request it just admitted.
        headroom = self._headroom
        later: list[Request] = []  # waiting for a snapshot under way: the ones behind them go first
        pending = self._pending_branches() if self.cache is not None and self.waiting else {}
        here = lane is not None and self.num_lanes > 1 and self.waiting and self._forms_now(lane)
        self._evict_ahead()
        while self.waiting and self.free_rows and not self._short:
            req = self.waiting[0]
            if req.aborted:
                self.waiting.popleft()
                continue
            # prompt log-probabilities still to collect need every prompt position computed
            use_cache = self.cache is not None and req.prompt_lps is None
            slot, req.num_computed = self.cache.lookup(req.all_ids[: req.prefill_len]) if use_cache else (-1, 0)
            branch = self._branch(req) if use_cache else (0, 0)
            if (self._row_snapshots and self._snapshot_coming(req)) or branch[1] in pending:
                # the next turn of a conversation whose release is under way, or a prompt that
                # leaves a cached sequence where a chunk in flight ends with a snapshot (a shared
                # system prompt's first requests): worth a round's wait, not the prefix's compute
                req.num_computed = 0
                later.append(self.waiting.popleft())
                continue
            need = self._kv_need(req, min(self.chunk_size, req.prefill_len - req.num_computed))
            from_slot = (req.num_computed // self.page_size) * self.page_size if slot >= 0 else 0  # its pages, shared
            short = self.kv_reserved + need - from_slot + headroom * self.num_running - self.kv_tokens
            if short > 0:
                req.num_computed = 0
                if self.cache and need - from_slot + headroom * (self.num_running + 1) <= self._room_beside_running():
                    # cached prefixes make room before a new request waits for running ones
                    # (vLLM counts cached blocks no request uses as free); not for one that
                    # must wait for running ones even with the cache empty
                    self.cache.evict(short - self._coming(), keep=(slot,), plan=self._drop_plan())
                break
            self.waiting.popleft()
            if self.cache:
                if slot >= 0:
                    self.cache.use(slot)
                req.restore_slot = slot
                # where it branches off a cached sequence where an earlier prompt branched too
                # (a shared system prompt's end): a chunk ends there, so its snapshot serves
                # the next request sharing as much. Not at a branch seen first (a conversation's
                # next turn leaving the last reply where it re-tokenizes differently: no later
                # request shares that point), nor a few tokens past the hit (prompts that
                # merely start alike): the split costs the request a round of its prefill
                req.branch_at, req.branch_key = branch if branch[1] in self._branches else (0, 0)
                if branch[1]:
                    self._branches.pop(branch[1], None)
                    self._branches[branch[1]] = None
                    if len(self._branches) > MAX_BRANCHES_SEEN:
                        del self._branches[next(iter(self._branches))]
                if req.branch_at:
                    pending[req.branch_key] = req.request_id
            req.row = self.free_rows.pop()
            if from_slot:
                self.kv.share(("row", req.row), ("slot", slot), req.num_computed)
            self.kv.grow(("row", req.row), need)
            req.reserved_tokens = need
            # the lane with the fewest requests; a request that hits the cache (a short prefill
            # left) joins the lane forming its micro-batch now instead, while that one holds at
            # most one request more and the emptiest has a micro-batch in flight: it rides in
            # the micro-batch formed now, not in the other lane's next one once its result is
            # back (a round later). An idle lane starts at once, so a burst stays spread;
            # a long prompt, which leaves the forming lane's micro-batch its chunks' weight,
            # goes to the emptiest.
            req.lane = min(range(self.num_lanes), key=lambda i: len(self.lanes[i]))
            if here and slot >= 0 and req.lane != lane and len(self.lanes[lane]) <= len(self.lanes[req.lane]) + 1 \
                    and any(r.in_flight for r in self.lanes[req.lane]):
                req.lane = lane
            req.status = RUNNING
            req.admitted_at = time.monotonic()
            self.lanes[req.lane].append(req)
        self.waiting.extendleft(reversed(later))

    def _forms_now(self, lane: int) -> bool:
        """Whether :meth:`schedule` of ``lane`` forms a micro-batch now (none of its requests
        in flight, or every one of them continues: ``cont`` there), so that a request admitted
        into it runs in it."""
        live = [r for r in self.lanes[lane] if r.status == RUNNING and not r.aborted]
        flying = [r for r in live if r.in_flight]
        cont = [r for r in flying if r.in_flight == 1 and r.follows_round]
        return not flying or self._may_follow_now(len(cont), len(flying))

    def _may_follow_now(self, continuing: int, flying: int) -> bool:
        """Whether a lane with ``flying`` requests in a micro-batch in flight sends its next
        one now, with the ``continuing`` of them that may follow (and requests not in
        flight). A second micro-batch beside the one in flight only to continue its
        requests: one of the other requests alone would run them in a forward of their own,
        and the lane's requests would stay split in two groups taking turns (two forwards
        of 32 rows where one of 64 costs about as much: decode reads every weight once).
        With MTP, when at least half of them continue: the others join the micro-batch
        after, formed once the one in flight is back, so they run every other round while
        the rest go on at the pipeline's pace: one near its end (within two rounds' tokens
        of ``max_tokens``, counting every draft accepted: up to 2 D rounds at one token a
        round) for those rounds, one that never follows (penalties, a grammar, a bad word
        of several tokens) for its whole life. Waiting for every request to continue left
        a lane of 64 mostly synchronous (some request is always near its end), a router
        round trip per round (docs/PERFORMANCE.md, "Following verifies near the end")."""
        if not continuing:
            return False
        return not self.num_steps or 2 * continuing >= flying

    def _grow(self, r: Request, extend: int) -> bool:
        """Make ``r`` hold :meth:`_kv_need` for its next micro-batch, preempting younger
        requests that are not in flight when the pool is short. False when the pages are
        not free yet (a preempted row's come back once every stage released it): ``r``
        sits this round out."""
        need = self._kv_need(r, extend)
        extra = need - r.reserved_tokens
        if extra <= 0:
            return True
        # freed by releases and drops under way: counted only when the pool lacks it without
        # them (it walks every page they hold; a grow is a page a few rounds per request)
        coming = 0 if self.kv_tokens - self.kv_reserved >= extra else self._coming()
        while self.kv_tokens - self.kv_reserved + coming < extra:
            if self.cache and self.cache.evict(extra - (self.kv_tokens - self.kv_reserved + coming),
                                               plan=self._drop_plan()):
                coming = self._coming()
                continue  # a cached prefix goes before a running request
            victims = [v for lane in self.lanes for v in lane
                       if v.order > r.order and not v.in_flight and v.status == RUNNING]
            if not victims:
                break
            self._preempt(max(victims, key=lambda v: v.order))
            coming = self._coming()
        if self.kv_reserved + extra > self.kv_tokens:
            self._short.add(r.request_id)
            return False
        self._short.discard(r.request_id)
        self.kv.grow(("row", r.row), need)
        r.reserved_tokens = need
        return True

    @property
    def kv_reserved(self) -> int:
        """KV tokens (whole pages) held on every stage: rows' reservations and snapshots,
        a shared page once."""
        return self.kv.used

    def _coming(self) -> int:
        """KV tokens the releases and snapshot drops under way give back."""
        holders = [("row", r) for r in self._releasing]
        if self.cache:
            holders += [("slot", s) for s in self.cache.dropping | set(self.cache.to_drop)]
        return self.kv.freed_by(holders)

    def _drop_plan(self) -> "_SlotDrops":
        """What dropping snapshot slots gives back beyond the drops under way (not the pages
        a running row or a kept snapshot shares): :meth:`PrefixCache.evict`'s plan."""
        return _SlotDrops(Letting(self.kv, [("slot", s) for s in self.cache.dropping | set(self.cache.to_drop)]))

    def _preempt(self, r: Request) -> None:
        """Give ``r``'s row and KV back (released by the driver: :meth:`take_preempted`) and
        queue it first, to be recomputed: its prompt and outputs are prefilled again."""
        self.lanes[r.lane].remove(r)
        self._releasing.add(r.row)
        self._preempted.append(r.row)
        self._short.discard(r.request_id)
        self._unpin(r)
        r.row, r.lane, r.reserved_tokens, r.status = -1, -1, 0, WAITING
        r.num_computed = 0
        r.prefill_len = len(r.all_ids) - 1 if r.output_ids else len(r.prompt_ids)
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)

    def take_preempted(self) -> list[int]:
        """Rows of requests preempted since the last call. The driver releases them on
        every stage, then :meth:`free` (as for a finished request's rows)."""
        rows, self._preempted = self._preempted, []
        return rows

    # ------------------------------------------------------------------ forming micro-batches
    def schedule(self, lane: int) -> ScheduledBatch | None:
        """The next micro-batch of ``lane`` within the token budget: its decoding requests
        first (a decode, or a verify when any has drafts; D tokens each), then prefill
        chunks of its other requests, oldest first, in the tokens left, all in one forward.
        A long prompt so never waits for the decodes nor stalls them. None when nothing
        can run now. Growing a request's KV may preempt younger ones not in this
        micro-batch: their rows are in :meth:`take_preempted`."""
        self._admit(lane)
        live = [r for r in self.lanes[lane] if r.status == RUNNING and not r.aborted]
        # async scheduling: requests whose micro-batch in flight leaves them decoding
        # continue now, at the position it leaves (Request.follows_round)
        cont = {r.request_id for r in live if r.in_flight == 1 and r.follows_round}
        flying = [r for r in live if r.in_flight]
        if flying and not self._may_follow_now(len(cont), len(flying)):
            return None
        reqs = [r for r in live if not r.in_flight or r.request_id in cont]
        reqs.sort(key=lambda r: r.order)  # growing the oldest first: they preempt the youngest
        prefill = [r for r in reqs if not r.in_flight and not r.prefill_done]
        # a slot is kept for a prompt while one waits, so that decodes never fill every one
        room = self.max_batch_size - (1 if prefill else 0)
        chosen: list[Request] = []
        for r in reqs:
            if len(chosen) == room:
                break
            # a round writes at most D tokens (a verify); grown for that whatever the mode,
            # past all the round in flight may add (all of a verify's tokens accepted)
            ahead = r.follows_ext if r.request_id in cont else 0
            if (ahead or r.prefill_done) and r.status == RUNNING and self._grow(r, ahead + self.D):
                r.in_flight += 1  # chosen: no prefill's growth below may preempt it
                chosen.append(r)
        return self._form(lane, chosen, prefill, self.max_num_batched_tokens, cont)

    def _form(self, lane: int, chosen: list[Request], prefill: list[Request], budget: int,
              cont: set[str] = frozenset()) -> ScheduledBatch | None:
        """The micro-batch of the decoding requests ``chosen`` (grown and marked in flight
        already; those in ``cont`` continue from their micro-batch in flight) and chunks of
        ``prefill`` (oldest first) in the tokens they leave of ``budget``; None if empty."""
        chosen = list(chosen)
        ahead = [r.request_id in cont for r in chosen]
        # with MTP a continuing request verifies the drafts the round in flight makes: all
        # its ids, its position and the commit of that round come from that round's result,
        # which the first stage fills in (fill_following); the router's figures for it here
        # are bounds (all of that round's tokens accepted)
        drafts = [[] if a else self._drafts_for(r) for r, a in zip(chosen, ahead)]
        mode, d = ("verify", self.D) if self.num_steps and (any(drafts) or any(ahead)) else ("decode", 1)
        seq = [r.num_computed + (r.follows_ext if a else 0) for r, a in zip(chosen, ahead)]
        out_lens = [len(r.output_ids) + (0 if not a else self.D if r.follows_verify else 1)
                    for r, a in zip(chosen, ahead)]
        follows = max((r.follows_round for r, a in zip(chosen, ahead) if a), default=0)
        ext = [d] * len(chosen)
        ids, nd = [], []
        for r, dr, a in zip(chosen, drafts, ahead):
            if a and self.num_steps:
                ids += [FOLLOWS] * d
                nd.append(d - 1)
                r.commit_follows = r.follows_round if r.follows_verify else 0
                continue
            dr = dr[: d - 1]
            ids += [FOLLOWS if a else r.output_ids[-1]] + dr + [0] * (d - 1 - len(dr))
            nd.append(len(dr))
        sample, nxt = [True] * len(chosen), [-1] * len(chosen)
        budget -= d * len(chosen)  # >= D: see __init__
        # beside decodes, prompt chunks take at most mixed_prefill_tokens (a long prompt
        # then stalls no decoder for long), but a short prompt (the rest of it, or up to its
        # branch point) joins whole in the rest of the budget: a burst of short prompts
        # starts in one round instead of one cap's worth a round, each a request left out of
        # the decodes meanwhile (docs/PERFORMANCE.md, "Short prompts in one round")
        cap = min(budget, self.mixed_prefill_tokens) if chosen else budget
        short = min(WHOLE_PROMPT_TOKENS, self.mixed_prefill_tokens, self.chunk_size) if chosen else 0
        chunks = 0
        for r in prefill:
            if budget <= 0 or len(chosen) == self.max_batch_size:
                break
            left = r.prefill_len - r.num_computed
            upto = min(left, r.branch_at - r.num_computed) if r.num_computed < r.branch_at else left
            whole = upto <= min(short, budget)
            n = upto if whole else min(cap, budget, self.chunk_size, upto)
            if n <= 0 or r.status != RUNNING or not self._grow(r, n):  # no cap left, preempted, or short
                continue
            budget -= n
            if not whole:
                cap -= n
            end = r.num_computed + n
            r.in_flight += 1
            r.prefill_batches += 1
            chosen.append(r)
            out_lens.append(len(r.output_ids))
            chunks += 1
            seq.append(r.num_computed)
            ext.append(n)
            ids += r.all_ids[r.num_computed : end]
            nd.append(0)
            # a recomputed request's last prefill token is an output: no new sample
            last = end == r.prefill_len
            sample.append(last and not r.output_ids)
            nxt.append(-1 if last and not r.output_ids else r.all_ids[end])
        if not chosen:
            return None
        if chunks == len(chosen):
            mode, chunks = "prefill", 0
        self.rounds[lane] += 1
        return self._dispatch(ScheduledBatch(lane, self.rounds[lane], mode, chosen, seq, ext, ids, nd, sample, nxt,
                                             num_prefill=chunks, output_lens=out_lens, follows_round=follows))

    def _dispatch(self, batch: ScheduledBatch) -> ScheduledBatch:
        nv = batch.num_verify
        for i, r in enumerate(batch.requests):
            if self._may_follow(batch, i):
                r.follows_round, r.follows_verify = batch.round, i < nv
                r.follows_ext = self.D if i < nv else batch.extend_lens[i]
            else:
                r.follows_round, r.follows_ext, r.follows_verify = 0, 0, False
        if self.cache:
            # counted once per request, where its first micro-batch starts: the prompt tokens
            # it skipped (its usage's cached_tokens); a request preempted before it ran is
            # looked up again at its next admission, not counted twice
            for r in batch.first:
                r.cached_tokens = r.num_computed
                self.cache.count(len(r.prompt_ids), r.num_computed)
        if self.cache and batch.first_chunk < len(batch.requests):
            # the prefill chunks' restore and snapshot slots, in a prefill batch or riding in
            # a decode / verify one (those rows' are -1)
            chunks = range(batch.first_chunk, len(batch.requests))
            restore, snap = [-1] * len(batch.requests), [-1] * len(batch.requests)
            for b in chunks:
                r, end = batch.requests[b], batch.seq_lens[b] + batch.extend_lens[b]
                restore[b] = r.restore_slot  # set until its first chunk ran
                # inside the prompt, and at its end (filed with the token it samples there:
                # the next turn of a conversation hits the whole prompt even where the reply
                # does not re-tokenize to the ids generated); not after a recompute's chunks
                snap[b] = self._reserve_snapshot(r, end) if end < r.prefill_len or (
                    batch.sample[b] and end - r.cached_tokens >= MIN_BRANCH_TOKENS) else -1
            batch.restore_slots = restore if max(restore) >= 0 else []
            batch.snapshot_slots = snap if max(snap) >= 0 else []
        return batch

    def _may_follow(self, batch: ScheduledBatch, i: int) -> bool:
        """Whether request ``i``'s next round may be formed before ``batch`` comes back.

        Without speculation: it emits exactly one token there (a decode, or the chunk
        ending its prompt) that cannot end it by length. With MTP: it verifies there, or
        its chunk ends its prompt, and its next round verifies the drafts the last stage
        makes (n-gram drafts are the router's own lookup in its tokens: those rounds stay
        synchronous); neither round can end it by length, counting every token of both
        accepted, so that its next round has the drafts the router would give it (as many
        as ``num_steps``) and no round of it runs past its end. Either way its next round
        needs nothing else of the result (no penalty counts of its outputs, no grammar, no
        bad word of several tokens). One that a stop id ends in ``batch`` is left out of the
        next round by the first stage (``fill_following``): its row keeps the state
        ``batch`` leaves, and the snapshot a finished row leaves for the next turn."""
        r, p = batch.requests[i], batch.requests[i].params
        if not (self.async_scheduling and batch.sample[i] and not r.aborted
                and p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1.0
                and p.grammar is None and all(len(w) == 1 for w in p.bad_words_token_ids or ())):
            return False
        if not self.num_steps:
            n = batch.output_lens[i] + 1  # its outputs once batch is processed
        elif self.spec == "mtp" and self.drafter is None and (i < batch.num_verify or i >= batch.first_chunk):
            # at most, once batch and the round after it are processed (output_lens is a
            # bound already when batch follows a verify itself)
            n = batch.output_lens[i] + (self.D if i < batch.num_verify else 1) + self.D
        else:
            return False
        return n < p.max_tokens and len(r.prompt_ids) + n < self.max_context

    # ------------------------------------------------------------------ prefix cache
    def _reserve_snapshot(self, r: Request, length: int, chunk: bool = True) -> int:
        """A slot for a snapshot of ``r``'s row after ``length`` tokens (``chunk``: after a
        prefill chunk, else the finished row's), -1 when none is free (a snapshot is never
        worth a wait). It holds the row's pages of those tokens: no new KV page, and they
        stay in use after the row's release."""
        c = self.cache
        # a chunk's inside or at the end of the prompt, not at a branch point: the request's
        # own later snapshot (its next chunk's, its finished row's) supersedes it, so it
        # evicts only snapshots superseded too (PrefixCache, "Eviction")
        superseded = chunk and length <= r.prefill_len and length != r.branch_at
        slot = c.reserve(length, r.request_id, superseded)
        if slot >= 0:
            self.kv.take(("slot", slot), ("row", r.row), length)
        elif length >= 1:
            c.evict_one(superseded)  # its slot is free once dropped: a later snapshot gets it
        return slot

    def _branch(self, req: Request) -> tuple[int, int]:
        """Where ``req``'s prefill tokens leave the cached sequences, at least
        ``MIN_BRANCH_TOKENS`` past its hit (``num_computed``) and before its last token:
        ``(position, hash of the snapshot's filing key there)``, or ``(0, 0)``."""
        tokens = req.all_ids[: req.prefill_len]
        at = self.cache.shared_len(tokens) - 1
        if at - req.num_computed < MIN_BRANCH_TOKENS or at >= req.prefill_len:
            return 0, 0
        return at, hash(tuple(tokens[: at + 1])) or 1

    def _pending_branches(self) -> dict[int, str]:
        """Branch points a running request's chunk is still to end at (its snapshot not
        filed yet): hash -> request id."""
        return {r.branch_key: r.request_id for lane in self.lanes for r in lane
                if r.branch_at > r.num_computed and r.branch_key}

    def _snapshot_coming(self, req: Request) -> bool:
        """A finished row's snapshot, not filed yet (its release is under way), holds more of
        ``req``'s prefill tokens than the cache does now: worth the wait of one release."""
        tokens = req.all_ids[: req.prefill_len]
        return any(req.num_computed < len(key) - 1 and tokens[: len(key)] == key
                   for _, key in self._row_snapshots.values())

    def _unpin(self, r: Request) -> None:
        if r.restore_slot >= 0:
            self.cache.done(r.restore_slot)
            r.restore_slot = -1

    def take_dropped_slots(self) -> list[int]:
        """Evicted prefix-cache slots: the driver drops them on every stage (Release
        ``drop_slots``), then :meth:`slots_dropped`."""
        return self.cache.take_drops() if self.cache else []

    def slots_dropped(self, slots: list[int]) -> None:
        """Every stage dropped ``slots``: free, their KV charge back."""
        if slots:
            self.cache.dropped(slots)
            for s in slots:
                self.kv.release(("slot", s))

    def release_snapshots(self, rows: list[int]) -> list[int]:
        """Per row the slot its release snapshots it into (-1: none), or [] when none does."""
        slots = [self._row_snapshots[r][0] if r in self._row_snapshots else -1 for r in rows]
        self._snapshots_sent.update(r for r in rows if r in self._row_snapshots)
        return slots if max(slots, default=-1) >= 0 else []

    def flush_cache(self) -> None:
        """Evict every cached prefix not in use (``take_dropped_slots`` has them), and forget
        the branch points seen."""
        if self.cache:
            self.cache.flush()
            self._branches.clear()

    def clear_cache(self) -> None:
        """The stages dropped every slot (a recovery): forget them all."""
        if self.cache:
            self.cache.clear()
            self._branches.clear()
            for h in self.kv.holders("slot"):
                self.kv.release(h)
            self._row_snapshots.clear()
            self._snapshots_sent.clear()
            for r in self.requests.values():
                r.restore_slot = -1

    def _drafts_for(self, r: Request) -> list[int]:
        if self.num_steps == 0:
            return []
        # drafts past max_tokens can never be emitted
        room = r.params.max_tokens - len(r.output_ids) - 1
        k = min(self.num_steps, max(0, room))
        if self.drafter is not None:
            return list(self.drafter(r, k))[:k]
        if self.spec == "ngram":
            return ngram_draft(r.all_ids, k, *self.ngram)
        return r.drafts[:k]

    # ------------------------------------------------------------------ results
    def process(self, batch: ScheduledBatch, output_ids: list[list[int]], drafts: list[list[int]] | None = None,
                logprobs: list | None = None, prompt_logprobs: list | None = None) -> Update:
        """Apply one step result of ``batch``.

        Args:
            output_ids: tokens each request emitted (accepted drafts + bonus; empty for a
                prefill chunk that does not end its prompt).
            drafts: MTP drafts for the next round, per request (empty lists otherwise).
            logprobs: per request, ``[(token, logprob, top)]`` per emitted token, or None.
            prompt_logprobs: per request of a prefill chunk, the same per prompt token its
                positions predict, or None.
        """
        if len(output_ids) != len(batch.requests):
            raise ValueError(
                f"micro-batch {batch.micro_batch_id} round {batch.round}: {len(output_ids)} results "
                f"for {len(batch.requests)} requests"
            )
        outputs, release, accept = [], [], []
        nv = batch.num_verify
        # verified rows of requests a failure dropped while this step was in flight (fail_all):
        # the recovery's release abandons their commit, which must never reach a stage after it
        dropped = {i for i, r in enumerate(batch.requests[:nv]) if r.status == FINISHED and r.held_row < 0}
        # verified rows whose commit the first stage added to the following verify (async
        # scheduling, fill_following): every one that went on in it, not stopped here
        rode = set()
        for i, r in enumerate(batch.requests[:nv]):
            if r.commit_follows == batch.round:
                r.commit_follows = 0
                if not stops_in(r.spec(self.eos), output_ids[i]):
                    rode.add(i)
        for i, r in enumerate(batch.requests):
            r.in_flight = max(0, r.in_flight - 1)  # 0 already if fail_all dropped it
            if batch.restore_slots and batch.restore_slots[i] >= 0:
                self._unpin(r)
            toks = output_ids[i]
            # every stage took it; unless the request failed while this step was in flight
            # (fail_all abandoned the slot: it is dropped, and after a recovery it may be
            # another request's already)
            if batch.snapshot_slots and batch.snapshot_slots[i] >= 0 and \
                    self.cache.taking.get(batch.snapshot_slots[i]) == r.request_id:
                # filed under its tokens and the next one (at a prompt's end: the one sampled)
                key = (r.all_ids + toks[:1])[: batch.seq_lens[i] + batch.extend_lens[i] + 1]
                if len(key) > self.cache.lens[batch.snapshot_slots[i]]:
                    self.cache.commit(batch.snapshot_slots[i], key)
                else:  # a prompt's end that sampled nothing (a refused request): never filed
                    self.cache.taking.pop(batch.snapshot_slots[i], None)
                    self.cache.to_drop.append(batch.snapshot_slots[i])
            # (none: the first stage left it out, a stop id having ended it in the round before)
            if i < nv and not 1 <= len(toks) <= batch.num_drafts[i] + 1 and (toks or r.status != FINISHED):
                raise ValueError(f"request {r.request_id}: {len(toks)} tokens from a verify of {batch.num_drafts[i]} drafts")
            r.num_computed += batch.extend_lens[i] if i >= nv else len(toks)
            accept.append(len(toks))
            if batch.sample[i]:
                r.drafts = list(drafts[i]) if drafts else []
            # else a prefill chunk: it drafts nothing, and a recomputed request keeps the MTP
            # drafts it had when preempted (those of the same context), so its next round is
            # the verify it would have been, with the same random draws
            if r.status == FINISHED:
                # failed while in flight (fail_all: its row is released already), or ended in
                # an earlier round while this one held its row: dropped, the row released now
                if r.held_row >= 0 and not r.in_flight:
                    release.append(self._unhold(r))
                continue
            if r.aborted:
                self._end(r, r.abort_reason, release)
                outputs.append(RequestOutput(r.request_id, [], r.abort_reason, len(r.prompt_ids), len(r.output_ids)))
                continue
            if prompt_logprobs and prompt_logprobs[i] is not None and r.prompt_lps is not None:
                if batch.seq_lens[i] == 0:  # the prompt's first chunk (again, after a preemption)
                    r.prompt_lps = []
                r.prompt_lps += [TokenLogprob(t, lp, list(top), *rank) for t, lp, top, *rank in prompt_logprobs[i]]
                r.prompt_lps = r.prompt_lps[:len(r.prompt_ids) - 1]
            new, reason = self._append(r, toks)
            lps = None
            if logprobs and logprobs[i] is not None:
                lps = [TokenLogprob(t, lp, list(top)) for t, lp, top in logprobs[i][: len(new)]]
            if reason:
                self._end(r, reason, release)
            if new or reason:
                outputs.append(
                    RequestOutput(
                        r.request_id, new, reason, len(r.prompt_ids), len(r.output_ids), lps,
                        [len(toks)] if i < nv else [], r.cached_tokens,
                        self._take_prompt_logprobs(r),
                    )
                )
        commit = None
        keep = [i for i in range(nv) if i not in dropped and i not in rode and accept[i]]
        if keep:  # the verified rows only (a mixed micro-batch's prefill chunks commit nothing)
            commit = Commit(batch.micro_batch_id, batch.round, [batch.rows[i] for i in keep], [accept[i] for i in keep])
        # the rows that ran (a left-out one's draft length 0: not counted as a verify)
        num_drafts = list(batch.num_drafts)
        if nv:
            num_drafts = [n if accept[i] else 0 for i, n in enumerate(num_drafts[:nv])]
        return Update(outputs, commit, release, accept[:nv], num_drafts, batch.micro_batch_id, batch.round)

    @staticmethod
    def _take_prompt_logprobs(r: Request) -> list[TokenLogprob] | None:
        """The prompt log-probabilities on the request's first output, once."""
        if r.params.prompt_logprobs is None or r.prompt_lps is None:
            return None
        out, r.prompt_lps = r.prompt_lps, None
        return out

    def _append(self, r: Request, toks: list[int]) -> tuple[list[int], str | None]:
        new = []
        p = r.params
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos))
        for t in toks:
            new.append(t)
            r.output_ids.append(t)
            r.output_counts[t] = r.output_counts.get(t, 0) + 1
            if t in stop_ids:  # the last stage masks them before min_tokens
                return new, "stop"
            if len(r.output_ids) >= p.max_tokens or len(r.prompt_ids) + len(r.output_ids) >= self.max_context:
                return new, "length"
        return new, None

    def _end(self, r: Request, reason: str, release: list[int]) -> None:
        """Finish ``r`` while a result of it is processed; its row goes to ``release``, or,
        while a later micro-batch in flight holds it (async scheduling), waits for that one."""
        row = self._finish(r, reason)
        if r.in_flight:
            r.held_row, self._held[row] = row, r
        else:
            release.append(row)

    def _unhold(self, r: Request) -> int:
        row, r.held_row = r.held_row, -1
        del self._held[row]
        return row

    def _finish(self, r: Request, reason: str) -> int:
        """End a running request. Its row (and KV reservation) come back with
        :meth:`free` once every stage acknowledged the release, so a new request never
        reaches a stage on a row that stage still holds."""
        r.status, r.finish_reason = FINISHED, reason
        self.lanes[r.lane].remove(r)
        self._short.discard(r.request_id)
        self.requests.pop(r.request_id, None)
        self._releasing.add(r.row)
        if self.cache:
            self._unpin(r)
            self.cache.abandon(r.request_id)  # snapshots of steps that failed
            # the row's committed state after prompt and reply: the next turn's prefix. Not
            # for an abort (a stop string) while a later round in flight holds the row: that
            # round moves the state past them (a stop id's end is left out of it instead)
            n = r.num_computed
            if reason in ("stop", "length") and r.prefill_done and n < len(r.all_ids) and not (
                    r.in_flight and r.aborted):
                slot = self._reserve_snapshot(r, n, chunk=False)
                if slot >= 0:
                    self._row_snapshots[r.row] = (slot, r.all_ids[: n + 1])
        row, r.row = r.row, -1
        return row

    def free(self, rows: list[int]) -> None:
        """Rows every stage has released: reusable from now on."""
        for row in rows:
            self._releasing.discard(row)
            self.kv.release(("row", row))
            self.free_rows.append(row)
            if row in self._row_snapshots:
                slot, key = self._row_snapshots.pop(row)
                if row in self._snapshots_sent:  # the release took it on every stage
                    self._snapshots_sent.discard(row)
                    self.cache.commit(slot, key)
                else:  # released without it (an abort's release): never taken
                    self.cache.taking.pop(slot, None)
                    self.cache.to_drop.append(slot)

    def releasing_rows(self) -> list[int]:
        """Rows of ended requests that :meth:`free` has not taken back yet."""
        return list(self._releasing)

    def abort(self, request_id: str, reason: str = "abort") -> list[int]:
        """Abort a request (``reason``: ``abort``, or ``stop`` for a stop string matched by
        the HTTP layer). Returns rows to release now (none while its micro-batch is in
        flight: the row is released after that round's commit)."""
        r = self.requests.get(request_id)
        if r is None or r.status == FINISHED or r.aborted:
            return []
        r.aborted, r.abort_reason = True, reason
        if r.status == WAITING:
            self.requests.pop(request_id, None)
            if self.preparing.pop(request_id, None) is None:
                self.waiting.remove(r)  # not left to count as waiting (the gauge, the queue bound)
            r.status, r.finish_reason = FINISHED, reason
            return []
        if not r.in_flight:
            return [self._finish(r, reason)]
        return []

    def fail_requests(self, requests: list[Request]) -> tuple[list[Request], list[int]]:
        """Drop ``requests`` (a stage refused their micro-batch; the pipeline serves on).
        Returns those dropped, so the driver can tell their clients, and the rows they held,
        to release on every stage (a stage before the refusing one ran the step)."""
        dropped, rows = [], []
        for r in requests:
            if r.status == FINISHED:
                if r.held_row >= 0:  # ended already; this micro-batch held its row
                    r.in_flight = 0
                    rows.append(self._unhold(r))
                continue
            r.in_flight = 0
            if r.status == RUNNING:
                rows.append(self._finish(r, "abort"))
            else:
                self.requests.pop(r.request_id, None)
                r.status = FINISHED
            dropped.append(r)
        return dropped, rows

    def fail_all(self) -> tuple[list[Request], list[int]]:
        """Drop every request (a stage died). Returns the dropped requests, so the driver
        can tell their clients, and the rows they held, to release on every stage."""
        dropped = list(self.requests.values())
        rows = []
        for r in list(self._held.values()):  # ended, their rows held by micro-batches in flight
            r.in_flight = 0
            rows.append(self._unhold(r))
        for r in dropped:
            r.in_flight = 0
            if r.status == RUNNING:
                rows.append(self._finish(r, "abort"))
            r.status = FINISHED
        self.waiting.clear()
        self.preparing.clear()
        self.requests.clear()
        self._short.clear()
        if self.cache:  # the recovery drops every slot on every stage (clear_cache)
            for r in dropped:
                r.restore_slot = -1
        return dropped, rows

    # ------------------------------------------------------------------ state
    @property
    def num_running(self) -> int:
        return sum(len(lane) for lane in self.lanes)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.preparing)

    def has_work(self, lane: int | None = None) -> bool:
        lanes = range(self.num_lanes) if lane is None else [lane]
        return bool(self.waiting) or bool(self.preparing) or any(self.lanes[i] for i in lanes)


class _SlotDrops:
    """:class:`~ppspec.router.kv_ledger.Letting` over snapshot slot ids."""

    def __init__(self, letting: Letting):
        self.letting = letting

    def gain(self, slot: int) -> int:
        return self.letting.gain(("slot", slot))

    def together(self, slots: list[int]):
        gain = self.letting.together([("slot", s) for s in slots])
        return lambda slot: gain(("slot", slot))

    def covers(self, holder: int, slot: int) -> bool:
        """Whether snapshot ``holder`` holds every KV page ``slot`` holds, its pages starting
        with ``slot``'s (both taken from one row): ``slot`` alone then frees nothing while
        ``holder`` stays (unless ``holder`` is let go in this plan: the caller's to know)."""
        pages = self.letting.ledger.pages
        mine, theirs = pages.get(("slot", slot)), pages.get(("slot", holder))
        return bool(mine) and theirs is not None and theirs[: len(mine)] == mine

    def add(self, slot: int) -> None:
        self.letting.add(("slot", slot))


# The longest prompt (tokens) that joins a micro-batch of decodes whole past
# ``--mixed-prefill-tokens``: the longest sequence of the stages' batched prefill graphs
# (``stage_server.graphs.BATCHED_PREFILL_SEQ_TOKENS``), so that a burst of such prompts
# replays one graph beside the decodes instead of running eagerly.
WHOLE_PROMPT_TOKENS = 256

# Defaults of the token budget per forward (``--max-num-batched-tokens``) and of the
# prefill share of a micro-batch that also decodes (``--mixed-prefill-tokens``), by the
# stages' device (docs/PERFORMANCE.md, "Prefill and the token budget"). CUDA: a lone
# prompt in 8192-token chunks costs 2.7x the compute floor at 8k tokens, in 512-token
# ones 31x; beside decodes, 512 prefill tokens of a 1.46B model are ~2 ms of matrix work,
# about a decode round's time (to be measured with bench/prefill_ttft.py on the GPU).
# CPU (demo checkpoint): 128-token chunks beside 32 decodes kept both their inter-token
# latency p99 and an arriving 2k prompt's time to first token at about 2x of theirs
# alone; 64 stretched the TTFT, 256 and more the inter-token latency.
DEFAULT_TOKEN_BUDGET = {"cuda": 8192, "cpu": 512}
DEFAULT_MIXED_PREFILL_TOKENS = {"cuda": 512, "cpu": 128}


def check_token_budget(budget: int, max_batch_size: int, D: int, page_size: int) -> None:
    """Refuse a token budget per forward below one verify micro-batch (``max_batch_size``
    requests of ``D`` tokens: decodes could not all run) or below one KV page (tokens).
    Raises ValueError naming both numbers."""
    if budget < max_batch_size * D:
        raise ValueError(
            f"--max-num-batched-tokens {budget} is less than one verify micro-batch: --max-batch-size "
            f"{max_batch_size} x D {D} = {max_batch_size * D} tokens; raise the budget or lower --max-batch-size")
    if budget < page_size:
        raise ValueError(f"--max-num-batched-tokens {budget} is less than a KV page of {page_size} tokens")


def default_token_budget(infos: list[StageInfo], max_batch_size: int, num_steps: int) -> tuple[int, int]:
    """``(max_num_batched_tokens, mixed_prefill_tokens)`` when none is given: the tables
    above for the stages' device (CUDA when any stage is on CUDA), the budget raised to
    one verify micro-batch."""
    dev = "cuda" if any(i.get("device_type") == "cuda" for i in infos) else "cpu"
    return max(DEFAULT_TOKEN_BUDGET[dev], max_batch_size * (num_steps + 1)), DEFAULT_MIXED_PREFILL_TOKENS[dev]


def kv_budget(infos: list[StageInfo]) -> tuple[int, int]:
    """``(kv_tokens, page_size)`` for the scheduler from the stages' ``Info``: the smallest
    pool, and the largest page (a stage without attention layers has no KV pool)."""
    pages = [i["kv_tokens"] // i["kv_pages_total"] for i in infos if i.get("kv_pages_total")]
    return min(i["kv_tokens"] for i in infos), max(pages, default=1)

