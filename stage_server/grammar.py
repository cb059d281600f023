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

A compile's time grows much faster than the grammar (an object of 1000 optional properties,
a 27 KB schema: 20 s on the demo's 8192-token vocabulary; 5000: many minutes), and xgrammar
cannot stop one that runs in a thread. So compiles run in child processes
(:class:`CompileProcess`, :data:`COMPILE_PROCESSES` side by side: a long one holds back
neither the steps nor the other requests' grammars), each stopped at
:data:`COMPILE_TIMEOUT_S` (its child killed: the request is refused, HTTP 400) and sent back
serialized (xgrammar's ``serialize_json``). A compile is shared by every request that asked
for its text while it is under way (:class:`_Compile`), and given up once all of them have
ended (their client went away, the router cancelled ``PrepareGrammar``): one still queued
is dropped before it starts, one running is stopped (its child killed, as at the cap), so
an abandoned compile never holds a compile process that another request waits for.

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
import os
import queue
import subprocess
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable
from multiprocessing.connection import Connection

import torch

from .pools import device_int64, to_device

log = logging.getLogger("ppspec.stage")

COMPILE_CACHE_BYTES = 256 << 20
"""Compiled grammars the stage keeps (xgrammar's cache, bytes): a schema sent again is not
compiled again."""

PREFETCHED = 256
"""Compiles (futures) :meth:`GrammarRows.prefetch` keeps by grammar text for the steps to
look up; older ones fall back to xgrammar's cache (a step compiling one again is cheap)."""


COMPILE_TIMEOUT_S = 10.0
"""Seconds one grammar may compile before it is refused (HTTP 400); the environment's
``PPSPEC_GRAMMAR_COMPILE_TIMEOUT`` sets another."""

COMPILE_PROCESSES = 2
"""Grammars compiling at once on the stage, each in a child process of its own."""


def _xgrammar():
    """xgrammar, imported on the first constrained request (it takes about a second)."""
    import xgrammar

    return xgrammar


class CompileProcess:
    """A child process that compiles grammars (xgrammar EBNF) against one tokenizer, one at
    a time, started on first use: :meth:`compile` sends the text and waits for the compiled
    grammar's serialized JSON, killing the child when it takes longer than the cap (the
    next compile starts another). Used by one thread at a time."""

    def __init__(self, tokenizer_info_json: str):
        self.info_json = tokenizer_info_json
        self.proc: subprocess.Popen | None = None
        self._send = self._recv = None
        self._stopping = threading.Lock()

    def _start(self) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from ppspec.stage_server.grammar import compile_worker; compile_worker()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        with self._stopping:  # stop() sees the process and its pipes together, or neither
            self.proc = proc
            self._send = Connection(os.dup(proc.stdin.fileno()), readable=False)
            self._recv = Connection(os.dup(proc.stdout.fileno()), writable=False)
        proc.stdin.close()
        proc.stdout.close()
        try:
            self._send.send_bytes(self.info_json.encode())
            assert self._recv.recv_bytes() == b"ready"
        except (EOFError, OSError, AssertionError):
            stopped = self.proc is not proc  # stop() from another thread killed it while it started
            self.stop()
            raise ValueError("the grammar compiler process stopped while compiling it" if stopped
                             else "the grammar compiler process did not start") from None

    def compile(self, text: str, timeout: float, abandoned: Callable[[], bool] | None = None) -> str:
        """The compiled grammar of ``text`` (xgrammar's ``CompiledGrammar.serialize_json``).
        Raises ValueError: the text does not compile, takes longer than ``timeout`` seconds,
        or the child exits (killed by :meth:`stop`, or crashed) while compiling it, or
        ``abandoned()`` says nobody waits for it once its child runs (a :meth:`stop` that
        came while no child ran would otherwise let a fresh one compile it for nobody)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        proc = self.proc
        if abandoned is not None and abandoned():
            raise ValueError("the grammar's compile was dropped: every request waiting for it ended")
        try:
            self._send.send_bytes(text.encode())
            if not self._recv.poll(timeout):
                self.stop()
                raise ValueError(f"the grammar did not compile within {timeout:g} s (PPSPEC_GRAMMAR_COMPILE_TIMEOUT "
                                 f"on the last stage): give a smaller schema or grammar")
            reply = self._recv.recv_bytes()
        except (EOFError, OSError, TypeError) as e:
            # stop() from another thread may close the pipe under poll / recv, which then
            # raise TypeError (the closed handle is None); any other TypeError is a bug
            if isinstance(e, TypeError) and self.proc is proc:
                raise
            self.stop()
            raise ValueError("the grammar compiler process stopped while compiling it") from None
        if reply[:2] != b"ok":
            raise ValueError(f"the grammar does not compile: {reply[2:].decode(errors='replace')}")
        return reply[2:].decode()

    def stop(self) -> None:
        """Kill the child (a compile waiting on it raises ValueError). From any thread."""
        with self._stopping:
            proc, self.proc = self.proc, None
            if proc is not None:
                proc.kill()
                proc.wait()
                self._send.close()
                self._recv.close()


def compile_worker() -> None:
    """The child of :class:`CompileProcess`: the tokenizer's xgrammar ``TokenizerInfo`` JSON
    on stdin, then grammar texts; each answered on stdout with ``ok`` + the compiled
    grammar's JSON or ``er`` + xgrammar's reason. Exits when stdin closes or its parent is
    gone."""
    channel = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # a stray print goes to stderr, never into the channel
    inp = Connection(0, writable=False)
    parent = os.getppid()

    def orphaned():  # a killed stage never closes our stdin while we compile
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    xgr = _xgrammar()
    info = xgr.TokenizerInfo.deserialize_json(inp.recv_bytes().decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILE_CACHE_BYTES)
    channel.send_bytes(b"ready")
    while True:
        try:
            text = inp.recv_bytes().decode()
        except EOFError:
            return
        try:
            channel.send_bytes(b"ok" + compiler.compile_grammar(text).serialize_json().encode())
        except RuntimeError as e:
            channel.send_bytes(b"er" + str(e).encode())


class CompilePool:
    """:data:`COMPILE_PROCESSES` compile processes for one tokenizer, shared by every
    :class:`GrammarRows` of this process over it (a stage has one; the in-process
    ``LLM`` one per instance)."""

    def __init__(self, tokenizer_info_json: str):
        self.processes = [CompileProcess(tokenizer_info_json) for _ in range(COMPILE_PROCESSES)]
        self.idle: queue.LifoQueue[CompileProcess] = queue.LifoQueue()  # the last used first: it has started
        for p in self.processes:
            self.idle.put(p)

    def compile(self, text: str, timeout: float, job: "_Compile | None" = None) -> str:
        """:meth:`CompileProcess.compile` on an idle process (waiting for one). ``job``: the
        shared compile this is, which may stop it (:meth:`_Compile.abandon`); raises
        ValueError when it was given up before a process took it."""
        process = self.idle.get()
        try:
            if job is None:
                return process.compile(text, timeout)
            job.attach(process)
            try:
                return process.compile(text, timeout, lambda: job.abandoned)
            finally:
                job.detach()
        finally:
            self.idle.put(process)

    def stop(self) -> None:
        for p in self.processes:
            p.stop()


def _pass_on(done: concurrent.futures.Future, to: concurrent.futures.Future) -> None:
    """``done``'s outcome into a caller's future ``to``, unless the caller cancelled it."""
    if not to.set_running_or_notify_cancel():
        return
    if done.cancelled():
        to.set_exception(ValueError("the grammar's compile was dropped: every request waiting for it ended"))
    elif done.exception() is not None:
        to.set_exception(done.exception())
    else:
        to.set_result(done.result())


_POOLS: dict[tuple, CompilePool] = {}
_POOLS_LOCK = threading.Lock()
_STOP_AT_EXIT = False


def _stop_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.stop()


class _Compile:
    """One grammar text's compile on the worker threads (:meth:`GrammarRows.prefetch`),
    shared by the callers that asked for it while it is under way: ``waiters`` of them have
    not given up. The last one to give up abandons it (:meth:`abandon`)."""

    def __init__(self):
        self.future: concurrent.futures.Future | None = None  # the worker thread's
        self.waiters = 0
        self.abandoned = False
        self._process: CompileProcess | None = None  # the process compiling it now
        self._lock = threading.Lock()  # abandon() and the worker agree on the process

    def attach(self, process: CompileProcess) -> None:
        """The worker gives the compile to ``process``; ValueError when it was abandoned."""
        with self._lock:
            if self.abandoned:
                raise ValueError("the grammar's compile was dropped: every request waiting for it ended")
            self._process = process

    def detach(self) -> None:
        with self._lock:
            self._process = None

    def abandon(self) -> None:
        """Nobody waits for the result: drop it if still queued, else stop its child (the
        compile raises ValueError; the process starts again for the next one)."""
        with self._lock:
            self.abandoned = True
            if self.future.cancel():
                return
            if self._process is not None:
                self._process.stop()

    def reusable(self) -> bool:
        """Whether a caller may wait for this compile: not abandoned, not failed (a failure
        such as a stopped child is tried again; a grammar that does not compile fails again
        in milliseconds)."""
        f = self.future
        return not self.abandoned and not (f.done() and (f.cancelled() or f.exception() is not None))


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
        # without waiting for the device: the step reads it once, its sampled tokens
        idx = device_int64(self.batch, logits.device)
        rows = logits.index_select(0, idx)  # [b, D, V], a copy
        bits = to_device(self.bitmask, logits.device)
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
        idx = device_int64(self.batch, logits.device)
        rows = logits.index_select(0, idx)
        # on CUDA from a pinned copy of the mask (the next step refills this one)
        _xgrammar().apply_token_bitmask_inplace(rows, to_device(bits, logits.device),
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
        self.compile_timeout = float(os.environ.get("PPSPEC_GRAMMAR_COMPILE_TIMEOUT", COMPILE_TIMEOUT_S))
        self._info = self._compiler = None
        self._lock = threading.Lock()
        # grammar text -> its compile on a worker thread (prefetch), for the steps to look up
        self._compiles: OrderedDict[str, _Compile] = OrderedDict()
        self._compiles_lock = threading.Lock()  # not the compiler's: its first use loads the tokenizer
        self._worker = concurrent.futures.ThreadPoolExecutor(COMPILE_PROCESSES, thread_name_prefix="grammar-compile")
        self._pool: CompilePool | None = None
        global _STOP_AT_EXIT
        with _POOLS_LOCK:
            if not _STOP_AT_EXIT:  # at exit before the compile threads are joined (concurrent.futures'
                # hook, registered earlier, runs later): a compile in flight must not hold the exit
                threading._register_atexit(_stop_pools)
                _STOP_AT_EXIT = True
        self.step_compiles = 0  # grammars a step had to compile (or wait for): none were prefetched

    @property
    def tokenizer_info(self):
        """xgrammar's ``TokenizerInfo`` of the checkpoint's tokenizer, made on first use."""
        with self._lock:
            if self._info is None:
                from transformers import AutoTokenizer

                try:
                    tok = AutoTokenizer.from_pretrained(self.model_dir)
                except Exception as e:  # noqa: BLE001 - no tokenizer files, a broken one
                    raise ValueError(f"grammar: the checkpoint's tokenizer ({self.model_dir}) does not load, so "
                                     f"no grammar can be matched: {e}") from None
                self._info = _xgrammar().TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                                        stop_token_ids=self.eos or None)
                key = (self.model_dir, self.vocab_size, tuple(self.eos))
                with _POOLS_LOCK:
                    if key not in _POOLS:
                        _POOLS[key] = CompilePool(self._info.serialize_json())
                    self._pool = _POOLS[key]
            return self._info

    @property
    def compiler(self):
        """xgrammar's compiler in this process (what the stage compiles goes to its children)."""
        info = self.tokenizer_info
        with self._lock:
            if self._compiler is None:
                self._compiler = _xgrammar().GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILE_CACHE_BYTES)
            return self._compiler

    def _compile(self, text: str, job: _Compile | None = None):
        """``text`` (xgrammar EBNF) compiled, in a child process (:class:`CompileProcess`);
        ValueError when it does not compile, or not within ``compile_timeout``, or ``job``
        (the shared compile this is) was abandoned."""
        if not self.eos:
            raise ValueError("grammar: the checkpoint names no EOS token, which a grammar needs to end the output")
        info = self.tokenizer_info
        return _xgrammar().CompiledGrammar.deserialize_json(self._pool.compile(text, self.compile_timeout, job), info)

    def compile_processes(self) -> list[subprocess.Popen]:
        """The child processes compiling now or started for a compile (for tests)."""
        return [p.proc for p in (self._pool.processes if self._pool else []) if p.proc is not None]

    def close(self) -> None:
        """Stop every compile in flight (its ValueError says so) and the child processes
        (the next compile starts one again)."""
        if self._pool is not None:
            self._pool.stop()

    def prefetch(self, text: str) -> concurrent.futures.Future:
        """Compile ``text`` on a worker thread (not the step's); the future gives the
        compiled grammar or raises ValueError. A text already compiled or compiling shares
        that compile. Cancelling the future gives this caller's interest up: once every
        caller of a compile under way has, it is dropped (queued) or stopped (running).
        Called from any thread."""
        with self._compiles_lock:
            job = self._compiles.get(text)
            if job is None or not job.reusable():
                job = self._compiles[text] = _Compile()
                job.future = self._worker.submit(self._compile, text, job)
            self._compiles.move_to_end(text)
            while len(self._compiles) > PREFETCHED:
                self._compiles.popitem(last=False)
            job.waiters += 1
        mine: concurrent.futures.Future = concurrent.futures.Future()
        mine.add_done_callback(lambda f: f.cancelled() and self._give_up(text, job))
        job.future.add_done_callback(lambda f: _pass_on(f, mine))
        return mine

    def _give_up(self, text: str, job: _Compile) -> None:
        """One caller of ``job`` cancelled its future: the last one abandons the compile
        (dropped from the lookup, so a later request of the same text compiles it anew)."""
        with self._compiles_lock:
            job.waiters -= 1
            if job.waiters or job.future.done():
                return
            if self._compiles.get(text) is job:
                del self._compiles[text]
        log.info("a grammar's compile was given up: every request waiting for it ended (%d chars)", len(text))
        job.abandon()

    def compiled(self, text: str):
        """The compiled grammar of ``text`` for a step: the prefetched one, else compiled
        here (counted in ``step_compiles``: a path that did not prefetch, or one pushed out)."""
        with self._compiles_lock:
            job = self._compiles.get(text)
        if job is None or not job.future.done():
            self.step_compiles += 1
            log.info("a step compiles a grammar that was not compiled ahead (%d chars)", len(text))
        if job is None:
            return self._compile(text)
        if job.future.done() and not job.future.cancelled():
            return job.future.result()
        # under way: the step waits as a caller of its own, so that the requests that asked
        # for it giving up does not stop it under the step
        return self.prefetch(text).result()

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
