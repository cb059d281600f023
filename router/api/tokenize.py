"""Prompt encoding and chat rendering: short texts on the event loop, longer ones on worker
threads, each thread with its own tokenizer copy.

Encoding toggles settings of the Rust tokenizer (a mutable borrow), which must not race with
another thread's use or with decodes of the shared tokenizer on the event loop: the event
loop encodes with a copy of its own too. The Rust encode releases the GIL, so a long prompt
holds one worker while shorter ones pass it on the others.
"""
from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .pieces import PieceCache

log = logging.getLogger("ppspec.router.api")

def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


TOKENIZE_WORKERS = max(4, min(8, _cores() // 2))
"""Threads that tokenize prompts and render chats, each with its own tokenizer copy: 4, up
to half the cores (at most 8) where there are more. The Rust encode runs without the GIL,
so a burst of long prompts spreads over them: 64 chats that share a 2000-token system
prompt are ~64 encodes of ~3 ms, whose last waited ~45 ms on four workers
(docs/PERFORMANCE.md, "Prefix caching on the H200")."""

SHORT_CHARS = 16384
"""Texts up to this many characters (a request's total) are short: longer ones run on all
workers but one, so a short request never queues behind long encodes, only behind other
short ones (each at most SHORT_CHARS characters). A long request waits at most for the long
encodes ahead of it, each at most the largest admissible text: the context times
``max_token_chars`` characters, or the body limit (``guard.DEFAULT_MAX_REQUEST_BYTES``)."""


INLINE_CHARS = 1024
"""Texts up to this many characters (a request's total) are encoded or rendered on the event
loop itself. The hand-off to a worker and back (the executor's queue, the worker's wake-up,
the loop's wake-up by the result) costs ~190 us of CPU on the 2-core host, more than
encoding ~250 tokens (~70 us for 71 tokens of the demo tokenizer), and a burst of short
requests would queue for the workers. Longer texts leave the loop free to stream meanwhile.
Measured in docs/PERFORMANCE.md, "A request's own cost at the HTTP edge"."""


MESSAGE_CHARS = 32
"""Characters a chat template writes around each message (ChatML: ``<|im_start|>``, the
role, ``<|im_end|>``, newlines), for choosing where a chat renders: a chat of many short
messages renders long (200k empty messages: 5.6M characters, 1M tokens) though its texts
are not."""


class PromptTooLong(ValueError):
    """A text whose character count alone proves it cannot fit the context (no tokenizer work done)."""


def max_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for: the longest vocabulary entry
    (byte-level BPE: one character per byte, so a text of ``c`` characters has at least
    ``c / bound`` tokens), times 4 when a normalizer runs first (NFC can merge up to about
    four code points into one)."""
    vocab = tokenizer.get_vocab()
    longest = max((len(t) for t in vocab), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return max(1, longest) * (4 if backend is not None and backend.normalizer is not None else 1)


class TokenizerPool:
    """``encode``, ``decode`` and ``render_chat`` of ``tokenizer`` (a Hugging Face tokenizer), run off the event loop."""

    def __init__(self, tokenizer: Any, workers: int = TOKENIZE_WORKERS):
        self.tokenizer = tokenizer
        self._local = threading.local()
        try:
            # the event loop's own copy for short texts; each worker makes its own at start
            self._inline = copy.deepcopy(tokenizer)
        except Exception:  # noqa: BLE001 - an uncopyable tokenizer: one worker shares it
            log.warning("tokenizer could not be copied; encoding shares it with decoding on one worker")
            workers, self._inline = 1, None
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ppspec-tokenize",
                                           initializer=self._init_worker, initargs=(self._inline is not None,))
        # long texts take at most workers - 1 threads: one is always free for short ones
        self._long = asyncio.Semaphore(max(1, workers - 1))
        self._short_lane = workers > 1
        self.max_token_chars = max_token_chars(tokenizer)
        self.pieces = PieceCache(tokenizer)  # long pieces of rendered chats, encoded once
        try:
            sig = inspect.signature(tokenizer.apply_chat_template)
            self._sanitize_kw = "sanitize_control_tokens" in sig.parameters
        except (TypeError, ValueError, AttributeError):
            self._sanitize_kw = False

    def _init_worker(self, copied: bool) -> None:
        self._local.encoder = copy.deepcopy(self.tokenizer) if copied else self.tokenizer

    @property
    def _encoder(self) -> Any:
        """This thread's tokenizer: a worker's, or the event loop's for short texts."""
        mine = getattr(self._local, "encoder", None)
        return self._inline if mine is None else mine

    async def _run(self, fn: Callable[..., Any], *args: Any, chars: int = 0) -> Any:
        if chars <= INLINE_CHARS and self._inline is not None:
            return fn(*args)
        loop = asyncio.get_running_loop()
        if chars <= SHORT_CHARS or not self._short_lane:
            return await loop.run_in_executor(self.executor, fn, *args)
        async with self._long:
            return await loop.run_in_executor(self.executor, fn, *args)

    def check_fits(self, chars: int, max_tokens: int | None) -> None:
        """Raise :class:`PromptTooLong` when ``chars`` characters are more tokens than
        ``max_tokens`` whatever they are (``max_token_chars``); None: no limit."""
        if max_tokens is not None and chars > max_tokens * self.max_token_chars:
            raise PromptTooLong(
                f"This model's maximum context length is {max_tokens} tokens. However, the prompt has {chars} "
                f"characters, at least {-(-chars // self.max_token_chars)} tokens (no token of this tokenizer stands "
                f"for more than {self.max_token_chars} characters). Please reduce the prompt.")

    async def encode(self, texts: list[str], add_special_tokens: bool = True,
                     max_tokens: int | None = None) -> list[list[int]]:
        """Token ids of each text, special tokens (BOS) added as the tokenizer does. A text
        that cannot fit ``max_tokens`` raises :class:`PromptTooLong` before any encoding."""
        for t in texts:
            self.check_fits(len(t), max_tokens)
        return await self._run(self._encode, texts, add_special_tokens, chars=sum(map(len, texts)))

    async def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                          template_kwargs: dict[str, Any] | None = None, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template. ``template_kwargs``: more
        arguments of ``apply_chat_template`` (``add_generation_prompt``, default True;
        ``continue_final_message``; template variables such as ``enable_thinking``). Message
        texts that cannot fit ``max_tokens`` raise :class:`PromptTooLong` before rendering, and
        a rendered chat that cannot (many short messages) before encoding."""
        chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        self.check_fits(chars, max_tokens)
        # what the template renders besides the texts: tool calls' arguments, the tools'
        # schemas, each message's markup
        chars += (sum(len(str(m["tool_calls"])) for m in messages if m.get("tool_calls")) + len(str(tools or ""))
                  + MESSAGE_CHARS * len(messages))
        return await self._run(self._render_chat, messages, tools, template_kwargs or {}, max_tokens, chars=chars)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self._run(self._decode, ids, skip_special_tokens, chars=len(ids))

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [list(self._encoder.encode(t, add_special_tokens=add_special_tokens)) for t in texts]

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._encoder.decode(ids, skip_special_tokens=skip_special_tokens)

    def _render_chat(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict[str, Any],
                     max_tokens: int | None = None) -> list[int]:
        kwargs: dict[str, Any] = {"add_generation_prompt": True, **template_kwargs}
        if tools:
            kwargs["tools"] = tools
        # rendered, then encoded with the long pieces cached; not where an added token's text
        # typed by a user must stay text (the template's sanitizing marks it while encoding)
        if self.pieces.enabled and not (self._sanitize_kw and self.pieces.contains_added(
                [messages, tools, template_kwargs])):
            text = self._encoder.apply_chat_template(messages, tokenize=False, **kwargs)
            # the rendered length alone may prove it too long: no encode of a text that
            # cannot be served (seconds of CPU for a chat of 200k empty messages)
            self.check_fits(len(text), max_tokens)
            return self.pieces.encode(self._encoder, text)
        kwargs.update(tokenize=True, return_dict=False)
        if self._sanitize_kw:
            kwargs["sanitize_control_tokens"] = True  # control tokens typed by users stay text
        ids = self._encoder.apply_chat_template(messages, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
