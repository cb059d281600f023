"""Detokenization for streaming text: token ids in, whole UTF-8 characters out, with
stop strings cut from the text (the HTTP layer, ``router.api``, and ``LLM.generate``).

Text is released by windows (decode a few tokens before the released text plus the new
ones, release what lies past the old text), the prefix / read offsets of vLLM's
incremental detokenizer; ``_DETOKENIZE_CONTEXT`` prompt tokens start the first window, so
a leading space of the first output token decodes as it does in context.
"""
from __future__ import annotations

from typing import Any

_DETOKENIZE_CONTEXT = 5  # prompt tokens decoded with the first output tokens (leading spaces)


def window_decoder(tokenizer: Any, skip_special_tokens: bool) -> Any:
    """A function from token ids to text, equal to ``tokenizer.decode(ids, skip_special_tokens,
    clean_up_tokenization_spaces=False)``. For a transformers fast tokenizer that keeps the
    library's ``decode`` / ``_decode`` this is its ``tokenizers`` backend's ``decode`` (what
    they call, without their argument handling: a third of the time, and streaming decodes
    twice per token); any other tokenizer is called as it is."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the public call
        TokenizersBackend = PreTrainedTokenizerBase = None  # type: ignore[assignment,misc]
    cls = type(tokenizer)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
            and cls._decode is TokenizersBackend._decode and cls.decode is PreTrainedTokenizerBase.decode):
        backend = tokenizer.backend_tokenizer.decode
        return lambda ids: backend(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of the byte-level BPE alphabet (printable bytes map to themselves,
    the others to code points from 256 upward, in byte order)."""
    kept = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenPieces:
    """The text and exact bytes of single tokens, for logprob entries (cached per id)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._alphabet = _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self.byte_level = self._alphabet is not None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw: bytes | None = None
        if self._alphabet is not None and token_id not in self._special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                try:
                    raw = bytes(self._alphabet[c] for c in piece)
                except KeyError:  # an added token, stored as plain text
                    raw = None
        if raw is not None:
            text = raw.decode("utf-8", errors="replace")
        elif token_id in self._special:
            text = str(self.tokenizer.convert_ids_to_tokens(token_id))
            raw = text.encode("utf-8")
        else:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = text.encode("utf-8")
        out = (text, list(raw))
        if len(self._cache) < 65536:
            self._cache[token_id] = out
        return out


class IncrementalDecoder:
    """Token ids in, text out, never splitting a UTF-8 character.

    Decodes a small window (a few tokens before the last released text plus the new ones)
    and releases the text beyond the window's old text once it no longer ends in U+FFFD
    (an incomplete character). The first window starts with the last prompt tokens, so a
    leading space of the first output token decodes as it does in context.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window = window_decoder(tokenizer, skip_special_tokens)
        self.ids: list[int] = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._prefix_text: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._window(ids) if ids else ""

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        return self._prefix_text

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        return self.push_many((token_id,))

    def push_many(self, token_ids) -> str:
        """Add several tokens; return the text they complete, as :meth:`push` of each would
        release it altogether, decoding the window once (with MTP a round brings a request
        several tokens, and decoding per token was most of the streaming text's cost). Where
        the last of them leaves a character incomplete, nothing is released until a later
        token completes it (per token, the text before that character came out already)."""
        self.ids.extend(token_ids)
        prefix = self._prefix()
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._prefix_text = None
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        """At the end: the text still held back (an incomplete character decodes as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._prefix()
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        self._prefix_text = None
        return text[len(prefix):] if len(text) > len(prefix) else ""


class TextStream:
    """Detokenized text of one choice with stop-string handling.

    ``add(token_id)`` returns True when a stop string has appeared (the text is then cut
    before it); ``take()`` returns the text safe to send now, holding back the longest tail
    that is a proper prefix of some stop string; ``finish()`` returns everything left.
    A stop string counts only when a token after the first ``min_tokens`` completes it
    (vLLM's rule: ``min_tokens`` holds back stop strings as it holds back EOS).
    ``include_stop``: the text is cut after the stop string instead (vLLM's
    ``include_stop_str_in_output``).
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stops: list[str],
                 skip_special_tokens: bool = True, min_tokens: int = 0, include_stop: bool = False):
        self.decoder = IncrementalDecoder(tokenizer, prompt_ids, skip_special_tokens)
        self.min_tokens, self.num_tokens = min_tokens, 0
        self.stops = [s for s in stops if s]
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.text = ""  # all text so far (cut at the stop string once one matched)
        self.sent = 0  # characters of self.text already returned
        self.stop_str: str | None = None
        self.include_stop = include_stop

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def add(self, token_id: int) -> bool:
        self.num_tokens += 1
        return self._append(self.decoder.push(token_id))

    def add_many(self, token_ids: list[int]) -> int:
        """:meth:`add` of each of ``token_ids`` until one completes a stop string; returns how
        many were added (that one included). Decoded together where no stop string is watched
        for past ``min_tokens``; one token at a time where one is (which token completes it
        matters then: the choice ends there)."""
        if self.stops and self.num_tokens + len(token_ids) > self.min_tokens:
            for n, t in enumerate(token_ids, 1):
                if self.add(t):
                    return n
            return len(token_ids)
        if token_ids:
            self.num_tokens += len(token_ids)
            self._append(self.decoder.push_many(token_ids))
        return len(token_ids)

    def _append(self, delta: str) -> bool:
        if self.stopped or not delta:
            return self.stopped
        old = len(self.text)
        self.text += delta
        if self.num_tokens <= self.min_tokens:
            return False  # a stop string ending here does not count
        # Only a match ending inside delta counts (one ending before it was either found then
        # or fell within min_tokens), so string s starts at most len(s) - 1 characters
        # before delta; text already sent never starts a match (it was held back while it could).
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, max(self.sent, old - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[:best[0] + (len(best[1]) if self.include_stop else 0)]
            self.stop_str = best[1]
        return self.stopped

    def _holdback(self) -> int:
        tail = self.text[self.sent:]
        for k in range(min(len(tail), self.max_stop - 1), 0, -1):
            suffix = tail[-k:]
            if any(s.startswith(suffix) for s in self.stops):
                return k
        return 0

    def take(self) -> str:
        end = len(self.text)
        if not self.stopped:
            end -= self._holdback()
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def finish(self) -> str:
        self._append(self.decoder.flush())
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out
