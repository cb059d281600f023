"""Where the device time of a GPU step goes: ``python -m ppspec.bench.profile_gpu``.

Runs steps under ``torch.profiler`` (CUPTI records each kernel, those replayed from CUDA
graphs included) and prints, per step: wall time, summed kernel time, kernel count, and
the kernels ranked by time (microseconds and launches per step). Cases:

- ``1b``: plain decode of a random 1.46B Qwen3.5-shaped checkpoint (``--model``, another
  family with ``--family`` as ``gpu_bench --family``, or made
  with ``gpu_bench.make_random_checkpoint``) through ``StageRunner.step`` at ``--batch``
  (context ``--context`` tokens), then a verify round of 3 drafts per request (D = 4
  tokens, and its commit) at the same batch; graphs as the stage runs them.
- ``demo``: ``LLM.generate`` on the demo checkpoint at batch 1, without speculation and
  with MTP (per round: wall, kernel time, kernels).
- ``prefill``: one ``--prefill-tokens`` prompt of the 1.46B checkpoint through
  ``LLM.generate`` (``max_tokens`` 1) with each token budget of ``--budgets``: per
  micro-batch (one chunk), wall against kernel time; host time between kernels shows as
  the difference.
- ``mixed``: ``--decoders`` requests of the 1.46B checkpoint decode, then one
  ``--prefill-tokens`` prompt arrives (``prefill_ttft``'s mixed load): each round while it
  prefills (wall ms, the micro-batch's prefill tokens), then the kernels of those rounds.

Wall time much above kernel time means the host (or launch gaps) bounds the step.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time


def _table(prof, steps: int, wall_s: float, top: int, title: str) -> None:
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total_us = sum(e.self_device_time_total for e in kernels)
    count = sum(e.count for e in kernels)
    print(f"\n### {title}\n")
    print(f"wall {wall_s / steps * 1e3:.3f} ms/step, kernels {total_us / steps / 1e3:.3f} ms/step, "
          f"{count / steps:.1f} kernels/step\n")
    print("| kernel | us/step | launches/step | share |")
    print("|---|---:|---:|---:|")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"| `{e.key[:90]}` | {e.self_device_time_total / steps:.1f} | {e.count / steps:.2f} | "
              f"{e.self_device_time_total / total_us:.1%} |")


def _host_profile(torch, fn, top: int) -> None:
    """Where the host's time of ``fn()`` goes (cProfile, no CUPTI): wall with and without
    the profiler, then the functions of most cumulative time."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    plain = time.perf_counter() - t0
    pr = cProfile.Profile()
    pr.enable()
    fn()
    torch.cuda.synchronize()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(top)
    print(f"\nwall without a profiler {plain * 1e3:.1f} ms; the host under cProfile (cumulative):\n")
    print("\n".join(out.getvalue().splitlines()[:top + 12]))


def _profile(torch, fn, steps: int):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return prof, wall


