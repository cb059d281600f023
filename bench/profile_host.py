"""Where the host time of a GPU step goes: ``python -m ppspec.bench.profile_host``.

Profiles (cProfile, sorted by own time) the demo checkpoint in bf16 on CUDA:
``LLM.generate`` at batch 32 without speculation and with MTP (wall time per round for
both, the profile of the MTP run), then 20 plain decode steps of one ``StageRunner``
at batch 32; prints the top functions and the wall time per step. Device time is not
separated: with a 10M-parameter model nearly all of a step is host work.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def _report(prof: cProfile.Profile, n: int) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def main(argv=None) -> None:
    import torch

    from ppspec.proto.messages import StepInput
    from ppspec.router.llm import DEMO_MODEL, LLM
    from ppspec.router.types import SamplingParams
    from ppspec.stage_server.runner import StageRunner

    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.profile_host", description=__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    B = a.batch

    prompts = [[1 + (i * 7 + j) % 300 for j in range(24)] for i in range(B)]
    p = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    for spec in ("none", "mtp"):
        llm = LLM(DEMO_MODEL, device="cuda", dtype="bfloat16", speculative_algorithm=spec, max_rows=B)
        llm.generate(prompts, p)  # the same call first: every Triton specialisation compiled
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        outs = llm.generate(prompts, p)
        torch.cuda.synchronize()
        prof.disable()
        dt = time.perf_counter() - t0
        rounds = max(len(o.accept_lengths) for o in outs) or a.max_tokens - 1
        print(f"LLM.generate batch {B} {spec}: {dt:.3f} s, {rounds} rounds after the prefill, "
              f"{dt / rounds * 1e3:.2f} ms per round (prefill included)")
    print(_report(prof, a.top))

    r = StageRunner(DEMO_MODEL, max_rows=B, kv_tokens=B * 256, dtype=torch.bfloat16, device="cuda")
    rows = list(range(B))
    r.step(StepInput(0, 0, "prefill", rows, [0] * B, [16] * B, [1] * (16 * B)))
    seq = 16
    for _ in range(3):
        r.step(StepInput(0, 1, "decode", rows, [seq] * B, [1] * B, [1] * B))
        seq += 1
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    n = 20
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(n):
        r.step(StepInput(0, 1, "decode", rows, [seq] * B, [1] * B, [1] * B))
        seq += 1
    torch.cuda.synchronize()
    prof.disable()
    print(f"StageRunner.step decode batch {B}: {(time.perf_counter() - t0) / n * 1e3:.2f} ms per step")
    print(_report(prof, a.top))


if __name__ == "__main__":
    main()
