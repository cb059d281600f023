"""The router's OpenAI-compatible HTTP API (FastAPI + sse-starlette, served by uvicorn on uvloop).

``build_app(engine)`` serves any object with the ``AsyncEngine`` shape
(``router/protocol.py``): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health`` and Prometheus' ``/metrics``.

What this layer owns, and the engine does not:

* tokenization of prompts and chat rendering (``tokenizer.apply_chat_template``);
* incremental detokenization: text is released only in whole UTF-8 characters;
* stop strings: text that could still become a stop string is held back; on a match the
  text is cut before it, the engine request is aborted (``engine.abort``) and the choice
  ends with ``finish_reason="stop"``;
* ``n`` > 1 (one ``generate`` call per choice, seeds ``seed + i``), logprob formatting,
  usage counts, server-sent events ending with ``data: [DONE]``;
* OpenAI error bodies ``{"error": {"message", "type", "param", "code"}}``: 400 invalid
  request (pydantic errors included) or over-long prompt, 401 wrong API key, 404 unknown
  model, 413 body too large, 429 ``QueueFullError``, 503 ``StageDownError`` (mid-stream:
  an error event, then ``[DONE]``);
* client disconnects (streaming or not): every unfinished engine request is aborted.

A streaming response sends its headers once every choice has produced its first output, so
that errors raised before any token (queue full, stage down, context length) still get
their HTTP status.
"""
from __future__ import annotations

import asyncio
import copy
import hmac
import inspect
import json
import logging
import math
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import make_asgi_app
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import (
    AsyncEngine,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    _GenerationRequest,
)
from .detokenize import TextStream, TokenPieces
from .tool_calls import ToolCallStream, check_parser, parse_tool_calls
from .types import ContextLengthError, EngineError, InvalidRequestError, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS_CAP: int | None = None
"""Cap on the default ``max_tokens`` of a request that gives none: None means the context
left after the prompt (vLLM's default; KV pages are taken as the sequence grows, so a
large default reserves nothing)."""
TOKENIZE_WORKERS = 4
"""Threads that tokenize prompts and render chats, each with its own tokenizer copy."""
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""Largest accepted request body, in bytes (larger: 413)."""
LOGPROB_FLOOR = -9999.0
"""Log-probabilities below this (and -inf / NaN) are reported as this value (JSON has no -inf)."""


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


class APIError(EngineError):
    """An HTTP-layer error with its own status (401, 404, 413, 500...)."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message, param=param, code=code)
        self.http_status = status
        self.error_type = error_type


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON object."""
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code)).model_dump()


def error_response(status: int, message: str, error_type: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param, code), status_code=status)


def _engine_error_response(exc: EngineError) -> JSONResponse:
    return error_response(exc.http_status, exc.message, exc.error_type, exc.param, exc.code)


_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 503: "service_unavailable"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of the first pydantic error, e.g. ``("temperature: Input should be ...", "temperature")``."""
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"request body is not valid JSON: {ctx.get('error', 'decode error')}", None
    if not loc and first.get("type") == "missing":
        return "request body is missing: expected a JSON object (Content-Type: application/json)", None
    if not loc and isinstance(first.get("input"), (bytes, str)):
        return "request body must be a JSON object (Content-Type: application/json)", None
    param = loc[0] if loc else None  # the top-level field (union branch names dropped)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    body = first.get("input")
    if param is None and isinstance(body, dict):
        # a whole-request check (a model validator) has no location; its message starts
        # with the field it is about ("tools are not supported")
        word = re.match(r"[a-z_]+", msg)
        param = word.group(0) if word and word.group(0) in body else None
    text = f"{'.'.join(loc)}: {msg}" if loc else msg
    locs = [[str(x) for x in e.get("loc", ()) if x != "body"] for e in errors]
    if param and len(errors) > 1 and all(len(l) >= 2 and l[0] == param for l in locs):
        # a value matching no form of a union field: name the forms, not each branch's complaint
        forms = list(dict.fromkeys(l[1] for l in locs))
        if len(forms) > 1:
            return f"{param}: expected {' or '.join(forms)}", param
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text, param