def main(argv=None) -> None:
    import torch

    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.profile_gpu", description=__doc__)
    ap.add_argument("--case", default="1b,demo")
    ap.add_argument("--model", default=None, help="checkpoint for the 1b case (default: a random 1.46B one)")
    ap.add_argument("--family", choices=("qwen3_5", "kimi_linear", "nemotron_h", "falcon_h1"), default="qwen3_5",
                    help="the 1b case's random checkpoint family (as gpu_bench --family)")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prefill-tokens", type=int, default=8000)
    ap.add_argument("--budgets", default="512,2048,8192", help="token budgets (chunk sizes) of the prefill case")
    ap.add_argument("--decoders", type=int, default=32, help="decoding requests of the mixed case")
    a = ap.parse_args(argv)
    cases = a.case.split(",")

    path = a.model
    if "1b" in cases or "prefill" in cases or "mixed" in cases:
        from ppspec.bench import gpu_bench

        if path is None:
            make = {"kimi_linear": gpu_bench.make_random_kimi_checkpoint,
                    "nemotron_h": gpu_bench.make_random_nemotron_checkpoint,
                    "falcon_h1": gpu_bench.make_random_falcon_h1_checkpoint}.get(a.family, gpu_bench.make_random_checkpoint)
            path = os.path.join(tempfile.mkdtemp(), f"{a.family}-1b")
            make(torch, path)
            torch.cuda.empty_cache()
    if "1b" in cases:
        from ppspec.bench.gpu_bench import prefilled_steps

        for B in [int(b) for b in a.batch.split(",")]:
            for mode in ("decode", "verify"):
                D = 4 if mode == "verify" else 1
                _, step, _ = prefilled_steps(torch, path, B, a.context, D - 1, rounds=a.steps + 1)
                prof, wall = _profile(torch, step, a.steps)
                what = "decode step" if mode == "decode" else "verify round (D = 4, with its commit)"
                _table(prof, a.steps, wall, a.top, f"1B {what}, batch {B}, context {a.context}")
                del step
                torch.cuda.empty_cache()

    if "demo" in cases:
        from ppspec.router.llm import DEMO_MODEL, LLM
        from ppspec.router.types import SamplingParams

        p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        prompt = [[1 + j % 300 for j in range(24)]]
        for spec in ("none", "mtp"):
            llm = LLM(DEMO_MODEL, device="cuda", dtype="bfloat16", speculative_algorithm=spec, max_rows=4)
            outs = []
            prof, wall = _profile(torch, lambda: outs.append(llm.generate(prompt, p)), 3)
            rounds = 3 * (max(len(o.accept_lengths) for o in outs[-1]) or 63)
            _table(prof, rounds, wall, a.top, f"demo, batch 1, {spec}: per round (prefill included)")


    if "prefill" in cases:
        from ppspec.router.llm import LLM
        from ppspec.router.types import SamplingParams

        p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        prompt = [[1 + j % 30000 for j in range(a.prefill_tokens)]]
        for budget in [int(b) for b in a.budgets.split(",")]:
            llm = LLM(path, device="cuda", dtype="bfloat16", max_rows=4, max_num_batched_tokens=budget,
                      max_context=a.prefill_tokens + 64)
            prof, wall = _profile(torch, lambda: llm.generate(prompt, p), 3)
            chunks = -(-a.prefill_tokens // budget)
            _table(prof, 3 * chunks, wall, a.top,
                   f"1B prefill of {a.prefill_tokens} tokens, budget {budget}: per micro-batch ({chunks} per prompt)")
            _host_profile(torch, lambda: llm.generate(prompt, p), a.top)
            del llm
            torch.cuda.empty_cache()

    if "mixed" in cases:
        _mixed(torch, path, a)


def _mixed(torch, path: str, a) -> None:
    """The ``mixed`` case: per-round wall times while a long prompt prefills beside
    ``a.decoders`` decoding requests, then those rounds' kernels."""
    import random

    from torch.profiler import ProfilerActivity, profile

    from ppspec.bench.prefill_ttft import random_prompt
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    rnd = random.Random(0)
    llm = LLM(path, device="cuda", dtype="bfloat16", max_rows=a.decoders + 2,
              kv_tokens=max(65536, 2 * a.prefill_tokens + a.decoders * 1024), max_context=a.prefill_tokens + 64)
    vocab = llm.pipeline.runners[0].cfg.vocab_size
    forever = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)
    ids = [llm.add_request(random_prompt(rnd, 64, vocab), forever) for _ in range(a.decoders)]
    while any(not llm.completions[r].token_ids for r in ids):
        llm.step()
    for _ in range(5):
        llm.step()
    # a first long prompt warms every bucket its chunks meet
    for label in ("warm", "measured"):
        long_req = llm.add_request(random_prompt(rnd, a.prefill_tokens, vocab),
                                   SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        walls = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            while not llm.completions[long_req].token_ids:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.step()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
        base = []
        for _ in range(8):
            t0 = time.perf_counter()
            llm.step()
            torch.cuda.synchronize()
            base.append(time.perf_counter() - t0)
    print(f"\n### mixed: {a.decoders} decoding, a {a.prefill_tokens}-token prompt arrives "
          f"(budget {llm.scheduler.max_num_batched_tokens}, {llm.scheduler.mixed_prefill_tokens} beside decodes)\n")
    print("rounds during its prefill (ms): " + " ".join(f"{w * 1e3:.1f}" for w in walls))
    print("rounds after (ms): " + " ".join(f"{w * 1e3:.1f}" for w in base))
    _table(prof, len(walls), sum(walls), a.top, "mixed rounds while the prompt prefills")
    # a third prompt without torch.profiler: plain round times, then the host under cProfile
    # (time a builtin spends waiting for the device, a .tolist() say, counts as its own)
    import cProfile
    import io
    import pstats

    for label in ("plain", "cprofile"):
        long_req = llm.add_request(random_prompt(rnd, a.prefill_tokens, vocab),
                                   SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        pr, walls = cProfile.Profile(), []
        while not llm.completions[long_req].token_ids:
            t0 = time.perf_counter()
            if label == "cprofile":
                pr.enable()
            llm.step()
            torch.cuda.synchronize()
            pr.disable()
            walls.append(time.perf_counter() - t0)
        print(f"\nrounds during its prefill, {label} (ms): " + " ".join(f"{w * 1e3:.1f}" for w in walls))
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(a.top)
    print("\n".join(out.getvalue().splitlines()[:a.top + 12]))
    for r in ids:
        llm.abort(r)


if __name__ == "__main__":
    main()
