"""Verify + commit of one GDN layer on the GPU: the copy design against the replay design
(docs/DESIGN.md, "Commit rule" and "Cost model"), against plain decode and against the copy bandwidth measured in
the same run. Prints numbers; asserts nothing about time.

    python3 kernels/bench_verify.py [--batches 64 256] [--steps 4] [--json out.json]

Shapes: Qwen3.5-sized GDN heads (16 key heads, 32 value heads, K = V = 128), fp32 state
(2 MiB per request), bf16 inputs, D verify steps, every request accepting all D tokens
(the most replay work; the state bytes do not depend on it). Rows are scattered stable
pool rows. Each variant is captured in a CUDA graph (row checks, which sync the host, are
done once outside) and timed by ``triton.testing.do_bench`` (median, L2 flushed between
repetitions); a replay of the graph is one steady-state round, so the replay design
replays the previous round's accepted steps every time.

Bytes per request and round (S = one state): copy design = verify reads S and writes D
scratch states, commit reads one and writes S: (D + 3) S; replay design = S read + S
written (+ a few KiB of step inputs); decode = 2 S. Achieved bandwidth counts every byte
the kernels must move (states, inputs, outputs, replay buffers).

``replay_round`` charges the layer a whole commit launch; a stage commits all its layers
in one launch, so ``replay_round_per_layer`` is the round less a one-layer commit plus
``1 / --layers`` of an all-layer commit (each commit timed alone in the same call).
"""
from __future__ import annotations

import argparse
import json
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

from ppspec.kernels.commit.triton_commit import launch_commit
from ppspec.kernels.gdn.naive_replay import alloc_replay_buffers
from ppspec.kernels.gdn.triton_recurrent import launch_gdn_recurrent
from ppspec.kernels.gdn.triton_replay import launch_replay_commit, launch_replay_verify

MiB = 1 << 20
KEYS = ("decode", "copy_verify", "copy_commit", "copy_round", "replay_round", "replay_round_per_layer", "replay_decode")


GRAPHS = {"ok": True}


def _graph(fn):
    """Capture ``fn`` (after a warm-up that compiles) into a CUDA graph; return its replay
    (or ``fn`` itself, noted in the output, if capture fails)."""
    if not GRAPHS["ok"]:
        fn()
        return fn
    try:
        return _capture(fn)
    except Exception as e:  # noqa: BLE001
        print(f"CUDA graph capture failed ({type(e).__name__}: {e}); timing plain launches")
        GRAPHS["ok"] = False
        torch.cuda.synchronize()
        return fn


def _capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _time_ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def copy_bandwidth(gib: float = 4.0) -> tuple[float, float]:
    """Device-to-device copy of a large random buffer: (bytes read + written) / time."""
    n = int(gib * (1 << 30)) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 4 / (ms * 1e-3), ms