def _check_utf8(text: str, param: str) -> None:
    """Raise ``InvalidRequestError`` when ``text`` holds lone surrogates (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{param} is not valid UTF-8 text", param=param) from None


# --------------------------------------------------------------------------------------
# Running the choices of one HTTP request
# --------------------------------------------------------------------------------------


@dataclass
class _Sub:
    """One engine request: one choice of one prompt."""

    index: int  # choice index in the response
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _TokenRecord:
    token_id: int
    logprob: TokenLogprob | None
    offset: int  # characters of text before this token's text


@dataclass
class _Event:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tokens: list[_TokenRecord] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Union[str, int, None] = None
    first: bool = False
    error: EngineError | None = None


class _Fanout:
    """Runs the engine requests of one HTTP request as tasks and merges their updates.

    Each task turns ``RequestOutput``s into ``_Event``s (text already detokenized and
    stop-checked). ``close()`` cancels unfinished tasks; a cancelled task aborts its engine
    request. Events come out per choice in order; choices interleave.
    """

    def __init__(self, server: "_Server", subs: list[_Sub], stops: list[str], skip_special_tokens: bool,
                 want_logprobs: bool):
        self.server = server
        self.subs = subs
        self.stops = stops
        self.skip_special_tokens = skip_special_tokens
        self.want_logprobs = want_logprobs
        self.queue: asyncio.Queue[_Event] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.started: set[int] = set()
        self.finished: set[int] = set()

    def start(self) -> None:
        self.tasks = [self.server.spawn(self._pump(sub)) for sub in self.subs]

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.subs)

    async def next(self) -> _Event:
        """The next event; raises the ``EngineError`` a choice ended with."""
        ev = await self.queue.get()
        if ev.error is not None:
            raise ev.error
        self.started.add(ev.index)
        if ev.finish_reason is not None:
            self.finished.add(ev.index)
        return ev

    async def prime(self) -> list[_Event]:
        """Wait until every choice produced its first output; return the events so far."""
        out = []
        while len(self.started) < len(self.subs):
            out.append(await self.next())
        return out

    async def collect(self) -> list[_Event]:
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

    async def _pump(self, sub: _Sub) -> None:
        server = self.server
        stream = TextStream(server.tokenizer, sub.prompt_ids, self.stops, self.skip_special_tokens,
                            sub.params.min_tokens)
        first, finished, last_token = True, False, None
        it: Any = None
        try:
            it = server.engine.generate(sub.request_id, sub.prompt_ids, sub.params)
            if inspect.isawaitable(it):
                it = await it
            async for out in it:
                ids: list[int] = []
                records: list[_TokenRecord] = []
                logprobs = out.logprobs or []
                for j, tid in enumerate(out.new_token_ids):
                    tid = int(tid)
                    ids.append(tid)
                    last_token = tid
                    if self.want_logprobs:
                        records.append(_TokenRecord(tid, logprobs[j] if j < len(logprobs) else None,
                                                    len(stream.text)))
                    if stream.add(tid):
                        break
                if stream.stopped:
                    text = stream.take()
                    finished = True
                    await server.abort(sub.request_id, "stop")  # frees the rows; the iterator is closed below
                    self.queue.put_nowait(_Event(sub.index, text, ids, records, "stop", stream.stop_str, first))
                    return
                if out.finish_reason is not None:
                    text = stream.take() + stream.finish()
                    finished = True
                    reason, stop_reason = out.finish_reason, None
                    if stream.stopped:  # the final flush completed a stop string
                        reason, stop_reason = "stop", stream.stop_str
                    elif reason == "stop" and last_token is not None and last_token in sub.params.stop_token_ids:
                        stop_reason = last_token
                    self.queue.put_nowait(_Event(sub.index, text, ids, records, reason, stop_reason, first))
                    return
                text = stream.take()
                if first or text or ids:
                    self.queue.put_nowait(_Event(sub.index, text, ids, records, first=first))
                    first = False
            # The iterator ended without a final output: report what we have as aborted.
            finished = True
            self.queue.put_nowait(_Event(sub.index, stream.take() + stream.finish(), finish_reason="abort",
                                         first=first))
        except EngineError as exc:
            finished = True  # the engine ended the request itself
            self.queue.put_nowait(_Event(sub.index, error=exc))
        except Exception as exc:  # a bug (ours or the engine's): abort and report a 500
            log.exception("request %s failed", sub.request_id)
            self.queue.put_nowait(_Event(sub.index, error=APIError(
                500, f"internal error: {type(exc).__name__}", "internal_error")))
        finally:
            try:
                if not finished:  # cancelled (client gone, a sibling failed) or crashed
                    await server.abort(sub.request_id)
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


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; raise ``_ClientGone`` (after cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        raise _ClientGone()
    return task.result()


def _finite(x: float | None) -> float:
    if x is None or math.isnan(x) or x < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return float(x)


# --------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------


@dataclass
class _Prepared:
    """A validated generation request, ready to run."""

    request_id: str
    prompts: list[list[int]]
    prompt_texts: list[str] | None  # for echo
    subs: list[_Sub]


class _Server:
    """The endpoints' logic over one engine (``build_app`` wires it to routes)."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, max_tokens_cap: int | None,
                 tool_call_parser: str | None):
        self.engine = engine
        self.tokenizer = engine.tokenizer  # decoding, on the event loop
        self.model_name = served_model_name
        self.max_tokens_cap = max_tokens_cap
        self.tool_call_parser = tool_call_parser
        self.pieces = TokenPieces(self.tokenizer)
        self.vocab_size = len(self.tokenizer)
        # Encoding and chat rendering run on worker threads, each with a private copy of the
        # tokenizer: encoding toggles settings of the Rust tokenizer (a mutable borrow),
        # which must not race with another thread's use or with decodes of the shared one
        # on the event loop. The Rust encode releases the GIL, so a long prompt holds one
        # worker while shorter ones pass it on the others.
        self._local = threading.local()
        try:
            copy.deepcopy(self.tokenizer)  # copyable? (each worker makes its own at start)
            workers = TOKENIZE_WORKERS
        except Exception:  # noqa: BLE001 - an uncopyable tokenizer: one worker shares it
            log.warning("tokenizer could not be copied; encoding shares it with decoding on one worker")
            workers = 1
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ppspec-tokenize",
                                           initializer=self._init_worker, initargs=(workers > 1,))
        self._background: set[asyncio.Task] = set()
        try:
            sig = inspect.signature(self.tokenizer.apply_chat_template)
            self._sanitize_kw = "sanitize_control_tokens" in sig.parameters
        except (TypeError, ValueError, AttributeError):
            self._sanitize_kw = False

    # -- helpers -----------------------------------------------------------------------

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        """A task that is kept referenced until it ends."""
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

    def _init_worker(self, copied: bool) -> None:
        self._local.encoder = copy.deepcopy(self.tokenizer) if copied else self.tokenizer

    @property
    def encoder(self):
        """This worker thread's tokenizer (encoding and chat rendering only)."""
        return self._local.encoder

    async def _in_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def check_model(self, name: str | None) -> None:
        """Raise ``APIError`` 404 (code ``model_not_found``) unless ``name`` is None or the served name."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error",
                           param="model", code="model_not_found")

    def _check_ids(self, ids: list[int], param: str) -> None:
        for t in ids:
            if not (0 <= t < self.vocab_size):
                raise InvalidRequestError(f"{param}: token id {t} is outside the vocabulary [0, {self.vocab_size})",
                                          param=param)

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        return [list(self.encoder.encode(t, add_special_tokens=True)) for t in texts]

    def _render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
        if tools:
            kwargs["tools"] = tools
        if self._sanitize_kw:
            kwargs["sanitize_control_tokens"] = True  # control tokens typed by users stay text
        ids = self.encoder.apply_chat_template(messages, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def _sampling_params(self, body: _GenerationRequest, prompt_len: int, choice: int,
                         logprobs: int | None, param: str) -> SamplingParams:
        """SamplingParams of one choice; raises ContextLengthError / InvalidRequestError."""
        limit = int(self.engine.max_model_len)
        requested = body.requested_max_tokens
        if prompt_len >= limit or (requested is not None and prompt_len + requested > limit):
            exc = ContextLengthError(prompt_len, requested if requested is not None else 1, limit)
            # the field to change: the prompt when it alone fills the context, else max_tokens
            exc.param = param if prompt_len >= limit else body.max_tokens_field
            raise exc
        max_tokens = requested if requested is not None else min(limit - prompt_len, self.max_tokens_cap or limit)
        if requested is None and body.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens {body.min_tokens} is more than the {max_tokens} tokens a completion "
                                      f"may have here (the context left after the prompt)", param="min_tokens")
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=0 if body.top_k is None else int(body.top_k),
            min_p=0.0 if body.min_p is None else float(body.min_p),
            seed=None if body.seed is None else body.seed + choice,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=body.logit_bias_ids,
        )
        params.validate()
        return params

    def _make_subs(self, body: _GenerationRequest, request_id: str, prompts: list[list[int]],
                   logprobs: int | None, param: str) -> list[_Sub]:
        for s in body.stop_list:
            _check_utf8(s, "stop")
        self._check_ids(list(body.stop_token_ids or []), "stop_token_ids")
        self._check_ids(list(body.logit_bias_ids or {}), "logit_bias")
        subs = []
        for p, ids in enumerate(prompts):
            for i in range(body.n):
                params = self._sampling_params(body, len(ids), i, logprobs, param)
                index = p * body.n + i
                subs.append(_Sub(index, p, f"{request_id}-{index}", ids, params))
        return subs

    async def prepare_completion(self, body: CompletionRequest) -> _Prepared:
        """Tokenize the prompt(s) and build one engine request per choice.

        Raises ``APIError`` (404 unknown model), ``InvalidRequestError`` (empty prompt, ids
        outside the vocabulary, text that is not UTF-8, bad sampling values) and
        ``ContextLengthError`` (prompt tokens + max_tokens over ``engine.max_model_len``).
        """
        self.check_model(body.model)
        p = body.prompt
        texts: list[str] | None = None
        if isinstance(p, str):
            texts = [p]
        elif isinstance(p[0], str):
            texts = list(p)  # type: ignore[arg-type]
        if texts is not None:
            for t in texts:
                _check_utf8(t, "prompt")
            try:
                prompts = await self._in_worker(self._encode_texts, texts)
            except Exception as exc:  # noqa: BLE001
                raise InvalidRequestError(f"prompt could not be tokenized: {exc}", param="prompt") from None
        else:
            prompts = [list(p)] if isinstance(p[0], int) else [list(x) for x in p]  # type: ignore[arg-type]
        for ids in prompts:
            if not ids:
                raise InvalidRequestError("prompt is empty (it encodes to no tokens)", param="prompt")
            self._check_ids(ids, "prompt")
        if body.echo and texts is None:
            texts = [self.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        subs = self._make_subs(body, request_id, prompts, body.logprobs, "prompt")
        return _Prepared(request_id, prompts, texts, subs)

    async def prepare_chat(self, body: ChatCompletionRequest) -> _Prepared:
        """Render the messages with the chat template (generation prompt added) and build one
        engine request per choice. Raises as ``prepare_completion``, and
        ``InvalidRequestError`` when the template fails or the model has none."""
        self.check_model(body.model)
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        messages = [m.to_template() for m in body.messages]
        for m in messages:
            if isinstance(m.get("content"), str):
                _check_utf8(m["content"], "messages")
        if body.tools_in_use and self.tool_call_parser is None:
            raise InvalidRequestError("tools need a server started with --tool-call-parser (e.g. hermes)",
                                      param="tools")
        try:
            ids = await self._in_worker(self._render_chat, messages, body.tools if body.tools_in_use else None)
        except Exception as exc:  # noqa: BLE001 - template errors (raise_exception, bad roles)
            raise InvalidRequestError(f"messages could not be rendered with the chat template: {exc}",
                                      param="messages") from None
        if not ids:
            raise InvalidRequestError("messages render to an empty prompt", param="messages")
        logprobs = None
        if body.logprobs:
            logprobs = body.top_logprobs or 0
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        subs = self._make_subs(body, request_id, [ids], logprobs, "messages")
        return _Prepared(request_id, [ids], None, subs)

    def usage(self, prepared: _Prepared, completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(p) for p in prepared.prompts)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    # -- logprob shapes ----------------------------------------------------------------

    def completion_logprobs(self, records: list[_TokenRecord], k: int, base_offset: int = 0) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for r in records:
            text, _ = self.pieces(r.token_id)
            out.tokens.append(text)
            out.text_offset.append(base_offset + r.offset)
            if r.logprob is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(r.logprob.logprob))
            top: dict[str, float] = {}
            for tid, lp in r.logprob.top[:k]:
                top.setdefault(self.pieces(int(tid))[0], _finite(lp))
            # OpenAI: the sampled token's logprob is always there (up to logprobs + 1 entries)
            top.setdefault(text, _finite(r.logprob.logprob))
            out.top_logprobs.append(top)
        return out

    def chat_logprobs(self, records: list[_TokenRecord], k: int) -> ChatChoiceLogprobs:
        content = []
        for r in records:
            text, raw = self.pieces(r.token_id)
            lp = r.logprob
            tops = []
            if lp is not None:
                for tid, value in lp.top[:k]:
                    t_text, t_raw = self.pieces(int(tid))
                    tops.append(ChatTopLogprob(token=t_text, logprob=_finite(value), bytes=t_raw))
            content.append(ChatTokenLogprob(token=text, logprob=_finite(None if lp is None else lp.logprob),
                                            bytes=raw, top_logprobs=tops))
        return ChatChoiceLogprobs(content=content)

    # -- endpoints -----------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """``POST /v1/completions``: JSON, or server-sent events when ``stream``. Raises
        ``EngineError`` subclasses (turned into OpenAI error bodies by the app)."""
        prepared = await self.prepare_completion(body)
        fanout = _Fanout(self, prepared.subs, body.stop_list, body.skip_special_tokens, body.logprobs is not None)
        if body.stream:
            return await self._stream(request, fanout, lambda buffered: self._completion_sse(body, prepared, fanout, buffered))
        events = await self._collect(request, fanout)
        if events is None:
            return Response(status_code=499)
        choices, total = [], 0
        for sub in prepared.subs:
            evs = [e for e in events if e.index == sub.index]
            ids = [t for e in evs for t in e.token_ids]
            records = [r for e in evs for r in e.tokens]
            total += len(ids)
            text = "".join(e.text for e in evs)
            prefix = prepared.prompt_texts[sub.prompt_index] if body.echo and prepared.prompt_texts else ""
            choices.append(CompletionChoice(
                index=sub.index, text=prefix + text,
                logprobs=None if body.logprobs is None else self.completion_logprobs(records, body.logprobs, len(prefix)),
                finish_reason=evs[-1].finish_reason, stop_reason=evs[-1].stop_reason,
                token_ids=ids if body.return_token_ids else None,
                prompt_token_ids=sub.prompt_ids if body.return_token_ids else None))
        resp = CompletionResponse(id=prepared.request_id, model=self.model_name, choices=choices,
                                  usage=self.usage(prepared, total))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        """``POST /v1/chat/completions``; as ``completions``."""
        prepared = await self.prepare_chat(body)
        fanout = _Fanout(self, prepared.subs, body.stop_list, body.skip_special_tokens, body.logprobs)
        if body.stream:
            return await self._stream(request, fanout, lambda buffered: self._chat_sse(body, prepared, fanout, buffered))
        events = await self._collect(request, fanout)
        if events is None:
            return Response(status_code=499)
        k = body.top_logprobs or 0
        choices, total = [], 0
        for sub in prepared.subs:
            evs = [e for e in events if e.index == sub.index]
            ids = [t for e in evs for t in e.token_ids]
            records = [r for e in evs for r in e.tokens]
            total += len(ids)
            content, calls = "".join(e.text for e in evs), []
            if body.tools_in_use:
                content, calls = parse_tool_calls(content)
            choices.append(ChatChoice(
                index=sub.index, message=ChatResponseMessage(content=content, tool_calls=calls or None),
                logprobs=self.chat_logprobs(records, k) if body.logprobs else None,
                finish_reason="tool_calls" if calls else evs[-1].finish_reason, stop_reason=evs[-1].stop_reason,
                token_ids=ids if body.return_token_ids else None))
        resp = ChatCompletionResponse(id=prepared.request_id, model=self.model_name, choices=choices,
                                      usage=self.usage(prepared, total),
                                      prompt_token_ids=prepared.prompts[0] if body.return_token_ids else None)
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _collect(self, request: Request, fanout: _Fanout) -> list[_Event] | None:
        """All events of a non-streaming request; None when the client went away."""
        fanout.start()
        try:
            return await _unless_disconnected(request, fanout.collect())
        except _ClientGone:
            log.info("client disconnected; aborted %d request(s)", len(fanout.subs))
            return None
        finally:
            await fanout.close()

    async def _stream(self, request: Request, fanout: _Fanout,
                      make_gen: Callable[[list[_Event]], AsyncIterator[str]]) -> Response:
        fanout.start()
        try:
            buffered = await _unless_disconnected(request, fanout.prime())
        except _ClientGone:
            await fanout.close()
            return Response(status_code=499)
        except BaseException:
            await fanout.close()
            raise
        # close() runs both when the generator ends (its finally) and after the response
        # (background), which also covers a client gone before the body started.
        return EventSourceResponse(make_gen(buffered), background=BackgroundTask(fanout.close))

    async def _events(self, fanout: _Fanout, buffered: list[_Event]) -> AsyncIterator[_Event]:
        for ev in buffered:
            yield ev
        while not fanout.done:
            yield await fanout.next()

    async def _completion_sse(self, body: CompletionRequest, prepared: _Prepared, fanout: _Fanout,
                              buffered: list[_Event]) -> AsyncIterator[str]:
        created = int(time.time())
        total = 0
        try:
            async for ev in self._events(fanout, buffered):
                total += len(ev.token_ids)
                sub = prepared.subs[ev.index]
                prefix = ""
                if ev.first and body.echo and prepared.prompt_texts:
                    prefix = prepared.prompt_texts[sub.prompt_index]
                text = prefix + ev.text
                # tokens whose text is held back (a possible stop string) make no chunk unless
                # the client asked for their ids or logprobs
                carries = body.return_token_ids or body.logprobs is not None
                if not (text or ev.finish_reason or (carries and (ev.token_ids or ev.first))):
                    continue
                choice = CompletionChoice(
                    index=ev.index, text=text,
                    logprobs=None if body.logprobs is None else self.completion_logprobs(ev.tokens, body.logprobs),
                    finish_reason=ev.finish_reason, stop_reason=ev.stop_reason,
                    token_ids=ev.token_ids if body.return_token_ids else None,
                    prompt_token_ids=sub.prompt_ids if (body.return_token_ids and ev.first) else None)
                yield CompletionChunk(id=prepared.request_id, created=created, model=self.model_name,
                                      choices=[choice]).model_dump_json()
            if body.include_usage:
                yield CompletionChunk(id=prepared.request_id, created=created, model=self.model_name, choices=[],
                                      usage=self.usage(prepared, total)).model_dump_json()
        except EngineError as exc:
            log.warning("stream %s ended by %s: %s", prepared.request_id, type(exc).__name__, exc.message)
            yield json.dumps(error_body(exc.message, exc.error_type, exc.param, exc.code))
        finally:
            await fanout.close()
        yield "[DONE]"

    async def _chat_sse(self, body: ChatCompletionRequest, prepared: _Prepared, fanout: _Fanout,
                        buffered: list[_Event]) -> AsyncIterator[str]:
        created = int(time.time())
        total = 0
        k = body.top_logprobs or 0
        sent_prompt_ids = False
        calls_of = {sub.index: ToolCallStream() for sub in prepared.subs} if body.tools_in_use else {}
        try:
            async for ev in self._events(fanout, buffered):
                total += len(ev.token_ids)
                text, calls, finish = ev.text, [], ev.finish_reason
                if ev.index in calls_of:  # content up to a tool call; the calls when the choice ends
                    text = calls_of[ev.index].feed(text)
                    if finish:
                        rest, calls = calls_of[ev.index].finish()
                        text += rest
                        finish = "tool_calls" if calls else finish
                if ev.first:
                    prompt_ids = None
                    if body.return_token_ids and not sent_prompt_ids:
                        prompt_ids, sent_prompt_ids = prepared.prompts[0], True
                    yield ChatCompletionChunk(
                        id=prepared.request_id, created=created, model=self.model_name,
                        choices=[ChatStreamChoice(index=ev.index, delta=ChatDelta(role="assistant", content=""))],
                        prompt_token_ids=prompt_ids).model_dump_json()
                if not (text or finish or ((body.return_token_ids or body.logprobs) and ev.token_ids)):
                    continue
                deltas = [{"index": i, **c} for i, c in enumerate(calls)] or None
                choice = ChatStreamChoice(
                    index=ev.index, delta=ChatDelta(content=text or None, tool_calls=deltas),
                    logprobs=self.chat_logprobs(ev.tokens, k) if body.logprobs else None,
                    finish_reason=finish, stop_reason=ev.stop_reason,
                    token_ids=ev.token_ids if body.return_token_ids else None)
                yield ChatCompletionChunk(id=prepared.request_id, created=created, model=self.model_name,
                                          choices=[choice]).model_dump_json()
            if body.include_usage:
                yield ChatCompletionChunk(id=prepared.request_id, created=created, model=self.model_name, choices=[],
                                          usage=self.usage(prepared, total)).model_dump_json()
        except EngineError as exc:
            log.warning("stream %s ended by %s: %s", prepared.request_id, type(exc).__name__, exc.message)
            yield json.dumps(error_body(exc.message, exc.error_type, exc.param, exc.code))
        finally:
            await fanout.close()
        yield "[DONE]"


# --------------------------------------------------------------------------------------
# ASGI guard: API key and body size, before any body is read
# --------------------------------------------------------------------------------------


class _Guard:
    """Checks the Bearer key on ``/v1/*`` (401) and caps request bodies (413)."""

    DRAIN_LIMIT = 64 * 1024 * 1024  # bytes of an oversized body read before replying anyway

    def __init__(self, app: Any, api_key: str | None, max_request_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_bytes = max_request_bytes

    async def _drain(self, receive: Any) -> None:
        """Read and drop the rest of an oversized body (up to DRAIN_LIMIT bytes), so that the
        client, which sends its whole body before reading, sees the 413 instead of a reset."""
        dropped = 0
        while dropped <= self.DRAIN_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _reply(self, send: Any, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope.get("path", "").startswith("/v1"):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                await self._reply(send, 401, error_body("Incorrect API key provided.", "invalid_request_error",
                                                        code="invalid_api_key"))
                return
        too_large = error_body(f"request body is larger than {self.max_bytes} bytes", "invalid_request_error",
                               code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._drain(receive)
            await self._reply(send, 413, too_large)
            return
        seen = 0

        async def limited_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # a chunked upload without Content-Length
                    if message.get("more_body", False):
                        await self._drain(receive)
                    raise StarletteHTTPException(413, too_large["error"]["message"])
            return message

        await self.app(scope, limited_receive, send)


# --------------------------------------------------------------------------------------
# App factory and server
# --------------------------------------------------------------------------------------


def build_app(engine: AsyncEngine, served_model_name: str | None = None, api_key: str | None = None, *,
              max_tokens_cap: int | None = DEFAULT_MAX_TOKENS_CAP, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              registry: Any = None, tool_call_parser: str | None = None) -> FastAPI:
    """The OpenAI-compatible ASGI app in front of ``engine``.

    served_model_name: the model id clients use (default ``engine.model_name``); another
    ``model`` gets 404. api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <key>``
    (401 otherwise); ``/health`` and ``/metrics`` stay open for probes and scrapers.
    max_tokens_cap: default ``max_tokens`` is min(context limit - prompt tokens, this);
    None: the context limit - prompt tokens.
    max_request_bytes: larger request bodies get 413. registry: the prometheus_client
    registry ``/metrics`` exports (default: the global one). tool_call_parser: how tool
    calls are read from generated text (``router.tool_calls``, e.g. ``hermes``); None: a
    chat request with ``tools`` gets 400. Raises ValueError for an unknown parser.
    """
    from prometheus_client import REGISTRY

    check_parser(tool_call_parser)
    server = _Server(engine, served_model_name or engine.model_name, max_tokens_cap, tool_call_parser)
    app = FastAPI(title="ppspec", summary="OpenAI-compatible API of the ppspec router",
                  docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(EngineError)
    async def _on_engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return _engine_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if status == 400 and message == "There was an error parsing the body":
            message = "request body could not be parsed (is it UTF-8 JSON?)"
        return error_response(status, message, _STATUS_TYPES.get(status, "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _on_crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    def _card() -> ModelCard:
        return ModelCard(id=server.model_name, max_model_len=int(engine.max_model_len))

    @app.get("/v1/models")
    async def list_models() -> Response:
        return Response(ModelList(data=[_card()]).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        server.check_model(model_id)
        return Response(_card().model_dump_json(), media_type="application/json")

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes that read the status alone
    async def health() -> JSONResponse:
        try:
            ok, detail = engine.health()
        except Exception as exc:  # noqa: BLE001 - a failing health check is "down"
            ok, detail = False, f"health check failed: {type(exc).__name__}: {exc}"
        if ok:
            return JSONResponse({"status": "ok", "detail": detail})
        body = {"status": "unavailable", "detail": detail, **error_body(detail, "service_unavailable")}
        return JSONResponse(body, status_code=503)

    app.mount("/metrics", _read_only(make_asgi_app(registry=REGISTRY if registry is None else registry)))
    # Serve "/metrics" itself, not only "/metrics/" (a Mount matches "/metrics/..." only).
    app.routes[-1].path_regex = re.compile(r"^/metrics(?P<path>.*)$")  # type: ignore[attr-defined]

    app.add_middleware(_Guard, api_key=api_key, max_request_bytes=max_request_bytes)
    return app


def _read_only(inner: Callable) -> Callable:
    """An ASGI app that passes GET and HEAD to ``inner`` and answers 405 (with ``Allow``)
    to any other method: prometheus_client's exporter answers every method alike."""

    async def app(scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD"):
            resp = error_response(405, f"method {scope['method']} is not allowed on {scope['path']} (GET or HEAD)",
                                  "invalid_request_error")
            resp.headers["allow"] = "GET, HEAD"
            await resp(scope, receive, send)
            return
        await inner(scope, receive, send)

    return app


async def serve_http(app: Any, host: str, port: int, *, log_level: str = "info",
                     shutdown: asyncio.Event | None = None, on_exit: Callable[[], None] | None = None,
                     drain_seconds: float = 1.0, **uvicorn_kwargs: Any) -> None:
    """Serve ``app`` with uvicorn until SIGINT / SIGTERM (main thread) or ``shutdown`` is set.

    Uses ``loop="uvloop"``: run this coroutine on a uvloop event loop, e.g.
    ``uvloop.run(serve_http(app, host, port))``, so that the engine and the server share it.
    On exit, in-flight responses get uvicorn's graceful-shutdown time
    (``timeout_graceful_shutdown``, seconds, in ``uvicorn_kwargs``). Extra keyword arguments
    go to ``uvicorn.Config``. When the port cannot be bound, uvicorn logs the error and
    raises ``SystemExit(3)``.

    ``on_exit`` runs on the event loop at the first SIGINT / SIGTERM, ``drain_seconds``
    before the server starts closing: the engine ends its requests there, so that open
    streams still carry the error event and ``[DONE]`` instead of being cut off.
    """
    import uvicorn

    loop = asyncio.get_running_loop()
    if "uvloop" not in type(loop).__module__:
        log.warning("serve_http is running on %s, not uvloop", type(loop).__name__)
    config = uvicorn.Config(app, host=host, port=port, loop="uvloop", log_level=log_level, **uvicorn_kwargs)

    class _Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame):  # a signal handler: hand the work to the loop
            if on_exit is None or self.draining:
                return super().handle_exit(sig, frame)
            self.draining = True
            loop.call_soon_threadsafe(on_exit)
            loop.call_soon_threadsafe(loop.call_later, drain_seconds, super().handle_exit, sig, frame)

    server = _Server(config)
    watcher = None
    if shutdown is not None:
        async def _stop_when_asked() -> None:
            await shutdown.wait()
            server.should_exit = True

        watcher = asyncio.ensure_future(_stop_when_asked())
    try:
        await server.serve()
    finally:
        if watcher is not None:
            watcher.cancel()
