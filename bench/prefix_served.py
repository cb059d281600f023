"""Issue 28's served prefix-caching targets in one run: ``python -m ppspec.bench.prefix_served``.

Starts ``ppspec serve`` with the prefix cache on (the default) and ``ppspec serve
--no-enable-prefix-caching``, the same checkpoint and settings otherwise, both at once,
and runs the ``ppspec bench`` client (``bench.runner``, ``bench.multiturn``) against each:

- ``first``: ShareGPT first turns only (no shared prefix, the peers' regression case),
  ``--first-prompts`` at concurrency ``--first-concurrency``: output tok/s and mean TTFT;
- ``shared``: ``--shared-prompts`` chat requests that share one system prompt of
  ``--shared-len`` tokens (``--shared-prefix-len``), at concurrency
  ``--shared-concurrency``, after one request with that system prompt (a deployed system
  prompt is cached before the measured traffic arrives; the uncached server gets the same
  request): mean TTFT, and where a hitting request's TTFT went by the router's own
  timestamps (``GET /v1/trace/first_tokens``, router/first_tokens.py: queued, admitted
  into a lane, its first micro-batch formed, sent, the result with its first token back;
  mean and median ms, micro-batches until the first token);
- ``mt1`` / ``mt32``: ShareGPT conversations replayed turn by turn (``--multi-turn``:
  each turn's prompt the chat so far), at concurrency 1 and ``--mt-concurrency``: mean
  TTFT of turns 2 and later, the hit rate of later turns, output tok/s.

Fairness: both servers are up and warmed up before anything is timed (``warm_up``:
``--warmup-prompts`` first turns, then a small run of every other workload on other
prompts, so that first-use compiles and graph captures of every path, hits included,
fall outside the figures); then each workload runs ``--repeats`` times on each server,
alternating off, on, on, off, ... (ABBA), so that neither side is always first, and the
table gives the ratio of the means with each pair's. The cache is flushed (``POST
/v1/cache/flush``) before every run, so that no run hits what an earlier one left.
Around each run the server's ``ppspec:prefix_cache_hits_total`` / ``queries_total`` are
read: the prompt tokens it reports hit must equal the sum of the responses'
``usage.prompt_tokens_details.cached_tokens`` (printed; ``hits_agree``). A failed request
is one whose stream carried no text, as in ``ppspec bench``; ``failed_no_text`` counts
those the server answered in full with tokens that decode to no text: a random checkpoint
whose ``vocab_size`` exceeds its tokenizer's (gpu_bench's 1.46B: 32000 ids, the demo
tokenizer's 8192) emits such replies, short ones most often, with the cache on or off.

``--round-trip-tokens``: a random checkpoint's replies are ids the tokenizer would not
produce for their text, so the next turn's prompt (the reply's text through the chat
template) differs from the ids generated and misses the finished row's snapshot. With
the flag every request samples only the tokenizer's word tokens (a space then letters)
that re-tokenize to themselves in any concatenation (``allowed_token_ids``; checked at
start, ``multiturn.round_trip_tokens``), as a trained model's replies do; printed with
the figures. It keeps the GPU's fused greedy MTP round out (a request with
``allowed_token_ids`` needs the host sampler), on both servers alike.

Prints a table of the on / off ratios against the issue's targets (later-turn TTFT at
most 0.3x, shared-system-prompt TTFT at most 0.2x, first turns within 3%), and writes
every figure to ``--output``. ``--cache on`` / ``off`` runs one server only (one run
under a per-command time limit); ``--compare ON.json OFF.json`` prints the table of two
such files (not a fair pair: run ``--cache both``).

GPU (one H200, the 1.46B checkpoint of docs/PERFORMANCE.md)::

    python -m ppspec.bench.prefix_served --model /tmp/qwen35-1b --device cuda --dtype bfloat16 --round-trip-tokens
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ppspec.bench.serving import first_token_mark, first_token_rows

WORKLOADS = ("first", "shared", "mt32", "mt1")


def cache_counters(url: str) -> tuple[int, int]:
    """``(queried, hit)`` prompt tokens of the server's prefix-cache counters (0, 0 when it
    exports none: caching off)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    got = {"ppspec:prefix_cache_queries": 0.0, "ppspec:prefix_cache_hits": 0.0}
    for fam in text_string_to_metric_families(text):
        if fam.name in got:
            got[fam.name] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return int(got["ppspec:prefix_cache_queries"]), int(got["ppspec:prefix_cache_hits"])