def bench_batch(B: int, D: int, H: int = 16, HV: int = 32, K: int = 128, V: int = 128, seed: int = 0,
                layers: int = 36):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows_n = B + 7
    R = rows_n + 1
    rows = torch.randperm(rows_n, device=dev, generator=gen)[:B].contiguous()
    acc = torch.full((B,), D, dtype=torch.int64, device=dev)
    dt = torch.bfloat16

    def inputs(d):
        q = torch.randn(B, d, H, K, device=dev, generator=gen).to(dt)
        k = torch.randn(B, d, H, K, device=dev, generator=gen).to(dt)
        v = torch.randn(B, d, HV, V, device=dev, generator=gen).to(dt)
        g = (-torch.rand(B, d, HV, device=dev, generator=gen) * 0.5).to(dt)
        beta = torch.rand(B, d, HV, device=dev, generator=gen).to(dt)
        return q, k, v, g, beta

    xv, x1 = inputs(D), inputs(1)
    state = torch.randn(R, HV, K, V, device=dev, generator=gen) * 0.05
    S = HV * K * V * 4  # bytes of one request's state
    io_bytes = lambda d: B * d * (2 * H * K + 2 * HV * V + 2 * HV) * 2  # q, k, v, o, g, beta (bf16)
    step_in = (H * K + HV * V + HV) * 4  # one step's replay record per request (fp32 k, delta, g)

    res = {"batch": B, "D": D, "state_MiB_per_request": S / MiB}

    # plain decode of one token
    f_dec = _graph(lambda: launch_gdn_recurrent(*x1, state, rows, None))
    t = _time_ms(f_dec)
    res["decode"] = {"ms": t, "state_bytes": 2 * S * B, "bytes": 2 * S * B + io_bytes(1)}

    # copy design: verify into a scratch of every step, then the commit copy
    scratch = torch.empty(1, R, D, HV, K, V, device=dev)
    scratch.normal_(generator=gen)
    st1 = state[None]
    f_ver = _graph(lambda: launch_gdn_recurrent(*xv, state, rows, None, scratch=scratch[0]))
    f_com = _graph(lambda: launch_commit(st1, scratch, rows, acc))

    def copy_round():
        launch_gdn_recurrent(*xv, state, rows, None, scratch=scratch[0])
        launch_commit(st1, scratch, rows, acc)

    f_copy = _graph(copy_round)
    res["copy_verify"] = {"ms": _time_ms(f_ver), "state_bytes": (1 + D) * S * B, "bytes": (1 + D) * S * B + io_bytes(D)}
    res["copy_commit"] = {"ms": _time_ms(f_com), "state_bytes": 2 * S * B, "bytes": 2 * S * B}
    res["copy_round"] = {"ms": _time_ms(f_copy), "state_bytes": (D + 3) * S * B,
                         "bytes": (D + 3) * S * B + io_bytes(D)}
    del scratch
    torch.cuda.empty_cache()

    # replay design: the verify replays last round's accepted steps, the commit moves 2 ints
    bufs = alloc_replay_buffers(R, D, H, HV, K, V, device=dev)
    rows32 = acc.to(torch.int32)

    def replay_round():
        launch_replay_verify(*xv, state, rows, bufs)
        launch_replay_commit(bufs.pending, bufs.slot, rows, rows32)

    launch_replay_verify(*xv, state, rows, bufs)  # fill the buffers once
    launch_replay_commit(bufs.pending, bufs.slot, rows, rows32)
    f_rep = _graph(replay_round)
    res["replay_round"] = {"ms": _time_ms(f_rep), "state_bytes": 2 * S * B,
                           "bytes": 2 * S * B + io_bytes(D) + B * 2 * D * step_in}
    # A stage commits every layer in one launch (``RowStatePool.commit``): the round's commit
    # is a share of that launch, 1 / layers of it, not a launch per layer. The verify's
    # time is the round less a one-layer commit (each timed alone, same call).
    from ppspec.kernels.gdn.naive_replay import alloc_replay_meta
    pend_l, slot_l = alloc_replay_meta(layers, R, dev)
    t_c1 = _time_ms(_graph(lambda: launch_replay_commit(bufs.pending, bufs.slot, rows, rows32)))
    t_cl = _time_ms(_graph(lambda: launch_replay_commit(pend_l, slot_l, rows, rows32)))
    t_layer = res["replay_round"]["ms"] - t_c1 + t_cl / layers
    res["replay_round_per_layer"] = {**res["replay_round"], "ms": t_layer, "commit_1_ms": t_c1,
                                     "commit_all_ms": t_cl, "layers": layers}
    f_rdec = _graph(lambda: launch_replay_verify(*x1, state, rows, bufs, verify=False))
    res["replay_decode"] = {"ms": _time_ms(f_rdec), "state_bytes": 2 * S * B, "bytes": 2 * S * B + io_bytes(1)}
    # tile sweep of the round (BV, warps); the default is triton_replay._verify_block_v
    res["replay_round_tiles"] = []
    for bv, nw in ((16, 1), (32, 1), (64, 2), (32, 2), (32, 4), (64, 4)):
        def tiled():
            launch_replay_verify(*xv, state, rows, bufs, block_v=bv, num_warps=nw)
            launch_replay_commit(bufs.pending, bufs.slot, rows, rows32)
        res["replay_round_tiles"].append({"BV": bv, "num_warps": nw, "ms": _time_ms(_graph(tiled))})
    res["decode_tiles"] = []
    for bv, nw in ((32, 1), (32, 2), (32, 4), (64, 4), (128, 8)):
        res["decode_tiles"].append({"BV": bv, "num_warps": nw, "ms": _time_ms(_graph(
            lambda: launch_gdn_recurrent(*x1, state, rows, None, block_v=bv, num_warps=nw)))})
    for key in KEYS:
        r = res[key]
        r["TBps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e12
        r["state_sizes_per_request"] = r["state_bytes"] / (S * B)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=4, help="D, tokens verified per request")
    ap.add_argument("--layers", type=int, default=36,
                    help="GDN layers whose commit shares one launch (Qwen3-Next: 36 of 48)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    bw, ms = copy_bandwidth()
    print(f"device-to-device copy (4 GiB, read + write counted): {bw / 1e12:.2f} TB/s ({ms:.3f} ms)")
    out = {"copy_TBps": bw / 1e12, "runs": []}
    for B in a.batches:
        r = bench_batch(B, a.steps, layers=a.layers)
        out["runs"].append(r)
        dec = r["decode"]["ms"]
        print(f"\nbatch {B}, D = {a.steps}, HV = 32, K = V = 128, fp32 state ({r['state_MiB_per_request']:.0f} MiB/request), one layer")
        print(f"{'variant':<26}{'time us':>10}{'state sizes':>13}{'GB moved':>10}{'TB/s':>8}{'% copy':>8}{'x decode':>10}")
        for key in KEYS:
            x = r[key]
            print(f"{key:<26}{x['ms'] * 1e3:>10.1f}{x['state_sizes_per_request']:>13.1f}{x['bytes'] / 1e9:>10.3f}"
                  f"{x['TBps']:>8.2f}{100 * x['TBps'] * 1e12 / bw:>7.0f}%{x['ms'] / dec:>10.2f}")
        pl = r["replay_round_per_layer"]
        print(f"replay commit alone: one layer {pl['commit_1_ms'] * 1e3:.1f} us, {pl['layers']} layers in one launch "
              f"{pl['commit_all_ms'] * 1e3:.1f} us (replay_round_per_layer: the round with 1/{pl['layers']} of that)")
        print("replay round by tile (BV, warps): " + ", ".join(
            f"({t['BV']}, {t['num_warps']}) {t['ms'] * 1e3:.1f} us" for t in r["replay_round_tiles"]))
        print("decode by tile (BV, warps): " + ", ".join(
            f"({t['BV']}, {t['num_warps']}) {t['ms'] * 1e3:.1f} us" for t in r["decode_tiles"]))
    print(f"\ntimed as {'CUDA graph replays' if GRAPHS['ok'] else 'plain launches'} (do_bench median)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
