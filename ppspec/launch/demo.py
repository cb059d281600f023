"""``ppspec demo`` (``make run``): serve the demo model with PP2 + MTP, send a few ShareGPT
prompts through the OpenAI API, print the answers and the accept length, keep serving."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import httpx

from ppspec.argtypes import DEMO_MODEL, listen_error, port, positive_int
from ppspec.launch.serve import wait_healthy
from ppspec.lifetime import die_with


def accept_stats(url: str) -> tuple[float | None, list[float]]:
    """Mean accept length (1 + accepted / drafts) and per-position acceptance from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    vals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "ppspec:spec_decode_num_accepted_tokens_per_pos_total":
                per_pos[int(s.labels["position"])] = s.value
            elif s.name.startswith("ppspec:spec_decode_num_") and s.name.endswith("_total"):
                vals[s.name] = s.value
    drafts = vals.get("ppspec:spec_decode_num_drafts_total", 0.0)
    if not drafts:
        return None, []
    mean = 1.0 + vals.get("ppspec:spec_decode_num_accepted_tokens_total", 0.0) / drafts
    return mean, [per_pos[k] / drafts for k in sorted(per_pos)]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ppspec demo", description=__doc__)
    ap.add_argument("--model", default=DEMO_MODEL, help="checkpoint folder (default: the demo model)")
    ap.add_argument("--pp-size", type=positive_int, default=2, help="pipeline stages (default: 2)")
    ap.add_argument("--speculative-algorithm", default="mtp", choices=["none", "ngram", "mtp"],
                    help="draft source (default: mtp)")
    ap.add_argument("--port", type=port, default=8000, help="port of the HTTP API (default: 8000)")
    ap.add_argument("--num-prompts", type=positive_int, default=4, help="ShareGPT prompts to send (default: 4)")
    ap.add_argument("--max-tokens", type=positive_int, default=96, help="max_tokens of each (default: 96)")
    ap.add_argument("--no-keep-serving", action="store_true", help="exit after the demo prompts")
    a = ap.parse_args(argv)
    url = f"http://127.0.0.1:{a.port}"
    # serve refuses a busy port too, but another server there answers /health before serve
    # has exited: the demo would take it for its own and send it the prompts
    err = listen_error("127.0.0.1", a.port)
    if err:
        print(f"ppspec demo: {err}", file=sys.stderr)
        return 2
    # SIGTERM (a supervisor, `kill`) ends the demo like Ctrl-C: the server below is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # die_with: a demo killed outright (SIGKILL, no finally below) still stops the server
    serve = subprocess.Popen([sys.executable, "-m", "ppspec.cli", "serve", "--model", a.model, "--pp-size",
                              str(a.pp_size), "--speculative-algorithm", a.speculative_algorithm, "--port", str(a.port)],
                             preexec_fn=die_with(os.getpid()))
    try:
        if not wait_healthy(url, serve, timeout=600):
            print(f"ppspec demo: the server did not become healthy (exit code {serve.poll()})", file=sys.stderr)
            return 1
        from openai import OpenAI

        from ppspec.bench.dataset import first_exchange, load_sharegpt

        client = OpenAI(base_url=url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        prompts = []
        for rec in load_sharegpt():
            pair = first_exchange(rec)
            if pair and 20 <= len(pair[0]) <= 300:
                prompts.append(pair[0])
            if len(prompts) == a.num_prompts:
                break
        for i, p in enumerate(prompts, 1):
            t0 = time.monotonic()
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                               max_tokens=a.max_tokens, temperature=0.0)
            dt = time.monotonic() - t0
            n = r.usage.completion_tokens
            print(f"\n[{i}] user: {p.strip()}\n[{i}] assistant ({n} tokens, {n / dt:.1f} tok/s): "
                  f"{r.choices[0].message.content.strip()}")
        mean, per_pos = accept_stats(url)
        if mean is not None:
            print(f"\nmean accept length {mean:.2f}; acceptance per draft position "
                  + ", ".join(f"{x:.2f}" for x in per_pos))
        if a.no_keep_serving:
            return 0
        print(f"\nserving on {url}/v1 (OpenAI API; metrics at {url}/metrics); Ctrl-C to stop", flush=True)
        return serve.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGINT)
            try:
                serve.wait(20)
            except subprocess.TimeoutExpired:
                serve.kill()
