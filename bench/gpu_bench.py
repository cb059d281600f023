"""GPU engine benchmarks (H200): ``python -m ppspec.bench.gpu_bench`` prints a markdown report.

1. HBM bandwidth: device-to-device copy of a 2 GiB buffer (the roofline's denominator).
2. Demo checkpoint, bf16: output tokens/s with MTP against no speculation at batch 1 and 32,
   and Hugging Face transformers' ``generate`` on the same prompts and GPU.
3. A random 1B-parameter Qwen3.5-shaped checkpoint: decode-step time at batch 1, 16, 64
   against its roofline ``(weight + KV + state bytes read) / measured bandwidth``, and a
   whole verify round (D = 4 tokens per request, logits, acceptance, commit) against it.
Every ratio is measured within this one run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def bandwidth_gbs(torch) -> float:
    x = torch.empty(1 << 30, dtype=torch.float16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        y.copy_(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / n
    return 2 * x.numel() * x.element_size() / dt / 1e9  # read + write


def demo_llm(torch, model, batch, spec, prompts, max_tokens):
    """The demo checkpoint in bf16 on CUDA with speculation ``spec``, warmed up with the
    very call it will be timed on: every kernel specialisation the timed runs meet (Triton
    compiles one per tile choice, and the batch shrinks as requests finish) is compiled
    before any clock starts."""
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    llm = LLM(model, device="cuda", dtype="bfloat16", speculative_algorithm=spec, max_rows=max(batch, 4))
    llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    torch.cuda.synchronize()
    return llm


def demo_throughput(torch, llm, prompts, batch, max_tokens):
    """One timed greedy ``generate`` of ``batch`` prompts: (output tokens/s, mean accept
    length or None)."""
    from ppspec.router.types import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts[:batch], p)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    acc = [a for o in outs for a in o.accept_lengths]
    return sum(len(o.token_ids) for o in outs) / dt, (sum(acc) / len(acc) if acc else None)


def hf_throughput(torch, model, prompts, batch, max_tokens):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    L = max(len(p) for p in prompts[:batch])
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts[:batch]], device="cuda")
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts[:batch]], device="cuda")
    kw = dict(attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        m.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.generate(ids, **kw)
        torch.cuda.synchronize()
    return batch * max_tokens / (time.perf_counter() - t0)


QWEN35_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=20,
                 num_attention_heads=16, num_key_value_heads=2, head_dim=128, linear_num_key_heads=16,
                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                 max_position_embeddings=8192)

# Kimi Linear at about the same size (0.96B parameters, 0.55B read per token): KDA layers of
# 16 heads of 128, MLA every 4th layer (layers 4 and 8, transformers' default pattern), a
# dense first layer, then 16 experts of 512 (top 4) and one shared expert
KIMI_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=12,
               num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, linear_num_heads=16, linear_head_dim=128,
               moe_intermediate_size=512, num_local_experts=16, num_experts_per_tok=4, n_shared_experts=1,
               n_group=1, topk_group=1, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _save_random(torch, path, device, config_cls: str, model_cls: str, shape: dict) -> int:
    """Save transformers' ``model_cls`` (a name in ``transformers``) built from ``config_cls(**shape)``,
    randomly initialised, in bf16 at ``path``, with the demo checkpoint's tokenizer files.
    Returns its parameter count (all experts)."""
    import shutil

    import transformers

    from ppspec.router.llm import DEMO_MODEL

    with torch.device(device):
        m = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**shape)).to(torch.bfloat16)
    m.save_pretrained(path)
    n = sum(p.numel() for p in m.parameters())
    del m
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEMO_MODEL, name), path)
    return n


def make_random_kimi_checkpoint(torch, path, device="cuda", **shape) -> int:
    """A random Kimi-Linear-shaped checkpoint (``KimiLinearForCausalLM``, default
    :data:`KIMI_1B`), as :func:`_save_random`."""
    return _save_random(torch, path, device, "KimiLinearConfig", "KimiLinearForCausalLM", {**KIMI_1B, **shape})


# NemotronH at about the same size (0.87B): 32 blocks, four times "M-M-M-M*" (16 Mamba2 blocks
# of 32 heads of 64 with 8 groups of B / C of 128, 12 relu2 MLPs of 8192, 4 attention blocks)
NEMOTRON_1B = dict(vocab_size=32000, hidden_size=2048, hybrid_override_pattern="M-M-M-M*" * 4, intermediate_size=8192,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, mamba_num_heads=32, mamba_head_dim=64,
                   n_groups=8, ssm_state_size=128, conv_kernel=4, max_position_embeddings=8192, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2)

# Falcon-H1 at about the same size (1.15B): 16 layers, each attention (16 heads of 128, 8 KV
# heads) beside a Mamba2 mixer (32 heads of 64, one group of B / C of 128), SwiGLU MLPs of
# 6144, transformers' default multipliers
FALCON_H1_1B = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, intermediate_size=6144,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, mamba_n_heads=32, mamba_d_head=64,
                    mamba_d_ssm=2048, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_rms_norm=True,
                    max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2)


# Granite 4.0 hybrid at about the same size (0.95B): 16 layers, attention (12 heads of 128, 4
# KV heads, no positional encoding, as Granite 4.0-H) at 5 and 11, Mamba2 elsewhere (48 heads
# of 64, one group of B / C of 128); every layer a shared SwiGLU MLP of 1024 and 16 SwiGLU
# experts of 512, top 4; tied embeddings
GRANITE_1B = dict(vocab_size=32000, hidden_size=1536, num_hidden_layers=16,
                  layer_types=["attention" if i in (5, 11) else "mamba" for i in range(16)], num_attention_heads=12,
                  num_key_value_heads=4, position_embedding_type="nope", intermediate_size=512,
                  shared_intermediate_size=1024, num_local_experts=16, num_experts_per_tok=4, mamba_n_heads=48,
                  mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
                  tie_word_embeddings=True, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)

# Bamba at about the same size (0.92B): 16 layers, attention (16 heads of 128, 8 KV heads,
# RoPE over half of each head) at 5 and 11, Mamba2 elsewhere (64 heads of 64, one group of
# B / C of 128), SwiGLU MLPs of 4096
BAMBA_1B = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, attn_layer_indices=[5, 11],
                num_attention_heads=16, num_key_value_heads=8, intermediate_size=4096, mamba_n_heads=64,
                mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
                max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def make_random_nemotron_checkpoint(torch, path, device="cuda", **shape) -> int:
    """A random NemotronH-shaped checkpoint (``NemotronHForCausalLM``, default
    :data:`NEMOTRON_1B`), as :func:`_save_random`."""
    return _save_random(torch, path, device, "NemotronHConfig", "NemotronHForCausalLM", {**NEMOTRON_1B, **shape})


def make_random_falcon_h1_checkpoint(torch, path, device="cuda", **shape) -> int:
    """A random Falcon-H1-shaped checkpoint (``FalconH1ForCausalLM``, default
    :data:`FALCON_H1_1B`), as :func:`_save_random`."""
    return _save_random(torch, path, device, "FalconH1Config", "FalconH1ForCausalLM", {**FALCON_H1_1B, **shape})


def make_random_granite_checkpoint(torch, path, device="cuda", **shape) -> int:
    """A random Granite-4.0-hybrid-shaped checkpoint (``GraniteMoeHybridForCausalLM``, default
    :data:`GRANITE_1B`), as :func:`_save_random`."""
    return _save_random(torch, path, device, "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                        {**GRANITE_1B, **shape})


def make_random_bamba_checkpoint(torch, path, device="cuda", **shape) -> int:
    """A random Bamba-shaped checkpoint (``BambaForCausalLM``, default :data:`BAMBA_1B`), as
    :func:`_save_random`."""
    return _save_random(torch, path, device, "BambaConfig", "BambaForCausalLM", {**BAMBA_1B, **shape})


def make_random_checkpoint(torch, path, device="cuda", mtp=True, **shape) -> int:
    """Save a randomly initialised Qwen3.5-shaped checkpoint (bf16) at ``path``: transformers'
    ``Qwen3_5ForCausalLM`` with ``shape`` (default :data:`QWEN35_1B`, 1.46B parameters),
    the demo checkpoint's tokenizer files (its 8192 ids fit any vocab here), and with ``mtp``
    a random one-layer MTP head (``mtp.*`` in ``mtp.safetensors``, ``mtp_num_hidden_layers``
    = 1; transformers' model has no MTP module). Returns the base model's parameter count."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from ppspec.router.llm import DEMO_MODEL
    from ppspec.stage_server.config import load_config
    from ppspec.stage_server.layers.rotary import Rotary
    from ppspec.stage_server.models.qwen3_next.model import MTPHead

    cfg = Qwen3_5TextConfig(**{**QWEN35_1B, **shape}, tie_word_embeddings=False)
    with torch.device(device):
        m = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(path)
    n = sum(p.numel() for p in m.parameters())
    del m
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEMO_MODEL, name), path)
    if mtp:
        conf_path = os.path.join(path, "config.json")
        conf = json.loads(Path(conf_path).read_text())
        conf["mtp_num_hidden_layers"] = 1
        Path(conf_path).write_text(json.dumps(conf, indent=2))
        hc = load_config(path)
        torch.manual_seed(0)
        head = MTPHead(hc, Rotary(hc))
        for name, p in head.named_parameters():
            if name.endswith("proj.weight") or name.endswith("fc.weight"):
                torch.nn.init.normal_(p, std=cfg.initializer_range)
        tensors = {"mtp." + k: v.to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
        save_file(tensors, os.path.join(path, "mtp.safetensors"))
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            idx = json.loads(Path(index).read_text())
            idx["weight_map"].update({k: "mtp.safetensors" for k in tensors})
            Path(index).write_text(json.dumps(idx, indent=2))
    return n


def step_bytes(r, batch, ctx) -> tuple[int, int, int]:
    """Bytes a decode step of ``batch`` requests at context ``ctx`` must read: ``(weights,
    KV, state)``. Every weight but the embedding table (one row per token) and the MTP
    head, of a routed MoE's experts (Granite's stacked ``block_sparse_moe.input_linear`` /
    ``output_linear`` included) at most the ``batch x top-k`` the tokens pick; keys and
    values once where the pool shares them (MLA's latent); the state read and written once."""
    c = r.cfg
    weights = 0
    experts = getattr(c, "num_experts", 0) or getattr(c, "n_routed_experts", 0)  # NemotronH's name for it
    for n, p in r.model.named_parameters():
        if n.startswith(("mtp.", "embed_tokens.", "embeddings.")):
            continue
        routed = ".experts." in n or ".block_sparse_moe.input_linear." in n or ".block_sparse_moe.output_linear." in n
        share = min(1.0, batch * c.num_experts_per_tok / experts) if routed else 1.0
        weights += int(p.numel() * p.element_size() * share)
    kv = len(r.model.kv_layers) * batch * ctx * (1 if r.model.shared_kv else 2) * c.num_key_value_heads * c.head_dim * 2
    # the recurrent state of a row in one layer (GDN [HV, K, V], Mamba2 [H, P, N]), fp32
    state = 0 if r.state is None else len(r.model.state_layers) * batch * 2 * 4 * r.state.ssm[0, 0].numel()
    return weights, kv, state


def eager_decode_step(torch, path, batch, ctx) -> float:
    """Seconds of a plain decode step of ``batch`` requests at context ``ctx`` through
    ``StageRunner.step`` without CUDA graphs (every kernel launched from Python)."""
    return _time(torch, prefilled_steps(torch, path, batch, ctx, cuda_graph_max_bs=0)[1])


def decode_and_verify(torch, path, batch, ctx, repeats=5, n=10, steps=3, **runner_kwargs):
    """A plain decode step and a whole verify round (``steps`` drafts, its commit) of
    ``batch`` requests at context ``ctx``, both runners alive and timed in alternating
    blocks of ``n`` steps, so that a slow spell of the shared machine hits both (timed one
    after the other in separate runs, the ratio moved by 0.05). Returns ``(decode seconds,
    verify seconds, the sorted per-block verify / decode ratios, the decode runner)``, the
    times medians of ``repeats`` blocks. Contexts grow by the tokens each step emits (a
    verify round up to ``steps + 1``), over ``3 + max(1, n // 2) + repeats * (n + 1)``
    steps: at the defaults by at most 252 tokens."""
    warm = max(1, n // 2)
    rounds = 3 + warm + repeats * (n + 1)  # every call below; the pools hold that many
    dec, dec_step, _ = prefilled_steps(torch, path, batch, ctx, 0, rounds=rounds, **runner_kwargs)
    _, ver_step, _ = prefilled_steps(torch, path, batch, ctx, steps, rounds=rounds, **runner_kwargs)
    for fn in (dec_step, ver_step):
        _time(torch, fn, warmup=3, n=warm)  # compiles; the replay buffers fill
    times = {"decode": [], "verify": []}
    for _ in range(repeats):
        times["decode"].append(_time(torch, dec_step, warmup=1, n=n))
        times["verify"].append(_time(torch, ver_step, warmup=1, n=n))
    ratios = sorted(v / d for d, v in zip(times["decode"], times["verify"]))
    return statistics.median(times["decode"]), statistics.median(times["verify"]), ratios, dec


def prefilled_steps(torch, path, batch, ctx, steps=0, rounds=64, **runner_kwargs):
    """``batch`` requests prefilled with ``ctx`` tokens on a bf16 CUDA ``StageRunner`` (unless
    ``runner_kwargs`` say otherwise), and a closure running one step of them: ``(runner,
    step, seq_lens)``.

    ``steps`` 0: a plain decode step. Else a whole verify round of ``steps`` drafts each (D
    = steps + 1 tokens): ``StageRunner.step`` in verify mode (graph replay, logits, the
    host's acceptance) plus ``commit_accept`` of the accept lengths it returned (replay
    design: the next verify applies them). ``seq_lens`` (a list the closure advances by the
    tokens each step emits) are the rows' lengths. The KV pool holds ``rounds`` rounds of D
    tokens past the prompt for every row (each row's last page partly used, hence the
    extra page a row)."""
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner

    D = steps + 1
    page = runner_kwargs.get("page_size", 16)
    runner_kwargs.setdefault("kv_tokens", batch * (ctx + rounds * D + page))
    runner_kwargs = {"dtype": torch.bfloat16, "device": "cuda", **runner_kwargs}
    r = StageRunner(path, max_rows=batch, num_speculative_steps=steps, **runner_kwargs)
    rows = list(range(batch))
    r.step(StepInput(0, 0, "prefill", rows, [0] * batch, [ctx] * batch, [1] * (ctx * batch)))
    mode = "verify" if steps else "decode"
    seq, rnd = [ctx] * batch, [1]

    def step():
        out = r.step(StepInput(0, rnd[0], mode, rows, list(seq), [D] * batch, [1] * (D * batch),
                               num_drafts=[steps] * batch if steps else []))
        acc = [len(t) for t in out.output_ids]
        if steps:
            r.commit_accept(0, rnd[0], rows, acc)
        for i, a in enumerate(acc):
            seq[i] += a
        rnd[0] += 1

    return r, step, seq


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(torch, fn, warmup=3, n=10) -> float:
    """Mean seconds of ``n`` calls of ``fn`` after ``warmup`` calls (device work included)."""
    for _ in range(warmup):
        fn()
    _sync(torch)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(torch)
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.gpu_bench", description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--skip-1b", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="timed demo runs of each algorithm (median reported)")
    ap.add_argument("--skip-demo", action="store_true", help="only the bandwidth and the 1B steps")
    ap.add_argument("--batch", default="1,16,64", help="1B batch sizes (comma-separated)")
    ap.add_argument("--skip-eager", action="store_true", help="1B decode with CUDA graphs only")
    ap.add_argument("--family", choices=("qwen3_5", "kimi_linear", "nemotron_h", "falcon_h1", "granitemoehybrid",
                                         "bamba"), default="qwen3_5",
                    help="the random 1B checkpoint's family: Qwen3.5 (GDN), Kimi Linear (KDA + MLA + MoE), "
                         "NemotronH (Mamba2 + attention + relu2 MLP), Falcon-H1 (attention beside Mamba2 in "
                         "every layer), Granite 4.0 hybrid (Mamba2 + attention, shared MLP + MoE) or Bamba "
                         "(Mamba2 + attention, SwiGLU MLPs)")
    ap.add_argument("--make-1b", metavar="PATH", default=None,
                    help="only save the random 1B checkpoint (with a random MTP head) at PATH and exit")
    a = ap.parse_args(argv)
    import torch

    make = {"kimi_linear": make_random_kimi_checkpoint, "nemotron_h": make_random_nemotron_checkpoint,
            "falcon_h1": make_random_falcon_h1_checkpoint, "granitemoehybrid": make_random_granite_checkpoint,
            "bamba": make_random_bamba_checkpoint}.get(a.family, make_random_checkpoint)
    if a.make_1b:
        n = make(torch, a.make_1b, "cuda" if torch.cuda.is_available() else "cpu")
        print(f"saved {a.make_1b}: {n / 1e9:.2f} B parameters" + (" + MTP head" if a.family == "qwen3_5" else ""))
        return 0
    from transformers import AutoTokenizer

    from ppspec.router.llm import DEMO_MODEL

    model = a.model or DEMO_MODEL
    bw = bandwidth_gbs(torch)
    print(f"## GPU engine ({torch.cuda.get_device_name()}, torch {torch.__version__})\n")
    print(f"device-to-device copy bandwidth: {bw:.0f} GB/s\n")
    tok = AutoTokenizer.from_pretrained(model)
    texts = ["Explain how a hash map works.", "Write a short poem about the sea.", "What is 17 times 23?",
             "Give me three tips for learning Python.", "Summarize the plot of Hamlet.", "How do vaccines work?"]
    prompts = []
    for i in range(32):
        x = tok.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}], add_generation_prompt=True)
        prompts.append(x if isinstance(x, list) else list(x["input_ids"]))
    if not a.skip_demo:
        print(f"ppspec: median of {a.repeats} runs of each, interleaved\n")
        print("| batch | ppspec none tok/s | ppspec mtp tok/s | mtp / none | mean accept length | HF generate tok/s | "
              "ppspec best / HF | range none / mtp |")
        print("|---|---|---|---|---|---|---|---|")
    for b in () if a.skip_demo else (1, 32):
        demo_row(torch, model, prompts, b, a.max_tokens, a.repeats)
    if not a.skip_demo:
        graphs, eager = demo_ttft(torch, model, prompts[0])
        print(f"\ntime to first token, batch 1, {len(prompts[0])}-token prompt, MTP: {graphs * 1e3:.2f} ms "
              f"(eager prefill: {eager * 1e3:.2f} ms)")
    if not a.skip_1b:
        path = os.path.join(tempfile.mkdtemp(), f"{a.family}-1b")
        n = make(torch, path)
        torch.cuda.empty_cache()
        print(f"\nrandom {a.family}-shaped checkpoint: {n / 1e9:.2f} B parameters, bf16, context 1024; a verify "
              "round is D = 4 tokens per request plus its commit\n")
        print("| batch | decode step, CUDA graphs (ms) | eager (ms) | roofline (ms) | graphs / roofline | "
              "verify round (ms) | verify / decode (range over blocks) | weight MB | KV MB | state MB |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for b in (int(x) for x in a.batch.split(",")):
            eager = float("nan") if a.skip_eager else eager_decode_step(torch, path, b, 1024)
            torch.cuda.empty_cache()
            dt, vr, ratios, r = decode_and_verify(torch, path, b, 1024)
            w, kv, st = step_bytes(r, b, 1024)
            floor = (w + kv + st) / (bw * 1e9)
            del r
            torch.cuda.empty_cache()
            print(f"| {b} | {dt * 1e3:.2f} | {eager * 1e3:.2f} | {floor * 1e3:.3f} | {dt / floor:.1f} | "
                  f"{vr * 1e3:.2f} | {vr / dt:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) | {w / 1e6:.0f} | "
                  f"{kv / 1e6:.0f} | {st / 1e6:.0f} |", flush=True)
    return 0


def demo_ttft(torch, model, prompt, repeats=5) -> tuple[float, float]:
    """Time to the first token of one request (its prefill, sampling and MTP drafts):
    median seconds with CUDA graphs (short prefill chunks replay one) and eagerly."""
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    out = []
    for graphs in (None, 0):
        llm = LLM(model, device="cuda", dtype="bfloat16", speculative_algorithm="mtp", max_rows=4,
                  cuda_graph_max_bs=graphs)
        p = SamplingParams(temperature=0, max_tokens=1)
        llm.generate([prompt], p)  # compiles
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate([prompt], p)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
        del llm
    return out[0], out[1]


def demo_row(torch, model, prompts, b, max_tokens, repeats) -> None:
    """MTP against no speculation, each timed ``repeats`` times, the two interleaved (so a
    slow spell of the shared machine hits both), medians reported."""
    llms = {spec: demo_llm(torch, model, b, spec, prompts, max_tokens) for spec in ("none", "mtp")}
    runs = {spec: [] for spec in llms}
    for _ in range(repeats):
        for spec, llm in llms.items():
            runs[spec].append(demo_throughput(torch, llm, prompts, b, max_tokens))
    none, mtp = (statistics.median(r[0] for r in runs[spec]) for spec in ("none", "mtp"))
    acc = runs["mtp"][0][1]  # greedy: every repeat accepts the same tokens
    del llms
    torch.cuda.empty_cache()
    hf = hf_throughput(torch, model, prompts, b, max_tokens)
    spread = " / ".join(f"{min(r[0] for r in runs[s]):.0f}-{max(r[0] for r in runs[s]):.0f}" for s in ("none", "mtp"))
    print(f"| {b} | {none:.0f} | {mtp:.0f} | {mtp / none:.2f} | {acc:.2f} | {hf:.0f} | {max(none, mtp) / hf:.2f} | {spread} |",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
