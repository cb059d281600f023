"""Kimi Linear on CUDA: fla's ``chunk_kda`` prefill at stable rows against the plain-torch
reference, the MLA kernel on the latent cache against its reference, the MoE's CUDA expert
runs (grouped GEMM, dense) against the CPU's and in a CUDA graph (the bf16 stage in CUDA
graphs against the fp32 CPU stage: tests/gpu/test_family_graphs_gpu.py), and end to end fp32 greedy tokens on
CUDA identical to the CPU's PP1 without speculation (near-ties of the reference aside,
docs/DESIGN.md, "Correctness"), PP 1 to 3, n-gram drafts, both commit designs."""
import os
import random
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

F32, BF16 = torch.float32, torch.bfloat16
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("K", [16, 128])
def test_kda_prefill_rows_fla(dev, K, dtype):
    if dev.type != "cuda":
        pytest.skip("fla needs CUDA")
    pytest.importorskip("fla")
    import importlib

    from ppspec.kernels.kda import chunk_kda_ref, kda_prefill_rows

    importlib.import_module("ppspec.kernels.gdn.fla_prefill")  # the path under test must import
    gen = torch.Generator().manual_seed(K + (dtype == BF16))
    H, rows = 4, 9
    lens = [1, 63, 64, 65, 300]
    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0)
    q, k, v = (torch.randn(T, H, K, generator=gen).to(dtype) for _ in range(3))
    g = -torch.nn.functional.softplus(torch.randn(T, H, K, generator=gen)) * 0.3
    beta = torch.rand(T, H, generator=gen).to(dtype)
    pool = torch.randn(rows + 1, H, K, K, generator=gen) * 0.1
    idx = torch.tensor([7, 0, 3, 5, 8])
    has_init = torch.tensor([True, False, True, True, False])
    init = torch.where(has_init.view(-1, 1, 1, 1), pool[idx], torch.zeros(()))
    o_ref, fin_ref = chunk_kda_ref(q, k, v, g, beta, cu, init)
    gpu_pool = pool.to(dev)
    o = kda_prefill_rows(*(x.to(dev) for x in (q, k, v, g, beta, cu)), gpu_pool, idx.to(dev), has_init.to(dev))
    tol = 5e-3 if dtype == F32 else 2e-2  # fla's products run in tf32 / bf16
    assert o.dtype == dtype and _rel_err(o.cpu(), o_ref) < tol
    assert _rel_err(gpu_pool[idx].cpu(), fin_ref) < tol
    others = [r for r in range(rows + 1) if r not in idx.tolist()]
    assert torch.equal(gpu_pool[others].cpu(), pool[others])


