"""What the prefix cache costs when nothing hits: ``python -m ppspec.bench.prefix_first_turns``.

ShareGPT first turns only (no shared prefix: the peers' regression case), run through two
in-process engines of the same checkpoint and settings, one with ``enable_prefix_caching``
and one without. Both are warmed up first with ``--warmup-prompts`` other first turns at
the same concurrency (Triton compiles, CUDA graph captures and the sampler's buffers
happen on first use; a timed run that paid them would compare a cold engine against a
warm one), and the cache is flushed after. Then ``--repeats`` pairs of runs in ABBA order
(each pair its own prompts, the same for both engines), ``--concurrency`` requests in
flight (a new one joins as one ends). The cache still takes a snapshot at every prefill
chunk that ends inside a prompt and at every finish, and looks every prompt up. Printed
per run and summed: output tokens per second and mean time to first token, with the on /
off ratios.

The clock is the process's CPU time on a CPU (``time.process_time``, one torch thread:
the work done, less disturbed by other processes on a shared machine than wall time) and
wall time on CUDA (synchronized at each step's end by its host read).

The cache's own work (:class:`CacheWork`), over the timed runs with the cache on: the
stages' snapshot take / restore / drop and the router's lookups, filing and eviction.
- host: the clock above around each call. On CUDA the calls are also watched for host
  syncs (``torch.cuda.set_sync_debug_mode``): a call that waits for the device would
  count the queued kernels of the step before it as its own, so the count is printed,
  and with none the host time is the host's own work.
- device (CUDA): CUDA events around each stage-side call, summed after the run: the
  stream time the call's kernels take, and any time the device sits idle waiting for the
  call's host side to launch them.
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


class CacheWork:
    """Wraps the cache's own work in ``llm`` (see the module's docstring) to measure it:
    ``host`` seconds on ``clock``, ``syncs`` (host waits for the device inside the calls,
    CUDA only), and, after :meth:`device_seconds`, the device time of the stage-side calls."""

    STAGE = ("take", "restore", "drop")
    ROUTER = ("lookup", "shared_len", "commit", "reserve", "evict", "evict_one")

    def __init__(self, llm, clock, cuda: bool):
        self.clock, self.cuda = clock, cuda
        self.host, self.syncs, self.calls = 0.0, 0, 0
        self._events: list = []
        for r in llm.pipeline.runners:
            for name in self.STAGE:
                self._wrap(r.snapshots, name, device=cuda)
        for name in self.ROUTER:
            self._wrap(llm.scheduler.cache, name, device=False)
        self.on = False  # counts only while on (the timed runs)

    def _wrap(self, obj, name: str, device: bool) -> None:
        import warnings

        import torch

        f = getattr(obj, name)

        def wrapper(*args, **kwargs):
            if not self.on:
                return f(*args, **kwargs)
            ev = None
            if device:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            if self.cuda:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    t = self.clock()
                    try:
                        return f(*args, **kwargs)
                    finally:
                        self.host += self.clock() - t
                        torch.cuda.set_sync_debug_mode("default")
                        self.syncs += sum("synchroniz" in str(w.message) for w in caught)
                        self.calls += 1
                        if ev is not None:
                            ev[1].record()
                            self._events.append(ev)
            t = self.clock()
            try:
                return f(*args, **kwargs)
            finally:
                self.host += self.clock() - t
                self.calls += 1
        setattr(obj, name, wrapper)

    def device_seconds(self) -> float:
        """Device seconds of the stage-side calls so far (synchronizes)."""
        import torch

        if not self._events:
            return 0.0
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self._events) / 1000


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
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="first turns through each engine before the timed runs (default: 2 x --concurrency)")
    ap.add_argument("--prefix-cache-gb", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    a = ap.parse_args(argv)
    import torch

    from ppspec.bench.dataset import TokenCounter, load_sharegpt, sample_sharegpt
    from ppspec.router.llm import DEMO_MODEL, LLM
    from ppspec.router.types import SamplingParams

    model = a.model or DEMO_MODEL
    cuda = a.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(a.threads)
    clock = time.perf_counter if cuda else time.process_time
    common = dict(pp_size=a.pp_size, speculative_algorithm=a.speculative_algorithm, device=a.device, dtype=a.dtype,
                  max_batch_size=max(8, a.concurrency))
    engines = {"off": LLM(model, **common),
               "on": LLM(model, **common, enable_prefix_caching=True, prefix_cache_gb=a.prefix_cache_gb)}
    work = CacheWork(engines["on"], clock, cuda)
    tok = engines["off"].tokenizer
    counter = TokenCounter(model)
    records = load_sharegpt()

    def prompts_of(n: int, seed: int):
        sample = sample_sharegpt(records, n, seed, counter, a.max_output_len, a.max_input_len)
        return ([tok.encode(s.prompt, add_special_tokens=False) for s in sample],
                [SamplingParams(temperature=0, max_tokens=s.output_len, ignore_eos=True) for s in sample])

    warm = 2 * a.concurrency if a.warmup_prompts is None else a.warmup_prompts
    print(f"{model}: PP{a.pp_size}, {a.speculative_algorithm}, {a.num_prompts} first turns per run, "
          f"concurrency {a.concurrency}, clock {'wall' if cuda else 'CPU time'}, {warm} warm-up prompts each")
    if warm:
        prompts, params = prompts_of(warm, 999)
        for name, llm in engines.items():
            r = run_once(llm, prompts, params, a.concurrency, clock)
            print(f"  warm-up {name:>3}: {r['tokens'] / r['seconds']:8.1f} output tok/s (not counted)")
        engines["on"].flush_cache()
    cache = engines["on"].scheduler.cache
    queried0, hit0 = cache.queried_tokens, cache.hit_tokens
    totals = {k: {"tokens": 0, "seconds": 0.0, "ttft": []} for k in engines}
    for rep in range(a.repeats):
        prompts, params = prompts_of(a.num_prompts, 1000 + rep)
        for name in (("off", "on") if rep % 2 == 0 else ("on", "off")):
            work.on = name == "on"
            r = run_once(engines[name], prompts, params, a.concurrency, clock)
            work.on = False
            for k in ("tokens", "seconds"):
                totals[name][k] += r[k]
            totals[name]["ttft"] += r["ttft"]
            print(f"  run {rep + 1} {name:>3}: {r['tokens'] / r['seconds']:8.1f} output tok/s, "
                  f"TTFT mean {1000 * statistics.mean(r['ttft']):7.1f} ms")
    tps = {k: v["tokens"] / v["seconds"] for k, v in totals.items()}
    ttft = {k: statistics.mean(v["ttft"]) for k, v in totals.items()}
    on_s = totals["on"]["seconds"]
    own = (f"the cache's own work: host {1000 * work.host:.0f} ms ({100 * work.host / on_s:.2f}% of the runs with it) "
           f"in {work.calls} calls")
    if cuda:
        dev = work.device_seconds()
        why = "none: the host time is its own" if not work.syncs else "the host time includes waits for the device"
        own += (f", {work.syncs} host syncs inside them ({why}); "
                f"device {1000 * dev:.0f} ms ({100 * dev / on_s:.2f}%) in the stages' snapshot calls")
    print(f"all runs: output tok/s off {tps['off']:.1f} on {tps['on']:.1f} (on/off {tps['on'] / tps['off']:.3f}); "
          f"TTFT mean off {1000 * ttft['off']:.1f} ms on {1000 * ttft['on']:.1f} ms (on/off "
          f"{ttft['on'] / ttft['off']:.3f}); prompt tokens hit {cache.hit_tokens - hit0} of "
          f"{cache.queried_tokens - queried0}; {own}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
