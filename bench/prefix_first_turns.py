"""What the prefix cache costs when nothing hits: ``python -m ppspec.bench.prefix_first_turns``.

ShareGPT first turns only (no shared prefix: the peers' regression case), run through two
in-process engines of the same checkpoint and settings, one with ``enable_prefix_caching``
and one without, in ABBA order over ``--repeats`` pairs (each pair its own prompts, the
same for both engines), ``--concurrency`` requests in flight (a new one joins as one
ends). The cache still takes a snapshot at every prefill chunk that ends inside a prompt
and at every finish, and looks every prompt up. Printed per run and summed: output
tokens per second and mean time to first token, with the on / off ratios.

The clock is the process's CPU time on a CPU (``time.process_time``, one torch thread:
the work done, less disturbed by other processes on a shared machine than wall time) and
wall time on CUDA (synchronized at each step's end by its host read).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def run_once(llm, prompts, params, concurrency: int, clock) -> dict:
    """All ``prompts``, ``concurrency`` at a time. Returns output tokens, time, TTFTs."""
    todo = list(range(len(prompts)))
    live: dict[str, float] = {}
    ttft, first_seen, out_tokens = [], set(), 0
    t0 = clock()
    while todo or llm.has_unfinished():
        while todo and len(live) < concurrency:
            i = todo.pop(0)
            live[llm.add_request(prompts[i], params[i])] = clock()
        for o in llm.step():
            out_tokens += len(o.new_token_ids)
            if o.new_token_ids and o.request_id not in first_seen:
                first_seen.add(o.request_id)
                ttft.append(clock() - live[o.request_id])
            if o.finished:
                live.pop(o.request_id, None)
                llm.completions.pop(o.request_id, None)
    return {"tokens": out_tokens, "seconds": clock() - t0, "ttft": ttft}


def time_cache_work(llm, clock) -> list[float]:
    """Wrap the cache's own work in ``llm`` (the stages' snapshot take / restore / drop, the
    router's lookups, filing and eviction) to add its clock time to the returned cell."""
    spent = [0.0]

    def timed(obj, name):
        f = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = clock()
            try:
                return f(*args, **kwargs)
            finally:
                spent[0] += clock() - t
        setattr(obj, name, wrapper)

    for r in llm.pipeline.runners:
        for name in ("take", "restore", "drop"):
            timed(r.snapshots, name)
    for name in ("lookup", "shared_len", "commit", "reserve", "evict", "evict_one"):
        timed(llm.scheduler.cache, name)
    return spent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.prefix_first_turns", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--pp-size", type=int, default=1)
    ap.add_argument("--speculative-algorithm", default="mtp", choices=("none", "ngram", "mtp"))
    ap.add_argument("--num-prompts", type=int, default=32, help="prompts per run")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-input-len", type=int, default=600)
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="ABBA pairs of runs")
    ap.add_argument("--prefix-cache-gb", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    a = ap.parse_args(argv)
    import torch

    from ppspec.bench.dataset import TokenCounter, load_sharegpt, sample_sharegpt
    from ppspec.router.llm import DEMO_MODEL, LLM
    from ppspec.router.types import SamplingParams

    model = a.model or DEMO_MODEL
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    clock = time.process_time if a.device == "cpu" else time.perf_counter
    common = dict(pp_size=a.pp_size, speculative_algorithm=a.speculative_algorithm, device=a.device, dtype=a.dtype,
                  max_batch_size=max(8, a.concurrency))
    engines = {"off": LLM(model, **common),
               "on": LLM(model, **common, enable_prefix_caching=True, prefix_cache_gb=a.prefix_cache_gb)}
    cache_work = time_cache_work(engines["on"], clock)
    tok = engines["off"].tokenizer
    counter = TokenCounter(model)
    records = load_sharegpt()
    totals = {k: {"tokens": 0, "seconds": 0.0, "ttft": []} for k in engines}
    print(f"{model}: PP{a.pp_size}, {a.speculative_algorithm}, {a.num_prompts} first turns per run, "
          f"concurrency {a.concurrency}, clock {'CPU time' if a.device == 'cpu' else 'wall'}")
    for rep in range(a.repeats):
        sample = sample_sharegpt(records, a.num_prompts, 1000 + rep, counter, a.max_output_len, a.max_input_len)
        prompts = [tok.encode(s.prompt, add_special_tokens=False) for s in sample]
        params = [SamplingParams(temperature=0, max_tokens=s.output_len, ignore_eos=True) for s in sample]
        for name in (("off", "on") if rep % 2 == 0 else ("on", "off")):
            r = run_once(engines[name], prompts, params, a.concurrency, clock)
            for k in ("tokens", "seconds"):
                totals[name][k] += r[k]
            totals[name]["ttft"] += r["ttft"]
            print(f"  run {rep + 1} {name:>3}: {r['tokens'] / r['seconds']:8.1f} output tok/s, "
                  f"TTFT mean {1000 * statistics.mean(r['ttft']):7.1f} ms")
    tps = {k: v["tokens"] / v["seconds"] for k, v in totals.items()}
    ttft = {k: statistics.mean(v["ttft"]) for k, v in totals.items()}
    hit = engines["on"].scheduler.cache
    print(f"all runs: output tok/s off {tps['off']:.1f} on {tps['on']:.1f} (on/off {tps['on'] / tps['off']:.3f}); "
          f"TTFT mean off {1000 * ttft['off']:.1f} ms on {1000 * ttft['on']:.1f} ms (on/off "
          f"{ttft['on'] / ttft['off']:.3f}); prompt tokens hit {hit.hit_tokens} of {hit.queried_tokens}; "
          f"the cache's own work {1000 * cache_work[0]:.0f} ms, {100 * cache_work[0] / totals['on']['seconds']:.2f}% "
          f"of the runs with it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
