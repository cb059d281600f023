"""What serving costs against the engine in one process: ``python -m ppspec.bench.served_vs_engine``.

The same prompts (ShareGPT first turns, every request ``--max-tokens`` long, greedy,
``ignore_eos``) go through ``LLM.generate`` (one process, no gRPC, at most ``--max-rows``
running) and through ``ppspec serve`` at each ``--pp`` with the ``ppspec bench`` client
(``bench.runner``); it prints the ratios of issue 25's table:

- served / engine output tok/s at concurrency ``--concurrency`` (64) and at 1, and with every
  prompt sent at once (the server's own queue admits each prompt the round a row frees, as
  ``LLM.generate`` does: what a closed loop of clients adds is its turnaround between a
  finished request and the next, which the client's CPU busy fraction helps place);
- a served round at concurrency 1 (TPOT times the output tokens per micro-batch: the
  accept length with speculation) against the engine's time per round (a decode step, or
  a verify round with speculation) at batch 1;
- PPk against PP1: tok/s at concurrency 64, TPOT at 1, TTFT of a ``--long-prompt`` token prompt;
- that TTFT (a non-streamed completion of the prompt as token ids, ``max_tokens`` 1, the
  median of three prompts that differ in their first token, after one untimed) against
  ``LLM.generate`` of the same prompts in the same run, and the difference: what the served
  path adds to a long prompt's prefill. ``ppspec serve`` caches prefixes by default and
  ``LLM`` does not: ``--engine-prefix-caching`` gives the engine the cache too;
- the first request after ``/health`` turned 200 against the same request in steady state, and
  the tok/s of a first, untimed pass of the prompts at ``--concurrency`` against the timed one
  after it (what first-use costs the warm-up at start left, at that load);
- tokens per micro-batch (output, and scheduled: ``ppspec:iteration_tokens``) and the
  stages' layer forwards by how they ran (``ppspec:stage_forwards``: graph replays or eager);
- the host's CPU per round: CPU milliseconds (user + system, ``/proc/PID/stat``) of the
  router process and of the stage processes per micro-batch and per output token, at
  concurrency ``--concurrency`` and at 1, beside the engine's own process per round (a
  round of ``LLM.generate``: one micro-batch through every stage). CPU time, not wall, so
  that a host whose cores other work shares still measures the work itself.

GPU (the H200 of docs/PERFORMANCE.md)::

    python -m ppspec.bench.gpu_bench --make-1b /tmp/qwen35-1b
    python -m ppspec.bench.served_vs_engine --model /tmp/qwen35-1b --device cuda --dtype bfloat16
    python -m ppspec.bench.served_vs_engine --device cuda --dtype bfloat16 --spec mtp --pp 1

``--tiny`` (CPU) writes a random checkpoint of 4 layers and hidden size 64, so that compute is
negligible and the figures are the system's own overhead per round: served against in
process, at PP 1, 2 and 4. ``--baseline-pythonpath DIR`` serves a second time with another
checkout's packages first on ``PYTHONPATH`` (a folder holding a ``ppspec`` package that
maps that checkout, see ``--help``), in the same run, for an A/B of a change;
``--variant NAME=ARGS`` (repeatable) serves this checkout again with more ``ppspec serve``
arguments, for an A/B of a setting (``--variant "one-lane=--num-micro-batches 1"``);
``--repeat N`` serves each of them N times, every other time in reversed order.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time

import httpx

from ppspec.bench.dataset import TokenCounter, load_sharegpt, sample_sharegpt
from ppspec.bench.runner import RunConfig, run_benchmark
from ppspec.bench.client import run as run_client
from ppspec.bench.serving import first_token_mark, first_token_rows, serving

# compute negligible: what a round costs is the system's own work
TINY_SHAPE = dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=16384)


def make_tiny(path: str, seed: int = 0, **shape) -> str:
    """The random tiny checkpoint at ``path`` (:data:`TINY_SHAPE`, ``shape`` overriding it),
    its weights drawn after ``torch.manual_seed(seed)``: the same checkpoint in every run."""
    import torch

    from ppspec.bench.gpu_bench import make_random_checkpoint

    torch.manual_seed(seed)
    make_random_checkpoint(torch, path, "cpu", mtp=True, **{**TINY_SHAPE, **shape})
    return path


def long_prompt(n: int, k: int = 0) -> list[int]:
    """The TTFT prompt: ``n`` token ids (below 8192, the tiny checkpoint's vocabulary),
    the ``k``-th of its kind: prompts of different ``k`` differ in their first id, so that
    none finds another's prefix-cache snapshots (a prompt sent again would, on a CPU stage
    whose prefill chunks of 512 tokens each leave one)."""
    ids = [(7 * i) % 8000 + 100 for i in range(n)]
    if ids:
        ids[0] = 8100 + k
    return ids


def long_path(got: dict) -> dict:
    """:func:`~ppspec.router.first_tokens.summarize` of the timed TTFT prompts' rows (the
    last three) of a ``first_token_rows`` answer: where the router saw their time go."""
    from ppspec.router.first_tokens import summarize

    return summarize(got["rows"][-3:], got["fields"])


def ttft_figures(time_one, n: int) -> float:
    """Median seconds of ``time_one(prompt)`` over :func:`long_prompt` ``(n, 1..3)``, after one
    untimed ``(n, 0)`` (first-use costs: allocations, a chunk size's kernels)."""
    time_one(long_prompt(n, 0))
    return statistics.median(time_one(long_prompt(n, k)) for k in (1, 2, 3))


# ------------------------------------------------------------------ the engine in one process
def engine_figures(a, prompts: list[list[int]]) -> dict:
    """``LLM.generate`` of every prompt at once (tok/s; ``cpu_round_s``, ``cpu_token_s``:
    the process's CPU seconds per micro-batch and per output token), and of one prompt
    alone: tok/s and the median seconds of a round after its prefill (``round_s``); the
    TTFT of ``--long-prompt`` tokens (``long_ttft_s``, :func:`ttft_figures`)."""
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    if a.device == "cpu":
        import torch

        torch.set_num_threads(a.num_threads)
    llm = LLM(a.model, speculative_algorithm=a.spec, device=a.device, dtype=a.dtype, max_rows=a.max_rows,
              max_batch_size=a.max_rows, kv_tokens=a.kv_tokens, enable_prefix_caching=a.engine_prefix_caching)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    # a whole untimed pass first: the timed runs meet no first-use cost (allocations, Triton
    # compiles, a batch size's graph capture), which a pass of two prompts left to the
    # timed generate and not to the closed loop after it (3.9x apart with MTP on the H200 at 6fdd2e9)
    llm.generate(prompts, params)
    rounds_done, on_round = [0], llm.engine.on_round

    def counted() -> None:  # one call per micro-batch whose outputs went to their streams
        rounds_done[0] += 1
        on_round()

    llm.engine.on_round = counted
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    cpu, tokens = time.process_time() - c0, sum(len(c.token_ids) for c in outs)
    batch_tok_s = tokens / (time.perf_counter() - t0)
    llm.engine.on_round = on_round
    closed_tokens, closed_s, closed_rounds = closed_loop(llm, prompts, params, a.concurrency)
    rounds, solo, solo_tokens, solo_steps = [], [], 0, 0
    for p in prompts[: a.solo_prompts]:
        t0 = time.perf_counter()
        rid = llm.add_request(p, params)
        times = []
        while llm.has_unfinished():
            t = time.perf_counter()
            llm.step()
            times.append(time.perf_counter() - t)
        n = len(llm.completions.pop(rid).token_ids)
        solo.append(n / (time.perf_counter() - t0))
        solo_tokens, solo_steps = solo_tokens + n, solo_steps + len(times)
        rounds += times[1:]  # after the prefill
    if a.long_prompt >= llm.max_context:
        print(f"--long-prompt {a.long_prompt} is over the context of {llm.max_context} tokens: "
              f"{llm.max_context - 1} used")
        a.long_prompt = llm.max_context - 1
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def time_one(ids: list[int]) -> float:
        t0 = time.perf_counter()
        llm.generate([ids], one)
        return time.perf_counter() - t0

    mark = llm.engine.first_tokens.total
    long_ttft = ttft_figures(time_one, a.long_prompt)
    path = long_path(llm.engine.first_tokens.rows(mark))
    del llm
    return {"tok_s": batch_tok_s, "solo_tok_s": statistics.median(solo), "round_s": statistics.median(rounds),
            "long_ttft_s": long_ttft, "long_path": path,
            # output tokens per micro-batch alone, the prefill's included (as the served figure counts them)
            "solo_tokens_per_round": solo_tokens / max(1, solo_steps),
            "cpu_round_s": cpu / max(1, rounds_done[0]), "cpu_token_s": cpu / max(1, tokens),
            "tokens_per_round": tokens / max(1, rounds_done[0]),
            "closed_tok_s": closed_tokens / closed_s, "closed_tokens_per_round": closed_tokens / max(1, closed_rounds)}


def closed_loop(llm, prompts: list[list[int]], params, concurrency: int) -> tuple[int, float, int]:
    """The same engine driven as ``ppspec bench`` drives a server: ``concurrency`` clients,
    each sending its next prompt once its last one finished (a closed loop, where
    ``generate`` queues every prompt at once). No HTTP, no gRPC: what the arrival pattern
    alone costs. Returns the output tokens, the seconds they took and the micro-batches."""
    import asyncio

    engine, ids = llm.engine, iter(range(len(prompts)))
    rounds, on_round = [0], engine.on_round

    def counted() -> None:
        rounds[0] += 1
        on_round()

    async def client() -> int:
        tokens = 0
        for i in ids:
            q = engine.submit(f"closed-{i}", prompts[i], params)
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    tokens += out.num_output_tokens
                    break
        return tokens

    async def run() -> int:
        return sum(await asyncio.gather(*(client() for _ in range(concurrency))))

    engine.on_round = counted
    try:
        t0 = time.perf_counter()
        tokens = llm._run(run())
        return tokens, time.perf_counter() - t0, rounds[0]
    finally:
        engine.on_round = on_round


# ------------------------------------------------------------------ served
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the state on (the name in parentheses may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (every thread), from /proc."""
    f = _proc_stat(pid)
    return (int(f[11]) + int(f[12])) / _CLK_TCK  # utime, stime: fields 14 and 15 of proc(5)


def serve_children(pid: int) -> dict[str, int]:
    """``ppspec serve``'s processes by role: ``router`` (the HTTP server), ``engine`` (the
    router's engine process, its child), ``http K`` (the router's extra HTTP servers,
    counted with ``router``) and ``stage`` K -> pid (Linux /proc)."""
    found = {}
    for entry, argv in children_of(pid):
        if "router" in argv:
            found["router"] = entry
            for sub, sub_argv in children_of(entry):
                if "--engine-fd" in sub_argv:
                    found["engine"] = sub
                elif "--engine-address" in sub_argv:
                    found[f"http {sub}"] = sub
        elif "stage" in argv:
            found[f"stage {argv[argv.index('--pp-rank') + 1]}"] = entry
    return found


def children_of(pid: int) -> list[tuple[int, list[str]]]:
    """``(pid, argv)`` of each child of ``pid``."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if int(_proc_stat(int(entry))[1]) != pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                kids.append((int(entry), f.read().decode(errors="replace").split("\0")))
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return kids


def _counts(url: str) -> dict[str, float]:
    """From the router's /metrics: micro-batches sent through the pipeline (its step-latency
    histogram's count), their tokens (``ppspec:iteration_tokens``) and the stages' layer
    forwards by how they ran (``ppspec:stage_forwards``, summed over stages)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {"rounds": 0.0, "scheduled_tokens": 0.0, "graph": 0.0, "eager": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("ppspec:pipeline_step_latency_seconds_count"):
            out["rounds"] += float(value)
        elif name.startswith("ppspec:iteration_tokens_sum"):
            out["scheduled_tokens"] += float(value)
        elif name.startswith("ppspec:stage_forwards{"):
            how = name.split('how="', 1)[1].split('"', 1)[0]
            out[how] = out.get(how, 0.0) + float(value)
    return out


class CpuMeter:
    """CPU seconds the router and the stages (together) spend while a block runs, per
    micro-batch and per output token (``figures``)."""

    def __init__(self, url: str, pids: dict[str, int]):
        self.url, self.pids = url, pids

    def __enter__(self):
        self.counts0 = _counts(self.url)
        self.cpu0 = {k: _cpu_seconds(p) for k, p in self.pids.items()}
        return self

    def __exit__(self, *exc):
        self.cpu = {k: _cpu_seconds(p) - self.cpu0[k] for k, p in self.pids.items()}
        self.counts = {k: v - self.counts0.get(k, 0.0) for k, v in _counts(self.url).items()}
        self.rounds = self.counts["rounds"]
        time.sleep(2.5)  # the router reads each stage's forwards every 2 s (Engine._stats_loop)
        later = _counts(self.url)
        for how in ("graph", "eager"):
            self.counts[how] = later.get(how, 0.0) - self.counts0.get(how, 0.0)

    def figures(self, tokens: int) -> dict:
        http = sum(v for k, v in self.cpu.items() if k.startswith("http "))
        parts = {"router": self.cpu.get("router", float("nan")) + http,  # the HTTP servers (and the engine
                 "engine": self.cpu.get("engine", 0.0),  # without --engine-process: then 0 here)
                 "stages": sum(v for k, v in self.cpu.items() if k.startswith("stage"))}
        per = lambda x, n: x / n if n else float("nan")  # noqa: E731
        figures = {"rounds": self.rounds, "tokens": tokens, "scheduled_tokens": self.counts["scheduled_tokens"],
                   "eager": self.counts["eager"], "graph": self.counts["graph"]}
        for part, seconds in parts.items():
            figures[f"{part}_round_s"], figures[f"{part}_token_s"] = per(seconds, self.rounds), per(seconds, tokens)
        return figures

def _timed_request(client: httpx.Client, prompt, max_tokens: int) -> float:
    """Seconds of one non-streamed greedy completion on ``client``'s kept-alive connection
    (a new ``httpx.Client`` per request costs ~20 ms of its own, its SSL context, which
    every served TTFT here carried before 2026-12-04)."""
    t0 = time.perf_counter()
    r = client.post("/v1/completions", timeout=600, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    return time.perf_counter() - t0


def served_figures(a, pp: int, samples, pythonpath: str | None, extra: str = "") -> dict:
    model = os.path.abspath(a.model) if os.path.exists(a.model) else a.model
    cmd = ["--model", model, "--pp-size", str(pp),
           "--speculative-algorithm", a.spec, "--device", a.device, "--dtype", a.dtype,
           "--max-rows", str(a.max_rows), "--max-batch-size", str(a.max_rows), "--kv-tokens", str(a.kv_tokens),
           "--served-model-name", "m"]
    if a.device == "cpu":
        cmd += ["--num-threads", str(a.num_threads)]
    cmd += a.serve_args.split() + extra.split()
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    with contextlib.ExitStack() as stack:
        url, proc = stack.enter_context(serving(cmd, a.startup_timeout, f"pp{pp}", env=env, cwd=pythonpath or None))
        first_prompt = samples[0].prompt
        timed = stack.enter_context(httpx.Client(base_url=url))
        timed.get("/health", timeout=10)  # the connection open, as a client's that sent anything before
        first = _timed_request(timed, first_prompt, 32)  # the first request after /health turned 200
        steady = statistics.median(_timed_request(timed, first_prompt, 32) for _ in range(5))
        cfg = dict(base_url=url, progress=False, test_request=False, ignore_eos=True)
        count = lambda s: len(s.split())  # noqa: E731  (the served usage counts the tokens)
        pids = serve_children(proc.pid)
        # a whole untimed pass first, as the engine's side has: the timed pass meets no
        # first-use cost that the warm-up at start left (a shape's kernels, allocations);
        # its tok/s against the timed pass's says how much of such cost there is
        cold = run_client(run_benchmark(RunConfig(max_concurrency=a.concurrency, **cfg), samples, count, "words"))
        with CpuMeter(url, pids) as cpu_full:
            cpu0, wall0 = time.process_time(), time.perf_counter()
            full = run_client(run_benchmark(RunConfig(max_concurrency=a.concurrency, **cfg), samples, count, "words"))
            client_busy = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        # every prompt sent at once: the server's own queue (at most --max-rows running)
        # admits the next prompt the round a row frees, as LLM.generate does; no client's
        # turnaround between a finished request and the next one
        queued = run_client(run_benchmark(RunConfig(max_concurrency=None, **cfg), samples, count, "words"))
        with CpuMeter(url, pids) as cpu_solo:
            solo = run_client(run_benchmark(RunConfig(max_concurrency=1, **cfg), samples[: a.solo_prompts], count,
                                             "words"))
        # within the served context (the demo checkpoint's is 4096 tokens)
        context = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        if a.long_prompt >= context:
            print(f"--long-prompt {a.long_prompt} is over the context of {context} tokens: {context - 1} used")
            a.long_prompt = context - 1
        try:  # a checkout before the router's first-token stamps has no such endpoint
            mark = first_token_mark(url)
        except httpx.HTTPError:
            mark = None
        with CpuMeter(url, pids) as cpu_long:
            ttft = ttft_figures(lambda ids: _timed_request(timed, ids, 1), a.long_prompt)
        path = long_path(first_token_rows(url, mark)) if mark is not None else {"n": 0}
    return {"tok_s": full["output_throughput"], "solo_tok_s": solo["output_throughput"],
            "tpot_s": solo["tpot_ms"]["mean"] / 1e3, "long_ttft_s": ttft, "long_path": path,
            "long_cpu": cpu_long.figures(4), "first_s": first, "steady_s": steady,
            "failed": full["failed"] + solo["failed"] + queued["failed"], "client_busy": client_busy,
            "queued_tok_s": queued["output_throughput"], "cold_tok_s": cold["output_throughput"],
            "ttft_split": ttft_split(full),
            "cpu": cpu_full.figures(full["total_output_tokens"]), "solo_cpu": cpu_solo.figures(solo["total_output_tokens"])}


def ttft_split(res: dict) -> tuple[float, float | None, float | None]:
    """The mean TTFT of a ``run_benchmark`` result ``res`` in ms: the client's, the router's
    (queued until its first token back; None without the router's stamps) and of it the
    wait until admitted into a lane. The client's less the router's is the HTTP edge's, the
    hop to the engine process's and the client's own share: in a closed loop, time a request
    spends outside the engine's micro-batches."""
    router = res.get("router_ttft") or {}
    mean = lambda key: router[key]["mean"] if key in router else None  # noqa: E731
    return res["ttft_ms"]["mean"], mean("router_ttft_ms"), mean("queued_ms")


# ------------------------------------------------------------------ report
def long_path_lines(a, eng: dict, served: dict[str, dict[int, dict]], names: list[str], pps: list[int], fmt) -> list[str]:
    """Where the long prompt's TTFT goes, by the router's stamps (router/first_tokens.py;
    medians of the three timed prompts), the engine in one process beside each server: the
    client's time less the router's is the HTTP edge and the hop to the engine process, and
    the stage forwards during them say whether the chunk replayed a graph."""
    from ppspec.router.first_tokens import SEGMENTS

    cols = [("engine", eng)] + [(f"{n} PP{pp}", served[n][pp]) for n in names for pp in pps]
    lines = ["", f"TTFT of the {a.long_prompt}-token prompt by the router's stamps (median ms of 3)", "",
             "| | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---|" * len(cols)]

    def row(label, fn, f="{:.1f}"):
        vals = []
        for _, fig in cols:
            try:
                vals.append(fmt(fn(fig), f))
            except (KeyError, TypeError):
                vals.append("-")
        lines.append(f"| {label} | " + " | ".join(vals) + " |")

    row("the client's TTFT", lambda g: g["long_ttft_s"] * 1e3)
    for name, text in SEGMENTS:
        row(text, lambda g, name=name: g["long_path"][name][1])
    row("queued until its first token back (router)", lambda g: g["long_path"]["ttft"][1])
    row("the client's less the router's (HTTP, the hop to the engine process)",
        lambda g: g["long_ttft_s"] * 1e3 - g["long_path"]["ttft"][1])
    row("micro-batches until its first token", lambda g: g["long_path"]["batches"][1], "{:.0f}")
    row("stage forwards of the 4 prompts: graph replays", lambda g: g["long_cpu"]["graph"], "{:.0f}")
    row("stage forwards of the 4 prompts: eager", lambda g: g["long_cpu"]["eager"], "{:.0f}")
    return lines


def _round_s(figures: dict) -> float:
    """Seconds of a served round at concurrency 1: TPOT times the output tokens of a
    micro-batch (1 without speculation; the accept length with it, which a TPOT divides)."""
    solo = figures["solo_cpu"]
    return figures["tpot_s"] * solo["tokens"] / max(1, solo["rounds"])


def report(a, eng: dict, served: dict[str, dict[int, dict]]) -> str:
    fmt = lambda x, f="{:.2f}": "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f.format(x)  # noqa: E731
    names = list(served)
    lines = [f"model {a.model}, {a.device} {a.dtype}, speculative {a.spec}; {a.num_prompts} prompts x {a.max_tokens} "
             f"tokens; engine: LLM.generate, at most {a.max_rows} running", "",
             f"engine: {eng['tok_s']:.1f} tok/s all prompts, {eng['solo_tok_s']:.1f} tok/s one request, "
             f"{eng['round_s'] * 1e3:.2f} ms per round at batch 1, {eng['solo_tokens_per_round']:.2f} output tokens "
             f"per micro-batch alone (the served c1 figure below is the same count); {eng['tokens_per_round']:.1f} "
             f"output tokens per micro-batch with every prompt queued at once, {eng['closed_tokens_per_round']:.1f} "
             f"with {a.concurrency} clients in a closed loop ({eng['closed_tok_s']:.1f} tok/s); TTFT of "
             f"{a.long_prompt} tokens {eng['long_ttft_s'] * 1e3:.1f} ms (prefix caching "
             f"{'on' if a.engine_prefix_caching else 'off'})", ""]
    head = "| figure | target (H200) | " + " | ".join(names) + " |"
    lines += [head, "|---|---|" + "---|" * len(names)]

    def row(label, target, fn):
        vals = []
        for n in names:
            try:
                vals.append(fmt(fn(served[n])))
            except (KeyError, ZeroDivisionError, TypeError):
                vals.append("-")
        lines.append(f"| {label} | {target} | " + " | ".join(vals) + " |")

    pps = sorted(next(iter(served.values())))
    base = pps[0]
    row(f"served / engine tok/s, PP{base}, concurrency {a.concurrency}", ">= 0.9", lambda s: s[base]["tok_s"] / eng["tok_s"])
    row(f"served / engine tok/s, PP{base}, concurrency 1", ">= 0.8 (MTP)", lambda s: s[base]["solo_tok_s"] / eng["solo_tok_s"])
    row(f"served round / engine round, PP{base}, concurrency 1", "<= 1.15", lambda s: _round_s(s[base]) / eng["round_s"])
    row(f"served / engine in a closed loop tok/s, PP{base}, concurrency {a.concurrency} (the same arrivals)", "-",
        lambda s: s[base]["tok_s"] / eng["closed_tok_s"])
    row(f"served / engine tok/s, PP{base}, every prompt sent at once (the server's queue: no client turnaround)", "-",
        lambda s: s[base]["queued_tok_s"] / eng["tok_s"])
    row(f"served / engine TTFT, {a.long_prompt}-token prompt, PP{base}", "-",
        lambda s: s[base]["long_ttft_s"] / eng["long_ttft_s"])
    for pp in pps[1:]:
        row(f"PP{pp} / PP{base} tok/s, concurrency {a.concurrency}", ">= 0.95", lambda s, pp=pp: s[pp]["tok_s"] / s[base]["tok_s"])
        row(f"PP{pp} / PP{base} TPOT, concurrency 1", "<= 1.1", lambda s, pp=pp: s[pp]["tpot_s"] / s[base]["tpot_s"])
        row(f"PP{pp} / PP{base} TTFT, {a.long_prompt}-token prompt", "<= 1.1",
            lambda s, pp=pp: s[pp]["long_ttft_s"] / s[base]["long_ttft_s"])
    for pp in pps:
        row(f"first request after /health / steady state, PP{pp}", "<= 2", lambda s, pp=pp: s[pp]["first_s"] / s[pp]["steady_s"])
    for pp in pps:
        row(f"the first pass at concurrency {a.concurrency} after start / the timed one, tok/s, PP{pp}", "-",
            lambda s, pp=pp: s[pp]["cold_tok_s"] / s[pp]["tok_s"])
    lines += ["", "| absolute | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for pp in pps:
        for key, label, scale, f in (("tok_s", f"tok/s c{a.concurrency}", 1, "{:.1f}"), ("solo_tok_s", "tok/s c1", 1, "{:.1f}"),
                                     ("tpot_s", "TPOT c1 (ms)", 1e3, "{:.2f}"),
                                     ("long_ttft_s", f"TTFT {a.long_prompt} tokens (ms)", 1e3, "{:.0f}")):
            lines.append(f"| PP{pp} {label} | " + " | ".join(fmt(served[n][pp][key] * scale, f) for n in names) + " |")
        lines.append(f"| PP{pp} TTFT {a.long_prompt} tokens less the engine's (ms) | " + " | ".join(
            fmt((served[n][pp]["long_ttft_s"] - eng["long_ttft_s"]) * 1e3, "{:.1f}") for n in names) + " |")
        lines.append(f"| PP{pp} TTFT c{a.concurrency}, mean ms: the client's / the router's (queued until its first "
                     f"token back) / of it queued until admitted | " + " | ".join(
                         " / ".join(fmt(x, "{:.1f}") for x in served[n][pp]["ttft_split"]) for n in names) + " |")
        # the system's own cost of a round at batch 1: a served round less the engine's
        lines.append(f"| PP{pp} overhead per round c1 (ms) | " + " | ".join(
            fmt((_round_s(served[n][pp]) - eng["round_s"]) * 1e3) for n in names) + " |")
    lines += long_path_lines(a, eng, served, names, pps, fmt)
    lines += ["", f"host CPU (user + system, /proc) per micro-batch and per output token; engine in one process: "
              f"{eng['cpu_round_s'] * 1e3:.2f} ms per micro-batch, {eng['cpu_token_s'] * 1e3:.3f} ms per token "
              f"(all prompts at once)", "", "| CPU | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for pp in pps:
        for key, conc in (("cpu", a.concurrency), ("solo_cpu", 1)):
            for part in ("router", "engine", "stages"):
                lines.append(f"| PP{pp} {part} c{conc}: ms per micro-batch / per token | " + " | ".join(
                    fmt(served[n][pp][key][f"{part}_round_s"] * 1e3) + " / "
                    + fmt(served[n][pp][key][f"{part}_token_s"] * 1e3, "{:.3f}") for n in names) + " |")
            lines.append(f"| PP{pp} tokens per micro-batch c{conc}: output / scheduled | " + " | ".join(
                fmt(served[n][pp][key]["tokens"] / max(1, served[n][pp][key]["rounds"]), "{:.1f}") + " / "
                + fmt(served[n][pp][key]["scheduled_tokens"] / max(1, served[n][pp][key]["rounds"]), "{:.1f}")
                for n in names) + " |")
            lines.append(f"| PP{pp} stage forwards c{conc}: graph replays / eager | " + " | ".join(
                fmt(served[n][pp][key]["graph"], "{:.0f}") + " / " + fmt(served[n][pp][key]["eager"], "{:.0f}")
                for n in names) + " |")
        # near 1: the client, not the server, paces the closed loop
        lines.append(f"| PP{pp} the benchmark client's CPU busy fraction c{a.concurrency} | " + " | ".join(
            fmt(served[n][pp].get("client_busy")) for n in names) + " |")
    return "\n".join(lines)


def serving_order(runs: list[tuple], repeat: int) -> list[tuple]:
    """The servers to start, in order: ``runs`` (``(name, pythonpath, args)``: this checkout,
    the baseline, the variants) ``repeat`` times, every other time reversed (A B, B A, A B,
    ...), each named with its pass (``served #2``) when ``repeat`` > 1. On the GPU hosts the
    server that ran first after the engine's run was the slower at concurrency 1 whichever it
    was (docs/PERFORMANCE.md, "The collector's passes"): alternating, a position's effect
    shows as the spread of one setting's columns, not as a difference between settings."""
    order = []
    for i in range(repeat):
        for name, path, extra in (runs if i % 2 == 0 else runs[::-1]):
            order.append((name if repeat == 1 else f"{name} #{i + 1}", path, extra))
    return order


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.served_vs_engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the demo model; with --tiny, made)")
    ap.add_argument("--tiny", action="store_true", help="CPU: a random 4-layer hidden-64 checkpoint")
    ap.add_argument("--spec", default="none", choices=["none", "ngram", "mtp"])
    ap.add_argument("--pp", default="1,2,4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--kv-tokens", type=int, default=131072)
    ap.add_argument("--solo-prompts", type=int, default=4, help="requests run alone (concurrency 1)")
    ap.add_argument("--long-prompt", type=int, default=8000, help="tokens of the TTFT prompt")
    ap.add_argument("--engine-prefix-caching", action="store_true",
                    help="the engine in one process caches prefixes, as ppspec serve does by default")
    ap.add_argument("--num-threads", type=int, default=1,
                    help="CPU: torch threads of the engine and of each stage (more than the free cores spin)")
    ap.add_argument("--serve-args", default="", help="more arguments for ppspec serve")
    ap.add_argument("--baseline-pythonpath", default=None,
                    help="also serve with this folder first on PYTHONPATH (another checkout's ppspec), named 'baseline'")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="also serve this checkout with these more ppspec serve arguments, named NAME (repeatable)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="serve each of them this many times, in reversed order every other time (A B, B A, ...)")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error(f"--repeat {a.repeat}: give 1 or more")
    variants = []
    for v in a.variant:
        name, sep, args = v.partition("=")
        if not sep or not name or name in ("served", "baseline"):
            ap.error(f"--variant {v!r}: NAME=ARGS, NAME not 'served' or 'baseline'")
        variants.append((name, None, args))
    if a.tiny:
        a.model = a.model or make_tiny(os.path.join(tempfile.mkdtemp(), "tiny"))
    if a.model is None:
        from ppspec.router.llm import DEMO_MODEL

        a.model = DEMO_MODEL
    counter = TokenCounter(a.model)
    samples = sample_sharegpt(load_sharegpt(), a.num_prompts, 0, counter, max_input_len=a.max_input_len)
    for s in samples:  # every request the same length, as LLM.generate runs them
        s.output_len = a.max_tokens
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = [tok.encode(s.prompt) for s in samples]
    print(f"engine in one process ({a.model}) ...", file=sys.stderr, flush=True)
    eng = engine_figures(a, prompts)
    served: dict[str, dict[int, dict]] = {}
    runs = [("served", None, "")] + ([("baseline", a.baseline_pythonpath, "")] if a.baseline_pythonpath else [])
    runs += variants
    for pp in (int(x) for x in a.pp.split(",")):
        for name, path, extra in serving_order(runs, a.repeat):  # interleaved: the A/B sees the same machine load
            print(f"{name} PP{pp} ...", file=sys.stderr, flush=True)
            served.setdefault(name, {})[pp] = served_figures(a, pp, samples, path, extra)
    print(report(a, eng, served))
    return 0


if __name__ == "__main__":
    sys.exit(main())
