"""``ppspec bench --multi-turn``: ShareGPT conversations replayed turn by turn.

Each conversation is a client of its own: turn ``t``'s request is the chat so far (every
earlier user message and the reply the server gave to it, then the ``t``-th user message
of the record) through ``/v1/chat/completions``, so that a server with a prefix cache finds
each turn's prompt but the new message cached. ``--max-concurrency`` conversations run at
once. The figures: TTFT of first turns and of later turns, the prefix-cache hit rate from
``usage.prompt_tokens_details.cached_tokens`` (cached / prompt tokens, later turns and
all), output tokens per second over the run.
"""
from __future__ import annotations

import asyncio
import datetime
import random
import sys
from dataclasses import dataclass


from ppspec.bench import BenchError
from ppspec.bench import client as client_mod
from ppspec.bench.client import RequestResult, session, stream_request
from ppspec.bench.dataset import ASSISTANT_ROLES, HUMAN_ROLES, TokenCounter
from ppspec.bench.metrics import summarize_ms
from ppspec.bench.runner import RunConfig, check_server, normalize_base_url


@dataclass
class Conversation:
    user_turns: list[str]   # the record's user messages, in order
    output_lens: list[int]  # max_tokens of each turn: the record's reply length, capped


def sample_conversations(records: list[dict], num: int, seed: int, counter: TokenCounter, max_turns: int,
                         max_output_len: int | None, max_input_len: int | None = None,
                         min_turns: int = 2) -> list[Conversation]:
    """``num`` records with at least ``min_turns`` user / assistant exchanges, in a seeded
    order, cut to ``max_turns`` and before a user message longer than ``max_input_len``."""
    order = list(range(len(records)))
    random.Random(f"multiturn-{seed}").shuffle(order)
    out = []
    for idx in order:
        turns = records[idx].get("conversations") if isinstance(records[idx], dict) else None
        if not isinstance(turns, list):
            continue
        users, lens = [], []
        for a, b in zip(turns[::2], turns[1::2]):
            if not (isinstance(a, dict) and isinstance(b, dict) and a.get("from") in HUMAN_ROLES
                    and b.get("from") in ASSISTANT_ROLES and isinstance(a.get("value"), str)
                    and isinstance(b.get("value"), str) and a["value"].strip() and b["value"].strip()):
                break
            if max_input_len is not None and counter.count(a["value"]) > max_input_len:
                break
            users.append(a["value"])
            n = max(1, counter.count(b["value"]))
            lens.append(n if max_output_len is None else min(n, max_output_len))
            if len(users) == max_turns:
                break
        if len(users) >= min_turns:
            out.append(Conversation(users, lens))
            if len(out) == num:
                return out
    raise BenchError(f"only {len(out)} conversations with {min_turns}+ turns in the dataset, asked for {num}")


def round_trip_tokens(tokenizer, vocab_size: int | None = None, checks: int = 64, length: int = 64,
                      seed: int = 0) -> list[int]:
    """The word tokens of ``tokenizer`` (a ``tokenizers.Tokenizer``; a space then ASCII
    letters, below ``vocab_size``) whose text re-tokenizes to that one id, checked on
    ``checks`` random sequences of ``length`` of them: each sequence's text, alone and after
    a newline (a chat template's ``assistant\\n``), re-tokenizes to the same ids. A random
    checkpoint sampling only these (``allowed_token_ids``) gives replies that come back in
    the next turn's prompt as the ids it generated, as a trained model's do; BenchError
    when there are none or a sequence does not round-trip."""
    import re

    ids = []
    for i in range(min(tokenizer.get_vocab_size(), vocab_size or tokenizer.get_vocab_size())):
        text = tokenizer.decode([i], skip_special_tokens=False)
        if re.fullmatch(r" [A-Za-z]+", text) and tokenizer.encode(text, add_special_tokens=False).ids == [i]:
            ids.append(i)
    if not ids:
        raise BenchError("the tokenizer has no word tokens (a space then letters) that re-tokenize to themselves")
    rng = random.Random(f"round-trip-{seed}")
    newline = tokenizer.encode("\n", add_special_tokens=False).ids
    for _ in range(checks):
        seq = [rng.choice(ids) for _ in range(length)]
        text = tokenizer.decode(seq, skip_special_tokens=False)
        alone = tokenizer.encode(text, add_special_tokens=False).ids
        after = tokenizer.encode("\n" + text, add_special_tokens=False).ids
        if alone != seq or after != newline + seq:
            raise BenchError(f"word tokens {seq[:8]}... do not re-tokenize to themselves: {alone[:8]}...")
    return ids


