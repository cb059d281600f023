"""FlashInfer's prefill attention (``kernels/attention/flashinfer.py``) on CUDA, against the
torch reference and the Triton kernel, and a bf16 pipeline's greedy tokens with it
against the same pipeline on Triton.

Marked ``gpu`` and ``flashinfer``: ``make test-gpu-flashinfer`` runs them where the
``flashinfer`` package is installed (``.whl/s/fi_test.sh``); ``make test-gpu`` leaves them
out. Where they are selected they fail, never skip, when flashinfer does not import.
Each head dim / dtype is a JIT build on first use (minutes, then cached on the machine).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.flashinfer]

BF16 = torch.bfloat16
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "models", "qwen35-demo")


@pytest.fixture(scope="module")
def fa(dev):
    """The FlashInfer module of ppspec, with flashinfer importable (else a failure)."""
    from ppspec.kernels.attention import flashinfer as fa

    assert dev.type == "cuda", "FlashInfer tests need CUDA"
    mod, why = fa._flashinfer()
    assert mod is not None, f"flashinfer does not import: {why}"
    return fa


def _rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "NaN in the output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _case(dev, Hq, Hkv, hd, page, seed, B=5):
    """Prefill chunks of B requests on scattered rows and pages: first chunks (kv_len = L)
    and later ones (kv_len > L, a prefix already cached). Returns the paged_attention
    arguments (int64 index tensors, as the stage makes them), a strided gate view as the
    model passes it, and the host lists of the plan."""
    from ppspec.kernels.checks import known

    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    Ls = [rng.randint(1, 300) for _ in range(B)]
    Ls[0] = 1  # a one-token chunk
    prefix = [0 if b % 3 == 1 else rng.randint(1, 1500) for b in range(B)]
    kv_lens = [p + L for p, L in zip(prefix, Ls)]
    max_pages = max(-(-n // page) for n in kv_lens) + 1
    rows_n = B + 6
    num_pages = (rows_n + 1) * max_pages + 3
    page_table = torch.randperm(num_pages, generator=gen)[: (rows_n + 1) * max_pages].view(rows_n + 1, max_pages)
    rows = torch.randperm(rows_n, generator=gen)[:B].tolist()
    k = torch.randn(num_pages, page, Hkv, hd, generator=gen).to(dev, BF16)
    v = torch.randn(num_pages, page, Hkv, hd, generator=gen).to(dev, BF16)
    T = sum(Ls)
    q = torch.randn(T, Hq, hd, generator=gen).to(dev, BF16)
    qkv = (torch.randn(T, 2 * Hq * hd, generator=gen) * 3).to(dev, BF16)
    gate = qkv.view(T, Hq, 2 * hd).chunk(2, dim=-1)[1]
    # what the stage states about its index tensors (kernels/checks.py), so that the
    # checks read no device value (which a graph capture forbids)
    cu = known(torch.tensor([0] + Ls).cumsum(0).to(dev), total=T, max_len=max(Ls), queries_fit=True)
    args = (q, k, v, known(page_table.to(dev), pages_in_pool=True),
            known(torch.tensor(rows, device=dev), min=min(rows), max=max(rows)),
            known(torch.tensor(kv_lens, device=dev), min=min(kv_lens), max=max(kv_lens)), cu, hd ** -0.5)
    return args, gate, (rows, kv_lens, Ls, page)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("heads", [(8, 8, 128), (16, 8, 128), (16, 2, 128), (8, 8, 256), (16, 8, 256), (16, 2, 256)])
def test_prefill_matches_reference(fa, dev, heads, page, gated):
    """GQA 1, 2 and 8, head dims 128 and 256, bf16: FlashInfer against the reference
    within bf16 error, as the Triton kernel is; FlashInfer really ran (the wrapper holds
    this plan)."""
    from ppspec.kernels.attention import paged_attention
    from ppspec.kernels.attention.gpu import paged_attention_gpu
    from ppspec.kernels.attention.naive import paged_attention_ref

    args, gate, lists = _case(dev, *heads, page, seed=sum(heads) + page + gated)
    gate = gate if gated else None
    plan = fa.prefill_plan(*lists)
    o = paged_attention(*args, gate=gate, plan=plan)
    assert fa._shared[args[0].device.index].owner is plan
    assert o.dtype == BF16 and o.shape == args[0].shape
    ref = paged_attention_ref(*args, gate=gate)
    err, err_triton = _rel_err(o, ref), _rel_err(paged_attention_gpu(*args, gate=gate), ref)
    assert err < 1e-2 and err < 2 * err_triton + 1e-3, (err, err_triton)
    # a second layer of the step reuses the plan: same numbers
    assert torch.equal(paged_attention(*args, gate=gate, plan=plan), o)


def test_interleaved_plans_and_fallbacks(fa, dev):
    """Two plans on the one wrapper, alternating without a host sync (each re-plans; the
    pinned plan buffer is not overwritten under a pending copy); under CUDA graph capture
    and for fp32 the Triton kernel runs instead (equal to it bit for bit)."""
    from ppspec.kernels.attention import paged_attention
    from ppspec.kernels.attention.gpu import paged_attention_gpu
    from ppspec.kernels.attention.naive import paged_attention_ref

    a_args, a_gate, a_lists = _case(dev, 16, 2, 256, 16, seed=1)
    b_args, b_gate, b_lists = _case(dev, 16, 2, 256, 16, seed=2, B=3)
    a, b = fa.prefill_plan(*a_lists), fa.prefill_plan(*b_lists)
    outs = [paged_attention(*args, gate=g, plan=p) for args, g, p in
            [(a_args, a_gate, a), (b_args, b_gate, b)] * 3]
    for i, (args, g) in enumerate([(a_args, a_gate), (b_args, b_gate)] * 3):
        assert _rel_err(outs[i], paged_attention_ref(*args, gate=g)) < 1e-2
        assert torch.equal(outs[i], outs[i % 2])

    triton_out = paged_attention_gpu(*a_args, gate=a_gate)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        paged_attention_gpu(*a_args, gate=a_gate)  # compile before capture
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        captured = paged_attention(*a_args, gate=a_gate, plan=a)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, triton_out)

    a32 = (a_args[0].float(), a_args[1].float(), a_args[2].float(), *a_args[3:])
    assert not a.supports(a32[0], a32[1])
    assert torch.equal(paged_attention(*a32, plan=a), paged_attention_gpu(*a32))


def _prefix_agreement(outs, ref):
    """Tokens up to each request's first divergence, as a fraction of all."""
    same = sum(next((j for j, (x, y) in enumerate(zip(o, r)) if x != y), len(r)) for o, r in zip(outs, ref))
    return same / sum(len(r) for r in ref)