def first_token_path(got: dict) -> dict:
    """:func:`~ppspec.router.first_tokens.summarize` of the rows of ``got`` (a
    :func:`first_token_rows` answer), for the requests that hit the cache and the others."""
    from ppspec.router.first_tokens import summarize

    cached = got["fields"].index("cached_tokens")
    return {"hit": summarize([x for x in got["rows"] if x[cached] > 0], got["fields"]),
            "miss": summarize([x for x in got["rows"] if x[cached] == 0], got["fields"])}


def flush(url: str, cache: bool) -> None:
    if cache:
        r = httpx.post(url + "/v1/cache/flush", timeout=60)
        r.raise_for_status()


def warm_up(a, url: str, cache: bool, records: list[dict], counter, extra: dict | None) -> None:
    """What serving meets, before anything is timed: ``--warmup-prompts`` first turns at
    ``--first-concurrency``, then one small run of each other workload of ``a.workloads`` on
    other prompts (a burst of ``--shared-concurrency`` requests sharing the system prompt,
    ``--mt-concurrency`` conversations turn by turn): the prefill shapes with and without a
    hit, the restores and snapshots, and their first-use compiles and graph captures. The
    cache is flushed after."""
    from ppspec.bench.dataset import sample_sharegpt, shared_prefix
    from ppspec.bench.multiturn import run_multi_turn, sample_conversations
    from ppspec.bench.runner import RunConfig, run_benchmark
    from ppspec.bench.client import run as run_client

    if not a.warmup_prompts:
        return
    base = dict(base_url=url, progress=False, test_request=False, ignore_eos=True, seed=a.seed, extra_body=extra)
    samples = sample_sharegpt(records, a.warmup_prompts, a.seed + 99, counter, a.max_output_len, a.max_input_len)
    run_client(run_benchmark(RunConfig(max_concurrency=a.first_concurrency, **base), samples, counter.count,
                              counter.source))
    if "shared" in a.workloads:
        flush(url, cache)
        samples = sample_sharegpt(records, a.shared_concurrency + 1, a.seed + 98, counter, a.shared_output_len, 200)
        system = shared_prefix(records, a.shared_len, counter)
        for s in samples:
            s.system = system
        cfg = RunConfig(endpoint="chat", max_concurrency=a.shared_concurrency, **base)
        run_client(run_benchmark(cfg, samples[:1], counter.count, counter.source))
        run_client(run_benchmark(cfg, samples[1:], counter.count, counter.source))
    if "mt32" in a.workloads or "mt1" in a.workloads:
        flush(url, cache)
        conc = a.mt_concurrency if "mt32" in a.workloads else 1
        convs = sample_conversations(records, conc, a.seed + 97, counter, a.max_turns, a.max_output_len,
                                     a.max_input_len)
        run_client(run_multi_turn(RunConfig(endpoint="chat", max_concurrency=conc, **base), convs))
    flush(url, cache)


