"""What one prefix-cache snapshot call costs a stage: ``python -m ppspec.bench.snapshot_ops``.

Builds one stage of the checkpoint (default: the demo model) with a prefix cache, gives
``B`` rows KV pages for a prompt of ``--tokens`` tokens (a partial last page, so a restore
copies one page per row) and times, per call over all ``B`` rows at once:

- ``take (chunk)``: the snapshot after a prefill chunk (``SnapshotPool.take``,
  ``pending=False``: a prefill flushed the replay design's pending steps before it ran);
- ``take (finish)``: a finished row's snapshot (its pending steps applied first);
- ``restore``: the snapshot copied into fresh rows, its KV pages shared;
- ``drop``: the slots freed.

Per call it prints the host time (median over ``--repeats``, ``time.perf_counter``; on
CUDA with the device idle before each call, so that a call that waits for the device
waits for nothing but itself), the device time on CUDA (CUDA events around the call), and
what the call dispatched to torch, counted with a ``TorchDispatchMode``: aten ops that
compute or copy (about the kernel launches on CUDA; views, ``to`` and reads left out),
host-to-device copies (seen on CUDA only: on a CPU nothing moves), and device reads
(``aten::item``: ``.item()``, ``int(t)``, ``bool(t)``; each one waits for the device on
CUDA). ``--profile`` adds the cProfile of the calls.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import inspect
import pstats
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name while active (``counts``)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.removeprefix("aten::")
        if name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst_dev = args[0].device if name == "copy_" else (kwargs or {}).get("device", src.device)
            if src.device.type == "cpu" and torch.device(dst_dev).type != "cpu":
                name = "h2d:" + name
        self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def summarize(counts: collections.Counter) -> dict:
    """``{"ops", "h2d", "reads"}`` from an :class:`OpCounter`'s counts (views excluded:
    they launch nothing)."""
    free = {"view", "_unsafe_view", "slice", "select", "transpose", "as_strided", "alias", "detach", "detach_", "t",
            "expand", "unsqueeze", "squeeze", "lift_fresh", "to", "item", "_local_scalar_dense", "pin_memory",
            "_pin_memory"}
    return {"ops": sum(n for k, n in counts.items() if k not in free),
            "h2d": sum(n for k, n in counts.items() if k.startswith("h2d:")),
            "reads": counts["item"] or counts["_local_scalar_dense"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.snapshot_ops", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--commit-design", default=None, choices=("copy", "replay"),
                    help="default: replay on CUDA, copy on CPU")
    ap.add_argument("--speculative-algorithm", default="mtp", choices=("none", "ngram", "mtp"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="rows per call")
    ap.add_argument("--tokens", type=int, default=200, help="tokens each row holds")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prefix-cache-gb", type=float, default=2.0, help="snapshot pool (must hold the largest --batch)")
    ap.add_argument("--profile", action="store_true", help="print the cProfile of the calls")
    a = ap.parse_args(argv)
    from ppspec.router.llm import DEMO_MODEL, LLM

    torch.set_num_threads(1)
    llm = LLM(a.model or DEMO_MODEL, device=a.device, dtype=a.dtype, commit_design=a.commit_design,
              speculative_algorithm=a.speculative_algorithm, max_rows=2 * max(a.batch),
              enable_prefix_caching=True, prefix_cache_gb=a.prefix_cache_gb)
    runner = llm.pipeline.runners[0]
    pool = runner.snapshots
    if pool.num_slots < max(a.batch):
        ap.error(f"--prefix-cache-gb {a.prefix_cache_gb} holds {pool.num_slots} snapshots of this checkpoint, "
                 f"fewer than --batch {max(a.batch)}")
    cuda = runner.device.type == "cuda"
    chunk_kw = {"pending": False} if "pending" in inspect.signature(pool.take).parameters else {}
    print(f"{a.model or DEMO_MODEL}: stage 0 of PP1, {runner.commit_design} design, {a.device} {a.dtype}, "
          f"{len(pool.saved)} state tensors of {next(iter(pool.saved.values())).shape[0]} layers, "
          f"{len(pool.kvs)} KV pools, {a.tokens} tokens a row")
    prof = cProfile.Profile() if a.profile else None
    with torch.inference_mode():
        for B in a.batch:
            src, dst, slots = list(range(B)), list(range(B, 2 * B)), list(range(B))
            for kv in pool.kvs:
                kv.ensure(src, [a.tokens] * B)
            calls = {
                "take (chunk)": lambda: pool.take(src, slots, [a.tokens] * B, **chunk_kw),
                "take (finish)": lambda: pool.take(src, slots, [a.tokens] * B),
                "restore": lambda: pool.restore(dst, slots),
                "drop": lambda: pool.drop(slots),
            }
            stats = {k: {"host": [], "device": [], "counts": None} for k in calls}
            for rep in range(a.repeats + 1):  # the first round warms up (not counted)
                for name, call in calls.items():
                    if name == "take (finish)":
                        pool.drop(slots)
                    if name == "drop":
                        for kv in pool.kvs:
                            for r in dst:
                                kv.release(r)
                    counter = OpCounter() if rep == 1 else None
                    if cuda:
                        torch.cuda.synchronize()
                        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                        ev[0].record()
                    if prof is not None and rep:
                        prof.enable()
                    t = time.perf_counter()
                    if counter is not None:
                        with counter:
                            call()
                    else:
                        call()
                    host = time.perf_counter() - t
                    if prof is not None:
                        prof.disable()
                    if cuda:
                        ev[1].record()
                        torch.cuda.synchronize()
                    if rep:
                        stats[name]["host"].append(host)
                        stats[name]["device"].append(ev[0].elapsed_time(ev[1]) / 1000 if cuda else 0.0)
                    if counter is not None:
                        stats[name]["counts"] = counter.counts
            for kv in pool.kvs:
                for r in src:
                    kv.release(r)
            for name, s in stats.items():
                c = summarize(s["counts"])
                dev = f", device {1e6 * statistics.median(s['device']):7.1f} us" if cuda else ""
                print(f"  B {B:3d} {name:14s} host {1e6 * statistics.median(s['host']):8.1f} us{dev}; "
                      f"{c['ops']:3d} aten ops, {c['h2d'] if cuda else '-'} host-to-device copies, "
                      f"{c['reads']} device reads"
                      f"  [{', '.join(f'{k} {n}' for k, n in sorted(s['counts'].items()))}]")
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
