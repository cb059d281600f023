"""The Mamba2 family on CUDA (``make test-gpu``; the kernels also under Triton's interpreter,
``TRITON_INTERPRET=1``): the Triton recurrent kernel (decode, copy-design verify, replay-
design verify and decode) against the plain-torch reference at stable rows, batch 1 to 256
with padding rows and D = 2 to 8; and NemotronH / Granite 4.0 hybrid checkpoints end to end
in fp32 on CUDA, token-identical to PP1 without speculation on CUDA."""
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(gen, Bs, T, H, P, G, N, dev, dtype):
    x = torch.randn(Bs, T, H, P, generator=gen).to(dev, dtype)
    dt = (torch.randn(Bs, T, H, generator=gen) - 1.0).to(dev, dtype)
    B = (torch.randn(Bs, T, G, N, generator=gen) * 0.5).to(dev, dtype)
    C = (torch.randn(Bs, T, G, N, generator=gen) * 0.5).to(dev, dtype)
    return x, dt, B, C


def _params(gen, H, dev):
    A = (-torch.rand(H, generator=gen) * 2 - 0.1).to(dev)
    D = torch.randn(H, generator=gen).to(dev)
    dt_bias = (torch.randn(H, generator=gen) * 0.5).to(dev)
    return A, D, dt_bias


def _rows(gen, Bs, R, pad):
    """Bs distinct rows of R - 1 real ones (not batch positions), the last ``pad`` entries
    the padding row R - 1 (a padded batch repeats it)."""
    real = torch.randperm(R - 1, generator=gen)[: Bs - pad]
    return torch.cat([real, torch.full((pad,), R - 1)]).long()