def run_workload(a, name: str, url: str, cache: bool, records: list[dict], counter, extra: dict | None) -> dict:
    """One run of workload ``name`` against the server at ``url`` (its cache flushed first):
    its figures. ``records``: ShareGPT (``dataset.load_sharegpt``); ``counter``: the
    model's ``TokenCounter``; ``extra``: more fields of every request (``allowed_token_ids``)."""
    from ppspec.bench.client import NO_TEXT_TOKENS
    from ppspec.bench.dataset import sample_sharegpt, shared_prefix
    from ppspec.bench.multiturn import run_multi_turn, sample_conversations
    from ppspec.bench.runner import RunConfig, run_benchmark
    from ppspec.bench.client import run as run_client

    base = dict(base_url=url, progress=False, test_request=False, ignore_eos=True, seed=a.seed, extra_body=extra)
    flush(url, cache)
    if name == "shared":
        system = shared_prefix(records, a.shared_len, counter)
        samples = sample_sharegpt(records, a.shared_prompts + 1, a.seed + 1, counter, a.shared_output_len, 200)
        for s in samples:
            s.system = system
        cfg = RunConfig(endpoint="chat", max_concurrency=a.shared_concurrency, **base)
        run_client(run_benchmark(cfg, samples[:1], counter.count, counter.source))  # the system prompt cached
        q0, h0 = cache_counters(url)
        mark = first_token_mark(url)
        r = run_client(run_benchmark(cfg, samples[1:], counter.count, counter.source))
        path = first_token_path(first_token_rows(url, mark))
    else:
        q0, h0 = cache_counters(url)
        if name == "first":
            samples = sample_sharegpt(records, a.first_prompts, a.seed, counter, a.max_output_len, a.max_input_len)
            r = run_client(run_benchmark(RunConfig(max_concurrency=a.first_concurrency, **base), samples,
                                          counter.count, counter.source))
        else:
            conc = 1 if name == "mt1" else a.mt_concurrency
            convs = sample_conversations(records, a.mt_conversations if conc > 1 else a.mt1_conversations,
                                         a.seed + 2, counter, a.max_turns, a.max_output_len, a.max_input_len)
            r = run_client(run_multi_turn(RunConfig(endpoint="chat", max_concurrency=conc, **base), convs))
    q1, h1 = cache_counters(url)
    rows = r.pop("turns", None) or r.pop("_per_request")
    later = [x for x in rows if x.get("turn", 1) > 0 and x["success"]]
    # every response that reported its usage, a turn the client counts failed included
    # (a reply with no text); the server counts every request that ran a micro-batch
    usage_cached = sum(x.get("cached_tokens") or 0 for x in rows)
    # failed turns the server answered in full, with tokens that decode to no text (a
    # random checkpoint's ids past its tokenizer's vocabulary): not server errors
    no_text = sum(1 for x in rows if not x["success"] and (x.get("error") or "").endswith(NO_TEXT_TOKENS))
    fig = {
        "output_tok_s": r["output_throughput"],
        "ttft_ms": (r["ttft_later_turns_ms"] if name.startswith("mt") else r["ttft_ms"])["mean"],
        "hit_rate": r.get("hit_rate_later_turns"),
        "requests": len(rows), "failed": r["failed"], "failed_no_text": no_text,
        "later_turns": len(later) if name.startswith("mt") else None,
        "server_queried": q1 - q0, "server_hit": h1 - h0, "usage_cached": usage_cached,
        "errors": r.get("errors", []),
    }
    fig["hits_agree"] = fig["server_hit"] == usage_cached
    if name == "shared":
        # the client's TTFT of the same hitting requests: what the router's stamps leave out
        # is the HTTP side (chat template, the engine process's hop, detokenization, SSE)
        import statistics

        client = [x["ttft_ms"] for x in rows if x["success"] and (x.get("cached_tokens") or 0) > 0]
        path["hit"]["client_ttft"] = (statistics.fmean(client), statistics.median(client)) if client else None
        fig["first_token_path"] = path
    if name.startswith("mt"):  # each turn's [conversation, turn, prompt, cached, output tokens]
        fig["turns"] = [[x["conversation"], x["turn"], x["prompt_tokens"], x["cached_tokens"], x["output_tokens"]]
                        for x in sorted(rows, key=lambda x: (x["conversation"], x["turn"]))]
    print(f"  {'on ' if cache else 'off'} {name:6s}: {fig['output_tok_s']:8.1f} output tok/s, TTFT mean "
          f"{fig['ttft_ms']:8.1f} ms{' (turns 2+)' if name.startswith('mt') else ''}, hit "
          f"{fig['server_hit']} of {fig['server_queried']} prompt tokens (responses' cached_tokens "
          f"{usage_cached}), {fig['failed']} failed"
          f"{f' ({no_text} of them replies that decode to no text)' if no_text else ''}", flush=True)
    for e in fig["errors"]:
        print(f"      error: {e}", flush=True)
    if name == "shared":
        from ppspec.router.first_tokens import format_summary

        print(format_summary(path["hit"], "where a hitting request's TTFT went (the router's timestamps)"))
        if path["hit"].get("client_ttft"):
            print(f"      {'the client TTFT of the same requests':52s} {path['hit']['client_ttft'][0]:8.1f} / "
                  f"{path['hit']['client_ttft'][1]:8.1f} ms")
        print(format_summary(path["miss"], "the requests that hit nothing"), flush=True)
    return fig


def combine(runs: list[dict]) -> dict:
    """One server's figures of a workload over its runs: TTFT, output tok/s and hit rate
    averaged (the runs are the same requests), counts summed; ``runs``: each run's."""
    if len(runs) == 1:
        return {**runs[0], "runs": runs}

    def mean(key):
        vals = [r[key] for r in runs]
        return None if any(v is None for v in vals) else sum(vals) / len(vals)

    out = {k: mean(k) for k in ("output_tok_s", "ttft_ms", "hit_rate")}
    for k in ("requests", "failed", "failed_no_text", "server_queried", "server_hit", "usage_cached"):
        out[k] = sum(r[k] for r in runs)
    out["later_turns"] = runs[0]["later_turns"]
    out["errors"] = sorted({e for r in runs for e in r["errors"]})[:10]
    out["hits_agree"] = all(r["hits_agree"] for r in runs)
    out["runs"] = runs
    return out


