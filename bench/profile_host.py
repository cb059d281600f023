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

``--case mixed`` splits the same way the step of a mixed micro-batch (``--batch`` decodes
beside one request's ``--chunk``-token chunk of a long prompt, in one mixed graph) and
counts its synchronisations with the device on CUDA (:func:`split_mixed`); ``--device cpu``
times the host's part on the demo checkpoint (the forward, eager there, timed apart).
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


def split_mixed(torch, batch: int, chunk: int, steps: int, device: str) -> dict[str, float]:
    """The host's part of a mixed micro-batch: ``batch`` decodes beside one request's chunk
    of ``chunk`` tokens of a long prompt, in one mixed graph (``graphs.MixedGraphs``, built for
    chunks of ``chunk`` tokens), through ``StageRunner.step`` on the last stage. Medians of
    ``steps`` steps (ms): ``wall``; ``host_before_launch`` (validation, the rows, KV pages,
    the graphs' fill: the device waits); ``after_launch`` (the rest of the step: on CUDA the
    device's time, the read of the tokens and the host's sampling; on the CPU the forward
    and the logits, computed eagerly there, are left out: ``forward``) and ``reads``, the step's
    synchronisations with the device (CUDA: ``torch.cuda.set_sync_debug_mode``; one is the
    read of the sampled tokens). The prompt restarts on the same row when it would pass the
    context.

    CUDA: the random 1.46B checkpoint, bf16, an 8k context. CPU: the demo checkpoint, fp32,
    a prompt of 4 chunks, with the long prefill bucket the CUDA stage captures forced (the
    CPU has none: they need fla), its forward run eagerly."""
    import os
    import random
    import statistics
    import tempfile
    import warnings

    from ppspec.proto.messages import StepInput
    from ppspec.stage_server import graphs
    from ppspec.stage_server.runner import StageRunner

    cuda = device == "cuda"
    if cuda:
        from ppspec.bench.gpu_bench import make_random_checkpoint

        path = os.path.join(tempfile.mkdtemp(), "qwen35-1b")
        make_random_checkpoint(torch, path)
        kw, ctx = dict(dtype=torch.bfloat16, device="cuda"), 8192
    else:
        from ppspec.router.llm import DEMO_MODEL

        path, kw, ctx = DEMO_MODEL, dict(dtype=torch.float32, device="cpu"), 4 * chunk + 128  # a short prompt: fast
    long_tokens = graphs.PrefillGraphs.__dict__["_long_tokens"]  # the staticmethod itself
    if not cuda:  # the bucket CUDA captures for this chunk, for this runner only
        t = next(t for t in graphs.PREFILL_GRAPH_LONG_TOKENS if t > chunk)
        graphs.PrefillGraphs._long_tokens = staticmethod(lambda capture, max_kv_len: [t])
    try:
        r = StageRunner(path, max_rows=batch + 1, kv_tokens=batch * 1024 + ctx + 1024, cuda_graph_max_bs=batch,
                        mixed_graph_tokens=chunk, max_context=ctx, **kw)
    finally:
        graphs.PrefillGraphs._long_tokens = long_tokens
    mg = r.mixed_graphs["decode"]
    forward = {"s": 0.0}
    if not cuda:  # the CPU runs the graph's forward eagerly: timed apart
        run_forward = mg._forward

        def timed(key):
            t0 = time.perf_counter()
            out = run_forward(key)
            forward["s"] += time.perf_counter() - t0
            return out
        mg._forward = timed
        logits = r.model.logits

        def timed_logits(*a, **k):
            t0 = time.perf_counter()
            out = logits(*a, **k)
            forward["s"] += time.perf_counter() - t0
            return out
        r.model.logits = timed_logits
    rnd = random.Random(0)
    V = r.cfg.vocab_size
    rows, lens, row = list(range(batch)), [64] * batch, batch
    r.step(StepInput(0, 0, "prefill", rows, [0] * batch, lens, [rnd.randrange(V) for _ in range(64 * batch)]))
    prompt = [rnd.randrange(V) for _ in range(ctx - 64)]
    seq, rows_t = 0, {k: [] for k in ("wall", "host_before_launch", "after_launch", "forward", "reads")}
    for i in range(steps + 3):
        if seq + chunk + 1 > len(prompt):
            r.release([row])
            seq = 0
        inp = StepInput(0, i + 1, "decode", rows + [row], lens + [seq], [1] * batch + [chunk],
                        [rnd.randrange(V) for _ in range(batch)] + prompt[seq:seq + chunk],
                        sample=[True] * batch + [False], next_token_ids=[-1] * batch + [prompt[seq + chunk]],
                        num_prefill=1)
        forward["s"] = 0.0
        before = r.forwards["graph"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            try:
                r.step(inp)
            finally:
                wall = time.perf_counter() - t0
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
        if r.forwards["graph"] != before + 1 or not t0 < mg.steps.launched_at < t0 + wall:
            raise RuntimeError("the mixed step did not replay its mixed graph")
        lens, seq = [n + 1 for n in lens], seq + chunk
        if i < 3:  # every kernel and bucket met once first
            continue
        pre = mg.steps.launched_at - t0
        rows_t["wall"].append(wall)
        rows_t["host_before_launch"].append(pre)
        rows_t["after_launch"].append(wall - pre - forward["s"])
        rows_t["forward"].append(forward["s"])
        rows_t["reads"].append(sum("synchroniz" in str(w.message) for w in caught) / 1e3)
    return {k: statistics.median(v) * 1e3 for k, v in rows_t.items()}


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
    ap.add_argument("--case", choices=("demo", "1b", "mixed"), default="demo")
    ap.add_argument("--steps", type=int, default=30, help="--case 1b / mixed: timed steps (median)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="--case 1b / mixed only")
    ap.add_argument("--chunk", type=int, default=512, help="--case mixed: the prefill chunk beside the decodes")
    a = ap.parse_args(argv)
    B = a.batch
    if a.case == "1b":
        split_1b(torch, B, a.steps, a.device)
        return
    if a.case == "mixed":
        t = split_mixed(torch, B, a.chunk, a.steps, a.device)
        print(f"| mixed step, {B} decodes + a {a.chunk}-token chunk ({a.device}) | wall (ms) | host before the launch "
              "| after the launch | CPU: forward and logits, not in after | device reads |")
        print("|---|---|---|---|---|---|")
        print(f"| median of {a.steps} | {t['wall']:.3f} | {t['host_before_launch']:.3f} | {t['after_launch']:.3f} | "
              f"{t['forward']:.3f} | {t['reads']:.0f} |")
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
