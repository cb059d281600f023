"""Engine throughput in one process (no gRPC, no HTTP): ``python -m ppspec.bench.offline``.

Generates greedily for B ShareGPT prompts at once with the single-process API and prints
output tokens/s and the mean accept length for each speculative algorithm. Compares
ratios within one run (the machines are shared and noisy).

``--kv-tokens N --stop-token-ids T``: a KV pool that cannot hold every request's
``prompt + max_tokens`` at once, with requests that end at a stop token before
``max_tokens`` (as clients that set a generous ``max_tokens`` see them; the demo
checkpoint rarely emits EOS): the scheduler's KV pages on demand and preemption at work;
the preemption count is printed.
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.offline", description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--spec", default="none,ngram,mtp")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pp-size", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-tokens", type=int, default=65536, help="KV pool of each stage (tokens)")
    ap.add_argument("--stop-at-eos", action="store_true", help="end requests at EOS (default: run to max_tokens)")
    ap.add_argument("--stop-token-ids", default="", help="comma-separated ids that end a request early")
    a = ap.parse_args(argv)
    import torch

    from ppspec.bench.dataset import first_exchange, load_sharegpt
    from ppspec.router.llm import DEMO_MODEL, LLM
    from ppspec.router.types import SamplingParams

    if a.threads:
        torch.set_num_threads(a.threads)
    model = a.model or DEMO_MODEL
    prompts = [p[0] for p in map(first_exchange, load_sharegpt()[:400]) if p and 50 < len(p[0]) < 600]
    print(f"model {model}, torch threads {torch.get_num_threads()}, max_tokens {a.max_tokens}")
    stops = [int(t) for t in a.stop_token_ids.split(",") if t]
    print(f"kv_tokens {a.kv_tokens}, {'stop at EOS' if a.stop_at_eos else 'ignore EOS'}, stop tokens {stops}")
    print("| batch | spec | output tok/s | mean accept length | output tokens | preemptions |\n|---|---|---|---|---|---|")
    for spec in a.spec.split(","):
        llm = LLM(model, pp_size=a.pp_size, speculative_algorithm=spec, max_rows=64, device=a.device, dtype=a.dtype,
                  kv_tokens=a.kv_tokens)
        tok = llm.tokenizer
        for b in [int(x) for x in a.batch.split(",")]:
            ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   for p in prompts[:b]]
            ids = [i if isinstance(i, list) else i["input_ids"] for i in ids]
            llm.generate(ids[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
            t0 = time.perf_counter()
            before = getattr(llm.scheduler, "num_preemptions", 0)
            outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=not a.stop_at_eos,
                                                    stop_token_ids=stops))
            dt = time.perf_counter() - t0
            preempted = getattr(llm.scheduler, "num_preemptions", 0) - before
            n = sum(len(o.token_ids) for o in outs)
            acc = [x for o in outs for x in o.accept_lengths]
            mean = f"{sum(acc) / len(acc):.2f}" if acc else "-"
            print(f"| {b} | {spec} | {n / dt:.1f} | {mean} | {n} | {preempted} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
