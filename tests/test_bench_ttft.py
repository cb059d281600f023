"""``served_vs_engine``'s long-prompt TTFT (prompts that share no prefix-cache snapshot,
the median of three after one untimed, and the served figure against the engine's of the
same run in the report: ratio and difference) and ``request_path``'s table."""
from __future__ import annotations

import argparse

from ppspec.bench.served_vs_engine import long_prompt, report, ttft_figures


def test_long_prompts_differ_in_their_first_id_only():
    a, b = long_prompt(8000, 1), long_prompt(8000, 2)
    assert len(a) == 8000 and a[1:] == b[1:] and a[0] != b[0]
    assert long_prompt(8000, 0)[1:] == [(7 * i) % 8000 + 100 for i in range(1, 8000)]
    assert max(max(long_prompt(8000, k)) for k in range(4)) < 8192  # the tiny checkpoint's vocabulary


def test_ttft_is_the_median_of_three_after_an_untimed_one():
    sent, seconds = [], iter([9.0, 0.3, 0.1, 0.2])

    def time_one(ids):
        sent.append(ids[0])
        return next(seconds)

    assert ttft_figures(time_one, 16) == 0.2  # the 9 s of the first is left out
    assert sent == [8100, 8101, 8102, 8103]


def fake_served(ttft_s):
    cpu = {"rounds": 10, "tokens": 10, "scheduled_tokens": 10, "graph": 0, "eager": 10}
    for part in ("router", "engine", "stages"):
        cpu[f"{part}_round_s"] = cpu[f"{part}_token_s"] = 0.001
    return {"tok_s": 100.0, "solo_tok_s": 50.0, "tpot_s": 0.002, "long_ttft_s": ttft_s, "first_s": 1.0,
            "steady_s": 1.0, "failed": 0, "cpu": cpu, "solo_cpu": cpu, "queued_tok_s": 95.0, "client_busy": 0.25,
            "cold_tok_s": 80.0, "ttft_split": (40.0, 12.5, None)}


def test_the_report_gives_the_served_ttft_against_the_engines():
    a = argparse.Namespace(model="m", device="cpu", dtype="float32", spec="none", num_prompts=4, max_tokens=8,
                           max_rows=8, concurrency=4, long_prompt=8000, engine_prefix_caching=False)
    eng = {"tok_s": 100.0, "solo_tok_s": 50.0, "round_s": 0.002, "solo_tokens_per_round": 1.0,
           "tokens_per_round": 4.0, "closed_tokens_per_round": 4.0, "closed_tok_s": 90.0, "cpu_round_s": 0.001,
           "cpu_token_s": 0.001, "long_ttft_s": 0.055}
    text = report(a, eng, {"served": {1: fake_served(0.100), 2: fake_served(0.121)}})
    lines = text.splitlines()
    assert "TTFT of 8000 tokens 55.0 ms (prefix caching off)" in lines[2]
    assert "| served / engine TTFT, 8000-token prompt, PP1 | - | 1.82 |" in lines  # 100 / 55
    assert "| PP1 TTFT 8000 tokens less the engine's (ms) | 45.0 |" in lines
    assert "| PP2 TTFT 8000 tokens less the engine's (ms) | 66.0 |" in lines
    assert "| PP2 / PP1 TTFT, 8000-token prompt | <= 1.1 | 1.21 |" in lines
    # every prompt at once against the engine's all-queued run (95 / 100); the client's CPU
    assert "| served / engine tok/s, PP1, every prompt sent at once (the server's queue: no client turnaround) | - | 0.95 |" \
        in lines
    assert "| PP1 the benchmark client's CPU busy fraction c4 | 0.25 |" in lines
    # the untimed first pass at the closed loop's concurrency against the timed one (80 / 100)
    assert "| the first pass at concurrency 4 after start / the timed one, tok/s, PP2 | - | 0.80 |" in lines
    # the closed loop's TTFT: the client's, the router's, its wait for admission (no stamps: -)
    assert "| PP1 TTFT c4, mean ms: the client's / the router's (queued until its first token back) / of it queued " \
           "until admitted | 40.0 / 12.5 / - |" in lines


def test_the_ttft_split_reads_the_clients_and_the_routers_means():
    from ppspec.bench.served_vs_engine import ttft_split

    res = {"ttft_ms": {"mean": 30.0}, "router_ttft": {"n": 2, "router_ttft_ms": {"mean": 8.0, "median": 7.0},
                                                       "queued_ms": {"mean": 1.5}}}
    assert ttft_split(res) == (30.0, 8.0, 1.5)
    assert ttft_split({"ttft_ms": {"mean": 30.0}, "router_ttft": None}) == (30.0, None, None)


def test_request_path_times_every_step_and_sums_them():
    from ppspec.bench.request_path import measure, table

    figures = measure([40, 700], repeats=2)
    assert list(figures) == [40, 700] and len(figures[40]) == 14
    assert all(v > 0 for f in figures.values() for v in f.values())
    lines = table(figures).splitlines()
    assert lines[0] == "| step (median us) | 40 ids | 700 ids |" and len(lines) == 2 + 14 + 1
    assert lines[-1] == f"| sum | {sum(figures[40].values()):.1f} | {sum(figures[700].values()):.1f} |"


def test_serving_order_alternates_and_names_each_pass():
    """``--repeat``: every server once per pass, each other pass reversed, named by pass;
    one pass keeps the plain names."""
    from ppspec.bench.served_vs_engine import serving_order

    runs = [("served", None, ""), ("baseline", "/b", ""), ("nofreeze", None, "--no-gc-freeze")]
    assert serving_order(runs, 1) == runs
    assert [n for n, *_ in serving_order(runs, 3)] == [
        "served #1", "baseline #1", "nofreeze #1", "nofreeze #2", "baseline #2", "served #2",
        "served #3", "baseline #3", "nofreeze #3"]
    assert serving_order(runs, 2)[3] == ("nofreeze #2", None, "--no-gc-freeze")