def abba(repeats: int) -> list[str]:
    """The order of a workload's runs on the two servers: off, on, on, off, off, on, ...
    (``repeats`` runs each; a drift in time, a first run's cold start, falls on both)."""
    order = []
    for p in range(repeats):
        order += ["off", "on"] if p % 2 == 0 else ["on", "off"]
    return order


def serve_args(a, cache: bool) -> list[str]:
    model = os.path.abspath(a.model) if os.path.exists(a.model) else a.model
    args = ["--model", model, "--device", a.device, "--dtype", a.dtype, "--speculative-algorithm", a.spec,
            "--pp-size", str(a.pp_size), "--kv-tokens", str(a.kv_tokens), "--max-rows", str(a.max_rows)]
    if a.device == "cpu":
        args += ["--num-threads", str(a.num_threads)]
    args += ["--prefix-cache-gb", str(a.prefix_cache_gb)] if cache else ["--no-enable-prefix-caching"]
    return args + a.serve_args.split()


TARGETS = [  # (workload, figure, label, target text, passes(on / off))
    ("mt1", "ttft_ms", "multi-turn c1: TTFT turns 2+", "<= 0.3x", lambda x: x <= 0.3),
    ("mt32", "ttft_ms", "multi-turn c32: TTFT turns 2+", "<= 0.3x", lambda x: x <= 0.3),
    ("mt1", "output_tok_s", "multi-turn c1: output tok/s", "", None),
    ("mt32", "output_tok_s", "multi-turn c32: output tok/s", "", None),
    ("shared", "ttft_ms", "shared system prompt: TTFT", "<= 0.2x", lambda x: x <= 0.2),
    ("first", "output_tok_s", "first turns: output tok/s", ">= 0.97x", lambda x: x >= 0.97),
    ("first", "ttft_ms", "first turns: TTFT", "<= 1.03x", lambda x: x <= 1.03),
]


