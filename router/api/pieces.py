"""A long text's pieces between added tokens, each encoded once: ``PieceCache``.

A fast tokenizer (Hugging Face ``tokenizers``) first splits its input where an added token
(``<|im_start|>``, ``<|im_end|>``, ...) occurs; every piece between two of them is then
normalized, pre-tokenized and encoded on its own, and no token spans two pieces. So the ids
of a text are the ids of its pieces and added tokens in order, and a piece that recurs in
many prompts (a long system prompt, the tools' schemas, the earlier turns of a conversation)
need be encoded once. A text whose long pieces are partly kept encodes the rest and keeps
its new long pieces, so a conversation's next turn encodes only its newest messages. With
a 2000-token system prompt shared by a burst of 64 chats, each chat's encode was ~3 ms on
the H200's host, and the burst's last waited for all of them on the tokenizer workers
(docs/PERFORMANCE.md, "A shared system prompt's encode").

Whether a tokenizer really encodes piece by piece is checked, not assumed: at start on probe
texts (a tokenizer whose added tokens strip whitespace, or that prepends to its first piece
only, fails and is never cached), and again every ``check_every``-th hit against the whole
encode, which turns the cache off for good on a difference (a warning in the log).
"""
from __future__ import annotations

import array
import collections
import logging
import re
import threading
from typing import Any

log = logging.getLogger("ppspec.router.api")

MIN_PIECE_CHARS = 512  # pieces at least this long are cached (~120 tokens; shorter ones encode in microseconds)
MAX_CACHED_CHARS = 1 << 24  # the cache's pieces, in characters: ~16 MB of text, ~16 MB of int32 ids
CHECK_EVERY = 64  # every this many hits, the text is encoded whole too and compared

# texts the start-up check encodes both ways: whitespace, newlines and words on both sides of
# added tokens, a piece that is empty, the text's own start (filled with the added tokens' contents)
_PROBES = ("{0}system\nYou are a helpful assistant.  Answer briefly.{1}\n{0}user\n Hi there{1}\n{0}assistant\n",
           "Leading words {0}{1}  two  spaces\n\n{0} x{1}y z\t{0}\n",
           " {0}A{1} B {0}  C  {1}")


def _added_tokens(tokenizer: Any) -> dict[str, int]:
    backend = tokenizer.backend_tokenizer
    return {t.content: i for i, t in backend.get_added_tokens_decoder().items()}


