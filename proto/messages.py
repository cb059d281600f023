"""The stage API's messages as plain dataclasses (the in-process form of ``stage.proto``).

The router builds them, stages consume them; over gRPC ``codec.py`` maps them to and from
the protobuf messages: a step (:class:`StepInput` / :class:`StepOutput`), a
:class:`Commit`, a :class:`Release` and a stage's :class:`StageInfo`. Only
``hidden_states`` holds a tensor, and the router never reads it: activations go from stage
to stage.
"""
from __future__ import annotations

import dataclasses
import itertools

from dataclasses import dataclass, field
from typing import Any, TypedDict

PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"


# Below this temperature a request samples greedily (vLLM's sampling epsilon): softmax(logits
# / t) is then the argmax but for exact ties, and fp32 logits divided by so small a t
# overflow to inf, whose softmax is NaN.
GREEDY_BELOW = 1e-5
_F32_MAX = 3.4028234663852886e38   # stage.proto carries temperature and top_p as float32
_F32_TINY = 1.1754943508222875e-38
_I32_MAX = 2**31 - 1               # and top_k as int32


REPETITION_PENALTY_RANGE = (1 / 128, 128.0)
"""Repetition penalties served: beyond them an fp32 logit (up to ~1e3) divided or
multiplied by the penalty could overflow, and the step would fail for every request in it.
Powers of two: the bounds are the same after the wire's float32."""


