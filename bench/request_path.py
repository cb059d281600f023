"""A long prompt's own cost on the served path, step by step: ``python -m ppspec.bench.request_path``.

Times, on this host's CPU and outside any server, what the served path does once or a
few times per request with every token of its prompt, for prompts of ``--lengths``
token ids (the ids of ``served_vs_engine``'s TTFT prompt): the HTTP server's JSON parse,
``CompletionRequest`` validation and ignored-field scan, the vocabulary check, the
submission's pickle to the engine process and back; the prefix cache's lookup, branch
point (``shared_len``) and the filing of a snapshot's key over a tree holding the prompt
(``_insert``); the eviction plan's gain of a snapshot holding the prompt's KV pages;
``StepRequest`` encode, bytes, decode and the stage's int64 tensor of the ids. Prints the
median microseconds of ``--repeats`` calls of each, per length, and their sum.

Each figure is the code on ``PYTHONPATH``; to time another checkout, run this file from a
folder holding its ``ppspec`` package, with that folder on ``PYTHONPATH`` (as
``hop_trace`` takes one)::

    PYTHONPATH=DIR python bench/request_path.py --lengths 1000,8000

The tokenizer's own encode of a text prompt and the chat template are not here (the
Rust tokenizer's work: ~0.6 us a token on the CPU host, docs/PERFORMANCE.md).
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time


def median_us(fn, repeats: int) -> float:
    """Median microseconds of ``fn()`` over ``repeats`` calls, after one untimed."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def steps(n: int, page_size: int = 16, chunk: int = 512) -> dict:
    """Name -> a call doing that step for a prompt of ``n`` token ids."""
    import torch

    from ppspec.proto.codec import SpecMemo, step_from_pb, step_to_pb
    from ppspec.proto.messages import SamplingSpec, StepInput
    from ppspec.proto.stubs import pb
    from ppspec.router.api.fanout import check_ids
    from ppspec.router.kv_ledger import Letting, PageLedger
    from ppspec.router.prefix_cache import PrefixCache
    from ppspec.router.protocol import CompletionRequest, ignored_fields
    from ppspec.stage_server.graphs import host_int64

    ids = [(7 * i) % 8000 + 100 for i in range(n)]
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True}).encode()
    parsed = json.loads(body)
    req = CompletionRequest.model_validate(parsed)
    msg = ("add", "cmpl-0", ids, None)
    # the tree after the prompt ran once: its chunks' snapshots and the finished row's
    cache = PrefixCache(1024, page_size)
    ends = list(range(chunk, n, chunk)) + [n]
    for end in ends:
        cache.commit(cache.reserve(end - 1, "r"), ids[:end])
    again = ids[:-1] + [ids[-1] + 1]  # the same prompt but its last id: branches at its end
    ledger = PageLedger(page_size)
    ledger.grow(("row", 0), n)
    for s, end in enumerate(ends):
        ledger.take(("slot", s), ("row", 0), end)
    ledger.release(("row", 0))
    plan = Letting(ledger)
    spec = SamplingSpec(0.0, 1.0, 0, 0.0, 0, None, 0, [], 0.0, 0.0, 1.0)
    inp = StepInput(0, 1, "prefill", [3], [0], [n], ids, [], [True], [], [spec], [0],
                    restore_slots=[-1], snapshot_slots=[-1])
    memo = SpecMemo()
    m = step_to_pb(inp, memo)
    raw = m.SerializeToString()
    parsed_pb = pb.StepRequest.FromString(raw)
    torch.set_num_threads(1)
    return {
        "HTTP: json.loads of the body": lambda: json.loads(body),
        "HTTP: CompletionRequest validation": lambda: CompletionRequest.model_validate(parsed),
        "HTTP: ignored_fields": lambda: ignored_fields(req),
        "HTTP: check_ids": lambda: check_ids(ids, "prompt", 1 << 20),
        "IPC: pickle dumps + loads of the submission": lambda: pickle.loads(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)),
        "scheduler: prefix cache lookup": lambda: cache.lookup(again),
        "scheduler: prefix cache shared_len": lambda: cache.shared_len(again),
        "scheduler: prefix cache _insert (a filed key, each chunk's snapshot)": lambda: cache._insert(ids),
        "scheduler: eviction gain of the prompt's last snapshot": lambda: plan.gain(("slot", len(ends) - 1)),
        "router: step_to_pb": lambda: step_to_pb(inp, memo),
        "router: SerializeToString": lambda: m.SerializeToString(),
        "stage: FromString": lambda: pb.StepRequest.FromString(raw),
        "stage: step_from_pb": lambda: step_from_pb(parsed_pb, memo),
        "stage: host_int64 of the ids": lambda: host_int64(ids),
    }


def measure(lengths: list[int], repeats: int) -> dict[int, dict[str, float]]:
    """Per length, each step's median microseconds."""
    return {n: {name: median_us(fn, repeats) for name, fn in steps(n).items()} for n in lengths}


def table(figures: dict[int, dict[str, float]]) -> str:
    lengths = list(figures)
    names = list(next(iter(figures.values())))
    lines = ["| step (median us) | " + " | ".join(f"{n} ids" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{figures[n][name]:.1f}" for n in lengths) + " |")
    lines.append("| sum | " + " | ".join(f"{sum(figures[n].values()):.1f}" for n in lengths) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.request_path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1000,8000", help="prompt lengths in token ids, comma-separated")
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args(argv)
    print(table(measure([int(x) for x in a.lengths.split(",")], a.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
