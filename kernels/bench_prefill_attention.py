"""Prefill attention on the GPU: FlashInfer (``attention/flashinfer.py``) against the Triton
kernel (``attention/gpu.py``), bf16, output gate on. Prints numbers; asserts only that
the two agree within bf16 error.

    python3 kernels/bench_prefill_attention.py [--requests 4] [--tokens 2048] [--prefix 0 6144]
    python3 kernels/bench_prefill_attention.py --triton-sweep --requests 1 --tokens 8192 --prefix 0 24576 --head-dims 128

``--triton-sweep`` needs no FlashInfer: the Triton kernel alone with each tile choice of
:data:`SWEEP` (``(block_m, block_n, stages, num_warps)``, ``default`` being
``gpu.tiles``'), at the 1.46B checkpoint's heads (16, 2, 128) and the Qwen3.5 ones
(16, 2, 256), against the reference in fp32 on the same inputs.

Each case is ``requests`` chunks of ``tokens`` queries after ``prefix`` cached tokens per
request (rows and pages scattered, page size 16), for Qwen3.5-sized heads (16 query heads,
2 KV heads, head dim 256) and the demo model's (4, 2, 64). Times are medians of
``triton.testing.do_bench``: one layer's attention (FlashInfer: ``run`` plus the gate;
its plan, made once per step for all layers, is timed on its own).
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

from ppspec.kernels.attention import flashinfer as fa
from ppspec.kernels.attention.gpu import paged_attention_gpu
from ppspec.kernels.checks import known


def case(B: int, L: int, prefix: int, Hq: int, Hkv: int, hd: int, page: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dev, bf = torch.device("cuda"), torch.bfloat16
    kv_lens = [prefix + L] * B
    max_pages = -(-(prefix + L) // page)
    num_pages = (B + 4) * max_pages
    page_table = torch.randperm(num_pages, generator=gen)[: (B + 1) * max_pages].view(B + 1, max_pages)
    rows = torch.randperm(B + 1, generator=gen)[:B].tolist()
    k = torch.randn(num_pages, page, Hkv, hd, generator=gen).to(dev, bf)
    v = torch.randn(num_pages, page, Hkv, hd, generator=gen).to(dev, bf)
    q = torch.randn(B * L, Hq, hd, generator=gen).to(dev, bf)
    gate = torch.randn(B * L, Hq, 2 * hd, generator=gen).to(dev, bf)[..., hd:]
    cu = known(torch.arange(B + 1, device=dev) * L, total=B * L, max_len=L, queries_fit=True)
    args = (q, k, v, known(page_table.to(dev), pages_in_pool=True),
            known(torch.tensor(rows, device=dev), min=min(rows), max=max(rows)),
            known(torch.tensor(kv_lens, device=dev), min=min(kv_lens), max=max(kv_lens)), cu, hd ** -0.5)
    return args, gate, (rows, kv_lens, [L] * B, page)


def bench(B: int, L: int, prefix: int, heads: tuple[int, int, int]) -> dict:
    args, gate, lists = case(B, L, prefix, *heads)
    plan = fa.prefill_plan(*lists)
    o_fi = plan.run(*args, gate=gate)  # plans (and JIT-builds on first use)
    o_tr = paged_attention_gpu(*args, gate=gate)
    err = float((o_fi.double() - o_tr.double()).norm() / o_tr.double().norm())
    assert err < 2e-2, err

    def replan():
        plan._key = None  # force plan() on the next run
        plan.run(*args, gate=gate)

    t_fi = triton.testing.do_bench(lambda: plan.run(*args, gate=gate))
    t_plan = triton.testing.do_bench(replan) - t_fi
    t_tr = triton.testing.do_bench(lambda: paged_attention_gpu(*args, gate=gate))
    Hq, _, hd = heads
    # causal attention FLOPs: 4 hd per (query, visible key) pair per head
    pairs = B * sum(prefix + i + 1 for i in range(L))
    flops = 4 * hd * Hq * pairs
    return dict(B=B, L=L, prefix=prefix, heads=heads, fi_ms=t_fi, plan_ms=t_plan, triton_ms=t_tr,
                fi_tflops=flops / t_fi / 1e9, triton_tflops=flops / t_tr / 1e9, rel_diff=err)


SWEEP = ["default", (64, 64, 1, 8), (64, 64, 2, 4), (128, 64, 2, 8), (128, 64, 3, 8), (128, 32, 2, 8),
         (64, 32, 2, 8), (64, 32, 2, 4), (128, 128, 2, 8)]


def sweep(B: int, L: int, prefix: int, heads: tuple[int, int, int]) -> None:
    """Time the Triton kernel with each tile choice of :data:`SWEEP` on one case."""
    from ppspec.kernels.attention import gpu
    from ppspec.kernels.attention.naive import paged_attention_ref

    args, gate, _ = case(B, L, prefix, *heads)
    Hq, _, hd = heads
    flops = 4 * hd * Hq * B * sum(prefix + i + 1 for i in range(L))
    ref = None
    if L * B * (prefix + L) <= 8192 * 8192:  # the reference materialises the score matrix
        ref = paged_attention_ref(*[x.float() if torch.is_tensor(x) and x.is_floating_point() else x for x in args],
                                  gate=gate.float())
    default = gpu.tiles
    for choice in SWEEP:
        gpu.tiles = default if choice == "default" else (lambda *a, c=choice: c)
        try:
            o = paged_attention_gpu(*args, gate=gate)
            ms = triton.testing.do_bench(lambda: paged_attention_gpu(*args, gate=gate))
        except Exception as e:  # noqa: BLE001  (a tile choice Triton refuses)
            print(f"| {heads} | {B} x {L} | {prefix} | {choice} | failed: {type(e).__name__} | | |", flush=True)
            continue
        finally:
            gpu.tiles = default
        err = float((o.double() - ref.double()).norm() / ref.double().norm()) if ref is not None else float("nan")
        print(f"| {heads} | {B} x {L} | {prefix} | {choice} | {ms:.3f} | {flops / ms / 1e9:.0f} | {err:.1e} |",
              flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prefix", type=int, nargs="+", default=[0, 6144])
    ap.add_argument("--triton-sweep", action="store_true", help="the Triton kernel's tile choices, no FlashInfer")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 256], help="head dims of the sweep (16 / 2 heads)")
    a = ap.parse_args(argv)
    if a.triton_sweep:
        print(f"{torch.cuda.get_device_name()}, Triton paged attention, bf16, gated")
        print("| heads (q, kv, hd) | requests x tokens | prefix | tiles | ms | TFLOP/s | rel. diff to fp32 ref |")
        print("|---|---|---|---|---|---|---|")
        for heads in [(16, 2, hd) for hd in a.head_dims]:
            for prefix in a.prefix:
                sweep(a.requests, a.tokens, prefix, heads)
        return
    mod, why = fa._flashinfer()
    if mod is None:
        sys.exit(f"flashinfer does not import: {why}")
    print(f"{torch.cuda.get_device_name()}, flashinfer {mod.__version__}, bf16, gated")
    print("| heads (q, kv, hd) | requests x tokens | prefix | FlashInfer ms | plan ms | Triton ms "
          "| FlashInfer TFLOP/s | Triton TFLOP/s | speed-up | rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for heads in ((16, 2, 256), (4, 2, 64)):
        for prefix in a.prefix:
            r = bench(a.requests, a.tokens, prefix, heads)
            print(f"| {heads} | {r['B']} x {r['L']} | {prefix} | {r['fi_ms']:.3f} | {r['plan_ms']:.3f} | "
                  f"{r['triton_ms']:.3f} | {r['fi_tflops']:.0f} | {r['triton_tflops']:.0f} | "
                  f"{r['triton_ms'] / r['fi_ms']:.2f}x | {r['rel_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
