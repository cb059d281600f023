"""Structured output on the last stage: one grammar matcher per constrained row, and the
token mask of every verified position of a speculative round.

The router turns a request's ``response_format`` / ``structured_outputs`` / ``tool_choice``
into a grammar (``router/structured.py``: xgrammar's EBNF text) and sends it once per row,
with the prefill chunk that ends the request's prefill (``SamplingSpec.grammar``, with the
outputs a preempted request already generated in ``grammar_accepted_ids``), whatever the
chunk's start (a prefix-cache hit may skip the first ones). Compiling it against the
checkpoint's tokenizer takes milliseconds to seconds (the schema's size times the
vocabulary's), so it happens off the step: the router asks for it when the request arrives
(``PrepareGrammar``; :meth:`GrammarRows.prefetch` compiles on a thread of its own, xgrammar
releasing the GIL) and admits the request once it is compiled, so the step only looks the
compiled grammar up and the other requests of its micro-batch never wait for a compile
(as vLLM's requests waiting for their FSM). Compiled grammars are kept by their text
(xgrammar's compiler cache: a schema sent again is not compiled again). The stage keeps a
matcher for the row, keyed by ``req_pool_index``, until the row is released.

A verify of ``D`` positions judges draft ``j`` by the logits of position ``j``, which
follow the drafts before it. So the mask of position ``j`` is the grammar's after the
drafts ``< j``: the matcher accepts the drafts one by one, filling each position's mask
first, then rolls them back (:meth:`GrammarRows.token_mask`). A draft the grammar refuses
is masked at its own position, so the verify rejects it (its logit is -inf: greedy never
picks it, sampling gives it probability 0), and the bonus or resampled token is drawn from
the masked logits. Positions after a refused draft are never reached and stay unmasked.
Only the tokens the verify emits advance the matcher (:meth:`GrammarRows.advance`): the
same tokens the router appends to the request, so a round's rejected drafts never reach
the grammar's state.

MTP drafts follow the grammar too (:meth:`GrammarRows.draft_mask`): each step of the draft
chain takes the argmax of the head's logits masked with the grammar's state after the
emitted tokens and the drafts before it (the matcher accepts each draft, then rolls them
all back), so a constrained request's drafts are tokens its verify can accept, and its
accept length is not lost to drafts the grammar refuses. They stay drafts: the verify's
mask alone decides what is emitted.

A position where the grammar allows no token (after the ``min_tokens`` ban of EOS, say,
once the grammar is complete) allows EOS alone: the request ends with ``finish_reason``
``stop`` and the stage logs why, never a NaN from a softmax over nothing.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger("ppspec.stage")

COMPILE_CACHE_BYTES = 256 << 20
"""Compiled grammars the stage keeps (xgrammar's cache, bytes): a schema sent again is not
compiled again."""

PREFETCHED = 256
"""Compiles (futures) :meth:`GrammarRows.prefetch` keeps by grammar text for the steps to
look up; older ones fall back to xgrammar's cache (a step compiling one again is cheap)."""


def _xgrammar():
    """xgrammar, imported on the first constrained request (it takes about a second)."""
    import xgrammar

    return xgrammar


@dataclass
class TokenMask:
    """The grammar's mask of one micro-batch (:meth:`GrammarRows.token_mask`).

    ``batch``: positions in the micro-batch of the constrained requests; ``bitmask``
    ``[len(batch), D, ceil(V / 32)]`` int32 on the host, bit ``v % 32`` of word ``v // 32``
    set when token ``v`` is allowed (xgrammar's layout; all ones where unconstrained);
    ``fallback``: the token a position with nothing allowed gets (EOS). ``dead`` is set by
    :meth:`apply`: ``[len(batch), D]`` bool, the positions that had nothing allowed."""

    batch: list[int]
    bitmask: torch.Tensor
    fallback: int
    dead: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[B, D, V]`` (any float dtype, any device) with the grammar's
        disallowed tokens at -inf for the constrained requests: a copy (the caller's
        logits stay as they were)."""
        B, D, V = logits.shape
        idx = torch.tensor(self.batch, dtype=torch.long, device=logits.device)
        rows = logits.index_select(0, idx)  # [b, D, V], a copy
        bits = self.bitmask.to(logits.device, non_blocking=True)
        _xgrammar().apply_token_bitmask_inplace(rows.view(-1, V), bits.view(-1, bits.shape[-1]), vocab_size=V,
                                                backend="torch_native")
        # nothing allowed (the grammar's end under a min_tokens ban, or a grammar that
        # cannot go on): EOS alone, so the request stops instead of sampling from nothing
        self.dead = torch.isneginf(rows).all(-1)  # [b, D]
        rows[..., self.fallback] = torch.where(self.dead, torch.zeros((), dtype=rows.dtype, device=rows.device),
                                               rows[..., self.fallback])
        return logits.index_copy(0, idx, rows)


class DraftMask:
    """The grammar's mask over one MTP draft chain of a micro-batch (:meth:`GrammarRows.draft_mask`).

    ``batch``: positions in the micro-batch of the constrained requests that draft; each
    step :meth:`apply` masks their rows of the head's logits with their matchers' states,
    :meth:`accept` advances those matchers by the step's drafts, and :meth:`rollback`
    undoes every draft accepted, leaving the matchers as the verify left them."""

    def __init__(self, batch: list[int], matchers: list, vocab_size: int):
        self.batch, self.matchers, self.vocab_size = batch, matchers, vocab_size
        self.live = [not m.is_terminated() for m in matchers]  # a row whose drafts the grammar still follows
        self.taken = [0] * len(matchers)
        self._bitmask = _xgrammar().allocate_token_bitmask(len(batch), vocab_size)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[B, V]`` with the tokens the grammar refuses next at -inf in the
        live constrained rows (a copy). A row whose grammar allows nothing (its end) is left
        as it is and followed no further."""
        bits = self._bitmask
        bits.fill_(-1)  # all allowed: rows not live stay unmasked
        for k, m in enumerate(self.matchers):
            if self.live[k]:
                m.fill_next_token_bitmask(bits, k)
                if not bool(bits[k].any()):
                    self.live[k] = False
                    bits[k].fill_(-1)
        idx = torch.tensor(self.batch, dtype=torch.long, device=logits.device)
        rows = logits.index_select(0, idx)
        _xgrammar().apply_token_bitmask_inplace(rows, bits.to(logits.device, non_blocking=True),
                                                vocab_size=logits.shape[-1], backend="torch_native")
        return logits.index_copy(0, idx, rows)

    def accept(self, drafts: list[int]) -> None:
        """Advance the live matchers by this step's drafts (one per micro-batch request)."""
        for k, (b, m) in enumerate(zip(self.batch, self.matchers)):
            if not self.live[k]:
                continue
            if m.accept_token(drafts[b]):  # an allowed token (the mask's argmax) always is
                self.taken[k] += 1
                self.live[k] = not m.is_terminated()
            else:
                self.live[k] = False

    def rollback(self) -> None:
        for m, n in zip(self.matchers, self.taken):
            if n:
                m.rollback(n)
        self.taken = [0] * len(self.matchers)


class GrammarRows:
    """The grammar matchers of the rows of constrained requests, on the last stage.

    Args:
        model_dir: the checkpoint (its tokenizer gives the token strings the grammar matches).
        vocab_size: the logits' width (``V``; may exceed the tokenizer's length).
        eos_token_ids: tokens that end a request: the grammar's stop tokens; the first is the
            token of a dead end.
    """

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: list[int]):
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self.eos = list(eos_token_ids)
        self.matchers: dict = {}  # req_pool_index -> xgrammar.GrammarMatcher
        self._compiler = None
        self._lock = threading.Lock()
        # grammar text -> its compile on the worker thread (prefetch), for the steps to look up
        self._compiles: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self._compiles_lock = threading.Lock()  # not the compiler's: its first use loads the tokenizer
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.step_compiles = 0  # grammars a step had to compile (or wait for): none were prefetched

    @property
    def compiler(self):
        """xgrammar's compiler over the checkpoint's tokenizer, made on first use."""
        with self._lock:
            if self._compiler is None:
                from transformers import AutoTokenizer

                xgr = _xgrammar()
                try:
                    tok = AutoTokenizer.from_pretrained(self.model_dir)
                except Exception as e:  # noqa: BLE001 - no tokenizer files, a broken one
                    raise ValueError(f"grammar: the checkpoint's tokenizer ({self.model_dir}) does not load, so "
                                     f"no grammar can be matched: {e}") from None
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILE_CACHE_BYTES)
            return self._compiler

    def _compile(self, text: str):
        """``text`` (xgrammar EBNF) compiled; ValueError when it does not compile."""
        if not self.eos:
            raise ValueError("grammar: the checkpoint names no EOS token, which a grammar needs to end the output")
        try:
            return self.compiler.compile_grammar(text)
        except RuntimeError as e:
            raise ValueError(f"the grammar does not compile: {e}") from None

    def prefetch(self, text: str) -> concurrent.futures.Future:
        """Compile ``text`` on the worker thread (not the step's); the future gives the
        compiled grammar or raises ValueError. A text already compiled or compiling shares
        that compile. Called from any thread."""
        with self._compiles_lock:
            fut = self._compiles.get(text)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._compiles[text] = self._worker.submit(self._compile, text)
            self._compiles.move_to_end(text)
            while len(self._compiles) > PREFETCHED:
                self._compiles.popitem(last=False)
            return fut

    def compiled(self, text: str):
        """The compiled grammar of ``text`` for a step: the prefetched one, else compiled
        here (counted in ``step_compiles``: a path that did not prefetch, or one pushed out)."""
        with self._compiles_lock:
            fut = self._compiles.get(text)
        if fut is None or not fut.done():
            self.step_compiles += 1
            log.info("a step compiles a grammar that was not compiled ahead (%d chars)", len(text))
        return self._compile(text) if fut is None else fut.result()

    def prepare(self, rows: list[int], grammars: list[str], accepted: list[list[int]]) -> dict:
        """Matchers for requests starting on ``rows``: ``grammars[i]`` (xgrammar EBNF)
        compiled (:meth:`compiled`: looked up), then advanced over ``accepted[i]`` (the
        outputs of a preempted request). Nothing is installed (:meth:`install` does, once
        the step runs).

        Raises ValueError naming the row: a grammar that does not compile, or outputs it
        does not accept."""
        xgr = _xgrammar()
        out = {}
        for r, text, ids in zip(rows, grammars, accepted):
            try:
                m = xgr.GrammarMatcher(self.compiled(text))
            except ValueError as e:
                raise ValueError(f"grammar of row {r}: {e}") from None
            for k, t in enumerate(ids):
                if not m.accept_token(t):
                    raise ValueError(f"grammar_accepted_ids of row {r}: token {k} ({t}) does not match the grammar")
            out[r] = m
        return out

    def install(self, matchers: dict) -> None:
        self.matchers.update(matchers)

    def drop(self, row: int) -> None:
        self.matchers.pop(row, None)

    def constrained(self, rows: list[int]) -> bool:
        return bool(self.matchers) and any(r in self.matchers for r in rows)

    def token_mask(self, rows: list[int], drafts: list[list[int]], sample: list[bool], D: int) -> TokenMask | None:
        """The mask of every verified position of the micro-batch's constrained requests
        (those with a matcher that sample): position ``j`` after drafts ``< j`` (see the
        module docstring). None when no request is constrained."""
        batch = [b for b, r in enumerate(rows) if r in self.matchers and sample[b]]
        if not batch:
            return None
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(batch) * D, self.vocab_size)  # all ones
        for k, b in enumerate(batch):
            m = self.matchers[rows[b]]
            taken = 0
            for j in range(len(drafts[b]) + 1):
                if m.is_terminated():  # ended by an EOS: nothing more is allowed
                    bitmask[k * D + j].zero_()
                    break
                m.fill_next_token_bitmask(bitmask, k * D + j)
                if j == len(drafts[b]) or not m.accept_token(drafts[b][j]):
                    break  # a refused draft is masked at its own position: no later one is reached
                taken += 1
            if taken:
                m.rollback(taken)
        return TokenMask(batch, bitmask.view(len(batch), D, -1), self.eos[0])

    def advance(self, rows: list[int], mask: TokenMask, emitted: list[list[int]]) -> None:
        """Advance the matchers of ``mask``'s requests by the tokens the verify emitted
        (``emitted[b]``: accepted drafts then the bonus or resampled token)."""
        dead = mask.dead.tolist() if mask.dead is not None else None
        for k, b in enumerate(mask.batch):
            m = self.matchers[rows[b]]
            for j, t in enumerate(emitted[b]):
                if m.is_terminated():  # it ended at an EOS: the router drops what follows
                    break
                if dead is not None and dead[k][j]:
                    log.warning("row %d: the grammar allows no token at this position (its end, with EOS banned "
                                "by min_tokens, or no continuation): the output ends here with EOS", rows[b])
                    break
                if not m.accept_token(t):
                    # never from the masked logits; the request ends with this round
                    log.warning("row %d: token %d does not match the grammar; the output ends here", rows[b], t)
                    break

    def draft_mask(self, rows: list[int], wants: list[bool]) -> DraftMask | None:
        """The mask of an MTP draft chain over the micro-batch's constrained requests that
        draft (``wants[b]``), from their matchers' states now (after the verify's
        :meth:`advance`); None when none is constrained."""
        if not self.matchers:  # the common case: no constrained row at all
            return None
        batch = [b for b, r in enumerate(rows) if r in self.matchers and wants[b]]
        if not batch:
            return None
        return DraftMask(batch, [self.matchers[rows[b]] for b in batch], self.vocab_size)
