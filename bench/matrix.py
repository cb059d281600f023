"""Run the serving benchmark over a grid of PP sizes x speculation x concurrency.

    python -m ppspec.bench.matrix --model models/qwen35-demo --pp 1,2,4 \\
        --spec none,ngram,mtp --concurrency 1,8,32 --out docs/perf/cpu

For each (pp, spec) it starts ``ppspec serve``, runs ``ppspec bench`` at each concurrency,
reads the router's ``/metrics`` before and after (per-stage compute, the router's
pipeline step time, stage busy fraction), and writes one result JSON per run plus
``summary.md``: output tokens/s, TPOT, mean accept length, per-hop latency
((step wall time - sum of stage compute) / stages, i.e. one gRPC round trip per stage)
and each stage's busy fraction (stage compute seconds / run seconds).

Does not import torch: the servers are child processes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ppspec.router.serve import wait_healthy


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict:
    out: dict = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def pipeline_figures(before: dict, after: dict, pp: int, seconds: float) -> dict:
    """Per-hop latency (ms) and per-stage busy fraction from two scrapes of /metrics."""
    steps = wall = 0.0
    for mode in ("forward", "verify"):
        steps += delta(after, before, "ppspec:pipeline_step_latency_seconds_count", mode=mode)
        wall += delta(after, before, "ppspec:pipeline_step_latency_seconds_sum", mode=mode)
    busy, compute_total = [], 0.0
    for k in range(pp):
        c = sum(delta(after, before, "ppspec:stage_forward_latency_seconds_sum", mode=m, stage=k)
                for m in ("forward", "verify"))
        c += delta(after, before, "ppspec:stage_commit_latency_seconds_sum", stage=k)
        busy.append(c / seconds if seconds > 0 else None)
        compute_total += sum(delta(after, before, "ppspec:stage_forward_latency_seconds_sum", mode=m, stage=k)
                             for m in ("forward", "verify"))
    hop_ms = ((wall - compute_total) / steps / pp * 1000.0) if steps else None
    return {"micro_batch_steps": steps, "mean_step_ms": wall / steps * 1000.0 if steps else None,
            "per_hop_ms": hop_ms, "stage_busy_fraction": busy}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.matrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--pp", default="1,2,4")
    ap.add_argument("--spec", default="none,ngram,mtp")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompts-per-concurrency", type=int, default=2, help="num prompts = max(8, this x C)")
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--serve-args", default="", help="extra arguments for ppspec serve")
    ap.add_argument("--out", required=True)
    ap.add_argument("--label-prefix", default="")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    py = [sys.executable, "-m", "ppspec.cli"]
    for pp in [int(x) for x in a.pp.split(",")]:
        for spec in a.spec.split(","):
            port = _port()
            url = f"http://127.0.0.1:{port}"
            serve_cmd = py + ["serve", "--model", a.model, "--pp-size", str(pp), "--speculative-algorithm", spec,
                              "--port", str(port)] + a.serve_args.split()
            serve = subprocess.Popen(serve_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
            try:
                if not wait_healthy(url, serve, timeout=600):
                    raise SystemExit(f"serve PP{pp} {spec} did not start")
                for conc in [int(x) for x in a.concurrency.split(",")]:
                    label = f"{a.label_prefix}pp{pp}-{spec}"
                    res_path = out / f"{label}-c{conc}.json"
                    bench_cmd = py + [
                        "bench", "--base-url", url, "--dataset", "sharegpt",
                        "--num-prompts", str(max(8, a.prompts_per_concurrency * conc)),
                        "--max-concurrency", str(conc), "--seed", "0", "--tokenizer", a.model,
                        "--max-output-len", str(a.max_output_len), "--max-input-len", str(a.max_input_len),
                        "--label", label, "--output", str(res_path), "--no-progress",
                    ]
                    before = scrape(url)
                    t0 = time.monotonic()
                    subprocess.run(bench_cmd, check=True, stdout=subprocess.DEVNULL)
                    seconds = time.monotonic() - t0
                    after = scrape(url)
                    res = json.loads(res_path.read_text())
                    res["pipeline"] = pipeline_figures(before, after, pp, seconds)
                    res["serve_command"] = " ".join(serve_cmd[2:]).replace("ppspec.cli", "ppspec")
                    res_path.write_text(json.dumps(res, indent=2))
                    sd = res.get("spec_decode") or {}
                    rows.append(dict(pp=pp, spec=spec, conc=conc, tok_s=res["output_throughput"],
                                     tpot=res["tpot_ms"]["mean"], ttft=res["ttft_ms"]["p50"],
                                     accept=sd.get("mean_accept_length"), **res["pipeline"]))
                    print(f"PP{pp} {spec:5s} c={conc:<3d} {res['output_throughput']:8.1f} tok/s "
                          f"accept {sd.get('mean_accept_length')}", flush=True)
            finally:
                os.killpg(serve.pid, signal.SIGINT)
                try:
                    serve.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(serve.pid, signal.SIGKILL)
    lines = ["| PP | spec | concurrency | output tok/s | TPOT mean (ms) | TTFT p50 (ms) | mean accept length "
             "| per-hop (ms) | stage busy fraction |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
    for r in rows:
        busy = ", ".join(fmt(b) for b in r["stage_busy_fraction"])
        lines.append(f"| {r['pp']} | {r['spec']} | {r['conc']} | {fmt(r['tok_s'], '{:.1f}')} | {fmt(r['tpot'], '{:.1f}')} "
                     f"| {fmt(r['ttft'], '{:.0f}')} | {fmt(r['accept'])} | {fmt(r['per_hop_ms'])} | {busy} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
