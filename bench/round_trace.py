"""Where the first stage's time goes between two rounds, served:
``python -m ppspec.bench.round_trace``.

Starts ``ppspec serve`` (PP 1 by default, with ``--spec``; by default the tiny random
checkpoint of ``served_vs_engine --tiny``) with a tracer loaded into each stage process (a
``sitecustomize`` on its ``PYTHONPATH`` that wraps ``StageServicer``'s and ``StageRunner``'s
methods, so the served code runs unchanged), sends ``--requests`` greedy completions,
``--concurrency`` at a time (1: one after another), and prints, from ``time.perf_counter_ns`` stamps of stage 0:

- the compute of a round (``StageRunner.step`` on the compute thread) and the gap from its
  end to the start of the next round's compute (the stage's own work between rounds: the
  result's encode and write, the next step's decode, fill-in, checks, the carried commit,
  the hand-offs between the event loop and the compute thread);
- how many rounds found their successor already queued at the stage when they ended (with
  MTP: a following verify, sent before the round's result), against those whose successor
  came after (the stage waited for the router: a request's first or last rounds, or a
  router slower than a round), and how long it waited;
- the segments of the most common sequences of stamps between two computes (median
  microseconds), named by the stamp at each end.

On the H200 (demo checkpoint)::

    python -m ppspec.bench.round_trace --model DEMO --serve-args "--device cuda:0 --dtype bfloat16"

(``DEMO``: the demo checkpoint folder, ``models/qwen35-demo``). To trace another checkout,
run this file from the folder that holds its ``ppspec`` package, with that folder on
``PYTHONPATH`` (as ``served_vs_engine --baseline-pythonpath`` takes it).
"""
from __future__ import annotations

import argparse
import bisect
import collections
import concurrent.futures
import glob
import json
import os
import statistics
import sys
import tempfile

import httpx

from ppspec.bench.serving import serving

TRACER = r'''
import os, threading, time
_d = os.environ.get("PPSPEC_ROUND_TRACE_DIR")
try:
    _argv = open("/proc/self/cmdline", "rb").read().decode().split("\0")
except OSError:
    _argv = []
if _d and "stage" in _argv and "--pp-rank" in _argv and _argv[_argv.index("--pp-rank") + 1] == "0":
    import atexit, json
    from ppspec.stage_server import rounds as R, runner as RN, server as S
    ns, ev = time.perf_counter_ns, []

    def rec(name, rnd):
        ev.append((name, rnd, ns()))

    def around(cls, name, tag, rnd_of, coro):
        orig = getattr(cls, name)
        if coro:
            async def wrapped(self, *a, **kw):
                rec(tag + "0", rnd_of(*a))
                try:
                    return await orig(self, *a, **kw)
                finally:
                    rec(tag + "1", rnd_of(*a))
        else:
            def wrapped(self, *a, **kw):
                rec(tag + "0", rnd_of(*a))
                try:
                    return orig(self, *a, **kw)
                finally:
                    rec(tag + "1", rnd_of(*a))
        setattr(cls, name, wrapped)

    around(S.StageServicer, "_step", "handler", lambda req, *a: req.round, True)
    around(RN.StageRunner, "step", "run", lambda inp: inp.round, False)
    around(RN.StageRunner, "commit_accept", "commit", lambda mb, rnd, *a: rnd, False)
    orig_wait = R.SampledRounds.wait

    async def wait(self, key, rnd, timeout):
        res = await orig_wait(self, key, rnd, timeout)
        rec("filled", rnd)
        return res
    R.SampledRounds.wait = wait
    orig_compute = S.StageServicer._compute

    async def compute(self, fn, *a, **kw):
        rec("handoff", -1)
        try:
            return await orig_compute(self, fn, *a, **kw)
        finally:
            rec("back", -1)
    S.StageServicer._compute = compute
    orig_steps = S.StageServicer.Steps

    class Ctx:
        def __init__(self, c):
            self._c = c

        async def write(self, res):
            await self._c.write(res)
            rec("written", res.round)

        def __getattr__(self, k):
            return getattr(self._c, k)

    async def Steps(self, requests, context):
        return await orig_steps(self, requests, Ctx(context))
    S.StageServicer.Steps = Steps

    def dump():
        with open(os.path.join(_d, f"stage0-{os.getpid()}.json"), "w") as f:
            json.dump(ev, f)
    atexit.register(dump)
'''