def table(on: dict, off: dict) -> str:
    lines = ["| figure | off | on | on / off | each pair | target | met |", "|---|---|---|---|---|---|---|"]
    for w, key, label, target, ok in TARGETS:
        if w not in on or w not in off:
            continue
        a, b = off[w][key], on[w][key]
        ratio = b / a if a else float("nan")
        met = "" if ok is None else ("yes" if ok(ratio) else "**no**")
        pairs = [(x[key], y[key]) for x, y in zip(off[w].get("runs", []), on[w].get("runs", []))]
        each = ", ".join(f"{y / x:.3f}x" if x else "nan" for x, y in pairs) if len(pairs) > 1 else ""
        lines.append(f"| {label} | {a:.1f} | {b:.1f} | {ratio:.3f}x | {each} | {target} | {met} |")
    for w in ("mt1", "mt32"):
        if w in on:
            hr = on[w]["hit_rate"]
            lines.append(f"| {w}: hit rate turns 2+ (on) | | {'n/a' if hr is None else f'{100 * hr:.1f}%'} | | | | |")
    bad = [f"{name} {w}" for name, figs in (("on", on), ("off", off)) for w, f in figs.items() if not f["hits_agree"]]
    lines.append(f"server hit counters against the responses' cached_tokens: "
                 f"{'agree in every workload' if not bad else 'DISAGREE in ' + ', '.join(bad)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.prefix_served", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the demo model; with --tiny, made)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU: a random 4-layer hidden-64 checkpoint with an MTP head (served_vs_engine's), made in a "
                         "temporary folder: a round's fixed cost outweighs its compute and replies do not re-tokenize "
                         "to their ids, as with the random 1.46B on the H200")
    ap.add_argument("--tiny-vocab-size", type=int, default=8192,
                    help="with --tiny, the checkpoint's vocab_size: 8192 is the demo tokenizer's; 32000 is the "
                         "H200's random 1.46B's, whose ids from 8192 on decode to no text")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--spec", default="mtp", choices=("none", "ngram", "mtp"))
    ap.add_argument("--pp-size", type=int, default=1)
    ap.add_argument("--kv-tokens", type=int, default=262144, help="KV cache of each stage, in tokens")
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--prefix-cache-gb", type=float, default=4.0)
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads per stage (CPU)")
    ap.add_argument("--serve-args", default="", help="more arguments for ppspec serve")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--cache", default="both", choices=("both", "on", "off"),
                    help="which servers to run: both are started and warmed up before any workload, whose runs "
                         "then alternate between them (--repeats)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each workload on each server; with --cache both in the order off on on off "
                         "off on ... (ABBA), the on / off ratio of their means printed with each pair's")
    ap.add_argument("--round-trip-tokens", action="store_true",
                    help="every request samples only the tokenizer's word tokens whose concatenations re-tokenize "
                         "to their ids (allowed_token_ids): a random checkpoint's replies then come back in the "
                         "next turn's prompt as the ids it generated, as a trained model's do")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--warmup-prompts", type=int, default=64,
                    help="first turns before the workloads, then a small run of each (not measured); 0: no warm-up")
    ap.add_argument("--first-prompts", type=int, default=256)
    ap.add_argument("--first-concurrency", type=int, default=32)
    ap.add_argument("--shared-prompts", type=int, default=64)
    ap.add_argument("--shared-len", type=int, default=2000, help="system prompt tokens")
    ap.add_argument("--shared-concurrency", type=int, default=16)
    ap.add_argument("--shared-output-len", type=int, default=64)
    ap.add_argument("--mt-conversations", type=int, default=64, help="conversations at --mt-concurrency")
    ap.add_argument("--mt-concurrency", type=int, default=32)
    ap.add_argument("--mt1-conversations", type=int, default=16, help="conversations at concurrency 1")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--output", default="prefix_served.json", help="the figures, as JSON")
    ap.add_argument("--compare", nargs=2, metavar=("ON.json", "OFF.json"), help="print the table of two runs' files")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {a.repeats}")
    if a.compare:
        on, off = (json.load(open(p))["results"] for p in a.compare)
        print(table(on.get("on", {}), off.get("off", {})))
        return 0
    from ppspec.bench.dataset import TokenCounter, load_sharegpt
    from ppspec.bench.serving import serving_all
    from ppspec.router.llm import DEMO_MODEL

    if a.tiny and not a.model:
        import tempfile

        from ppspec.bench.served_vs_engine import make_tiny

        a.model = make_tiny(os.path.join(tempfile.mkdtemp(), "tiny"), vocab_size=a.tiny_vocab_size)
    a.model = a.model or DEMO_MODEL
    records, counter = load_sharegpt(), TokenCounter(a.model)
    extra, words = None, None
    if a.round_trip_tokens:
        from ppspec.bench.multiturn import round_trip_tokens

        if counter.source != "tokenizer":
            raise SystemExit(f"--round-trip-tokens: no tokenizer.json in {a.model}")
        vocab = None  # the checkpoint's, when its config says (ids past it are refused)
        if os.path.isfile(os.path.join(a.model, "config.json")):
            with open(os.path.join(a.model, "config.json")) as f:
                cfg = json.load(f)
            vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
        words = round_trip_tokens(counter._tok, vocab)
        extra = {"allowed_token_ids": words}
    sampling = (f"replies sampled from {len(words)} word tokens that re-tokenize to their ids "
                f"(--round-trip-tokens: allowed_token_ids)" if words else "replies sampled from the whole vocabulary")
    print(f"prefix_served: {sampling}", flush=True)
    names = ("off", "on") if a.cache == "both" else (a.cache,)
    runs: dict[str, dict[str, list]] = {n: {w: [] for w in a.workloads} for n in names}
    # every server up (started side by side) and warmed up before anything is timed
    with serving_all([(serve_args(a, n == "on"), f"prefix-{n}") for n in names], a.startup_timeout) as up:
        urls = {n: url for n, (url, _) in zip(names, up)}
        for name in names:
            warm_up(a, urls[name], name == "on", records, counter, extra)
        order = abba(a.repeats) if a.cache == "both" else [a.cache] * a.repeats
        for w in a.workloads:
            for name in order:
                runs[name][w].append(run_workload(a, w, urls[name], name == "on", records, counter, extra))
    results = {n: {w: combine(rs) for w, rs in by_w.items()} for n, by_w in runs.items()}
    with open(a.output, "w") as f:
        json.dump({"command": "python -m ppspec.bench.prefix_served " + " ".join(argv or sys.argv[1:]),
                   "sampling": sampling, "order": order, "results": results}, f, indent=1)
    if len(results) == 2:
        print(f"on / off, {a.repeats} run(s) each in the order {' '.join(order)} per workload; {sampling}")
        print(table(results["on"], results["off"]))
    print(f"figures written to {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
