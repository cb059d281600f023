"""Prefill against the compute floor, and decodes while a long prompt prefills.

``python -m ppspec.bench.prefill_ttft`` prints two markdown tables, every ratio from this run:

1. Time to first token of a lone prompt of each ``--lengths`` (``LLM.generate`` with
   ``max_tokens`` 1, median of ``--repeats`` after a warm-up at that length) against the
   compute floor measured in the same run: the forward's matrix FLOPs (2 x the decoder
   layers' parameters x tokens, plus causal attention's ``2 x heads x head_dim x T^2`` per
   full-attention layer; the GDN recurrence, norms and the embedding are left out, so
   the floor is a lower bound) at the rate of one matrix product of the model's dtype
   timed on the device (``[min(T, budget), hidden] x [hidden, 2 x intermediate]``, the
   MLP's gate / up GEMM).
2. Mixed load: ``--decoders`` requests decoding, then one ``--mixed-length`` prompt
   arrives. The decoders' inter-token latency p99 while it prefills against their p99
   over as many rounds without it, and its TTFT under that load against its TTFT alone.

On a GPU, without ``--model``, the random 1.46B Qwen3.5-shaped checkpoint of
``gpu_bench.make_random_checkpoint`` with its context raised to hold the longest prompt::

    python -m ppspec.bench.prefill_ttft --device cuda

On the CPU (demo checkpoint, whose context is 4096 tokens) the defaults are smaller.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from ppspec.argtypes import positive_int


def int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def _sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_rate(torch, device: str, dtype, m: int, k: int, n: int, repeats: int = 10) -> float:
    """FLOP/s of ``[m, k] x [k, n]`` in ``dtype`` on ``device`` (best of ``repeats`` after a warm-up)."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        _sync(torch, device)
        t0 = time.perf_counter()
        a @ b
        _sync(torch, device)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best


def forward_flops(cfg, layer_params: int, T: int) -> float:
    """Matrix FLOPs of a prefill of ``T`` tokens: the decoder layers' GEMMs and causal attention."""
    attn_layers = sum(1 for t in cfg.layer_types if t == "full_attention")
    return 2.0 * layer_params * T + attn_layers * 2.0 * cfg.num_attention_heads * cfg.head_dim * T * T


def random_prompt(rnd: random.Random, n: int, vocab: int) -> list[int]:
    return [rnd.randrange(3, vocab) for _ in range(n)]


