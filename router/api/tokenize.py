"""Prompt encoding and chat rendering on worker threads, each with its own tokenizer copy.

Encoding toggles settings of the Rust tokenizer (a mutable borrow), which must not race with
another thread's use or with decodes of the shared tokenizer on the event loop. The Rust
encode releases the GIL, so a long prompt holds one worker while shorter ones pass it on the
others.
"""
from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

log = logging.getLogger("ppspec.router.api")

TOKENIZE_WORKERS = 4
"""Threads that tokenize prompts and render chats, each with its own tokenizer copy."""


class TokenizerPool:
    """``encode``, ``decode`` and ``render_chat`` of ``tokenizer`` (a Hugging Face tokenizer), run off the event loop."""

    def __init__(self, tokenizer: Any, workers: int = TOKENIZE_WORKERS):
        self.tokenizer = tokenizer
        self._local = threading.local()
        try:
            copy.deepcopy(tokenizer)  # copyable? (each worker makes its own at start)
        except Exception:  # noqa: BLE001 - an uncopyable tokenizer: one worker shares it
            log.warning("tokenizer could not be copied; encoding shares it with decoding on one worker")
            workers = 1
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ppspec-tokenize",
                                           initializer=self._init_worker, initargs=(workers > 1,))
        try:
            sig = inspect.signature(tokenizer.apply_chat_template)
            self._sanitize_kw = "sanitize_control_tokens" in sig.parameters
        except (TypeError, ValueError, AttributeError):
            self._sanitize_kw = False

    def _init_worker(self, copied: bool) -> None:
        self._local.encoder = copy.deepcopy(self.tokenizer) if copied else self.tokenizer

    @property
    def _encoder(self) -> Any:
        """This worker thread's tokenizer."""
        return self._local.encoder

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, special tokens (BOS) added as the tokenizer does."""
        return await self._run(self._encode, texts, add_special_tokens)

    async def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template. ``template_kwargs``: more
        arguments of ``apply_chat_template`` (``add_generation_prompt``, default True;
        ``continue_final_message``; template variables such as ``enable_thinking``)."""
        return await self._run(self._render_chat, messages, tools, template_kwargs or {})

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self._run(self._decode, ids, skip_special_tokens)

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [list(self._encoder.encode(t, add_special_tokens=add_special_tokens)) for t in texts]

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._encoder.decode(ids, skip_special_tokens=skip_special_tokens)

    def _render_chat(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict[str, Any]) -> list[int]:
        kwargs: dict[str, Any] = {"add_generation_prompt": True, **template_kwargs, "tokenize": True,
                                  "return_dict": False}
        if tools:
            kwargs["tools"] = tools
        if self._sanitize_kw:
            kwargs["sanitize_control_tokens"] = True  # control tokens typed by users stay text
        ids = self._encoder.apply_chat_template(messages, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
