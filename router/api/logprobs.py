"""Log-probabilities in OpenAI's two shapes: completions' legacy lists, chat's ``content``
entries; and vLLM's ``prompt_logprobs`` (a dict per prompt token).

JSON has no -inf: a log-probability below ``LOGPROB_FLOOR`` (or -inf / NaN) is reported as it.
"""
from __future__ import annotations

import math
from typing import Callable

from ..detokenize import TokenPieces
from ..protocol import ChatChoiceLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs
from ..types import TokenLogprob
from .fanout import TokenRecord

LOGPROB_FLOOR = -9999.0
"""Log-probabilities below this (and -inf / NaN) are reported as this value (JSON has no -inf)."""


def finite(x: float | None) -> float:
    if x is None or math.isnan(x) or x < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return float(x)


def token_id_pieces(token_id: int) -> tuple[str, list[int]]:
    """A token's entry as vLLM's ``return_tokens_as_token_ids`` writes it: ``token_id:{id}``
    (its UTF-8 bytes as the bytes), for clients that map entries back to ids."""
    text = f"token_id:{token_id}"
    return text, list(text.encode())


def completion_logprobs(pieces: Callable[[int], tuple[str, list[int]]], records: list[TokenRecord], k: int,
                        base_offset: int = 0) -> CompletionLogprobs:
    """``records`` with their ``k`` top alternatives; offsets shifted by ``base_offset`` characters."""
    out = CompletionLogprobs()
    for r in records:
        text, _ = pieces(r.token_id)
        out.tokens.append(text)
        out.text_offset.append(base_offset + r.offset)
        if r.logprob is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(finite(r.logprob.logprob))
        top: dict[str, float] = {}
        for tid, lp in r.logprob.top[:k]:
            top.setdefault(pieces(int(tid))[0], finite(lp))
        # OpenAI: the sampled token's logprob is always there (up to logprobs + 1 entries)
        top.setdefault(text, finite(r.logprob.logprob))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(pieces: Callable[[int], tuple[str, list[int]]], records: list[TokenRecord], k: int) -> ChatChoiceLogprobs:
    content = []
    for r in records:
        text, raw = pieces(r.token_id)
        lp = r.logprob
        tops = []
        if lp is not None:
            for tid, value in lp.top[:k]:
                t_text, t_raw = pieces(int(tid))
                tops.append(ChatTopLogprob(token=t_text, logprob=finite(value), bytes=t_raw))
        content.append(ChatTokenLogprob(token=text, logprob=finite(None if lp is None else lp.logprob),
                                        bytes=raw, top_logprobs=tops))
    return ChatChoiceLogprobs(content=content)


def prompt_logprobs(pieces: TokenPieces, prompt_ids: list[int], lps: list[TokenLogprob], k: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each later one
    its own entry (log-probability, rank, text) and those of the ``k`` most likely tokens
    at its position (ranks 1..k), keyed by token id. ``lps[j]``: the entry of prompt token
    ``j + 1`` (the stage's); missing ones are None."""
    out: PromptLogprobs = [None]
    for j, tid in enumerate(prompt_ids[1:]):
        if j >= len(lps):
            out.append(None)
            continue
        lp = lps[j]
        entry = {tid: PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank, decoded_token=pieces(tid)[0])}
        for rank, (i, value) in enumerate(lp.top[:k], 1):
            entry.setdefault(int(i), PromptLogprob(logprob=finite(value), rank=rank, decoded_token=pieces(int(i))[0]))
        out.append(entry)
    return out