def _kda_inputs(B, D, H, K, V, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, D, H, K, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, D, H, V, generator=gen).to(dtype)
    g = -torch.nn.functional.softplus(torch.randn(B, D, H, K, generator=gen)) * 0.3
    return q, k, v, g, torch.rand(B, D, H, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("B,D,K,V", [(1, 1, 16, 16), (5, 1, 128, 128), (3, 2, 16, 16), (6, 4, 64, 128), (4, 8, 32, 32)])
def test_kda_decode_verify_replay_triton(dev, B, D, K, V, dtype):
    """The Triton kernel against the reference at stable rows: decode, the copy design's
    verify (scratch per step), the replay design's verify (records) whose commit and flush
    give the copy design's committed state, and a replay decode; untouched rows stay."""
    from ppspec.kernels.commit.naive import commit_accept_ref
    from ppspec.kernels.gdn.naive_replay import alloc_replay_buffers, commit_accept_replay_ref, replay_flush_ref
    from ppspec.kernels.kda.naive import recurrent_kda_ref
    from ppspec.kernels.gdn.naive_replay import recurrent_gated_delta_rule_replay_ref as replay_ref
    from ppspec.kernels.kda.triton_kda import (kda_recurrent_replay_triton, kda_recurrent_triton,
                                               kda_replay_flush_triton)

    if dev.type == "cpu" and dtype == BF16:
        pytest.skip("the interpreter's bf16 is numpy's")
    H, rows = 2, B + 4
    idx = torch.randperm(rows, generator=torch.Generator().manual_seed(B))[:B]
    x = _kda_inputs(B, D, H, K, V, dtype, seed=10 * D + B)
    pool = torch.randn(rows + 1, H, K, V, generator=torch.Generator().manual_seed(1)) * 0.3
    tol = 1e-5 if dtype == F32 else 2e-2
    on = lambda t: t.to(dev)  # noqa: E731

    # decode / copy verify
    ref_pool, gpu_pool = pool.clone(), on(pool.clone())
    scr_ref = torch.zeros(rows + 1, D, H, K, V) if D > 1 else None
    scr = on(torch.zeros(rows + 1, D, H, K, V)) if D > 1 else None
    o_ref = recurrent_kda_ref(*x, ref_pool, idx, scr_ref)
    o = kda_recurrent_triton(*map(on, x), gpu_pool, on(idx), scr)
    assert _rel_err(o.cpu(), o_ref) < tol and _rel_err(gpu_pool.cpu(), ref_pool) < tol
    if D == 1:
        return
    assert torch.equal(gpu_pool.cpu(), pool)  # a verify leaves the committed state
    assert _rel_err(scr[idx].cpu(), scr_ref[idx]) < tol
    acc = torch.randint(1, D + 1, (B,), generator=torch.Generator().manual_seed(2))
    commit_accept_ref(ref_pool[None], scr_ref[None], idx, acc)

    # replay verify, commit, flush
    b_ref = alloc_replay_buffers(rows + 1, D, H, H, K, V, per_channel_gate=True)
    b_gpu = alloc_replay_buffers(rows + 1, D, H, H, K, V, device=dev, per_channel_gate=True)
    rp_ref, rp_gpu = pool.clone(), on(pool.clone())
    o2_ref = replay_ref(*x, rp_ref, idx, b_ref)
    o2 = kda_recurrent_replay_triton(*map(on, x), rp_gpu, on(idx), b_gpu)
    assert _rel_err(o2.cpu(), o2_ref) < tol and _rel_err(o2.cpu(), o_ref) < tol
    for b in (b_ref, b_gpu):
        commit_accept_replay_ref(b.pending, b.slot, idx.to(b.pending.device), acc.to(b.pending.device))
    copy = lambda b: type(b)(*(t.clone() for t in b))  # noqa: E731

    # a replay decode applies the pending steps first, then its own token
    d_ref, d_gpu, db_ref, db_gpu = rp_ref.clone(), rp_gpu.clone(), copy(b_ref), copy(b_gpu)
    y = _kda_inputs(B, 1, H, K, V, dtype, seed=99)
    o3_ref = replay_ref(*y, d_ref, idx, db_ref, verify=False)
    o3 = kda_recurrent_replay_triton(*map(on, y), d_gpu, on(idx), db_gpu, verify=False)
    assert _rel_err(o3.cpu(), o3_ref) < tol and _rel_err(d_gpu.cpu(), d_ref) < tol

    # the flush gives the copy design's committed state
    replay_flush_ref(rp_ref, b_ref, idx)
    kda_replay_flush_triton(rp_gpu, b_gpu, on(idx))
    assert _rel_err(rp_gpu.cpu(), rp_ref) < tol and _rel_err(rp_gpu.cpu(), ref_pool) < tol
    assert int(b_gpu.pending.abs().sum()) == 0 and int(db_gpu.pending.abs().sum()) == 0
    others = [r for r in range(rows + 1) if r not in idx.tolist()]
    assert torch.equal(rp_gpu[others].cpu(), pool[others])


@pytest.mark.parametrize("B,D,pad,K,V", [(1, 2, 0, 16, 16), (64, 4, 3, 32, 32), (256, 8, 7, 16, 16),
                                         (256, 2, 1, 64, 32)])
def test_kda_rounds_with_padding_rows_replay_equals_copy(dev, B, D, pad, K, V):
    """Rounds of verify -> commit (accept lengths 1..D) at batches up to 256 whose last
    ``pad`` entries are the padding row (a padded batch repeats it): the copy design's
    Triton verify against the reference (outputs and per-step scratch of the real rows),
    the replay design's Triton verify, decode and flush equal the copy design's committed
    state; padding entries and rows nobody names change no real row."""
    from ppspec.kernels.commit.naive import commit_accept_ref
    from ppspec.kernels.gdn.naive_replay import alloc_replay_buffers, commit_accept_replay_ref
    from ppspec.kernels.kda.naive import recurrent_kda_ref
    from ppspec.kernels.kda.triton_kda import (kda_recurrent_replay_triton, kda_recurrent_triton,
                                               kda_replay_flush_triton)

    H, R = 2, B + 5  # R - 1 is the padding row
    gen = torch.Generator().manual_seed(B * 10 + D)
    real = torch.randperm(R - 1, generator=gen)[: B - pad]
    idx = torch.cat([real, torch.full((pad,), R - 1)]).long()
    n = B - pad
    pool = torch.randn(R, H, K, V, generator=gen) * 0.3
    copy_ref, copy_gpu, rep_gpu = pool.clone(), pool.clone().to(dev), pool.clone().to(dev)
    scr_ref, scr_gpu = torch.zeros(R, D, H, K, V), torch.zeros(R, D, H, K, V, device=dev)
    bufs = alloc_replay_buffers(R, D, H, H, K, V, device=dev, per_channel_gate=True)
    on = lambda t: t.to(dev)  # noqa: E731
    tol = dict(atol=1e-4, rtol=1e-4)
    for rnd in range(3):
        x = _kda_inputs(B, D, H, K, V, F32, seed=100 * rnd + B)
        o_ref = recurrent_kda_ref(*x, copy_ref, idx, scr_ref)
        o_copy = kda_recurrent_triton(*map(on, x), copy_gpu, on(idx), scr_gpu)
        o_rep = kda_recurrent_replay_triton(*map(on, x), rep_gpu, on(idx), bufs)
        torch.testing.assert_close(o_copy[:n].cpu(), o_ref[:n], **tol)
        torch.testing.assert_close(o_rep[:n].cpu(), o_ref[:n], **tol)
        torch.testing.assert_close(scr_gpu[real].cpu(), scr_ref[real], **tol)
        acc = torch.randint(1, D + 1, (n,), generator=gen)
        commit_accept_ref(copy_ref[None], scr_ref[None], real, acc)
        commit_accept_ref(copy_gpu[None], scr_gpu[None], on(real), on(acc))
        commit_accept_replay_ref(bufs.pending, bufs.slot, on(real), on(acc))
    torch.testing.assert_close(copy_gpu[real].cpu(), copy_ref[real], **tol)  # committed from the Triton scratch
    # a decode (D = 1) applies the pending steps first; then the flush of the real rows
    y = _kda_inputs(B, 1, H, K, V, F32, seed=7)
    d_ref = recurrent_kda_ref(*y, copy_ref, idx)
    d_rep = kda_recurrent_replay_triton(*map(on, y), rep_gpu, on(idx), bufs, verify=False)
    torch.testing.assert_close(d_rep[:n].cpu(), d_ref[:n], **tol)
    kda_replay_flush_triton(rep_gpu, bufs, on(real))
    torch.testing.assert_close(rep_gpu[real].cpu(), copy_ref[real], **tol)
    others = [r for r in range(R - 1) if r not in real.tolist()]
    assert torch.equal(rep_gpu[others].cpu(), pool[others]) and torch.equal(copy_gpu[others].cpu(), pool[others])
    assert int(bufs.pending[real].abs().sum()) == 0


# ((heads, kv_lora_rank, qk_rope_head_dim), page size): Kimi Linear's 512 + 64 at 16 heads
# (both page sizes) and 32, a rank that is not a power of two (masked columns), no rope part
MLA_CASES = [((16, 512, 64), 16), ((16, 512, 64), 64), ((32, 512, 64), 16), ((4, 24, 8), 64), ((4, 32, 0), 16)]


@pytest.mark.parametrize("mode", ["decode", "verify", "prefill"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape,page", MLA_CASES)
def test_mla_attention_triton(dev, shape, page, dtype, mode):
    """The MLA kernel (``kernels/attention/mla.py``) against ``mla_attention_ref``: decode of
    5 requests (key shares merged by the combine kernel, some shares empty), verify of 4
    queries causal within the request, prefill of 1 to 40 queries after a cached prefix;
    fp32 (IEEE products) within 1e-5, bf16 within 1e-2 (relative); the dispatch takes it."""
    sys.path.insert(0, TESTS)
    from test_mla_attention import mla_case

    from ppspec.kernels.attention import mla_attention
    from ppspec.kernels.attention.mla import mla_attention_gpu
    from ppspec.kernels.attention.naive import mla_attention_ref

    nh, rank, rope = shape
    if dev.type == "cpu" and (dtype == BF16 or rank > 64):
        pytest.skip("the interpreter: bf16 is numpy's, and wide latents take minutes")
    args = mla_case(mode, nh, rank, rope, page, dtype, seed=rank + rope + page)
    args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
    o = mla_attention_gpu(*args)
    ref = mla_attention_ref(*args)
    assert o.shape == ref.shape and o.dtype == dtype
    assert _rel_err(o, ref) < (1e-5 if dtype == F32 else 1e-2)
    if dev.type == "cuda":
        assert torch.equal(mla_attention(*args), o)


def test_mla_attention_triton_long_context_decode(dev):
    """One request at 1024 tokens of context and one at 3 (32 shares of the keys each, most
    of the short one's empty), bf16, Kimi Linear's 16 heads of 512 + 64."""
    from ppspec.kernels.attention.mla import mla_attention_gpu
    from ppspec.kernels.attention.naive import mla_attention_ref

    if dev.type == "cpu":
        pytest.skip("the interpreter: bf16 is numpy's")
    gen = torch.Generator().manual_seed(7)
    page, lens = 16, [1024, 3]
    pt = torch.randperm(200, generator=gen)[:130].view(2, 65)
    cache = torch.randn(200, page, 1, 576, generator=gen).to(dev, BF16)
    q = torch.randn(2, 16, 576, generator=gen).to(dev, BF16)
    args = (q, cache, pt.to(dev), torch.tensor([1, 0], device=dev), torch.tensor(lens, device=dev),
            torch.tensor([0, 1, 2], device=dev), 192 ** -0.5, 512)
    assert _rel_err(mla_attention_gpu(*args), mla_attention_ref(*args)) < 1e-2


@pytest.mark.parametrize("act", ["swiglu", "relu2"])
@pytest.mark.parametrize("T", [1, 5, 64, 256])
def test_moe_expert_runs_on_cuda(monkeypatch, T, act):
    """bf16 routed experts on CUDA, SwiGLU and relu2 without a gate (NemotronH's): the
    grouped-GEMM run (compute capability 9 / 10: the H200's; ``PPSPEC_MOE_GROUPED=0`` picks
    the dense run) and the dense run against the CPU's grouping in fp32 on the same bf16
    values, within 1e-2 (relative); the grouped run recorded in a CUDA graph and replayed on
    new tokens and routes equals its eager run."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from types import SimpleNamespace

    from ppspec.stage_server.layers import moe

    E, k, H, I = 16, 4, 256, 64
    gates, extra = (2, {}) if act == "swiglu" else (1, dict(act=moe.RELU2))
    gen = torch.Generator().manual_seed(T)
    ex = SimpleNamespace(gate_up_proj=(torch.randn(E, gates * I, H, generator=gen) * H ** -0.5).to(BF16),
                         down_proj=(torch.randn(E, H, I, generator=gen) * I ** -0.5).to(BF16), **extra)
    gpu = SimpleNamespace(gate_up_proj=ex.gate_up_proj.cuda(), down_proj=ex.down_proj.cuda(), **extra)

    def routes(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(T, H, generator=g).to(BF16)
        top_w, top_i = torch.rand(T, E, generator=g).topk(k, dim=-1)
        return x, top_i, top_w

    x, top_i, top_w = routes(1)
    f32 = SimpleNamespace(gate_up_proj=ex.gate_up_proj.float(), down_proj=ex.down_proj.float(), **extra)
    ref = moe.run_experts(x.float(), top_i, top_w, f32)
    grouped = torch.cuda.get_device_capability()[0] in (9, 10)
    assert moe.grouped_gemm_runs(x.cuda(), gpu) == grouped
    runs = [moe.experts_dense] + ([moe.experts_grouped] if grouped else [])
    for fn in runs:
        out = fn(x.cuda(), top_i.cuda(), top_w.cuda(), gpu)
        assert out.dtype == BF16 and _rel_err(out.cpu(), ref) < 1e-2, fn.__name__
    with monkeypatch.context() as m:
        m.setenv("PPSPEC_MOE_GROUPED", "0")
        assert moe.pick_experts(x.cuda(), gpu) is moe.run_experts  # eager: the host's grouping
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # as inside a capture
        assert moe.pick_experts(x.cuda(), gpu) is moe.experts_dense
    fn = moe.pick_experts(x.cuda(), gpu)
    assert fn is (moe.experts_grouped if grouped else moe.experts_dense)
    static = [t.cuda() for t in (x, top_i, top_w)]
    fn(*static, gpu)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static, gpu)
    new = routes(2)
    for s, t in zip(static, new):
        s.copy_(t.cuda())
    graph.replay()
    torch.testing.assert_close(out, fn(*(t.cuda() for t in new), gpu), atol=1e-2, rtol=1e-2)
    assert _rel_err(out.cpu(), moe.run_experts(new[0].float(), new[1], new[2], f32)) < 1e-2


@pytest.mark.parametrize("T,H,K", [(1, 2, 16), (7, 16, 128), (64, 16, 128), (3, 4, 200)])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_sigmoid_gated_norm_triton(dev, T, H, K, dtype):
    """A KDA layer's output norm ``w * x / rms(x) * sigmoid(z)`` in one launch against
    ``sigmoid_gated_rms_norm_ref``, the gate a per-head view of a wider projection: fp32 within
    1e-5, bf16 within one ulp (one rounding at the end, as the reference)."""
    from ppspec.kernels.norm import sigmoid_gated_rms_norm
    from ppspec.kernels.norm.naive import sigmoid_gated_rms_norm_ref
    from ppspec.kernels.norm.triton_norm import sigmoid_gated_rms_norm_triton

    gen = torch.Generator().manual_seed(T * H + K)
    x = torch.randn(T, H, K, generator=gen).to(dev, dtype)
    z = (torch.randn(T, H * K + 24, generator=gen) * 3).to(dev, dtype)[:, 8:8 + H * K].view(T, H, K)
    w = (1 + 0.2 * torch.randn(K, generator=gen)).to(dev, dtype)
    out = sigmoid_gated_rms_norm_triton(x, z, w, 1e-5)
    ref = sigmoid_gated_rms_norm_ref(x, z, w, 1e-5)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == F32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        b = ref.float()
        ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)
        assert ((out.float() - b).abs() / ulp).max() <= 1
    if dev.type == "cuda":  # the layer's dispatch takes the kernel on CUDA
        assert torch.equal(sigmoid_gated_rms_norm(x, z, w, 1e-5), out)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    sys.path.insert(0, TESTS)
    from checkpoints import make_checkpoint

    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    path = make_checkpoint("kimi_moe_5l", str(tmp_path_factory.mktemp("kimi")))
    rnd = random.Random(0)
    prompts = [[rnd.randrange(256) for _ in range(n)] for n in (5, 17, 40, 70, 100, 130)]
    prompts[0] = (prompts[4][:6] * 20)[:100]  # repetitive: the n-gram drafter finds drafts
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    outs = LLM(path, max_rows=8).generate(prompts, sp)  # CPU, PP1, no speculation
    return path, prompts, [o.token_ids for o in outs], [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in outs]


@pytest.mark.parametrize("pp,spec,design", [(1, "none", "replay"), (2, "ngram", "replay"), (3, "ngram", "copy")])
def test_fp32_cuda_identical_to_cpu_pp1(kimi, pp, spec, design):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    path, prompts, ref, gaps = kimi
    llm = LLM(path, device="cuda", pp_size=pp, speculative_algorithm=spec, max_rows=8, commit_design=design)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for o, r, gp in zip(outs, ref, gaps):
        if o.token_ids != r:
            j = next(j for j, (a, b) in enumerate(zip(o.token_ids, r)) if a != b)
            assert gp[j] < 1e-4, f"divergence at {j} where the reference's top-2 gap is {gp[j]}"