def _unsupported(tokenizer: Any) -> str | None:
    """Why ``tokenizer`` cannot be encoded piece by piece here, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return "not a fast (tokenizers) tokenizer"
    if getattr(tokenizer, "split_special_tokens", False):
        return "it encodes special tokens as text (split_special_tokens)"
    added = backend.get_added_tokens_decoder().values()
    if not added:
        return "it has no added tokens to split at"
    odd = [t.content for t in added if t.lstrip or t.rstrip or t.single_word or t.normalized]
    if odd:  # matched after normalization, or taking whitespace beside them: not a plain split
        return f"added tokens that strip, match single words or are normalized ({odd[0]!r})"
    return None


class PieceCache:
    """The ids of long pieces (between added tokens) of the texts encoded, least recently
    used dropped past ``max_chars``. :meth:`encode` is thread-safe (each thread passes its own
    tokenizer copy)."""

    def __init__(self, tokenizer: Any, min_chars: int = MIN_PIECE_CHARS, max_chars: int = MAX_CACHED_CHARS,
                 check_every: int = CHECK_EVERY):
        self.min_chars, self.max_chars, self.check_every = min_chars, max_chars, check_every
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[str, array.array] = collections.OrderedDict()  # piece -> int32 ids
        self._chars = 0
        self.hits = self.misses = 0
        self.reason = _unsupported(tokenizer)
        if self.reason is None:
            self._ids = _added_tokens(tokenizer)
            contents = sorted(self._ids, key=len, reverse=True)  # the longest first where two match at a place
            self._split = re.compile("(" + "|".join(map(re.escape, contents)) + ")")
            self.reason = self._check_probes(tokenizer)
        if self.reason is not None:
            log.info("prompt pieces are not cached: %s", self.reason)

    @property
    def enabled(self) -> bool:
        return self.reason is None

    def contains_added(self, obj: Any) -> bool:
        """Whether any string in ``obj`` (strings, lists, dicts) holds an added token's text."""
        if isinstance(obj, str):
            return self._split.search(obj) is not None
        if isinstance(obj, dict):
            return any(self.contains_added(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return any(self.contains_added(v) for v in obj)
        return False

    def encode(self, tokenizer: Any, text: str) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=False)``, its long pieces from the cache."""
        if self.reason is not None or len(text) < self.min_chars:
            return tokenizer.encode(text, add_special_tokens=False)
        parts = self._split.split(text)  # piece, added token, piece, ..., piece
        long = [i for i in range(2, len(parts), 2) if len(parts[i]) >= self.min_chars]
        if not long:
            return tokenizer.encode(text, add_special_tokens=False)
        with self._lock:
            cached = {i: self._lru[parts[i]] for i in long if parts[i] in self._lru}
            for i in cached:
                self._lru.move_to_end(parts[i])
        ids = self._assemble(tokenizer, parts, cached, long)  # nothing cached: the whole text, one run
        if not cached:
            self.misses += 1
            return ids
        self.hits += 1
        if self.hits % self.check_every == 0:
            whole = tokenizer.encode(text, add_special_tokens=False)
            if whole != ids:
                self.reason = "a text's pieces encoded apart differed from it encoded whole"
                log.warning("prompt pieces are no longer cached: %s (%d against %d ids)", self.reason, len(ids),
                            len(whole))
                return whole
        return ids

    def _assemble(self, tokenizer: Any, parts: list[str], cached: dict[int, "array.array | list[int]"],
                  long: list[int] = ()) -> list[int]:
        """The ids of ``"".join(parts)``: the cached pieces' ids, and between them each run of
        parts encoded as one text (it starts at the text's start or with an added token).
        The pieces of ``long`` that a run holds are kept (a conversation's newest turn is
        cached for its next one)."""
        out: list[int] = []
        start = 0
        for i in sorted(cached) + [len(parts)]:
            if start < i:
                ids = tokenizer.encode("".join(parts[start:i]), add_special_tokens=False)
                new = [g for g in long if start <= g < i]
                if new:  # the run as pieces and tokens again: a piece first, a piece last
                    lead = start % 2
                    run = [""] * lead + parts[start:i] + [""] * (1 - i % 2 if i < len(parts) else 0)
                    self._fill(run, [g - start + lead for g in new], ids)
                out += ids
            if i < len(parts):
                out += cached[i]
            start = i + 1
        return out

    def _pieces_of(self, parts: list[str], ids: list[int]) -> list[list[int]] | None:
        """Each piece's ids (the even parts), cut from the whole text's ``ids`` at its added
        tokens' ids; None where those are not the added tokens of ``parts`` in order."""
        want = [self._ids[parts[k]] for k in range(1, len(parts), 2)]
        pieces, cur, j = [], [], 0
        for t in ids:
            if j < len(want) and t == want[j]:
                pieces.append(cur)
                cur, j = [], j + 1
            else:
                cur.append(t)
        pieces.append(cur)
        return pieces if j == len(want) else None

    def _fill(self, parts: list[str], long: list[int], ids: list[int]) -> None:
        pieces = self._pieces_of(parts, ids)
        if pieces is None:  # never with a tokenizer that passed the probes: keep out of its way
            return
        with self._lock:
            for i in long:
                if parts[i] not in self._lru:
                    self._lru[parts[i]] = array.array("i", pieces[i // 2])
                    self._chars += len(parts[i])
            while self._chars > self.max_chars and self._lru:
                key, _ = self._lru.popitem(last=False)
                self._chars -= len(key)

    def _check_probes(self, tokenizer: Any) -> str | None:
        """Encode each probe whole and piece by piece (every piece cached but the first); the
        reason to refuse, or None where all agree."""
        tokens = list(self._ids)
        for probe in _PROBES:
            text = probe.format(tokens[0], tokens[1 % len(tokens)])
            parts = self._split.split(text)
            try:
                ids = tokenizer.encode(text, add_special_tokens=False)
                pieces = self._pieces_of(parts, ids)
                if pieces is None:
                    return "its ids do not split at its added tokens"
                for step in (2, 4):  # every piece cached but the first; every other one
                    cached = {i: pieces[i // 2] for i in range(2, len(parts), step)}
                    if self._assemble(tokenizer, parts, cached) != ids:
                        return "a probe's pieces encoded apart differ from the probe encoded whole"
            except Exception as e:  # noqa: BLE001 - whatever fails, the plain encode stays
                return f"the check failed: {e}"
        return None
