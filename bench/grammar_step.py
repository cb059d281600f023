"""A step's time with a fresh 50-property JSON schema's request in its micro-batch, with the
grammar compiled off the step (the router's PrepareGrammar before admission, the default)
and in the step (``--in-step``: the compile that used to run there).

Runs the demo checkpoint in process (PP1, CPU): ``--decodes`` plain requests decode; each
trial submits one constrained request with a schema never seen before (fresh property
names: no compile cache hit) and records the time of the step that carries its first
chunk against the median of the plain decode steps around it.

    python bench/grammar_step.py [--trials 10] [--decodes 8] [--in-step]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ppspec.router.llm import DEMO_MODEL, LLM
from ppspec.router.protocol import CompletionRequest
from ppspec.router.structured import request_grammar
from ppspec.router.types import SamplingParams


def schema(trial: int, n: int = 50) -> dict:
    kinds = ["string", "integer", "number", "boolean"]
    props = {f"t{trial}_field_{i}": {"type": kinds[i % 4]} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)[:5]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--in-step", action="store_true", help="compile in the step (no PrepareGrammar)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(DEMO_MODEL, max_rows=args.decodes + 2)
    if args.in_step:
        async def nothing(grammar):  # the step compiles (GrammarRows.compiled's fallback)
            return None
        llm.pipeline.prepare_grammar = nothing
    steps: list[tuple[bool, float]] = []  # (carries a grammar, seconds)
    step_sync = llm.pipeline.step_sync

    def timed(inp):
        t = time.perf_counter()
        out = step_sync(inp)
        steps.append((any(s.grammar for s in inp.sampling), time.perf_counter() - t))
        return out

    llm.pipeline.step_sync = timed
    plain = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    for k in range(args.decodes):
        llm.add_request([5 + k, 6, 7, 8], plain)
    for _ in range(5):
        llm.step()
    with_grammar, without = [], []
    for trial in range(args.trials):
        g = request_grammar(CompletionRequest(prompt="x", guided_json=schema(trial)))
        rid = llm.add_request([9, 10, 11], SamplingParams(temperature=0, max_tokens=4, grammar=g))
        n0 = len(steps)
        while llm.completions[rid].finish_reason is None:
            llm.step()
        for _ in range(3):
            llm.step()
        with_grammar += [s for carries, s in steps[n0:] if carries]
        without += [s for carries, s in steps[n0:] if not carries]
    compiles = llm.pipeline.runners[-1].grammars.step_compiles
    print(json.dumps({
        "compile": "in the step" if args.in_step else "off the step (PrepareGrammar)",
        "step_ms_with_fresh_schema_median": round(1e3 * statistics.median(with_grammar), 2),
        "step_ms_with_fresh_schema_max": round(1e3 * max(with_grammar), 2),
        "step_ms_plain_median": round(1e3 * statistics.median(without), 2),
        "steps_that_compiled": compiles, "trials": args.trials, "decodes": args.decodes,
    }))
    llm.close()


if __name__ == "__main__":
    main()
