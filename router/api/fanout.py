"""Request fan-out: one engine request per (prompt, choice), run as tasks, events merged.

A completions request may carry several prompts and ``n`` choices each; a chat request one
prompt and ``n`` choices. :func:`make_subs` turns the validated body into one ``Sub`` (its
``SamplingParams``, seed ``seed + i`` for choice i) per engine request, choice index
``prompt_index * n + i``. :class:`Fanout` runs them and hands out ``Event`` s: text already
detokenized and stop-checked (``router/detokenize.py``), per choice in order, choices
interleaved. A cancelled choice aborts its engine request.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Union

from fastapi import Request

from ..detokenize import TextStream
from ..protocol import AsyncEngine, _GenerationRequest
from ..types import ContextLengthError, EngineError, InvalidRequestError, SamplingParams, TokenLogprob
from .errors import APIError, check_utf8

log = logging.getLogger("ppspec.router.api")


@dataclass
class Sub:
    """One engine request: one choice of one prompt."""

    index: int  # choice index in the response
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cached_tokens: int = 0  # prompt tokens the prefix cache held (the engine's outputs say)


@dataclass
class TokenRecord:
    token_id: int
    logprob: TokenLogprob | None
    offset: int  # characters of text before this token's text


@dataclass
class Event:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tokens: list[TokenRecord] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Union[str, int, None] = None
    first: bool = False
    error: EngineError | None = None


# --------------------------------------------------------------------------------------
# One Sub per (prompt, choice)
# --------------------------------------------------------------------------------------


def check_ids(ids: list[int], param: str, vocab_size: int) -> None:
    for t in ids:
        if not (0 <= t < vocab_size):
            raise InvalidRequestError(f"{param}: token id {t} is outside the vocabulary [0, {vocab_size})",
                                      param=param)


def sampling_params(body: _GenerationRequest, prompt_len: int, choice: int, logprobs: int | None, param: str,
                    max_model_len: int, max_tokens_cap: int | None, grammar: str | None = None,
                    max_logprobs: int = 20, vocab_size: int | None = None,
                    defaults: dict[str, float] | None = None) -> SamplingParams:
    """SamplingParams of one choice; raises ContextLengthError / InvalidRequestError.
    ``defaults``: the values of ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
    ``repetition_penalty`` a request that leaves them out gets (the checkpoint's
    generation_config.json, as vLLM's ``--generation-config auto``); else vLLM's own."""
    limit = int(max_model_len)
    defaults = defaults or {}

    def given(name: str, fallback: float):
        value = getattr(body, name)
        return defaults.get(name, fallback) if value is None else value

    requested = body.requested_max_tokens
    if prompt_len >= limit or (requested is not None and prompt_len + requested > limit):
        exc = ContextLengthError(prompt_len, requested if requested is not None else 1, limit)
        # the field to change: the prompt when it alone fills the context, else max_tokens
        exc.param = param if prompt_len >= limit else body.max_tokens_field
        raise exc
    max_tokens = requested if requested is not None else min(limit - prompt_len, max_tokens_cap or limit)
    if requested is None and body.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens {body.min_tokens} is more than the {max_tokens} tokens a completion "
                                  f"may have here (the context left after the prompt)", param="min_tokens")
    params = SamplingParams(
        temperature=float(given("temperature", 1.0)),
        top_p=float(given("top_p", 1.0)),
        top_k=int(given("top_k", 0)),
        min_p=float(given("min_p", 0.0)),
        seed=None if body.seed is None else body.seed + choice,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=float(given("repetition_penalty", 1.0)),
        logit_bias=body.logit_bias_ids,
        grammar=grammar,
        allowed_token_ids=body.allowed_token_ids,
        bad_words=list(body.bad_words or []),
    )
    try:
        params.validate(max_logprobs, vocab_size)
    except InvalidRequestError as e:
        if e.param == "logprobs" and getattr(body, "top_logprobs", None) is not None:
            # chat's count of alternatives (its logprobs is a bool): the error names that field
            e.param = "top_logprobs"
            if e.message.startswith("logprobs"):
                e.message = "top_" + e.message
                e.args = (e.message,)
        raise
    return params


def make_subs(body: _GenerationRequest, request_id: str, prompts: list[list[int]], logprobs: int | None,
              param: str, *, vocab_size: int, max_model_len: int, max_tokens_cap: int | None,
              grammar: str | None = None, max_logprobs: int = 20,
              defaults: dict[str, float] | None = None) -> list[Sub]:
    """One ``Sub`` per (prompt, choice), request ids ``{request_id}-{index}``. ``param``
    names the prompt's field (``prompt`` / ``messages``) in errors; ``grammar``: the
    structured output's (``router/structured.py``), every choice's. Raises
    ``InvalidRequestError`` / ``ContextLengthError`` before anything runs."""
    for s in body.stop_list:
        check_utf8(s, "stop")
    check_ids(list(body.stop_token_ids or []), "stop_token_ids", vocab_size)
    check_ids(list(body.logit_bias_ids or {}), "logit_bias", vocab_size)
    subs = []
    for p, ids in enumerate(prompts):
        for i in range(body.n):
            params = sampling_params(body, len(ids), i, logprobs, param, max_model_len, max_tokens_cap, grammar,
                                     max_logprobs, vocab_size, defaults)
            index = p * body.n + i
            subs.append(Sub(index, p, f"{request_id}-{index}", ids, params))
    return subs


# --------------------------------------------------------------------------------------
# Running them
# --------------------------------------------------------------------------------------


class Runner:
    """The engine and its tokenizer, with tasks kept referenced until they end and aborts
    that complete even when their caller is cancelled."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer  # decoding, on the event loop
        self._background: set[asyncio.Task] = set()

    @property
    def eos_ids(self) -> set[int]:
        """The ids the engine stops on unless ``ignore_eos``: the checkpoint's EOS ids where
        the engine says them (known once it started), else the tokenizer's."""
        eos = getattr(self.engine, "eos", None)
        if eos is None:
            eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        return {int(t) for t in eos}

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        """``engine.abort``, completed even if the caller is cancelled meanwhile."""
        await asyncio.shield(self.spawn(self._abort_now(request_id, finish_reason)))

    async def _abort_now(self, request_id: str, finish_reason: str) -> None:
        try:
            await self.engine.abort(request_id, finish_reason)
        except Exception:  # noqa: BLE001
            log.exception("engine.abort(%s) failed", request_id)


class Fanout:
    """Runs the engine requests of one HTTP request as tasks and merges their updates.

    Each task turns ``RequestOutput``s into ``Event``s (text already detokenized and
    stop-checked). ``close()`` cancels unfinished tasks; a cancelled task aborts its engine
    request. Events come out per choice in order; choices interleave.
    """

    def __init__(self, runner: Runner, subs: list[Sub], body: _GenerationRequest, want_logprobs: bool):
        self.runner = runner
        self.subs = subs
        self.stops = body.stop_list
        self.skip_special_tokens = body.skip_special_tokens
        self.include_stop = body.include_stop_str_in_output
        self.want_logprobs = want_logprobs
        self.echo_only = getattr(body, "echo_only", False)  # the generated token is dropped
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.prompt_logprobs: dict[int, list[TokenLogprob]] = {}  # choice -> its prompt's (when asked)
        self.tasks: list[asyncio.Task] = []
        self.started: set[int] = set()
        self.finished: set[int] = set()

    def start(self) -> None:
        self.tasks = [self.runner.spawn(self._pump(sub)) for sub in self.subs]

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.subs)

    async def next(self) -> Event:
        """The next event; raises the ``EngineError`` a choice ended with."""
        ev = await self.queue.get()
        if ev.error is not None:
            raise ev.error
        self.started.add(ev.index)
        if ev.finish_reason is not None:
            self.finished.add(ev.index)
        if self.echo_only:
            ev.text, ev.token_ids, ev.tokens, ev.stop_reason = "", [], [], None
            ev.finish_reason = ev.finish_reason and "length"
        return ev

    async def prime(self) -> list[Event]:
        """Wait until every choice produced its first output; return the events so far."""
        out = []
        while len(self.started) < len(self.subs):
            out.append(await self.next())
        return out

    async def collect(self) -> list[Event]:
        out = []
        while not self.done:
            out.append(await self.next())
        return out

    async def close(self) -> None:
        """Cancel unfinished choices (their engine requests are aborted); idempotent."""
        pending = [t for t in self.tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.shield(asyncio.gather(*pending, return_exceptions=True))

    async def _pump(self, sub: Sub) -> None:
        runner = self.runner
        stream = TextStream(runner.tokenizer, sub.prompt_ids, self.stops, self.skip_special_tokens,
                            sub.params.min_tokens, self.include_stop)
        first, finished, last_token = True, False, None
        # the token that ends a choice ("stop" from the engine) stays out of its text, as vLLM's
        stop_ids = set(sub.params.stop_token_ids) | (set() if sub.params.ignore_eos else runner.eos_ids)
        it: Any = None
        try:
            it = runner.engine.generate(sub.request_id, sub.prompt_ids, sub.params)
            if inspect.isawaitable(it):
                it = await it
            async for out in it:
                sub.cached_tokens = max(sub.cached_tokens, getattr(out, "num_cached_tokens", 0))
                if out.prompt_logprobs is not None:  # on the first output, before its event
                    self.prompt_logprobs[sub.index] = out.prompt_logprobs
                ids = [int(t) for t in out.new_token_ids]
                # the token that ends the choice stays out of its text
                text_ids = ids[:-1] if (out.finish_reason == "stop" and ids and ids[-1] in stop_ids
                                        and not self.include_stop) else ids
                records: list[TokenRecord] = []
                if self.want_logprobs:  # each token's record notes where its text starts
                    logprobs = out.logprobs or []
                    for j, tid in enumerate(ids):
                        records.append(TokenRecord(tid, logprobs[j] if j < len(logprobs) else None,
                                                    len(stream.text)))
                        if j == len(text_ids) or stream.add(tid):
                            break
                    ids = ids[: len(records)]
                else:  # a round's tokens decoded together (TextStream.add_many)
                    taken = stream.add_many(text_ids)
                    if taken < len(text_ids):
                        ids = ids[:taken]  # a stop string ended the choice there
                if ids:
                    last_token = ids[-1]
                if stream.stopped:
                    text = stream.take()
                    finished = True
                    await runner.abort(sub.request_id, "stop")  # frees the rows; the iterator is closed below
                    self.queue.put_nowait(Event(sub.index, text, ids, records, "stop", stream.stop_str, first))
                    return
                if out.finish_reason is not None:
                    text = stream.take() + stream.finish()
                    finished = True
                    reason, stop_reason = out.finish_reason, None
                    if stream.stopped:  # the final flush completed a stop string
                        reason, stop_reason = "stop", stream.stop_str
                    elif reason == "stop" and last_token is not None and last_token in sub.params.stop_token_ids:
                        stop_reason = last_token
                    self.queue.put_nowait(Event(sub.index, text, ids, records, reason, stop_reason, first))
                    return
                text = stream.take()
                if first or text or ids:
                    self.queue.put_nowait(Event(sub.index, text, ids, records, first=first))
                    first = False
            # The iterator ended without a final output: report what we have as aborted.
            finished = True
            self.queue.put_nowait(Event(sub.index, stream.take() + stream.finish(), finish_reason="abort",
                                         first=first))
        except EngineError as exc:
            finished = True  # the engine ended the request itself
            self.queue.put_nowait(Event(sub.index, error=exc))
        except Exception as exc:  # a bug (ours or the engine's): abort and report a 500
            log.exception("request %s failed", sub.request_id)
            self.queue.put_nowait(Event(sub.index, error=APIError(
                500, f"internal error: {type(exc).__name__}", "internal_error")))
        finally:
            try:
                if not finished:  # cancelled (client gone, a sibling failed) or crashed
                    await runner.abort(sub.request_id)
            finally:
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except BaseException:  # noqa: BLE001 - best effort, the request is over
                        pass


async def _wait_disconnect(request: Request) -> None:
    """Return when the client has gone (the body has been read, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    pass


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; raise ``ClientGone`` (after cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()
