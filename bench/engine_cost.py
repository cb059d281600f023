"""The served path's own CPU per round with a stage whose compute costs nothing:
``python -m ppspec.bench.engine_cost``.

On the H200 a demo verify round of 64 requests computes in ~1 ms, and the stage then waits
for the router's next step most of the rest (docs/PERFORMANCE.md, "The kept-alive client on
the H200"): the router's engine process and the HTTP server bound the served rounds. On the
2-core CPU host the tiny checkpoint's eager forward (~10 ms a round) hides them. This serves
the tiny random checkpoint of ``served_vs_engine --tiny`` with a stand-in for the stages'
compute (a ``sitecustomize`` on the stages' ``PYTHONPATH`` that replaces ``StageRunner._forward``,
the step's compute past its checks and row bookkeeping: every sampled request emits token 7, a verify accepts
all its drafts, an MTP stage drafts 7s; no layer runs), drives it with a closed loop of
``ppspec bench`` clients (synthetic prompts, greedy, ``ignore_eos``) and prints the served
tok/s, the micro-batches a second and their tokens, and the CPU milliseconds per
micro-batch of the HTTP server, the engine process and the stages (``/proc``, as
``served_vs_engine`` counts them), after an untimed pass of the same load::

    python -m ppspec.bench.engine_cost --spec mtp --concurrency 64

``--variant NAME=ARGS`` (repeatable) serves this checkout again with more ``ppspec serve``
arguments (``--variant "nocache=--no-enable-prefix-caching"``). ``--baseline-pythonpath DIR`` serves a second time from another checkout (a folder whose
``ppspec`` package maps it, as ``served_vs_engine`` takes it) for an A/B in one run; the
stand-in replaces the same method there, so that checkout must have it (since the commit
after 1866ca5; the figures of docs/PERFORMANCE.md against e9039ac replaced the whole
``StageRunner.step`` with the same stand-in). What the stand-in leaves out: the layers, the
sampler, the MTP head, the graphs; what it keeps: the stage's step decode and result
encode, ``check_input``, the rows' KV and length bookkeeping, the commit and snapshots.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

STANDIN = r'''
import os
try:
    _argv = open("/proc/self/cmdline", "rb").read().decode(errors="replace").split("\0")
except OSError:
    _argv = []
if os.environ.get("PPSPEC_STANDIN_COMPUTE") == "1" and "stage" in _argv and "--pp-rank" in _argv:
    import torch
    from ppspec.stage_server import runner as _R, warmup as _W

    if not hasattr(_R.StageRunner, "_forward"):  # a checkout before the step's compute was its own method
        raise SystemExit("engine_cost: this checkout's StageRunner has no _forward to stand in for")
    _real_forward, _real_warm_up = _R.StageRunner._forward, _W.warm_up

    def _forward(self, inp, parts, out):
        if not getattr(self, "_standin", False):  # the warm-up at start runs the real layers
            return _real_forward(self, inp, parts, out)
        for p in parts:  # a prefill chunk starts or continues its row (as _run_layers records)
            if p.mode == _R.PREFILL:
                self.rows.rows_in_use.update(p.req_pool_indices)
        B = len(inp.req_pool_indices)
        if not self.is_last:
            n = len(inp.input_ids) if inp.hidden_states is None else inp.hidden_states.shape[0]
            out.hidden_states = torch.zeros(n, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
            return
        sample = inp.sample or [True] * B
        drafts = inp.num_drafts or [0] * B
        out.output_ids = [[7] * (drafts[b] + 1) if sample[b] else [] for b in range(B)]
        if self.use_mtp:
            out.drafts = [[7] * self.num_steps if sample[b] else [] for b in range(B)]

    def _warm_up(runner):
        try:
            return _real_warm_up(runner)
        finally:
            runner._standin = True

    _R.StageRunner._forward = _forward
    _W.warm_up = _warm_up
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.engine_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="mtp", choices=["none", "mtp"])
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--serve-args", default="", help="more arguments for ppspec serve")
    ap.add_argument("--baseline-pythonpath", default=None, help="serve a second time from this checkout")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="serve this checkout again with more ppspec serve arguments (repeatable)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    a = ap.parse_args(argv)
    variants = []
    for v in a.variant:
        name, sep, extra = v.partition("=")
        if not sep or not name:
            ap.error(f"--variant {v!r}: NAME=ARGS")
        variants.append((name, None, extra.split()))
    from ppspec.bench.dataset import SampleRequest
    from ppspec.bench.runner import RunConfig, run_benchmark
    from ppspec.bench.client import run as run_client
    from ppspec.bench.served_vs_engine import CpuMeter, make_tiny, serve_children
    from ppspec.bench.serving import serving

    work = tempfile.mkdtemp(prefix="engine-cost-")
    model = make_tiny(os.path.join(work, "tiny"))
    with open(os.path.join(work, "sitecustomize.py"), "w") as f:
        f.write(STANDIN)
    # prompts of 8-40 numbers, each its own from its first (no two share a cached prefix,
    # as ShareGPT's first turns do not: the prefix cache fills with them as it would)
    lens = [8 + (7 * i) % 33 for i in range(a.num_prompts)]
    samples = [SampleRequest(prompt=" ".join(str(1000 + (31 * i + 7 * j) % 9000) for j in range(n)), prompt_len=n,
                             output_len=a.max_tokens, reference_len=a.max_tokens) for i, n in enumerate(lens)]
    args = ["--model", model, "--pp-size", str(a.pp), "--speculative-algorithm", a.spec, "--served-model-name", "m",
            "--num-threads", "1", *a.serve_args.split()]
    runs = [("this checkout", None, [])] + ([("baseline", a.baseline_pythonpath, [])] if a.baseline_pythonpath else [])
    rows = []
    for name, pythonpath, extra in runs + variants:
        env = dict(os.environ, PPSPEC_STANDIN_COMPUTE="1", PYTHONPATH=os.pathsep.join(
            filter(None, [pythonpath, work, os.environ.get("PYTHONPATH")])))
        print(f"{name} ...", file=sys.stderr)
        with serving(args + extra, a.startup_timeout, f"engine-cost-{len(rows)}", env=env, cwd=pythonpath) as (url, proc):
            cfg = dict(base_url=url, progress=False, test_request=False, ignore_eos=True, model="m",
                       max_concurrency=a.concurrency)
            count = lambda s: len(s.split())  # noqa: E731  (the served usage counts the tokens)
            run_client(run_benchmark(RunConfig(**cfg), samples, count, "words"))  # untimed
            with CpuMeter(url, serve_children(proc.pid)) as cpu:
                t0 = time.perf_counter()
                res = run_client(run_benchmark(RunConfig(**cfg), samples, count, "words"))
                wall = time.perf_counter() - t0
            f = cpu.figures(res["total_output_tokens"])
            rows.append((name, res["output_throughput"], f["rounds"] / wall, f["tokens"] / max(1, f["rounds"]),
                         f["router_round_s"] * 1e3, f["engine_round_s"] * 1e3, f["stages_round_s"] * 1e3,
                         res["ttft_ms"]["mean"], res["failed"], res["spec_decode"]["mean_accept_length"]))
    print(f"tiny checkpoint, stand-in compute, speculative {a.spec}, PP{a.pp}; {a.num_prompts} prompts x "
          f"{a.max_tokens} tokens at concurrency {a.concurrency}\n")
    print("| served | output tok/s | micro-batches / s | output tokens per micro-batch | CPU ms per micro-batch: "
          "HTTP / engine process / stages | TTFT mean (ms) | accept length | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for name, tok_s, mbs, per, http, eng, st, ttft, failed, accept in rows:
        acc = "-" if accept is None else f"{accept:.2f}"
        print(f"| {name} | {tok_s:.0f} | {mbs:.0f} | {per:.1f} | {http:.2f} / {eng:.2f} / {st:.2f} | {ttft:.1f} | {acc} "
              f"| {failed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
