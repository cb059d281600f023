"""Paged attention of decode and verify on the GPU: the Triton kernel with its KV split
into shares (flash-decoding, ``attention/gpu.py``) against the same kernel unsplit, one
layer, bf16, output gate on. Prints numbers; asserts only that both agree within bf16
error.

    python3 kernels/bench_decode_attention.py [--batches 1 16 64 256] [--context 1024] [--queries 1 4]
        [--sweep 1 2 4 8 16 32]

``--sweep`` also times each given share count, to check the rule ``gpu.kv_splits`` follows.

Each case is ``batch`` requests of ``queries`` tokens (1: decode, 4: a verify of 3 drafts)
after ``context`` cached tokens (rows and pages scattered, page size 16), for Qwen3.5-sized
heads (16 query heads, 2 KV heads, head dim 256). Bytes are the K and V the step must read
(``2 * batch * (context + queries) * Hkv * hd * 2``); GB/s against the device-to-device
copy bandwidth measured in the same run (``bench_verify.copy_bandwidth``). Times are
medians of ``triton.testing.do_bench`` over replays of a CUDA graph of the call (as the
stages run decode and verify), so Python's launch time is not counted.
"""
from __future__ import annotations

import argparse
import os
import sys

try:
    import ppspec.kernels  # noqa: F401
except ImportError:  # a bare checkout (the GPU machine): map the folders as pyproject does
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, _root)
    import ppspec

    ppspec.__path__.append(_root)

import torch
import triton

from ppspec.kernels.attention import gpu
from ppspec.kernels.bench_prefill_attention import case
from ppspec.kernels.bench_verify import copy_bandwidth


def _graphed(fn):
    """``fn`` captured in a CUDA graph, as the stages run decode and verify: the replay
    times the kernels, not Python's launches. Returns (replay, output)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    torch.cuda.synchronize()
    return g.replay, out


def _timed(run, splits: int | None):
    """(microseconds per graphed call, output) with the share count forced to ``splits``
    (None: the kernel's own choice, ``gpu.kv_splits``)."""
    chosen = gpu.kv_splits
    if splits is not None:
        gpu.kv_splits = lambda *a, **k: splits
    try:
        replay, out = _graphed(run)
        return triton.testing.do_bench(replay) * 1e3, out
    finally:
        gpu.kv_splits = chosen


def bench(B: int, L: int, ctx: int, heads=(16, 2, 256), sweep=()) -> dict:
    """The kernel's choice of shares against no split, and each share count of ``sweep``."""
    args, gate, _ = case(B, L, ctx, *heads)
    run = lambda: gpu.paged_attention_gpu(*args, gate=gate)  # noqa: E731
    splits = gpu.kv_splits(B * heads[1], args[0].device)
    t_split, o_split = _timed(run, None)
    t_one, o_one = _timed(run, 1)
    err = float((o_split.double() - o_one.double()).norm() / o_one.double().norm())
    assert err < 1e-2, err
    _, Hkv, hd = heads
    nbytes = 2 * B * (ctx + L) * Hkv * hd * 2
    swept = {s: _timed(run, s)[0] for s in sweep}
    return dict(B=B, L=L, splits=splits, one_us=t_one, split_us=t_split, one_gbs=nbytes / t_one / 1e3,
                split_gbs=nbytes / t_split / 1e3, rel_diff=err, swept=swept)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--sweep", type=int, nargs="*", default=[],
                    help="also time these share counts (e.g. 1 2 4 8 16 32)")
    a = ap.parse_args(argv)
    copy_gbs = copy_bandwidth()[0] / 1e9
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s; context {a.context}, heads 16/2/256, bf16\n")
    sweep_cols = "".join(f" {s} shares (us) |" for s in a.sweep)
    print(f"| batch | queries | splits | unsplit (us) | split (us) | unsplit GB/s (% copy) | split GB/s (% copy) "
          f"| speed-up |{sweep_cols}")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(a.sweep))
    for L in a.queries:
        for B in a.batches:
            r = bench(B, L, a.context, sweep=a.sweep)
            swept = "".join(f" {r['swept'][s]:.1f} |" for s in a.sweep)
            print(f"| {B} | {L} | {r['splits']} | {r['one_us']:.1f} | {r['split_us']:.1f} | "
                  f"{r['one_gbs']:.0f} ({r['one_gbs'] / copy_gbs:.0%}) | {r['split_gbs']:.0f} "
                  f"({r['split_gbs'] / copy_gbs:.0%}) | {r['one_us'] / r['split_us']:.2f}x |{swept}", flush=True)


if __name__ == "__main__":
    main()
