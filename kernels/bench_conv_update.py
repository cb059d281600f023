"""The conv1d update of decode and verify on the GPU, one layer, with the windows and the
weight stored as the stage keeps them (column-major windows, tap-major weight: ``columns``)
against row-major windows and weight (``rows``). Prints numbers; asserts that both
layouts give the same outputs and windows, bit for bit.

    python3 kernels/bench_conv_update.py [--batches 1 64 256] [--steps 1 4] [--channels 8192]

Each case is ``batch`` requests at scattered rows of a pool of 256 (+ 1) rows, D tokens
each (1: decode, which rewrites the window; 4: a verify, which writes the D windows of its
scratch), width 4, bf16. Bytes are what the kernel must move: the window read, the D
inputs read and the D outputs written, then the window written (decode) or the D scratch
windows written (verify). Times are medians of ``triton.testing.do_bench`` over replays of
a CUDA graph of the launch (the stage runs decode and verify graphed); GB/s against the
device-to-device copy bandwidth measured in the same run.
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

from ppspec.kernels.bench_decode_attention import _graphed
from ppspec.kernels.bench_verify import copy_bandwidth
from ppspec.kernels.checks import known
from ppspec.kernels.conv1d.triton_update import causal_conv1d_update_triton


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A copy of ``t`` (``[..., C, W - 1]`` or ``[C, W]``) stored row-major or column-major."""
    return t.clone(memory_format=torch.contiguous_format) if layout == "rows" else \
        t.transpose(-1, -2).contiguous().transpose(-1, -2)


def bench(B: int, D: int, C: int, W: int = 4, rows_n: int = 256) -> dict:
    gen = torch.Generator().manual_seed(B * 10 + D)
    dev, bf = torch.device("cuda"), torch.bfloat16
    R = rows_n + 1
    x = torch.randn(B, D, C, generator=gen).to(dev, bf)
    weight = torch.randn(C, W, generator=gen).to(dev, bf)
    perm = torch.randperm(rows_n, generator=gen)[:B]
    # the rows' range stated, as the stage does: the check reads no device memory (capturable)
    rows = known(perm.to(dev), min=int(perm.min()), max=int(perm.max()))
    state0 = torch.randn(R, C, W - 1, generator=gen).to(dev, bf)  # never written: each layout gets copies
    out = {}
    for layout in ("rows", "columns"):
        w, st = _layout(weight, layout), _layout(state0, layout)
        sc = _layout(torch.zeros(R, D, C, W - 1, device=dev, dtype=bf), layout) if D > 1 else None
        replay, y = _graphed(lambda: causal_conv1d_update_triton(x, w, None, st, rows, sc))
        # one replay more leaves decode's windows advanced once more: compare a fresh launch
        st_fresh = _layout(state0, layout)
        y = causal_conv1d_update_triton(x, w, None, st_fresh, rows, sc)
        out[layout] = (triton.testing.do_bench(replay) * 1e3, y, st_fresh.contiguous(),
                       None if sc is None else sc.contiguous())
    (t_rows, y_r, st_r, sc_r), (t_cols, y_c, st_c, sc_c) = out["rows"], out["columns"]
    assert torch.equal(y_r, y_c) and torch.equal(st_r, st_c) and (sc_r is None or torch.equal(sc_r, sc_c))
    window = B * C * (W - 1) * 2
    nbytes = window + 2 * B * D * C * 2 + (window if D == 1 else D * window)
    return dict(B=B, D=D, rows_us=t_rows, cols_us=t_cols, rows_gbs=nbytes / t_rows / 1e3,
                cols_gbs=nbytes / t_cols / 1e3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--channels", type=int, default=8192, help="conv channels (Qwen3.5-sized GDN: 8192)")
    a = ap.parse_args(argv)
    copy_gbs = copy_bandwidth()[0] / 1e9
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s; conv width 4, {a.channels} channels, bf16\n")
    print("| batch | D | rows (us) | columns (us) | rows GB/s (% copy) | columns GB/s (% copy) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for D in a.steps:
        for B in a.batches:
            r = bench(B, D, a.channels)
            print(f"| {B} | {D} | {r['rows_us']:.2f} | {r['cols_us']:.2f} | {r['rows_gbs']:.0f} "
                  f"({r['rows_gbs'] / copy_gbs:.0%}) | {r['cols_gbs']:.0f} ({r['cols_gbs'] / copy_gbs:.0%}) | "
                  f"{r['rows_us'] / r['cols_us']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