@pytest.mark.parametrize("H,P,G,N", [(8, 16, 2, 32), (6, 64, 3, 128), (4, 12, 1, 8)])
@pytest.mark.parametrize("Bs,D", [(1, 1), (3, 2), (64, 4), (256, 8), (17, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_recurrent_copy_design(dev, H, P, G, N, Bs, D, dtype):
    """Decode (D = 1: the final state to ``state[row]``) and verify (the state after each
    step to ``scratch[row, t]``) against ``recurrent_ref``; other rows untouched."""
    from ppspec.kernels.mamba2.naive import recurrent_ref
    from ppspec.kernels.mamba2.triton_recurrent import mamba2_recurrent_triton

    gen = torch.Generator().manual_seed(Bs * 10 + D)
    R = Bs + 5
    rows = _rows(gen, Bs, R, pad=0).to(dev)
    x, dt, B, C = _inputs(gen, Bs, D, H, P, G, N, dev, dtype)
    A, Dk, bias = _params(gen, H, dev)
    limit = (0.001, float("inf")) if D == 1 else (0.0, float("inf"))
    st = torch.randn(R, H, P, N, generator=gen).to(dev)
    st_ref = st.clone()
    scratch = torch.zeros(R, D, H, P, N, device=dev) if D > 1 else None
    scratch_ref = None if scratch is None else scratch.clone()
    y = mamba2_recurrent_triton(x, dt, A, B, C, Dk, bias, st, rows, scratch, dt_limit=limit)
    y_ref = recurrent_ref(x, dt, A, B, C, Dk, bias, st_ref, rows, scratch_ref, dt_limit=limit)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)
    torch.testing.assert_close(st, st_ref, atol=1e-4, rtol=1e-4)
    if scratch is not None:
        torch.testing.assert_close(scratch, scratch_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("T,G,GS", [(1, 1, 64), (5, 2, 32), (3, 8, 24), (64, 8, 256), (7, 1, 2048)])
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_gated_norm_triton(dev, T, G, GS, norm_before_gate, dtype):
    """The output norm (gate then group norm: NemotronH, Granite, Bamba; group norm then
    gate: Falcon-H1) in one launch against ``gated_rms_norm_ref``, the gate a column slice
    of a wider projection as the mixer passes it: fp32 within 1e-5, bf16 within 3 ulps (the
    reference rounds twice more); the dtype the reference's."""
    from ppspec.kernels.mamba2 import mamba2_gated_rms_norm
    from ppspec.kernels.mamba2.naive import gated_rms_norm_ref
    from ppspec.kernels.mamba2.triton_norm import gated_rms_norm_triton

    gen = torch.Generator().manual_seed(T * G + GS)
    n = G * GS
    y = torch.randn(T, n, generator=gen).to(dev, dtype)
    z = torch.randn(T, n + 40, generator=gen).to(dev, dtype)[:, 8:8 + n]
    w = (1 + 0.2 * torch.randn(n, generator=gen)).to(dev, dtype)
    out = gated_rms_norm_triton(y, z, w, GS, 1e-5, norm_before_gate)
    ref = gated_rms_norm_ref(y, z, w, GS, 1e-5, norm_before_gate)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        b = ref.float()
        ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)
        assert ((out.float() - b).abs() / ulp).max() <= 3
    if dev.type == "cuda":  # the mixer's dispatch takes the kernel on CUDA
        assert torch.equal(mamba2_gated_rms_norm(y, z, w, GS, 1e-5, norm_before_gate), out)


@pytest.mark.parametrize("Bs,D,pad", [(1, 2, 0), (5, 3, 0), (64, 4, 3), (256, 8, 7)])
def test_mamba2_replay_design_matches_copy_design(dev, Bs, D, pad):
    """Rounds of verify -> commit (accept lengths 1..D) -> verify / decode under the replay
    design (Triton) equal the copy design (reference: scratch copied back) in outputs and,
    after a flush, in the committed state; padding entries (the padding row, accept length
    0) change no real row."""
    from ppspec.kernels.commit.naive import commit_accept_ref
    from ppspec.kernels.gdn.naive_replay import commit_accept_replay_ref
    from ppspec.kernels.mamba2.naive import recurrent_ref
    from ppspec.kernels.mamba2.naive_replay import alloc_mamba2_replay_buffers, replay_flush_ref
    from ppspec.kernels.mamba2.triton_recurrent import mamba2_recurrent_replay_triton

    H, P, G, N = 8, 16, 2, 32
    gen = torch.Generator().manual_seed(Bs + D)
    R = Bs + 4
    rows = _rows(gen, Bs, R, pad).to(dev)
    A, Dk, bias = _params(gen, H, dev)
    st_rep = torch.randn(R, H, P, N, generator=gen).to(dev)
    st_copy = st_rep.clone()
    bufs = alloc_mamba2_replay_buffers(R, D, H, P, G, N, device=dev)
    scratch = torch.zeros(R, D, H, P, N, device=dev)
    real = rows[: Bs - pad]
    for rnd in range(4):
        x, dt, B, C = _inputs(gen, Bs, D, H, P, G, N, dev, torch.float32)
        y_rep = mamba2_recurrent_replay_triton(x, dt, A, B, C, Dk, bias, st_rep, rows, bufs, verify=True)
        y_copy = recurrent_ref(x, dt, A, B, C, Dk, bias, st_copy, rows, scratch)
        torch.testing.assert_close(y_rep[: Bs - pad], y_copy[: Bs - pad], atol=1e-4, rtol=1e-4)
        acc = torch.randint(1, D + 1, (Bs - pad,), generator=gen).to(dev)
        commit_accept_replay_ref(bufs.pending, bufs.slot, real, acc)
        commit_accept_ref(st_copy[None], scratch[None], real, acc)
    x, dt, B, C = _inputs(gen, Bs, 1, H, P, G, N, dev, torch.float32)
    y_rep = mamba2_recurrent_replay_triton(x, dt, A, B, C, Dk, bias, st_rep, rows, bufs, verify=False)
    y_copy = recurrent_ref(x, dt, A, B, C, Dk, bias, st_copy, rows)
    torch.testing.assert_close(y_rep[: Bs - pad], y_copy[: Bs - pad], atol=1e-4, rtol=1e-4)
    replay_flush_ref(st_rep, bufs, real)
    torch.testing.assert_close(st_rep[real], st_copy[real], atol=1e-4, rtol=1e-4)
    assert int(bufs.pending[real].abs().sum()) == 0


@pytest.mark.parametrize("H,P,G,N", [(8, 16, 2, 32), (4, 64, 4, 128), (6, 12, 1, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_prefill_rows_fla(dev, H, P, G, N, dtype, monkeypatch):
    """fla's simple-GLA chunk kernels as the Mamba2 chunked scan (``fla_scan``) against the
    plain-torch ``chunk_scan_ref`` at stable rows: sequences longer than a chunk, one of a
    single token, an empty one (keeps its state), continuing rows (``has_init``) and new
    ones (a fresh row's garbage ignored), dt clamped; other rows untouched. On CUDA the
    dispatcher takes this path for bf16 (fp32 keeps the reference there: fla's products run
    as TF32 on the GPU, so in fp32 on CUDA this checks fla at TF32's tolerance and that the
    dispatcher's fp32 prefill is the reference's). (Under the interpreter only fp32 is
    meaningful: its bf16 emulation breaks fla's own kernels too.)"""
    pytest.importorskip("fla")
    monkeypatch.delenv("PPSPEC_MAMBA2_FLA", raising=False)
    from ppspec.kernels.mamba2 import mamba2_prefill_rows
    from ppspec.kernels.mamba2.fla_scan import mamba2_prefill_rows_fla
    from ppspec.kernels.mamba2.naive import chunk_scan_ref

    gen = torch.Generator().manual_seed(H * 100 + N)
    lens = [200, 1, 0, 130, 64]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    T, R = sum(lens), 12
    x, dt, B, C = (t[0] for t in _inputs(gen, 1, T, H, P, G, N, dev, dtype))
    A, Dk, bias = _params(gen, H, dev)
    rows = torch.tensor([7, 0, 3, 10, 5], device=dev)
    has_init = torch.tensor([True, False, True, False, True], device=dev)
    state = torch.randn(R, H, P, N, generator=gen).to(dev) * 0.3
    limit = (0.001, 5.0)
    st = state.clone()
    y = mamba2_prefill_rows_fla(x, dt, A, B, C, Dk, bias, cu.to(dev), st, rows, has_init, limit)
    init = torch.where(has_init.view(-1, 1, 1, 1), state[rows], torch.zeros(()).to(dev))
    y_ref, final_ref = chunk_scan_ref(x.float(), dt, A, B, C, Dk, bias, cu, init, 64, limit)
    cuda = torch.device(dev).type == "cuda"
    if dtype != torch.float32:
        tol = dict(atol=5e-2, rtol=5e-2)
    else:  # TF32 on the GPU: 10 mantissa bits in each product
        tol = dict(atol=1e-1, rtol=2e-2) if cuda else dict(atol=2e-4, rtol=2e-4)
    assert y.dtype == dtype and y.shape == (T, H, P)
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)
    torch.testing.assert_close(st[rows], final_ref, **tol)
    others = [r for r in range(R) if r not in rows.tolist()]
    assert torch.equal(st[others], state[others])
    assert torch.equal(st[3], state[3])  # the empty sequence's row: its state as it was
    if cuda:  # the dispatcher: fla for bf16, the reference for fp32
        st2 = state.clone()
        y2 = mamba2_prefill_rows(x, dt, A, B, C, Dk, bias, cu.to(dev), st2, rows, has_init, limit)
        if dtype == torch.float32:
            torch.testing.assert_close(y2, y_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(st2[rows], final_ref, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(y2, y) and torch.equal(st2, st)


@pytest.mark.parametrize("kind", ["nemotron_h_b", "granite_a", "bamba_b", "falcon_h1_a"])
def test_mamba2_hybrid_fp32_on_cuda_identical_to_pp1(tmp_path, kind):
    """A random NemotronH / Granite 4.0 hybrid / Bamba / Falcon-H1 checkpoint (transformers' own) on CUDA in
    fp32: PP 2 and 4 with n-gram drafts under both commit designs (the Triton decode /
    verify kernel, the replay's records) give the greedy tokens of PP1 without speculation
    on CUDA, divergence allowed only at a near-tie of the reference (top-2 gap < 1e-4)."""
    if not torch.cuda.is_available():
        pytest.skip("end to end needs CUDA")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from checkpoints import make_checkpoint

    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    path = make_checkpoint(kind, str(tmp_path))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 40, 130, 17, 64, 9, 90, 33)]
    prompts[1] = (prompts[1][:6] * 10)[:40]  # something for the n-gram drafter
    outs = LLM(path, device="cuda", max_rows=8).generate(
        prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2))
    ref = [o.token_ids for o in outs]
    gaps = [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in outs]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for pp, design in ((2, "replay"), (4, "copy"), (4, "replay")):
        llm = LLM(path, device="cuda", pp_size=pp, max_rows=8, speculative_algorithm="ngram",
                  num_speculative_steps=3, commit_design=design)
        for i, o in enumerate(llm.generate(prompts, params)):
            if o.token_ids != ref[i]:
                j = next(j for j, (a, b) in enumerate(zip(o.token_ids, ref[i])) if a != b)
                assert gaps[i][j] < 1e-4, f"PP{pp} {design}: request {i} diverges at {j} (gap {gaps[i][j]:.2e})"