async def run_multi_turn(cfg: RunConfig, convs: list[Conversation]) -> dict:
    root = normalize_base_url(cfg.base_url)
    url = root + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    rows: list[dict] = []
    async with session(cfg.timeout, cfg.connect_timeout) as client:
        model = await check_server(client, root, cfg.model, headers)
        slots = asyncio.Semaphore(cfg.max_concurrency or len(convs))

        async def one(k: int, conv: Conversation) -> None:
            async with slots:
                messages = []
                for t, (text, n) in enumerate(zip(conv.user_turns, conv.output_lens)):
                    messages.append({"role": "user", "content": text})
                    payload = {"model": model, "messages": list(messages), "max_tokens": n, "stream": True,
                               "temperature": cfg.temperature, "stream_options": {"include_usage": True}}
                    if cfg.ignore_eos:
                        payload["ignore_eos"] = True
                    if cfg.extra_body:
                        payload.update(cfg.extra_body)
                    r: RequestResult = await stream_request(client, url, payload, True, headers)
                    rows.append({"conversation": k, "turn": t, "success": r.success, "error": r.error,
                                 "ttft_s": r.ttft, "e2el_s": r.e2el, "prompt_tokens": r.prompt_tokens,
                                 "cached_tokens": r.cached_tokens, "output_tokens": r.completion_tokens})
                    if not r.success:
                        return  # the conversation cannot go on without the reply
                    messages.append({"role": "assistant", "content": r.text})

        start = client_mod.clock()
        await asyncio.gather(*(one(k, c) for k, c in enumerate(convs)))
        duration = client_mod.clock() - start
    return summarize_turns(rows, duration, model, cfg)


def summarize_turns(rows: list[dict], duration: float, model: str, cfg: RunConfig) -> dict:
    ok = [r for r in rows if r["success"]]
    if not ok:
        errors = [r["error"] for r in rows if r["error"]]
        raise BenchError(f"every request failed; first error: {errors[0] if errors else '?'}")

    def hit_rate(rs):
        prompt = sum(r["prompt_tokens"] or 0 for r in rs)
        cached = [r["cached_tokens"] for r in rs]
        if not prompt or any(c is None for c in cached):
            return None  # the server reports no cached tokens
        return sum(cached) / prompt

    first, later = [r for r in ok if r["turn"] == 0], [r for r in ok if r["turn"] > 0]
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    return {
        "mode": "multi-turn",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "max_concurrency": cfg.max_concurrency,
        "conversations": len({r["conversation"] for r in rows}),
        "completed": len(ok),
        "failed": len(rows) - len(ok),
        "duration_s": duration,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "ttft_first_turn_ms": summarize_ms([r["ttft_s"] for r in first]),
        "ttft_later_turns_ms": summarize_ms([r["ttft_s"] for r in later]),
        "hit_rate_later_turns": hit_rate(later),
        "hit_rate": hit_rate(ok),
        "errors": sorted({r["error"] for r in rows if r["error"]})[:10],
        "turns": rows,
    }


def format_multi_turn(r: dict) -> str:
    def ms(s):
        return " / ".join("n/a" if s[k] is None else f"{s[k]:.2f}" for k in ("mean", "p50", "p90", "p99"))

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    lines = ["=" * 16 + " ppspec bench multi-turn " + "=" * 13,
             f"{'Model':<36}{r['model']}",
             f"{'Conversations / max concurrency':<36}{r['conversations']} / {r['max_concurrency'] or 'all'}",
             f"{'Completed / failed turns':<36}{r['completed']} / {r['failed']}",
             f"{'Duration (s)':<36}{r['duration_s']:.2f}",
             f"{'Output throughput (tok/s)':<36}{r['output_throughput']:.2f}",
             f"{'TTFT turn 1 ms (mean/p50/p90/p99)':<36}{ms(r['ttft_first_turn_ms'])}",
             f"{'TTFT turns 2+ ms (mean/p50/p90/p99)':<36}{ms(r['ttft_later_turns_ms'])}",
             f"{'Prefix-cache hit rate turns 2+':<36}{pct(r['hit_rate_later_turns'])}",
             f"{'Prefix-cache hit rate all turns':<36}{pct(r['hit_rate'])}",
             "=" * 54]
    return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
