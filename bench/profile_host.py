"""Where the host time of a GPU step goes: ``python -m ppspec.bench.profile_host``.

``--case demo`` (default) profiles (cProfile, sorted by own time) the demo checkpoint in
bf16 on CUDA: ``LLM.generate`` at batch 32 without speculation and with MTP (wall time per
round for both, the profile of the MTP run), then 20 plain decode steps of one
``StageRunner`` at batch 32; prints the top functions and the wall time per step. Device
time is not separated: with a 10M-parameter model nearly all of a step is host work.

``--case 1b`` splits the wall time of a decode step and of a verify round (D = 4, with its
commit) of the random 1.46B checkpoint at ``--batch`` (``gpu_bench.prefilled_steps``,
context 1024, median of ``--steps``): the host's time before the graph launch (the device
waits: the step synchronised on its read-back), from the launch to the step's end (device
time, the read-back of the tokens and the host's sampling), and the commit (host time;
its device work is a few microseconds). ``--device cpu`` runs the same split on the demo
checkpoint without graphs (a smoke test of the tool).
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


def step_split(runner, step, mode: str, n: int, batch: int) -> dict[str, float]:
    """Median milliseconds of ``n`` calls of ``step`` (a ``gpu_bench.prefilled_steps``
    closure over ``runner`` with ``batch`` requests: its ``step``, then its
    ``commit_accept`` in verify mode): ``wall``, ``host_before_launch``,
    ``launch_to_step_end``, ``commit``.

    Raises:
        ValueError: ``batch`` is above the largest graph (its steps run eagerly).
        RuntimeError: a step did not run its graph."""
    import statistics

    graphs = runner.graphs[mode]
    commit, marks = runner.commit_accept, {}
    if graphs.bucket(batch) is None:
        raise ValueError(f"batch {batch} is above the largest {mode} graph ({graphs.sizes[-1]}): "
                         "its steps run eagerly, with no launch to split at")

    def timed_commit(*a):
        t = time.perf_counter()
        commit(*a)
        marks["commit"] = time.perf_counter() - t

    runner.commit_accept = timed_commit  # the closure calls it through the runner
    rows: dict[str, list[float]] = {k: [] for k in ("wall", "host_before_launch", "launch_to_step_end", "commit")}
    try:
        for _ in range(n):
            marks.clear()
            t0 = time.perf_counter()
            step()
            wall = time.perf_counter() - t0
            if not t0 < graphs.launched_at < t0 + wall:
                raise RuntimeError(f"the {mode} step did not run its graph")
            c = marks.get("commit", 0.0)
            rows["wall"].append(wall)
            rows["host_before_launch"].append(graphs.launched_at - t0)
            rows["launch_to_step_end"].append(wall - c - (graphs.launched_at - t0))
            rows["commit"].append(c)
    finally:
        del runner.commit_accept
    return {k: statistics.median(v) * 1e3 for k, v in rows.items()}


def split_1b(torch, batch: int, steps: int, device: str) -> None:
    import os
    import tempfile

    from ppspec.bench.gpu_bench import make_random_checkpoint, prefilled_steps

    kw = {}
    if device == "cuda":
        path = os.path.join(tempfile.mkdtemp(), "qwen35-1b")
        make_random_checkpoint(torch, path)
        ctx = 1024
    else:  # the tool's own check: the demo checkpoint, eager padded steps
        from ppspec.router.llm import DEMO_MODEL

        path, ctx = DEMO_MODEL, 64
        kw = dict(device="cpu", dtype=torch.float32, cuda_graph_max_bs=batch)
    print(f"| step, batch {batch} | wall (ms) | host before the launch | launch to step end | commit |")
    print("|---|---|---|---|---|")
    for drafts in (0, 3):
        mode = "verify" if drafts else "decode"
        r, step, _ = prefilled_steps(torch, path, batch, ctx, drafts, rounds=steps + 5, **kw)
        for _ in range(3):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        t = step_split(r, step, mode, steps, batch)
        print(f"| {mode} | {t['wall']:.3f} | {t['host_before_launch']:.3f} | {t['launch_to_step_end']:.3f} | "
              f"{t['commit']:.3f} |")
        del r, step


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
    ap.add_argument("--case", choices=("demo", "1b"), default="demo")
    ap.add_argument("--steps", type=int, default=30, help="--case 1b: timed steps (median)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="--case 1b only")
    a = ap.parse_args(argv)
    B = a.batch
    if a.case == "1b":
        split_1b(torch, B, a.steps, a.device)
        return

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
