"""Latency statistics and the server's speculative-decoding counters.

Percentiles interpolate linearly between the two nearest ranks (numpy's default).
Spec-decode figures come from the Prometheus counters a ppspec router exports (names
in the style of vLLM's), read before and after the run; the difference covers the
benchmark's own requests:

* mean accept length = 1 + accepted / drafts (tokens emitted per verify round: the
  accepted draft tokens plus the one token the target model always contributes);
* acceptance rate = accepted / draft tokens;
* acceptance at draft position i = accepted at position i / drafts.

A counter the server does not export gives ``null``. Counters are summed over every
other label (stage, model name, ...).
"""
from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

DEFAULT_PREFIX = "ppspec:"  # vLLM exports the same counters under "vllm:"
NUM_DRAFTS = "spec_decode_num_drafts_total"
NUM_DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
NUM_ACCEPTED = "spec_decode_num_accepted_tokens_total"
NUM_ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: list[float], p: float) -> float:
    """The p-th percentile (0..100) of an ascending list, linear interpolation."""
    if not sorted_values:
        raise ValueError("percentile of an empty list")
    k = (len(sorted_values) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarize_ms(values_s: list[float]) -> dict:
    """mean, std, p50, p90, p99 in milliseconds of values given in seconds (nulls if empty)."""
    keys = ["mean", "std"] + [f"p{p}" for p in PERCENTILES]
    if not values_s:
        return {k: None for k in keys}
    v = sorted(x * 1000.0 for x in values_s)
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / len(v))
    out = {"mean": mean, "std": std}
    out.update({f"p{p}": percentile(v, p) for p in PERCENTILES})
    return out


def parse_spec_counters(text: str, prefix: str = DEFAULT_PREFIX) -> dict:
    """The spec-decode counters (``<prefix>spec_decode_...``) of a Prometheus text exposition.

    Returns ``{"drafts", "draft_tokens", "accepted": float | None,
    "per_pos": {position: float} | None}``; None where the metric is absent.
    Raises ``ValueError`` when the text is not Prometheus' format.
    """
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    totals = {prefix + n: n for n in (NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED)}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in totals:
                key = totals[s.name]
                sums[key] = sums.get(key, 0.0) + float(s.value)
            elif s.name == prefix + NUM_ACCEPTED_PER_POS:
                try:
                    pos = int(s.labels.get("position", ""))
                except ValueError:
                    continue
                per_pos[pos] = per_pos.get(pos, 0.0) + float(s.value)
    return {
        "drafts": sums.get(NUM_DRAFTS),
        "draft_tokens": sums.get(NUM_DRAFT_TOKENS),
        "accepted": sums.get(NUM_ACCEPTED),
        "per_pos": per_pos or None,
    }


def spec_decode_summary(before: dict | None, after: dict | None, error: str | None = None) -> dict:
    """Differences of the counters across the run and the figures derived from them.

    ``before`` / ``after`` are ``parse_spec_counters`` results, or None when /metrics
    could not be read (then every figure is null and ``metrics_error`` says why). A
    counter missing before the run but present after it started at 0 (counters with
    labels appear on first use).
    """
    out = {
        "num_drafts": None,
        "num_draft_tokens": None,
        "num_accepted_tokens": None,
        "mean_accept_length": None,
        "acceptance_rate": None,
        "accepted_per_position": None,
        "acceptance_per_position": None,
        "metrics_error": error,
    }
    if before is None or after is None:
        return out

    def delta(key):
        a = after.get(key)
        return None if a is None else a - (before.get(key) or 0.0)

    drafts, draft_tokens, accepted = delta("drafts"), delta("draft_tokens"), delta("accepted")
    out.update(num_drafts=drafts, num_draft_tokens=draft_tokens, num_accepted_tokens=accepted)
    if drafts and accepted is not None:
        out["mean_accept_length"] = 1.0 + accepted / drafts
    if draft_tokens and accepted is not None:
        out["acceptance_rate"] = accepted / draft_tokens
    if after.get("per_pos"):
        b = before.get("per_pos") or {}
        a = after["per_pos"]
        n = max(a) + 1
        acc = [a.get(i, 0.0) - b.get(i, 0.0) for i in range(n)]
        out["accepted_per_position"] = acc
        if drafts:
            out["acceptance_per_position"] = [x / drafts for x in acc]
    return out