def ttft_alone(torch, llm, prompt: list[int], repeats: int, device: str) -> float:
    """Median seconds of ``generate(prompt, max_tokens=1)``, after one warm-up call."""
    from ppspec.router.types import SamplingParams

    p = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt], p)
    times = []
    for _ in range(repeats):
        _sync(torch, device)
        t0 = time.perf_counter()
        llm.generate([prompt], p)
        _sync(torch, device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def mixed_load(torch, llm, rnd, vocab: int, decoders: int, decoder_prompt: int, long_len: int, device: str):
    """``decoders`` requests decode; a ``long_len`` prompt arrives. Returns (ITL p99 without,
    ITL p99 during its prefill, its TTFT, rounds its prefill took), seconds."""
    from ppspec.router.types import SamplingParams

    forever = SamplingParams(temperature=0.0, max_tokens=llm.max_context - decoder_prompt - 1, ignore_eos=True)
    ids = [llm.add_request(random_prompt(rnd, decoder_prompt, vocab), forever) for _ in range(decoders)]
    last: dict[str, float] = {}

    def rounds(n: int | None, until=None) -> tuple[list[float], float]:
        """Step ``n`` rounds (or until ``until()``); the decoders' gaps between tokens."""
        gaps, k = [], 0
        while (n is None or k < n) and not (until and until()):
            llm.step()
            _sync(torch, device)
            now = time.perf_counter()
            for rid in ids:
                if len(llm.completions[rid].token_ids) > counts.get(rid, 0):
                    if rid in last:
                        gaps.append(now - last[rid])
                    last[rid] = now
                    counts[rid] = len(llm.completions[rid].token_ids)
            k += 1
        return gaps, time.perf_counter()

    counts: dict[str, int] = {}
    while any(not llm.completions[r].token_ids for r in ids):  # every decoder past its prefill
        rounds(1)
    rounds(3)  # warm: every decode round shape met
    long_req = llm.add_request(random_prompt(rnd, long_len, vocab), SamplingParams(temperature=0.0, max_tokens=1,
                                                                                   ignore_eos=True))
    t0 = time.perf_counter()
    # its micro-batches: the rounds that computed some of its prompt (the engine forms a
    # lane's next micro-batch while one is out, so a round counter would count one formed
    # before the prompt arrived)
    seen = {"computed": 0, "rounds": 0}

    def done() -> bool:
        req = llm.scheduler.requests.get(long_req)
        finished = bool(llm.completions[long_req].token_ids)
        computed = long_len if req is None and finished else req.num_computed if req is not None else 0
        if computed > seen["computed"]:  # the request leaves the scheduler with its token
            seen["computed"], seen["rounds"] = computed, seen["rounds"] + 1
        return finished

    during, t1 = rounds(None, done)
    n_rounds = seen["rounds"]
    base, _ = rounds(max(n_rounds, 8))
    for r in ids:
        llm.abort(r)
    llm.completions.clear()
    return p99(base), p99(during), t1 - t0, n_rounds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.prefill_ttft", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None,
                    help="checkpoint folder (default: a random 1.46B one on CUDA, the demo checkpoint on the CPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--lengths", type=int_list, default=None,
                    help="prompt lengths (default: 1024,8192,32768 on CUDA, 512,1024,3968 on CPU)")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="token budget (default: LLM's)")
    ap.add_argument("--mixed-prefill-tokens", type=int_list, default=None,
                    help="prefill tokens beside decodes: the mixed load runs once per value (default: LLM's)")
    ap.add_argument("--chunk-size", type=positive_int, default=None)
    ap.add_argument("--pp-size", type=positive_int, default=1)
    ap.add_argument("--repeats", type=positive_int, default=4)
    ap.add_argument("--decoders", type=positive_int, default=32)
    ap.add_argument("--decoder-prompt", type=positive_int, default=64, help="tokens of each decoder's prompt")
    ap.add_argument("--mixed-length", type=positive_int, default=None,
                    help="the prompt arriving under load (default: 8192 on CUDA, 2048 on CPU)")
    ap.add_argument("--num-threads", type=positive_int, default=None, help="torch CPU threads")
    a = ap.parse_args(argv)
    import torch

    from ppspec.router.llm import DEMO_MODEL, LLM
    from ppspec.stage_server.config import load_config

    if a.num_threads:
        torch.set_num_threads(a.num_threads)
    cuda = a.device.startswith("cuda")
    dtype = a.dtype or ("bfloat16" if cuda else "float32")
    lengths = a.lengths or ([1024, 8192, 32768] if cuda else [512, 1024, 3968])
    long_len = a.mixed_length or (8192 if cuda else 2048)
    model = a.model or (None if cuda else DEMO_MODEL)
    if model is None:
        import os
        import tempfile

        from ppspec.bench.gpu_bench import make_random_checkpoint

        model = os.path.join(tempfile.mkdtemp(), "qwen35-1b")
        make_random_checkpoint(torch, model, max_position_embeddings=max(lengths + [long_len]) + 2048)
        torch.cuda.empty_cache()
    cfg = load_config(model)
    kv = max(65536, 2 * max(lengths + [long_len]) + a.decoders * 1024)
    llm = LLM(model, device=a.device, dtype=dtype, pp_size=a.pp_size, max_rows=a.decoders + 2, kv_tokens=kv,
              max_context=min(cfg.max_context, max(lengths + [long_len]) + 1024),
              max_num_batched_tokens=a.max_num_batched_tokens, chunk_size=a.chunk_size)
    budget = llm.scheduler.max_num_batched_tokens
    layer_params = sum(p.numel() for r in llm.pipeline.runners for n, p in r.model.named_parameters()
                       if n.startswith("layers."))
    tdtype = getattr(torch, dtype)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"## Prefill ({name}, {model.rstrip('/').split('/')[-1]}, {dtype}, PP{a.pp_size}, "
          f"token budget {budget}, {layer_params / 1e9:.3f} B layer parameters)\n")
    rnd = random.Random(0)
    print("| prompt tokens | TTFT ms | floor ms | TTFT / floor | matmul rate TFLOP/s |")
    print("|---|---|---|---|---|")
    alone = {}
    for T in lengths:
        if T + 1 > llm.max_context:
            print(f"| {T} | - | - | - | - | (beyond the context of {llm.max_context})")
            continue
        rate = matmul_rate(torch, a.device, tdtype, min(T, budget), cfg.hidden_size, 2 * cfg.intermediate_size)
        floor = forward_flops(cfg, layer_params, T) / rate
        t = ttft_alone(torch, llm, random_prompt(rnd, T, cfg.vocab_size), a.repeats, a.device)
        alone[T] = t
        print(f"| {T} | {t * 1e3:.1f} | {floor * 1e3:.1f} | {t / floor:.2f}x | {rate / 1e12:.2f} |", flush=True)
    if long_len not in alone:
        alone[long_len] = ttft_alone(torch, llm, random_prompt(rnd, long_len, cfg.vocab_size), a.repeats, a.device)
    print(f"\n### Mixed load: {a.decoders} requests decoding, one {long_len}-token prompt arrives "
          f"(alone: TTFT {alone[long_len] * 1e3:.1f} ms)\n")
    print("| prefill tokens beside decodes | its micro-batches | decoders' ITL p99 during / without the prefill "
          "| its TTFT under load / alone |")
    print("|---|---|---|---|")
    for m in a.mixed_prefill_tokens or [llm.scheduler.mixed_prefill_tokens]:
        llm.scheduler.mixed_prefill_tokens = m
        base, during, ttft, n_rounds = mixed_load(torch, llm, rnd, cfg.vocab_size, a.decoders, a.decoder_prompt,
                                                  long_len, a.device)
        print(f"| {m} | {n_rounds} | {during * 1e3:.1f} / {base * 1e3:.1f} ms, {during / base:.2f}x | "
              f"{ttft * 1e3:.1f} / {alone[long_len] * 1e3:.1f} ms, {ttft / alone[long_len]:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