def analyze(ev: list) -> str:
    """The report of one stage's stamps (``[name, round, ns]``)."""
    ev = sorted(ev, key=lambda e: e[2])
    us = lambda a, b: (b - a) / 1e3  # noqa: E731
    starts = [e for e in ev if e[0] == "handler0"]
    lines, computes, gaps, queued, waited = [], [], [], [], []
    seqs: collections.Counter = collections.Counter()
    parts: dict = collections.defaultdict(list)
    runs = [i for i, e in enumerate(ev) if e[0] in ("run0", "run1")]
    for a, b in zip(runs, runs[1:]):
        if ev[a][0] == "run0" and ev[b][0] == "run1":
            computes.append(us(ev[a][2], ev[b][2]))
        if ev[a][0] != "run1" or ev[b][0] != "run0":
            continue
        end, nxt = ev[a], ev[b]
        gaps.append(us(end[2], nxt[2]))
        # the handler of the next round: the last one of its round entered before it ran
        k = bisect.bisect_right([s[2] for s in starts], nxt[2]) - 1
        while k >= 0 and starts[k][1] != nxt[1]:
            k -= 1
        if k >= 0 and starts[k][2] < end[2]:
            queued.append(gaps[-1])
        elif k >= 0:
            waited.append(us(end[2], starts[k][2]))
        seg = ev[a: b + 1]
        key = " > ".join(e[0] for e in seg)
        seqs[key] += 1
        for j in range(1, len(seg)):
            parts[key, j].append(us(seg[j - 1][2], seg[j][2]))
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    lines.append(f"rounds: {len(computes)}; compute (StageRunner.step) median {med(computes):.0f} us")
    lines.append(f"gap from a round's compute end to the next one's start: median {med(gaps):.0f} us")
    lines.append(f"  next round queued at the stage when the round ended: {len(queued)} rounds, gap median "
                 f"{med(queued):.0f} us")
    lines.append(f"  next round came after it ended (the stage waited for the router): {len(waited)} rounds, "
                 f"waited median {med(waited):.0f} us")
    for key, n in seqs.most_common(3):
        names = key.split(" > ")
        lines.append(f"{n} gaps: {key}")
        for j in range(1, len(names)):
            lines.append(f"    {names[j - 1]} -> {names[j]}: {med(parts[key, j]):.0f} us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.round_trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the tiny random one, made)")
    ap.add_argument("--spec", default="mtp", choices=["none", "ngram", "mtp"])
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--serve-args", default="", help="more arguments for ppspec serve")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="round-trace-")
    model = a.model
    if model is None:
        from ppspec.bench.served_vs_engine import make_tiny

        model = make_tiny(os.path.join(work, "tiny"))
    with open(os.path.join(work, "sitecustomize.py"), "w") as f:
        f.write(TRACER)
    env = dict(os.environ, PPSPEC_ROUND_TRACE_DIR=work,
               PYTHONPATH=os.pathsep.join(filter(None, [work, os.environ.get("PYTHONPATH")])))
    args = ["--model", os.path.abspath(model) if os.path.exists(model) else model, "--pp-size", str(a.pp),
            "--speculative-algorithm", a.spec, "--served-model-name", "m", *a.serve_args.split()]
    if "--device" not in a.serve_args:
        args += ["--num-threads", "1"]
    prompts = [[(37 * i + 11 * k) % 200 + 20 for k in range(24)] for i in range(a.requests)]
    with serving(args, a.startup_timeout, "round-trace", env=env) as (url, _):
        def complete(p: list[int]) -> None:
            r = httpx.post(url + "/v1/completions", timeout=600, json={
                "model": "m", "prompt": p, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()

        # a thread per request in flight: a closed loop of --concurrency clients
        with concurrent.futures.ThreadPoolExecutor(max(1, a.concurrency)) as pool:
            list(pool.map(complete, prompts))
    files = glob.glob(os.path.join(work, "stage0-*.json"))
    if not files:
        print(f"no trace written (the stage did not exit cleanly?); folder {work}", file=sys.stderr)
        return 1
    with open(files[0]) as f:
        print(analyze(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