@dataclass
class SamplingSpec:
    """What the last stage needs of a request's sampling parameters (see
    ``router.types.SamplingParams``); ``seed`` is always set by the router.

    Built in canonical form, the same on both sides of the wire and meaning the same as
    given: a temperature below :data:`GREEDY_BELOW` becomes 0 (greedy); a finite
    temperature above float32's largest, a positive ``top_p`` below its smallest normal
    and a ``top_k`` above int32's largest are clamped to them (the same distribution: uniform,
    the top token alone, no top-k limit at any vocabulary that fits an int32). Values no
    clamp can mean (NaN, inf, negative) are left for the stage to refuse."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    logprobs: int | None = None
    min_tokens: int = 0
    banned_until_min: list[int] = field(default_factory=list)  # EOS / stop ids masked before min_tokens
    # Logit processing (``stage_server.sampler.adjust_logits``). The penalties count the
    # tokens generated before each verified position, drafts ahead of it included: the
    # router sends what was generated before the step (distinct ids and their counts, and
    # the prompt's distinct ids for the repetition penalty), only when a penalty is set.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    output_token_ids: list[int] = field(default_factory=list)
    output_token_counts: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    logit_bias_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    # Structured output (``stage_server/grammar.py``): the request's grammar (xgrammar EBNF),
    # sent once per row, with the prefill chunk that ends its prefill, and the outputs a
    # preempted request already generated (the grammar accepts them before its next sample).
    grammar: str = ""
    grammar_accepted_ids: list[int] = field(default_factory=list)
    # prefill chunks: log-probabilities of the prompt tokens the chunk's positions predict,
    # with this many alternatives (None: none)
    prompt_logprobs: int | None = None
    # vLLM's allowed_token_ids and bad_words (token sequences, concatenated, with their
    # lengths), and the last outputs before the step that the longest bad word can need
    allowed_token_ids: list[int] = field(default_factory=list)
    bad_word_ids: list[int] = field(default_factory=list)
    bad_word_lens: list[int] = field(default_factory=list)
    recent_output_ids: list[int] = field(default_factory=list)

    @property
    def bad_words(self) -> list[list[int]]:
        """The bad words as token sequences."""
        out, at = [], 0
        for n in self.bad_word_lens:
            out.append(self.bad_word_ids[at:at + n])
            at += n
        return out

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        elif _F32_MAX < self.temperature < float("inf"):
            self.temperature = _F32_MAX
        if 0.0 < self.top_p < _F32_TINY:
            self.top_p = _F32_TINY
        if self.top_k > _I32_MAX:
            self.top_k = _I32_MAX


@dataclass
class StepInput:
    """One micro-batch, one round, as a stage receives it (``StepRequest``).

    Every request is addressed by its stable ``req_pool_indices`` row. input_ids: ``T``
    packed token ids (every stage gets them: the last stage judges drafts by them). For
    ``verify`` each request has ``D`` tokens: the last sampled token then ``D - 1`` drafts
    (``num_drafts`` of them real, the rest padding). hidden_states: ``[T, hidden]`` tensor
    from the previous stage (None on stage 0). sample: per request, whether the step ends
    with a sampled token (False for a prefill chunk that does not end its prompt).
    next_token_ids: the prompt token after a non-final prefill chunk (the MTP head
    conditions on it), else -1. output_lens: tokens generated before this step.
    restore_slots / snapshot_slots: the prefill chunks' prefix-cache slots, per request
    (-1: none, and for every request of a mixed micro-batch's decode / verify part) or
    empty: start the row from the snapshot of its ``seq_lens`` tokens; snapshot the row
    after the chunk.

    A *mixed* micro-batch (``num_prefill > 0``, mode ``decode`` or ``verify``) carries
    prefill chunks in the same forward (chunked prefill mixed with decode, as vLLM and
    SGLang run it): its first ``B - num_prefill`` requests run ``mode``, its last
    ``num_prefill`` requests are prefill chunks whose tokens follow theirs in
    ``input_ids``. :meth:`parts` splits it into one step per kind. A ``prefill`` step
    has ``num_prefill`` 0: all its requests are chunks.

    ``follows_round`` (async scheduling, docs/DESIGN.md, "Async scheduling"): the router
    formed this step before round ``follows_round`` of the same micro-batch came back, so
    the input ids of a request continuing from that round are -1 (:data:`FOLLOWS`): a
    decode's one id, or all of a verify's, whose position, drafts and the commit of the
    followed verify depend on that round's result too; the first stage fills them in with
    :func:`fill_following` from that round's result before it checks or runs the step. 0:
    every input id is given.
    """

    micro_batch_id: int
    round: int
    mode: str
    req_pool_indices: list[int]
    seq_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]
    num_drafts: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    next_token_ids: list[int] = field(default_factory=list)
    sampling: list[SamplingSpec] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    hidden_states: Any = None
    # prefix cache (stage_server.snapshots), per request or empty: -1 for none
    restore_slots: list[int] = field(default_factory=list)   # prefill from this snapshot's seq_lens tokens
    snapshot_slots: list[int] = field(default_factory=list)  # snapshot the row after this chunk
    num_prefill: int = 0
    follows_round: int = 0

    def is_prefill(self, b: int) -> bool:
        """Request ``b`` runs a prefill chunk (all of a prefill step, the tail of a mixed one)."""
        return self.mode == PREFILL or b >= len(self.req_pool_indices) - self.num_prefill

    @property
    def verify_rows(self) -> list[int]:
        """Rows this step verifies (their commit must come before their next step)."""
        if self.mode != VERIFY:
            return []
        return self.req_pool_indices[: len(self.req_pool_indices) - self.num_prefill]

    def without(self, drop: list[int]) -> StepInput:
        """This step less the requests at indices ``drop`` (decode or verify requests, not
        prefill chunks; no hidden states: the first stage's step)."""
        gone = set(drop)
        keep = [b for b in range(len(self.req_pool_indices)) if b not in gone]
        starts = [sum(self.extend_lens[:b]) for b in range(len(self.extend_lens))]

        def cut(xs):
            return [xs[b] for b in keep] if xs else []
        ids = [t for b in keep for t in self.input_ids[starts[b]: starts[b] + self.extend_lens[b]]]
        # a mixed step that loses every decode / verify request is its prefill chunks alone:
        # a prefill step (a mixed one needs a request of its own mode)
        mode, num_prefill = self.mode, self.num_prefill
        if num_prefill and len(keep) == num_prefill:
            mode, num_prefill = PREFILL, 0
        return StepInput(self.micro_batch_id, self.round, mode, cut(self.req_pool_indices), cut(self.seq_lens),
                         cut(self.extend_lens), ids, cut(self.num_drafts), cut(self.sample), cut(self.next_token_ids),
                         cut(self.sampling), cut(self.output_lens), restore_slots=cut(self.restore_slots),
                         snapshot_slots=cut(self.snapshot_slots), num_prefill=num_prefill,
                         follows_round=self.follows_round)

    def parts(self) -> list[StepInput]:
        """This step as one step per kind, in request and token order: itself when it is
        not mixed, else its ``mode`` requests then its prefill chunks (``hidden_states``
        split by tokens; per-request lists that are empty stay empty)."""
        if not self.num_prefill:
            return [self]
        B = len(self.req_pool_indices)
        k = B - self.num_prefill
        t = sum(self.extend_lens[:k])
        return [self._part(self.mode, slice(0, k), slice(0, t)), self._part(PREFILL, slice(k, B), slice(t, None))]

    def per_request(self) -> list[StepInput]:
        """A prefill step as one prefill step per request, in order (``hidden_states``
        split by tokens): a stage may run its chunks one at a time, each row's state and
        KV being its own."""
        if self.mode != PREFILL:
            raise ValueError(f"per_request splits a prefill step, not a {self.mode} one")
        cu = [0, *itertools.accumulate(self.extend_lens)]
        return [self._part(PREFILL, slice(b, b + 1), slice(cu[b], cu[b + 1])) for b in range(len(cu) - 1)]

    def _part(self, mode: str, rq: slice, tok: slice) -> StepInput:
        """The requests ``rq`` of this step, whose tokens are ``tok``, as a ``mode`` step."""
        def cut(xs):
            return list(xs[rq]) if xs else []

        def chunks_only(xs):  # prefix-cache slots name prefill chunks only
            return cut(xs) if mode == PREFILL else []
        h = self.hidden_states[tok] if self.hidden_states is not None else None
        return StepInput(self.micro_batch_id, self.round, mode, cut(self.req_pool_indices), cut(self.seq_lens),
                         cut(self.extend_lens), list(self.input_ids[tok]), cut(self.num_drafts), cut(self.sample),
                         cut(self.next_token_ids), cut(self.sampling), cut(self.output_lens), h,
                         restore_slots=chunks_only(self.restore_slots), snapshot_slots=chunks_only(self.snapshot_slots))


FOLLOWS = -1
"""An input id the first stage fills in from the round its step follows
(``StepInput.follows_round``): a decode's one id (the token its row emitted last in that
round), or every id of a verify (that token, then the MTP drafts that round made)."""


@dataclass
class RoundNote:
    """What one row left in a round that ended on the first stage: what a step following
    that round takes (:func:`fill_following`; docs/DESIGN.md, "Async scheduling").

    ids: the tokens it emitted (a verify's: its accept length of them). drafts: the MTP
    drafts for its next round. seq_len: the row's length once the round is committed
    (``seq_len + accept length`` for a verify, ``seq_len + extend_len`` else). output_len:
    tokens generated once the round is processed. verified: a verify row, whose accept
    length a commit must apply."""

    ids: list[int]
    drafts: list[int]
    seq_len: int
    output_len: int
    verified: bool


def note_round(step, output_ids, drafts) -> dict[int, RoundNote]:
    """Per row of ``step`` that emitted tokens, its :class:`RoundNote`. ``step``: the step
    that ran, as a :class:`StepInput` or a ``StepRequest`` (the same field names; FOLLOWS
    ids filled in already); ``output_ids`` / ``drafts``: its result's, per request (lists
    of ids; ``drafts`` may be empty)."""
    rows, seq, ext = step.req_pool_indices, step.seq_lens, step.extend_lens
    out_lens = step.output_lens or [0] * len(rows)
    nv = len(rows) - step.num_prefill if step.mode == VERIFY else 0
    notes = {}
    for b, ids in enumerate(output_ids):
        if len(ids):
            ids = list(ids)
            verified = b < nv
            notes[rows[b]] = RoundNote(ids, list(drafts[b]) if b < len(drafts) else [],
                                       seq[b] + (len(ids) if verified else ext[b]), out_lens[b] + len(ids), verified)
    return notes


def fill_following(inp: StepInput, noted: dict[int, RoundNote],
                   pending: dict[int, tuple[int, int]]) -> tuple[StepInput, list[int], Commit | None]:
    """The first stage's part of a step that follows a round (``inp.follows_round``;
    ``noted``: that round's :func:`note_round`), before anything checks or runs it.

    A decode request whose first id is :data:`FOLLOWS` takes the token its row emitted
    last there. A verify request whose ids are all FOLLOWS (a *following verify*: its
    position and drafts depend on that round's accept length) takes that token then the
    round's MTP drafts (``num_drafts`` of them), and ``seq_lens`` / ``output_lens`` as
    the round leaves them; a verify row's accept length goes into the returned commit of
    the followed round, which every stage applies before the step (as one the router
    built: docs/DESIGN.md, "Ordering"). A request that one of its stop ids ended there
    (``SamplingSpec.banned_until_min``: EOS unless ``ignore_eos``, its stop ids, the
    router's stop rule) is left out of the step (and of the commit: the router commits it).

    ``pending``: the first stage's rows whose verify awaits its commit (row ->
    ``(micro_batch_id, round)``). A row of the step pending on the round it follows can
    only be a following verify (the router formed the step while that round held every
    other row of it), and no one else sends that commit: a row it would wait for is refused.

    Returns the filled step (``follows_round`` 0) less those left out, their indices in
    ``inp``, and the commit (None: no followed verify). Raises ValueError naming a row
    that follows but emitted nothing there, FOLLOWS ids a request cannot have, or a row
    pending on the followed round that the result gives no commit.
    """
    rows, exts = inp.req_pool_indices, inp.extend_lens
    ids = list(inp.input_ids)
    if len(rows) != len(exts) or sum(exts) != len(ids) or min(exts, default=1) < 1:
        raise ValueError("input_ids: a step that follows a round needs one extend_len >= 1 per request, summing "
                         "to the number of input_ids")
    seq, out, nd = list(inp.seq_lens), list(inp.output_lens), list(inp.num_drafts)
    nv = len(inp.verify_rows)
    left_out, c_rows, c_acc = [], [], []
    start = 0
    for b, (row, n) in enumerate(zip(rows, exts)):
        own = ids[start: start + n]
        if own[0] == FOLLOWS:
            note = noted.get(row)
            if note is None:
                raise ValueError(f"input_ids: row {row} follows a round in which it emitted no token")
            stopped = b < len(inp.sampling) and stops_in(inp.sampling[b], note.ids)
            if b < nv:  # a following verify: its ids, position and drafts are the round's
                if own.count(FOLLOWS) != n or len(seq) != len(rows) or len(nd) != len(rows) or len(out) != len(rows):
                    raise ValueError(f"input_ids: row {row} is a following verify: all of its {n} ids FOLLOWS, with "
                                     f"seq_lens, num_drafts and output_lens for every request")
                drafts = note.drafts[: n - 1]
                ids[start: start + n] = [note.ids[-1]] + drafts + [0] * (n - 1 - len(drafts))
                seq[b], out[b], nd[b] = note.seq_len, note.output_len, len(drafts)
                if note.verified and not stopped:
                    c_rows.append(row)
                    c_acc.append(len(note.ids))
            else:
                if FOLLOWS in own[1:]:
                    raise ValueError(f"input_ids: row {row} follows its previous round past its first token")
                ids[start] = note.ids[-1]
            if stopped:
                left_out.append(b)
        elif FOLLOWS in own[1:]:
            raise ValueError(f"input_ids: row {row} follows its previous round past its first token")
        start += n
    filled = dataclasses.replace(inp, input_ids=ids, seq_lens=seq, output_lens=out, num_drafts=nd, follows_round=0)
    if left_out:
        filled = filled.without(left_out)
    followed = (inp.micro_batch_id, inp.follows_round)
    stuck = [r for r in filled.req_pool_indices if pending.get(r) == followed and r not in c_rows]
    if stuck:
        raise ValueError(f"rows {stuck} wait for the commit of round {inp.follows_round}, which they follow, but its "
                         f"result gives them none")
    commit = Commit(inp.micro_batch_id, inp.follows_round, c_rows, c_acc) if c_rows else None
    return filled, left_out, commit


def stops_in(spec: SamplingSpec, ids) -> bool:
    """Whether one of ``ids`` is a stop id of the request (``banned_until_min``: EOS unless
    ``ignore_eos``, its stop ids): the first stage left it out of a step following the round
    that emitted ``ids`` (:func:`fill_following`), and the router then commits that round
    for it itself."""
    return any(t in spec.banned_until_min for t in ids)


@dataclass
class StepOutput:
    """A stage's answer: hidden states (non-last stages) or, from the last stage, the
    tokens each request emitted (``len`` = accept length; empty for a non-final prefill
    chunk), MTP drafts for its next round (per request, or empty: none for any),
    optional log-probabilities
    (``[(token, logprob, [(id, logprob)])]`` per request), and per-stage compute times
    (seconds, index = PP rank)."""

    micro_batch_id: int
    round: int
    hidden_states: Any = None
    output_ids: list[list[int]] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # per request: [(token, logprob, top, rank)] per predicted prompt token, or None
    compute_seconds: float = 0.0
    stage_seconds: list[float] = field(default_factory=list)
    commit_seconds: list[float] = field(default_factory=list)  # each stage's for the commit the step carried


def with_left_out(out: StepOutput | None, n: int, left_out: list[int], micro_batch_id: int, round: int) -> StepOutput:
    """The result of a step of ``n`` requests run without those at ``left_out`` (``out``:
    the result of the others, None when none ran): they emit nothing, draft nothing."""
    out = out or StepOutput(micro_batch_id, round)
    ran = iter(range(n - len(left_out)))
    gone = set(left_out)
    idx = [None if b in gone else next(ran) for b in range(n)]

    def spread(xs, empty):
        return [empty if i is None else xs[i] for i in idx] if xs is not None else None
    return StepOutput(out.micro_batch_id, out.round, None, spread(out.output_ids, []),
                      spread(out.drafts or [[]] * (n - len(left_out)), []), spread(out.logprobs, None),
                      spread(out.prompt_logprobs, None), out.compute_seconds, list(out.stage_seconds))


@dataclass
class Commit:
    """Accept the verify of micro-batch ``micro_batch_id``, round ``round`` on every stage
    (``CommitRequest``; docs/DESIGN.md, "Commit rule"): row ``req_pool_indices[i]`` keeps
    ``accept_lengths[i]`` (in ``[1, D]``) of the tokens that verify ran."""

    micro_batch_id: int
    round: int
    req_pool_indices: list[int]
    accept_lengths: list[int]


@dataclass
class Release:
    """Free rows of finished or aborted requests on every stage (``ReleaseRequest``), after
    their pending commit; ``micro_batch_id`` / ``round``: where they last ran.
    ``abandon``: no commit will come for their pending round (it failed, or the pipeline is
    being reset): drop it instead of waiting. ``snapshot_slots`` / ``drop_slots``: the
    prefix cache's (``StageRunner.release``). ``commit``: the rows' pending commit (with
    its micro-batch's other rows), applied first on each stage as ``CommitAccept`` applies
    it: one call where two went one after the other."""

    req_pool_indices: list[int]
    micro_batch_id: int = 0
    round: int = 0
    abandon: bool = False
    snapshot_slots: list[int] = field(default_factory=list)  # per row: its prefix-cache slot, or -1
    drop_slots: list[int] = field(default_factory=list)      # prefix-cache slots to drop after
    commit: Commit | None = None


class StageInfo(TypedDict, total=False):
    """A stage's ``Info`` (``InfoReply``): what the router schedules by, and the stage's
    state. The runner fills the first group; the stage server adds the second."""

    pp_rank: int
    pp_size: int
    layer_start: int
    layer_end: int              # layers [layer_start, layer_end) of num_layers
    num_layers: int
    max_rows: int               # req_pool_indices range
    rows_in_use: int
    kv_tokens: int              # KV pool capacity in tokens (1 << 30 without attention layers)
    kv_pages_used: int
    kv_pages_total: int
    max_context: int            # tokens
    num_speculative_steps: int
    has_mtp: bool
    vocab_size: int
    eos_token_ids: list[int]
    memory_bytes: dict[str, int]
    busy_seconds: float         # compute seconds since start
    forwards: dict[str, int]    # layer forwards since start by how they ran: "graph" replays, "eager"
    commit_design: str          # "copy" or "replay"
    prefill_attention: str      # "flashinfer" or "triton" (CUDA), "torch" (CPU)
    warmup_seconds: float       # the warm-up at start
    device_type: str            # "cuda" or "cpu" (the router's default token budget)
    device_uuid: str            # the accelerator's identity ("" on the CPU): equal on stages that share one
    # the stage server's
    pending_commits: int        # rows whose verify awaits its commit
    instance_id: str            # random per process: a restart changes it
    next_instance_id: str       # the stage it relays to ("" on the last stage)
    routers: dict[str, float]   # router_id -> seconds since its last Info
    owner_router_id: str        # the router that last claimed the stage
    not_serving: str            # why it takes no step now ("" when it does)
    replaced: bool              # another router's claim took the stage from the asking one
    transport: str              # data plane to the next stage: "shm", "cuda_ipc", "dist", "bytes" ("" on the last)
    transport_detail: str       # why "bytes" where the stage asked for another
    control_socket: str         # its step socket for callers on its host ("" none; proto/local.py)
    host_id: str                # hostname/boot id (proto/local.host_id)
    control: str                # what its relay's steps go on: "socket", "grpc" ("" on the last stage)
    control_detail: str         # why "grpc" where a socket was not used
    inline_jobs: int            # steps and commits run on the event loop, no thread hand-off (--inline-steps)
    snapshot_slots: int         # prefix-cache snapshot slots of the stage
    snapshots_in_use: int
