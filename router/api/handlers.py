"""The OpenAI endpoints' logic: ``/v1/completions`` and ``/v1/chat/completions``.

A request is prepared (prompt tokenized or chat rendered, one ``Sub`` per choice: nothing
runs until every check passed), run by a ``Fanout``, and answered as one JSON body or as
server-sent events by :meth:`OpenAIHandlers._sse`, the one SSE writer of both endpoints (each
endpoint gives it a function from ``Event`` to chunks). A streaming response sends its
headers once every choice has produced its first output, so that errors raised before any
token (queue full, stage down, context length) still get their HTTP status; an error after
that is an error event, then ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterable

from fastapi import Request
from fastapi.responses import Response
from starlette.background import BackgroundTask

from ..detokenize import IncrementalDecoder, TokenPieces
from ..protocol import (
    AsyncEngine,
    PromptTokensDetails,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    _GenerationRequest,
    ignored_fields,
)
from ..reasoning import prompt_opens_reasoning
from ..types import EngineError, InvalidRequestError
from .chat_text import ChoiceText
from .errors import APIError, check_utf8_fields, error_body, renderable
from ..structured import grammar_builder
from .fanout import ClientGone, Event, Fanout, Runner, Sub, TokenRecord, check_ids, make_subs, unless_disconnected
from .logprobs import chat_logprobs, completion_logprobs, prompt_logprobs, token_id_pieces
from .sse import DONE, SSEResponse, TextChunk, frame
from .tokenize import PromptTooLong, TokenizerPool

log = logging.getLogger("ppspec.router.api")

ACCESS_KEY = "ppspec.access"
"""ASGI scope key of the dict where a handler leaves what the access-log line reports."""

_Chunks = tuple[Callable[[Event, "UsageInfo | None"], Iterable[bytes]], Callable[[UsageInfo], bytes]]
"""An endpoint's stream shape: the JSON of the chunks of one event (each carrying the usage
given, the event's choice's so far, when not None), and of the usage chunk."""


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset, token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


def warn_ignored(body: _GenerationRequest, path: str) -> None:
    """One warning line naming the fields of ``body`` that were ignored (unknown to ppspec)."""
    names = ignored_fields(body)
    if names:
        log.warning("%s: ignored unknown request field%s: %s", path, "s" if len(names) > 1 else "",
                    ", ".join(renderable(n) for n in names))


def note_usage(request: Request, usage: UsageInfo) -> UsageInfo:
    """Record the request's token counts for its access-log line (``app.AccessLog``)."""
    record = request.scope.get(ACCESS_KEY)
    if record is not None:
        record["prompt_tokens"], record["completion_tokens"] = usage.prompt_tokens, usage.completion_tokens
    return usage


@dataclass
class Prepared:
    """A validated generation request, ready to run."""

    request_id: str
    prompts: list[list[int]]
    prompt_texts: list[str] | None  # for echo
    subs: list[Sub]
    in_reasoning: bool | None = None  # chat with a reasoning parser: the prompt left <think> open