# A logprob gap within which another kernel's bf16 rounding may flip a greedy choice: two
# bf16 ulps of a logit in [4, 8), one in [8, 16).
BF16_TIE = 0.125


def _chunked_prefill_hidden(stage, ids: list[list[int]], rows: list[int], chunk: int = 32) -> torch.Tensor:
    """Prefill ``ids`` at ``rows`` in chunks of ``chunk`` tokens (later chunks attend to the
    cached prefix); the hidden states ``[T, hidden]`` of the last chunk, fp32."""
    from ppspec.proto.messages import StepInput

    done, h = [0] * len(ids), None
    while any(d < len(x) for d, x in zip(done, ids)):
        sel = [i for i, (d, x) in enumerate(zip(done, ids)) if d < len(x)]
        take = {i: min(chunk, len(ids[i]) - done[i]) for i in sel}
        _, h = stage.forward_hidden(StepInput(0, 0, "prefill", [rows[i] for i in sel], [done[i] for i in sel],
                                              [take[i] for i in sel],
                                              [t for i in sel for t in ids[i][done[i]:done[i] + take[i]]]))
        for i in sel:
            done[i] += take[i]
    return h.float()


def test_bf16_flashinfer_prefill_matches_triton_to_rounding(fa, dev, monkeypatch):
    """The demo model in bf16, eager, prompts prefilled in chunks of 32 tokens, once with
    FlashInfer's prefill attention and once with Triton's:

    - a stage's hidden states after a three-chunk prefill agree to 3e-2 relative. On CPU,
      perturbing the reference's prefill attention by 0.35% (the two kernels' measured
      difference) moved them by 1.0e-2, by 3% 1.6e-2, by 30% 0.12 (bf16 rounding flips
      dominate the small cases).
    - greedy tokens part only at near-ties: at a request's first different token, the
      Triton run's top-2 logprob gap is at most ``BF16_TIE``.

    Token agreement is not the criterion: it measured 84% on the H200 (12 prompts x 48
    tokens), and on CPU one flip at a near-tie early in one request costs ~8% of it, with
    ~1% of this model's bf16 positions within 0.05 of a tie. These two checks have not run
    on a GPU yet (docs/PERFORMANCE.md, "Prefill attention")."""
    from transformers import AutoTokenizer

    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams
    from ppspec.stage_server.runner import StageRunner

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (70, 45, 90)]
    hidden = {}
    for backend in ("triton", "flashinfer"):
        monkeypatch.setenv(fa.ENV, backend)
        stage = StageRunner(DEMO, max_rows=4, device="cuda", dtype=BF16, cuda_graph_max_bs=0)
        assert stage.flashinfer_prefill == (backend == "flashinfer")
        hidden[backend] = _chunked_prefill_hidden(stage, ids, [2, 0, 3])
        del stage
    err = _rel_err(hidden["flashinfer"], hidden["triton"])
    print(f"bf16 stage, three-chunk prefill: hidden states FlashInfer vs Triton, relative error {err:.2e}")
    assert err < 3e-2

    tok = AutoTokenizer.from_pretrained(DEMO)
    texts = ["Explain how a hash map works.", "Write a short poem about the sea.", "What is 17 times 23?",
             "Give me three tips for learning Python.", "Summarize the plot of Hamlet.", "How do vaccines work?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t * (1 + i % 4)}], add_generation_prompt=True)
               for i, t in enumerate(texts * 2)]
    prompts = [p if isinstance(p, list) else list(p["input_ids"]) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    outs, gaps = {}, None
    for backend in ("triton", "flashinfer"):
        monkeypatch.setenv(fa.ENV, backend)
        llm = LLM(DEMO, device="cuda", dtype="bfloat16", max_rows=len(prompts), chunk_size=32, cuda_graph_max_bs=0)
        assert [r.flashinfer_prefill for r in llm.pipeline.runners] == [backend == "flashinfer"]
        fa._shared.pop(torch.cuda.current_device(), None)  # a fresh wrapper: its owner shows FlashInfer ran
        res = llm.generate(prompts, params)
        outs[backend] = [o.token_ids for o in res]
        if backend == "triton":  # the top-2 logprob gap at each position: how near a tie it was
            gaps = [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in res]
        assert (fa._shared.get(torch.cuda.current_device()) is not None) == (backend == "flashinfer")
        del llm
    parted = [(i, j, gaps[i][j]) for i, (o, r) in enumerate(zip(outs["flashinfer"], outs["triton"]))
              for j in [next((j for j, (x, y) in enumerate(zip(o, r)) if x != y), None)] if j is not None]
    print(f"bf16 greedy tokens, FlashInfer prefill vs Triton: {_prefix_agreement(outs['flashinfer'], outs['triton']):.2%} "
          f"identical; (request, first different token, Triton's top-2 logprob gap there): {parted}")
    assert all(gap <= BF16_TIE for _, _, gap in parted), parted