def compute_results(results, samples, duration: float, counter_source: str, count_tokens,
                    start: float = 0.0) -> dict:
    """Aggregate per-request ``RequestResult``s into the benchmark's figures.

    ``samples`` are the ``SampleRequest``s in the same order; ``count_tokens`` counts
    the tokens of a text when the server reported no usage; ``start`` is the run's start on
    the requests' clock (seconds): each row's ``send_s`` is its request's send time after it.
    """
    ttfts, tpots, itls, e2els = [], [], [], []
    total_in = total_out = completed = chunks = 0
    in_src, out_src = set(), set()
    per_request = []
    for res, sample in zip(results, samples):
        row = {
            "prompt_len": sample.prompt_len,
            "output_len": sample.output_len,
            "success": res.success,
            "error": res.error,
            "send_s": res.start - start,
            "cached_tokens": res.cached_tokens,  # usage.prompt_tokens_details (a prefix cache), or None
        }
        if res.success:
            completed += 1
            if res.prompt_tokens is not None:
                n_in = int(res.prompt_tokens)
                in_src.add("server")
            else:
                n_in = sample.prompt_len
                in_src.add(counter_source)
            if res.completion_tokens is not None:
                n_out = int(res.completion_tokens)
                out_src.add("server")
            else:
                n_out = count_tokens(res.text)
                out_src.add(counter_source)
            total_in += n_in
            total_out += n_out
            chunks += res.num_chunks
            ttfts.append(res.ttft)
            e2els.append(res.e2el)
            itls.extend(res.itl)
            tpot = (res.e2el - res.ttft) / (n_out - 1) if n_out > 1 else None
            if tpot is not None:
                tpots.append(tpot)
            row.update(
                input_tokens=n_in,
                output_tokens=n_out,
                chunks=res.num_chunks,
                ttft_ms=res.ttft * 1e3,
                tpot_ms=None if tpot is None else tpot * 1e3,
                e2el_ms=res.e2el * 1e3,
                itl_ms=[x * 1e3 for x in res.itl],
            )
        per_request.append(row)

    def rate(x):
        return x / duration if duration > 0 else None

    def source(s):
        return None if not s else s.pop() if len(s) == 1 else "mixed"

    return {
        "duration_s": duration,
        "completed": completed,
        "failed": len(results) - completed,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(completed),
        "input_throughput": rate(total_in),
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
        "mean_concurrency": rate(sum(e2els)),
        "tokens_per_chunk": total_out / chunks if chunks else None,
        "token_count_source": {"input": source(in_src), "output": source(out_src)},
        "ttft_ms": summarize_ms(ttfts),
        "tpot_ms": summarize_ms(tpots),
        "itl_ms": summarize_ms(itls),
        "e2el_ms": summarize_ms(e2els),
        "_per_request": per_request,
    }


# the router's stamps of a request's path to its first token (router/first_tokens.py), each
# segment from the stamp before it: (key, the stamps it spans, what it is)
ROUTER_SEGMENTS = (
    ("queued_ms", ("arrival", "admitted"), "queued until admitted"),  # into a lane: a row, its KV
    ("admitted_ms", ("admitted", "sent"), "admitted until sent"),  # its first micro-batch
    ("sent_ms", ("sent", "back"), "sent until first token back"),
    ("router_ttft_ms", ("arrival", "back"), "queued until first token back"),
)


def router_ttft_summary(got: dict) -> dict | None:
    """:func:`summarize_ms` of each of :data:`ROUTER_SEGMENTS` over the rows of a ppspec
    router's ``GET /v1/trace/first_tokens`` answer ``got`` (``fields``, ``rows``; stamps in
    seconds of the router's clock), and ``n``, the rows; None without rows. The client's TTFT
    less ``router_ttft_ms`` is the HTTP edge's and the client's own share."""
    fields, rows = got.get("fields") or [], got.get("rows") or []
    if not rows:
        return None
    ix = {f: i for i, f in enumerate(fields)}
    out: dict = {"n": len(rows)}
    for key, (a, b), _ in ROUTER_SEGMENTS:
        out[key] = summarize_ms([r[ix[b]] - r[ix[a]] for r in rows])
    return out

