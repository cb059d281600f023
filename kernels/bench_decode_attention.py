"""Paged attention of decode and verify on the GPU: the Triton kernel with its KV split
into shares (flash-decoding, ``attention/gpu.py``) against the same kernel unsplit, one
layer, bf16, output gate on. Prints numbers; asserts only that both agree within bf16
error.

    python3 kernels/bench_decode_attention.py [--batches 1 16 64 256] [--context 1024] [--queries 1 4]

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


def bench(B: int, L: int, ctx: int, heads=(16, 2, 256)) -> dict:
    args, gate, _ = case(B, L, ctx, *heads)
    run = lambda: gpu.paged_attention_gpu(*args, gate=gate)  # noqa: E731
    M = L * heads[0] // heads[1]
    splits = gpu.kv_splits(B * heads[1], args[0].device, 16 if M <= 16 else 64)
    replay, o_split = _graphed(run)
    t_split = triton.testing.do_bench(replay)
    saved = gpu._MAX_SPLITS
    gpu._MAX_SPLITS = 1
    try:
        replay, o_one = _graphed(run)
        t_one = triton.testing.do_bench(replay)
    finally:
        gpu._MAX_SPLITS = saved
    err = float((o_split.double() - o_one.double()).norm() / o_one.double().norm())
    assert err < 1e-2, err
    _, Hkv, hd = heads
    nbytes = 2 * B * (ctx + L) * Hkv * hd * 2
    return dict(B=B, L=L, splits=splits, one_us=t_one * 1e3, split_us=t_split * 1e3,
                one_gbs=nbytes / t_one / 1e6, split_gbs=nbytes / t_split / 1e6, rel_diff=err)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args(argv)
    copy_gbs = copy_bandwidth()[0] / 1e9
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s; context {a.context}, heads 16/2/256, bf16\n")
    print("| batch | queries | splits | unsplit (us) | split (us) | unsplit GB/s (% copy) | split GB/s (% copy) | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for L in a.queries:
        for B in a.batches:
            r = bench(B, L, a.context)
            print(f"| {B} | {L} | {r['splits']} | {r['one_us']:.1f} | {r['split_us']:.1f} | "
                  f"{r['one_gbs']:.0f} ({r['one_gbs'] / copy_gbs:.0%}) | {r['split_gbs']:.0f} "
                  f"({r['split_gbs'] / copy_gbs:.0%}) | {r['one_us'] / r['split_us']:.2f}x |")


if __name__ == "__main__":
    main()
