"""The router's CPU time per streamed token at its HTTP edge: ``python -m ppspec.bench.edge_cost``.

The router's app (``build_app``) behind ``serve_http`` (uvloop, the edge protocol) in a
process of its own, over a stand-in engine that costs next to nothing: every ``--round-ms``
milliseconds each running request gets ``--tokens-per-round`` tokens of a fixed text (the
demo tokenizer's ids), as a decode or verify round would deliver them. The ``ppspec bench``
client (``bench.runner``) streams ``--num-prompts`` ShareGPT first turns at
``--concurrency`` from this process; the server's own CPU time (user + system, all its
threads, read from the server before and after the timed run) divided by the tokens
streamed is the edge's cost per token: HTTP parsing and writing, the SSE frames, chunk
formatting, detokenization and stop strings, the request fan-out. The engine, gRPC and the
stages are not in it (docs/PERFORMANCE.md, "CPU: the router's cost per streamed token").

``--baseline-pythonpath DIR`` serves a second time with DIR first on ``PYTHONPATH`` (a
folder holding a ``ppspec`` package that maps another checkout, and that checkout's
``models`` beside it: the stand-in loads the demo tokenizer from there; this file is run
from here), alternating with this checkout ``--repeat`` times, for an A/B of a change.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import httpx

CPU_PATH = "/bench/cpu"  # the stand-in server's CPU seconds so far


def serve(port: int, round_ms: float, tokens_per_round: int, parser: str) -> None:
    """Serve the app over the stand-in engine on ``port`` until SIGINT / SIGTERM."""
    import uvloop
    from fastapi.responses import JSONResponse
    from transformers import AutoTokenizer

    from ppspec.argtypes import DEMO_MODEL
    from ppspec.router.api import build_app, serve_http
    from ppspec.router.types import RequestOutput

    class RoundEngine:
        """Every ``round_ms`` each running request's queue gets one round's wake-up."""

        def __init__(self, tokenizer):
            self.model_name, self.tokenizer, self.max_model_len = "edge", tokenizer, 1 << 16
            self.ids = tokenizer.encode("The pipeline commits the accepted state of its micro-batch. " * 40)
            self.queues: dict[str, asyncio.Queue] = {}
            self.ticker: asyncio.Task | None = None

        async def _rounds(self) -> None:
            while True:
                await asyncio.sleep(round_ms / 1000)
                for q in list(self.queues.values()):
                    q.put_nowait(None)

        async def generate(self, request_id, prompt_token_ids, params):
            if self.ticker is None:
                self.ticker = asyncio.ensure_future(self._rounds())
            q: asyncio.Queue = asyncio.Queue()
            self.queues[request_id] = q
            made, pos = 0, len(prompt_token_ids)
            try:
                while True:
                    await q.get()
                    if request_id not in self.queues:
                        yield RequestOutput(request_id, [], "abort", len(prompt_token_ids), made)
                        return
                    n = min(tokens_per_round, params.max_tokens - made)
                    new = [self.ids[(pos + j) % len(self.ids)] for j in range(n)]
                    pos, made = pos + n, made + n
                    finish = "length" if made >= params.max_tokens else None
                    yield RequestOutput(request_id, new, finish, len(prompt_token_ids), made)
                    if finish:
                        return
            finally:
                self.queues.pop(request_id, None)

        async def abort(self, request_id, finish_reason="abort"):
            self.queues.pop(request_id, None)

        def health(self):
            return True, "stand-in engine"

    async def main() -> None:
        app = build_app(RoundEngine(AutoTokenizer.from_pretrained(DEMO_MODEL)), "edge")
        app.add_api_route(CPU_PATH, lambda: JSONResponse({"cpu_s": time.process_time()}), methods=["GET"])
        kwargs = {}
        if parser != "auto":
            from ppspec.router.api.edge import edge_protocol

            kwargs["http"] = edge_protocol(parser=parser)
        await serve_http(app, "127.0.0.1", port, log_level="warning", **kwargs)

    uvloop.run(main())


def measure(a, samples: list, pythonpath: str | None) -> dict:
    """One server: its CPU ms per streamed token over the timed run, tok/s, tokens."""
    from ppspec.bench.runner import RunConfig, run_benchmark
    from ppspec.bench.client import run as run_client

    from ppspec.argtypes import free_ports

    (port,) = free_ports("127.0.0.1", 1)
    env = dict(os.environ)
    cwd = None
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
        cwd = pythonpath  # not a checkout's root, which would come first on sys.path
    code = ("import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", code, os.path.abspath(__file__), "--serve", str(port),
                             "--round-ms", str(a.round_ms), "--tokens-per-round", str(a.tokens_per_round),
                             "--parser", a.parser], env=env, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the stand-in server did not start")
            time.sleep(0.2)

        def run(some: list) -> dict:
            cfg = RunConfig(base_url=url, max_concurrency=a.concurrency, endpoint=a.endpoint, progress=False,
                            test_request=False)
            return run_client(run_benchmark(cfg, some, lambda s: len(s.split()), "words"))

        run(samples[:8])  # warm: first requests, lazy imports
        cpu0 = httpx.get(url + CPU_PATH).json()["cpu_s"]
        result = run(samples)
        cpu1 = httpx.get(url + CPU_PATH).json()["cpu_s"]
    finally:
        proc.terminate()
        proc.wait(30)
    tokens = result["total_output_tokens"]
    return {"ms_per_token": 1000 * (cpu1 - cpu0) / tokens, "tok_s": result["output_throughput"], "tokens": tokens,
            "failed": result["failed"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.edge_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens of every reply")
    ap.add_argument("--max-input-len", type=int, default=1024, help="ShareGPT first turns of at most this many tokens")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--round-ms", type=float, default=4.0, help="milliseconds between the stand-in's rounds")
    ap.add_argument("--tokens-per-round", type=int, default=1, help="tokens a request gets per round (verify: up to D)")
    ap.add_argument("--parser", choices=["auto", "httptools", "h11"], default="auto", help="the edge's HTTP parser")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each server")
    ap.add_argument("--baseline-pythonpath", default=None,
                    help="also serve with this folder first on PYTHONPATH (another checkout's ppspec), alternating")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the server process
    a = ap.parse_args(argv)
    if a.serve is not None:
        serve(a.serve, a.round_ms, a.tokens_per_round, a.parser)
        return 0
    from ppspec.bench.dataset import TokenCounter, load_sharegpt, sample_sharegpt

    samples = sample_sharegpt(load_sharegpt(), a.num_prompts, a.seed, TokenCounter(None), max_output_len=a.max_tokens,
                              max_input_len=a.max_input_len)
    runs = [("this checkout", None)] + ([("baseline", a.baseline_pythonpath)] if a.baseline_pythonpath else [])
    got: dict[str, list[dict]] = {name: [] for name, _ in runs}
    for _ in range(a.repeat):
        for name, path in runs:
            r = measure(a, samples, path)
            got[name].append(r)
            print(f"{name}: {r['ms_per_token']:.4f} ms CPU per streamed token, {r['tok_s']:.0f} tok/s, "
                  f"{r['tokens']} tokens, {r['failed']} failed", flush=True)
    for name, rs in got.items():
        print(f"{name}: median {statistics.median(r['ms_per_token'] for r in rs):.4f} ms CPU per streamed token "
              f"over {len(rs)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