class OpenAIHandlers:
    """The endpoints' logic over one engine (``build_app`` wires it to routes)."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, max_tokens_cap: int | None,
                 tool_call_parser: str | None, reasoning_parser: str | None = None,
                 sampling_defaults: dict[str, float] | None = None):
        self.engine = engine
        self.runner = Runner(engine)
        self.tokenizer = engine.tokenizer  # decoding, on the event loop
        self.tokens = TokenizerPool(self.tokenizer)  # encoding and chat rendering, on workers
        self.model_name = served_model_name
        self.max_tokens_cap = max_tokens_cap
        self.sampling_defaults = dict(sampling_defaults or {})
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.pieces = TokenPieces(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        """Token ids requests may name: the model's vocabulary (its embedding's rows, once
        the engine started), not the tokenizer's length, which differs from it either way
        (Qwen3.5's embedding has rows no tokenizer id names, which the model may generate;
        a tokenizer's added tokens may name ids past the embedding, which the first stage
        refuses with the whole micro-batch). vLLM refuses only ids past both."""
        return getattr(self.engine, "vocab_size", 0) or len(self.tokenizer)

    def check_model(self, name: str | None) -> None:
        """Raise ``APIError`` 404 (code ``model_not_found``) unless ``name`` is None or the served name."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error",
                           param="model", code="model_not_found")

    async def _subs(self, body, request_id: str, prompts: list[list[int]], logprobs: int | None, param: str,
                    echo_logprobs: int | None = None, in_reasoning: bool | None = None) -> list[Sub]:
        """One ``Sub`` per choice; the stage computes prompt log-probabilities with the most
        top alternatives either use asks for (``prompt_logprobs``, ``echo_logprobs``); a
        structured output starts after the thinking when ``in_reasoning``, its grammar built
        on a worker thread (seconds for a big schema: the event loop serves on)."""
        build = grammar_builder(body, self.tool_call_parser, bool(in_reasoning))
        grammar = None if build is None else await asyncio.to_thread(build)
        subs = make_subs(body, request_id, prompts, logprobs, param, vocab_size=self.vocab_size,
                         max_model_len=int(self.engine.max_model_len), max_tokens_cap=self.max_tokens_cap,
                         grammar=grammar, max_logprobs=getattr(self.engine, "max_logprobs", 20),
                         defaults=self.sampling_defaults)
        # vLLM's prompt_logprobs -1: the whole vocabulary, within --max-logprobs
        asked = [self.vocab_size if k == -1 else k for k in (body.prompt_logprobs, echo_logprobs) if k is not None]
        if asked:
            for sub in subs:
                sub.params.prompt_logprobs = max(asked)
                sub.params.validate(getattr(self.engine, "max_logprobs", 20), self.vocab_size)
        return subs

    def _vllm_prompt_logprobs(self, body, fanout: Fanout, sub: Sub):
        """vLLM's ``prompt_logprobs`` of ``sub``'s prompt, when the request asks for them."""
        if body.prompt_logprobs is None:
            return None
        return prompt_logprobs(self.pieces, sub.prompt_ids, fanout.prompt_logprobs.get(sub.index) or [],
                               self.vocab_size if body.prompt_logprobs == -1 else body.prompt_logprobs)

    # -- preparing -------------------------------------------------------------------------

    def _keep_last(self, body: _GenerationRequest) -> int | None:
        """Tokens of each prompt ``truncate_prompt_tokens`` keeps (None: all). Raises
        ``InvalidRequestError`` when it asks for more than the context."""
        k, limit = body.truncate_prompt_tokens, int(self.engine.max_model_len)
        if k is not None and k > limit:
            raise InvalidRequestError(f"truncate_prompt_tokens {k} is more than the context of {limit} tokens",
                                      param="truncate_prompt_tokens")
        return limit if k == -1 else k

    async def prepare_completion(self, body: CompletionRequest) -> Prepared:
        """Tokenize the prompt(s) and build one engine request per choice.

        Raises ``APIError`` (404 unknown model), ``InvalidRequestError`` (empty prompt, ids
        outside the vocabulary, text that is not UTF-8, bad sampling values) and
        ``ContextLengthError`` (prompt tokens + max_tokens over ``engine.max_model_len``).
        """
        self.check_model(body.model)
        warn_ignored(body, "/v1/completions")
        check_utf8_fields(body)
        keep = self._keep_last(body)
        p = body.prompt
        texts: list[str] | None = None
        if isinstance(p, str):
            texts = [p]
        elif isinstance(p[0], str):
            texts = list(p)  # type: ignore[arg-type]
        if texts is not None:
            try:
                # a truncated prompt may be longer than the context (the body size bounds it)
                prompts = await self.tokens.encode(texts, max_tokens=None if keep else int(self.engine.max_model_len))
            except PromptTooLong as exc:  # refused by its length alone, no worker taken
                raise InvalidRequestError(str(exc), param="prompt", code="context_length_exceeded") from None
            except Exception as exc:  # noqa: BLE001
                raise InvalidRequestError(f"prompt could not be tokenized: {exc}", param="prompt") from None
        else:
            prompts = [list(p)] if isinstance(p[0], int) else [list(x) for x in p]  # type: ignore[arg-type]
        if keep and any(len(ids) > keep for ids in prompts):
            prompts, texts = [ids[-keep:] for ids in prompts], None  # echo: the text of the tokens kept
        for ids in prompts:
            if not ids:
                raise InvalidRequestError("prompt is empty (it encodes to no tokens)", param="prompt")
            check_ids(ids, "prompt", self.vocab_size)
        if body.echo and texts is None:
            # vLLM's echo of token ids: the ids decoded with their special tokens (the request's
            # skip_special_tokens is for the generated text)
            texts = [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        run = body.model_copy(update={"max_tokens": 1, "max_completion_tokens": None}) if body.echo_only else body
        subs = await self._subs(run, request_id, prompts, body.logprobs, "prompt", body.logprobs if body.echo else None)
        return Prepared(request_id, prompts, texts, subs)

    def _pieces(self, body: _GenerationRequest):
        """Text and bytes of a token's logprob entry: its own, or ``token_id:{id}``."""
        return token_id_pieces if body.return_tokens_as_token_ids else self.pieces

    def _prompt_logprobs(self, fanout: Fanout, sub: Sub, k: int, pieces) -> CompletionLogprobs:
        """Echo with logprobs: the prompt tokens' entries, offsets in the echoed prompt text
        (special tokens written out, as the echo has them; the first token's log-probability
        null: nothing predicts it)."""
        lps = fanout.prompt_logprobs.get(sub.index) or []
        decoder = IncrementalDecoder(self.tokenizer, [], skip_special_tokens=False)
        records, offset = [], 0
        for j, tid in enumerate(sub.prompt_ids):
            records.append(TokenRecord(tid, lps[j - 1] if 0 < j <= len(lps) else None, offset))
            offset += len(decoder.push(tid))
        return completion_logprobs(pieces, records, k)

    async def prepare_chat(self, body: ChatCompletionRequest) -> Prepared:
        """Render the messages with the chat template (generation prompt added) and build one
        engine request per choice. Raises as ``prepare_completion``, and
        ``InvalidRequestError`` when the template fails or the model has none."""
        self.check_model(body.model)
        warn_ignored(body, "/v1/chat/completions")
        check_utf8_fields(body)
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        messages = [m.to_template() for m in body.messages]
        if body.tools_in_use and self.tool_call_parser is None:
            raise InvalidRequestError("tools need a server started with --tool-call-parser (e.g. hermes)",
                                      param="tools")
        keep = self._keep_last(body)
        try:
            template_kwargs = {**(body.chat_template_kwargs or {}), "add_generation_prompt": body.add_generation_prompt,
                               "continue_final_message": body.continue_final_message}
            ids = await self.tokens.render_chat(messages, body.tools if body.tools_in_use else None, template_kwargs,
                                                max_tokens=None if keep else int(self.engine.max_model_len))
            ids = ids[-keep:] if keep else ids
        except PromptTooLong as exc:
            raise InvalidRequestError(str(exc), param="messages", code="context_length_exceeded") from None
        except Exception as exc:  # noqa: BLE001 - template errors (raise_exception, bad roles)
            raise InvalidRequestError(f"messages could not be rendered with the chat template: {exc}",
                                      param="messages") from None
        if not ids:
            raise InvalidRequestError("messages render to an empty prompt", param="messages")
        logprobs = None
        if body.logprobs:
            logprobs = body.top_logprobs or 0
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        in_reasoning = None
        if self.reasoning_parser is not None and (body.chat_template_kwargs or {}).get("enable_thinking") is not False:
            in_reasoning = prompt_opens_reasoning(self.tokenizer.decode(ids[-8:], skip_special_tokens=False))
        subs = await self._subs(body, request_id, [ids], logprobs, "messages", in_reasoning=in_reasoning)
        return Prepared(request_id, [ids], None, subs, in_reasoning)

    def _choice_text(self, body: ChatCompletionRequest, prepared: Prepared) -> ChoiceText:
        return ChoiceText(prepared.in_reasoning, self.tool_call_parser if body.tools_in_use else None, body.tools,
                          body.parallel_tool_calls is not False)

    def usage(self, prepared: Prepared, completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(p) for p in prepared.prompts)
        details = None
        if getattr(self.engine, "prefix_caching", False):  # each prompt once, as prompt_tokens
            cached = {s.prompt_index: s.cached_tokens for s in sorted(prepared.subs, key=lambda s: s.cached_tokens)}
            details = PromptTokensDetails(cached_tokens=sum(cached.values()))
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)

    @staticmethod
    def choice_usage(prepared: Prepared, index: int, completion_tokens: int) -> UsageInfo:
        """vLLM's ``continuous_usage_stats`` usage of one chunk: its choice's prompt tokens and
        the ``completion_tokens`` that choice generated so far (with n > 1 or several prompts,
        each choice counts its own; the request's totals are the usage chunk's)."""
        prompt_tokens = len(prepared.prompts[prepared.subs[index].prompt_index])
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    # -- endpoints -------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """``POST /v1/completions``: JSON, or server-sent events when ``stream``. Raises
        ``EngineError`` subclasses (turned into OpenAI error bodies by the app)."""
        prepared = await self.prepare_completion(body)
        fanout = Fanout(self.runner, prepared.subs, body, body.logprobs is not None)
        if body.stream:
            return await self._stream(request, fanout, prepared, body, *self._completion_chunks(body, prepared, fanout))
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
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(self._pieces(body), records, body.logprobs, len(prefix))
                if body.echo:
                    logprobs = _joined(self._prompt_logprobs(fanout, sub, body.logprobs, self._pieces(body)), logprobs)
            choices.append(CompletionChoice(
                index=sub.index, text=prefix + text,
                logprobs=logprobs,
                finish_reason=evs[-1].finish_reason, stop_reason=evs[-1].stop_reason,
                token_ids=ids if body.return_token_ids else None,
                prompt_token_ids=sub.prompt_ids if body.return_token_ids else None,
                prompt_logprobs=self._vllm_prompt_logprobs(body, fanout, sub)))
        resp = CompletionResponse(id=prepared.request_id, model=self.model_name, choices=choices,
                                  usage=note_usage(request, self.usage(prepared, total)))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        """``POST /v1/chat/completions``; as ``completions``."""
        prepared = await self.prepare_chat(body)
        fanout = Fanout(self.runner, prepared.subs, body, body.logprobs)
        if body.stream:
            return await self._stream(request, fanout, prepared, body, *self._chat_chunks(body, prepared))
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
            reasoning, content, calls = self._choice_text(body, prepared).whole("".join(e.text for e in evs))
            if body.echoed:
                content = body.echoed + (content or "")
            message = ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)
            choices.append(ChatChoice(
                index=sub.index, message=message,
                logprobs=chat_logprobs(self._pieces(body), records, k) if body.logprobs else None,
                finish_reason="tool_calls" if calls else evs[-1].finish_reason, stop_reason=evs[-1].stop_reason,
                token_ids=ids if body.return_token_ids else None))
        resp = ChatCompletionResponse(id=prepared.request_id, model=self.model_name, choices=choices,
                                      usage=note_usage(request, self.usage(prepared, total)),
                                      prompt_token_ids=prepared.prompts[0] if body.return_token_ids else None,
                                      prompt_logprobs=self._vllm_prompt_logprobs(body, fanout, prepared.subs[0]))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """``POST /tokenize``: the token ids ``/v1/completions`` (``prompt``) or
        ``/v1/chat/completions`` (``messages``) would run on."""
        self.check_model(body.model)
        check_utf8_fields(body)
        if body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = (await self.tokens.encode([body.prompt], add_special))[0]
        else:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidRequestError("this model has no chat template", param="messages")
            messages = [m.to_template() for m in body.messages or []]
            kwargs = {**(body.chat_template_kwargs or {}), "add_generation_prompt": body.add_generation_prompt,
                      "continue_final_message": body.continue_final_message}
            try:
                ids = await self.tokens.render_chat(messages, None, kwargs)
            except Exception as exc:  # noqa: BLE001 - template errors
                raise InvalidRequestError(f"messages could not be rendered with the chat template: {exc}",
                                          param="messages") from None
        return TokenizeResponse(count=len(ids), max_model_len=int(self.engine.max_model_len), tokens=ids)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """``POST /detokenize``: the text of ``tokens`` (special tokens kept)."""
        self.check_model(body.model)
        check_ids(body.tokens, "tokens", max(self.vocab_size, len(self.tokenizer)))  # text, no model
        return DetokenizeResponse(prompt=await self.tokens.decode(body.tokens, skip_special_tokens=False))

    # -- streamed chunks of each endpoint --------------------------------------------------

    def _completion_chunks(self, body: CompletionRequest, prepared: Prepared, fanout: Fanout) -> _Chunks:
        created = int(time.time())

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionChunk:
            return CompletionChunk(id=prepared.request_id, created=created, model=self.model_name, choices=choices,
                                   usage=usage)

        # the chunk of most tokens: text alone, spliced into one rendering per choice
        plain = {sub.index: TextChunk(lambda s, i=sub.index: chunk([CompletionChoice(index=i, text=s)]))
                 for sub in prepared.subs}

        def chunks(ev: Event, usage: UsageInfo | None) -> Iterable[bytes]:
            sub = prepared.subs[ev.index]
            # the echoed prompt text: sent with the first chunk, counted in every chunk's offsets
            echoed = prepared.prompt_texts[sub.prompt_index] if body.echo and prepared.prompt_texts else ""
            prefix = echoed if ev.first else ""
            text = prefix + ev.text
            # tokens whose text is held back (a possible stop string) make no chunk unless
            # the client asked for their ids or logprobs
            carries = body.return_token_ids or body.logprobs is not None
            if not (text or ev.finish_reason or (carries and (ev.token_ids or ev.first))):
                return
            if not carries and usage is None and ev.finish_reason is None and ev.stop_reason is None:
                yield plain[ev.index](text)
                return
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(self._pieces(body), ev.tokens, body.logprobs, len(echoed))
                if body.echo and ev.first:  # the prompt's entries, as the whole response has them
                    logprobs = _joined(self._prompt_logprobs(fanout, sub, body.logprobs, self._pieces(body)), logprobs)
            choice = CompletionChoice(
                index=ev.index, text=text,
                logprobs=logprobs,
                finish_reason=ev.finish_reason, stop_reason=ev.stop_reason,
                token_ids=ev.token_ids if body.return_token_ids else None,
                prompt_token_ids=sub.prompt_ids if (body.return_token_ids and ev.first) else None)
            yield chunk([choice], usage).model_dump_json().encode()

        def usage_chunk(usage: UsageInfo) -> bytes:
            return chunk([], usage).model_dump_json().encode()

        return chunks, usage_chunk

    def _chat_chunks(self, body: ChatCompletionRequest, prepared: Prepared) -> _Chunks:
        created = int(time.time())
        k = body.top_logprobs or 0
        sent_prompt_ids = False
        split = {sub.index: self._choice_text(body, prepared) for sub in prepared.subs}

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None,
                  prompt_token_ids: list[int] | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=prepared.request_id, created=created, model=self.model_name, choices=choices,
                                       usage=usage, prompt_token_ids=prompt_token_ids)

        # the chunks of most tokens: content alone or reasoning alone, spliced into one
        # rendering per choice
        content = {sub.index: TextChunk(lambda s, i=sub.index: chunk([ChatStreamChoice(
            index=i, delta=ChatDelta(content=s))])) for sub in prepared.subs}
        reasoning_only = {sub.index: TextChunk(lambda s, i=sub.index: chunk([ChatStreamChoice(
            index=i, delta=ChatDelta(reasoning_content=s))])) for sub in prepared.subs}
        carries = bool(body.return_token_ids or body.logprobs)

        def chunks(ev: Event, usage: UsageInfo | None) -> Iterable[bytes]:
            nonlocal sent_prompt_ids
            parts = split[ev.index]
            reasoning, text, deltas = parts.feed(ev.text)
            finish = ev.finish_reason
            if finish:
                more_reasoning, rest, more = parts.finish()
                reasoning, text, deltas = reasoning + more_reasoning, text + rest, deltas + more
                if finish == "stop" and parts.calls_sent:
                    finish = "tool_calls"
            if ev.first:
                prompt_ids = None
                if body.return_token_ids and not sent_prompt_ids:
                    prompt_ids, sent_prompt_ids = prepared.prompts[0], True
                # the role chunk comes before any generated token (vLLM's: completion_tokens 0)
                nothing_yet = None if usage is None else self.choice_usage(prepared, ev.index, 0)
                yield chunk([ChatStreamChoice(index=ev.index, delta=ChatDelta(role="assistant", content=body.echoed))],
                            nothing_yet, prompt_ids).model_dump_json().encode()
            if not (text or reasoning or deltas or finish or (carries and ev.token_ids)):
                return
            if (not (carries or deltas or finish) and usage is None and ev.stop_reason is None
                    and not (text and reasoning)):
                yield content[ev.index](text) if text else reasoning_only[ev.index](reasoning)
                return
            delta = ChatDelta(content=text or None, reasoning_content=reasoning or None, tool_calls=deltas or None)
            choice = ChatStreamChoice(
                index=ev.index, delta=delta,
                logprobs=chat_logprobs(self._pieces(body), ev.tokens, k) if body.logprobs else None,
                finish_reason=finish, stop_reason=ev.stop_reason,
                token_ids=ev.token_ids if body.return_token_ids else None)
            yield chunk([choice], usage).model_dump_json().encode()

        def usage_chunk(usage: UsageInfo) -> bytes:
            return chunk([], usage).model_dump_json().encode()

        return chunks, usage_chunk

    # -- running ---------------------------------------------------------------------------

    async def _collect(self, request: Request, fanout: Fanout) -> list[Event] | None:
        """All events of a non-streaming request; None when the client went away."""
        fanout.start()
        try:
            return await unless_disconnected(request, fanout.collect())
        except ClientGone:
            log.info("client disconnected; aborted %d request(s)", len(fanout.subs))
            return None
        finally:
            await fanout.close()

    async def _stream(self, request: Request, fanout: Fanout, prepared: Prepared, body: _GenerationRequest,
                      chunks: Callable[[Event, UsageInfo | None], Iterable[bytes]],
                      usage_chunk: Callable[[UsageInfo], bytes]) -> Response:
        fanout.start()
        try:
            buffered = await unless_disconnected(request, fanout.prime())
        except ClientGone:
            await fanout.close()
            return Response(status_code=499)
        except BaseException:
            await fanout.close()
            raise
        # close() runs both when the generator ends (its finally) and after the response
        # (background), which also covers a client gone before the body started.
        sse = self._sse(request, fanout, prepared, buffered, chunks, usage_chunk if body.include_usage else None,
                        body.continuous_usage)
        return SSEResponse(sse, background=BackgroundTask(fanout.close))

    async def _sse(self, request: Request, fanout: Fanout, prepared: Prepared, buffered: list[Event],
                   chunks: Callable[[Event, UsageInfo | None], Iterable[bytes]],
                   usage_chunk: Callable[[UsageInfo], bytes] | None, continuous_usage: bool) -> AsyncIterator[bytes]:
        """The one SSE writer: the frames of ``chunks(event)`` of every event, joined per
        event (one ``send``; each chunk with its choice's usage so far when
        ``continuous_usage``, as vLLM), ``usage_chunk`` (when not None) after the last, with the
        totals over every choice, an error event if a choice fails, then ``[DONE]``."""
        counts = [0] * len(prepared.subs)  # completion tokens of each choice so far
        total = 0

        def frames(ev: Event) -> bytes:
            nonlocal total
            total += len(ev.token_ids)
            counts[ev.index] += len(ev.token_ids)
            usage = self.choice_usage(prepared, ev.index, counts[ev.index]) if continuous_usage else None
            return b"".join(frame(c) for c in chunks(ev, usage))

        try:
            for ev in buffered:
                if data := frames(ev):
                    yield data
            while not fanout.done:
                if data := frames(await fanout.next()):
                    yield data
            if usage_chunk is not None:
                yield frame(usage_chunk(self.usage(prepared, total)))
        except EngineError as exc:
            log.warning("stream %s ended by %s: %s", prepared.request_id, type(exc).__name__, exc.message)
            yield frame(json.dumps(error_body(exc.message, exc.error_type, exc.param, exc.code)).encode())
        finally:
            note_usage(request, self.usage(prepared, total))
            await fanout.close()
        yield DONE
