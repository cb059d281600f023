"""Every GPU kernel of ``kernels/`` against its plain-torch reference, on CUDA.

Marked ``gpu``: ``make test-gpu`` runs them; the CPU ``make test`` deselects them. For
development without a GPU they also run on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1 pytest -m gpu tests/gpu``, with smaller shapes).

Each check poisons what the kernel must not write (NaN scratch, untouched rows compared
bit for bit) and draws fresh random inputs; rows are scattered stable pool rows, padding
entries point at the pool's last row.
"""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

F32, BF16 = torch.float32, torch.bfloat16
BATCH_FOR_D = {1: 1, 2: 7, 3: 64, 4: 256, 5: 33}


def _small(dev) -> bool:
    return dev.type != "cuda"  # the interpreter: keep shapes tiny


def _rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "NaN in the output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _rows(gen, rows_n, B, n_pad, dev):
    """B scattered stable rows out of a pool of rows_n (+1 padding); the last n_pad entries
    are padding (the pool's last row)."""
    rows = torch.randperm(rows_n, generator=gen)[:B]
    if n_pad:
        rows[B - n_pad:] = rows_n
    return rows.to(dev)


def _gdn_inputs(gen, B, D, H, HV, K, V, dtype, dev):
    q = torch.randn(B, D, H, K, generator=gen)
    k = torch.randn(B, D, H, K, generator=gen)
    v = torch.randn(B, D, HV, V, generator=gen)
    g = -torch.rand(B, D, HV, generator=gen) * 0.5
    beta = torch.rand(B, D, HV, generator=gen)
    return tuple(x.to(dev, dtype) for x in (q, k, v, g, beta))


# ---------------------------------------------------------------- GDN recurrent (copy design)


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("D", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("G", [1, 2])
def test_gdn_recurrent(dev, G, dtype, D, mode):
    from ppspec.kernels.gdn.naive import recurrent_gated_delta_rule_ref
    from ppspec.kernels.gdn.triton_recurrent import recurrent_gated_delta_rule_triton

    gen = torch.Generator().manual_seed(100 * G + 10 * D + (dtype == BF16) + (mode == "verify") * 7)
    B = min(BATCH_FOR_D[D], 9) if _small(dev) else BATCH_FOR_D[D]
    H, K, V = (2, 16, 16) if _small(dev) else (4, 128, 128)
    HV = G * H
    rows_n = B + 5
    R = rows_n + 1
    n_pad = 2 if B >= 7 else 0
    rows = _rows(gen, rows_n, B, n_pad, dev)
    real = rows[: B - n_pad]
    q, k, v, g, beta = _gdn_inputs(gen, B, D, H, HV, K, V, dtype, dev)
    state0 = (torch.randn(R, HV, K, V, generator=gen) * 0.1).to(dev)
    st, st_ref = state0.clone(), state0.clone()
    scratch = scratch_ref = None
    if mode == "verify":
        scratch = torch.full((R, D + 1, HV, K, V), float("nan"), device=dev)
        scratch_ref = scratch.clone()
    o = recurrent_gated_delta_rule_triton(q, k, v, g, beta, st, rows, scratch)
    o_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, st_ref, rows, scratch_ref)
    assert o.dtype == v.dtype and o.shape == v.shape
    tol = 1e-5 if dtype == F32 else 1e-2
    nb = B if mode == "verify" else B - n_pad  # decode: padding entries share a row (undefined)
    assert _rel_err(o[:nb], o_ref[:nb]) < tol
    untouched = torch.ones(R, dtype=torch.bool, device=dev)
    untouched[rows] = False
    if mode == "verify":
        assert torch.equal(st, state0), "verify must not write the committed state"
        assert _rel_err(scratch[real, :D], scratch_ref[real, :D]) < 1e-5
        assert torch.isnan(scratch[untouched]).all(), "scratch written at rows not named"
        assert torch.isnan(scratch[:, D:]).all(), "scratch written past step D"
    else:
        assert _rel_err(st[real], st_ref[real]) < 1e-5
        assert torch.equal(st[untouched], state0[untouched]), "state written at rows not named"


def test_gdn_rows_outside_pool_raise(dev):
    from ppspec.kernels.gdn import gdn_recurrent
    from ppspec.kernels.gdn.triton_recurrent import recurrent_gated_delta_rule_triton

    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta = _gdn_inputs(gen, 2, 2, 1, 2, 16, 16, F32, dev)
    state = torch.randn(4, 2, 16, 16, device=dev)
    before = state.clone()
    for bad in ([0, 4], [-1, 1]):
        rows = torch.tensor(bad, device=dev)
        with pytest.raises(IndexError):
            gdn_recurrent(q, k, v, g, beta, state, rows)
        with pytest.raises(IndexError):
            recurrent_gated_delta_rule_triton(q, k, v, g, beta, state, rows)
    assert torch.equal(state, before)


# ---------------------------------------------------------------- replay commit


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("G", [1, 2])
def test_gdn_replay_matches_copy_commit(dev, G, dtype):
    """Triton replay design == Triton scratch+copy design == naive replay reference, over
    rounds of interleaved micro-batches (batch 1, 64, 191 at disjoint rows) with random
    accept lengths and a plain decode round in between."""
    from ppspec.kernels.commit.triton_commit import commit_accept_triton
    from ppspec.kernels.gdn.naive_replay import (
        alloc_replay_buffers, alloc_replay_meta, commit_accept_replay_ref,
        recurrent_gated_delta_rule_replay_ref, replay_flush_ref,
    )
    from ppspec.kernels.gdn.triton_recurrent import recurrent_gated_delta_rule_triton
    from ppspec.kernels.gdn.triton_replay import (
        commit_accept_replay_triton, recurrent_gated_delta_rule_replay_triton, replay_flush_triton,
    )

    gen = torch.Generator().manual_seed(77 + G + (dtype == BF16))
    rng = random.Random(G)
    D = 4
    if _small(dev):
        H, K, V, sizes = 2, 16, 16, [1, 3, 4]
    else:
        H, K, V, sizes = 4, 128, 128, [1, 64, 191]
    HV = G * H
    rows_n = sum(sizes) + 3
    R = rows_n + 1
    perm = torch.randperm(rows_n, generator=gen)
    mbs, at = [], 0
    for s in sizes:
        mbs.append(perm[at:at + s].to(dev))
        at += s
    state0 = (torch.randn(1, R, HV, K, V, generator=gen) * 0.1).to(dev)
    st_copy, st_rep, st_ref = state0.clone(), state0[0].clone(), state0[0].clone()
    scratch = torch.full((1, R, D, HV, K, V), float("nan"), device=dev)
    pend, slot = alloc_replay_meta(1, R, dev)
    bufs = alloc_replay_buffers(R, D, H, HV, K, V, device=dev, meta=(pend[0], slot[0]))
    pend_r, slot_r = alloc_replay_meta(1, R, dev)
    bufs_r = alloc_replay_buffers(R, D, H, HV, K, V, device=dev, meta=(pend_r[0], slot_r[0]))
    tol = 1e-5 if dtype == F32 else 1e-2

    for rnd in range(3):
        order = list(range(len(mbs)))
        rng.shuffle(order)
        accs = {}
        for i in order:
            rows = mbs[i]
            x = _gdn_inputs(gen, rows.numel(), D, H, HV, K, V, dtype, dev)
            o_c = recurrent_gated_delta_rule_triton(*x, st_copy[0], rows, scratch[0])
            o_r = recurrent_gated_delta_rule_replay_triton(*x, st_rep, rows, bufs)
            o_n = recurrent_gated_delta_rule_replay_ref(*x, st_ref, rows, bufs_r)
            assert _rel_err(o_r, o_c) < tol and _rel_err(o_r, o_n) < tol
            accs[i] = torch.tensor([rng.randint(1, D) for _ in range(rows.numel())], device=dev)
        rng.shuffle(order)
        for i in order:
            commit_accept_triton(st_copy, scratch, mbs[i], accs[i])
            commit_accept_replay_triton(pend, slot, mbs[i], accs[i])
            commit_accept_replay_ref(pend_r, slot_r, mbs[i], accs[i])
        if rnd == 1:  # a plain decode of one micro-batch applies its pending steps
            rows = mbs[2]
            x = _gdn_inputs(gen, rows.numel(), 1, H, HV, K, V, dtype, dev)
            o_c = recurrent_gated_delta_rule_triton(*x, st_copy[0], rows)
            o_r = recurrent_gated_delta_rule_replay_triton(*x, st_rep, rows, bufs, verify=False)
            o_n = recurrent_gated_delta_rule_replay_ref(*x, st_ref, rows, bufs_r, verify=False)
            assert _rel_err(o_r, o_c) < tol and _rel_err(o_r, o_n) < tol

    all_rows = torch.arange(R, device=dev)
    replay_flush_triton(st_rep, bufs, all_rows)
    assert int(pend.abs().sum()) == 0
    assert _rel_err(st_rep, st_copy[0]) < 1e-5
    replay_flush_ref(st_ref, bufs_r, all_rows)
    assert _rel_err(st_rep, st_ref) < 1e-5
    named = torch.cat(mbs)
    others = torch.ones(R, dtype=torch.bool, device=dev)
    others[named] = False
    assert torch.equal(st_rep[others], state0[0][others])


# ---------------------------------------------------------------- commit (copy design)


@pytest.mark.parametrize("B", [1, 64, 256])
def test_commit_accept(dev, B):
    from ppspec.kernels.commit import commit_accept
    from ppspec.kernels.commit.naive import commit_accept_ref
    from ppspec.kernels.commit.triton_commit import commit_accept_triton

    gen = torch.Generator().manual_seed(B)
    if _small(dev):
        B = min(B, 9)
    L, D = 3, 4
    R = B + 10
    shapes = [((4, 32, 32) if not _small(dev) else (2, 4, 4), F32), ((96, 3), BF16)]  # GDN state, conv window
    for S, dt in shapes:
        state0 = torch.randn(L, R, *S, generator=gen).to(dev, dt)
        scratch = torch.randn(L, R, D, *S, generator=gen).to(dev, dt)
        rows = torch.randperm(R, generator=gen)[:B].to(dev)
        acc = torch.randint(1, D + 1, (B,), generator=gen).to(dev)
        st, st_ref = state0.clone(), state0.clone()
        commit_accept_triton(st, scratch, rows, acc)
        commit_accept_ref(st_ref, scratch, rows, acc)
        assert torch.equal(st, st_ref)
        st2 = state0.clone()
        commit_accept(st2, scratch, rows, acc)  # the dispatcher takes the GPU path
        assert torch.equal(st2, st_ref)
    with pytest.raises(IndexError):
        commit_accept_triton(st, scratch, torch.tensor([R], device=dev), torch.tensor([1], device=dev))
    with pytest.raises(ValueError):
        commit_accept_triton(st, scratch, torch.tensor([0], device=dev), torch.tensor([D + 1], device=dev))


# ---------------------------------------------------------------- conv1d update


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("D", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_conv1d_update(dev, dtype, D, mode):
    from ppspec.kernels.conv1d.naive import causal_conv1d_update_ref
    from ppspec.kernels.conv1d.triton_update import causal_conv1d_update_triton

    gen = torch.Generator().manual_seed(D * 3 + (mode == "verify"))
    B = min(BATCH_FOR_D[D], 9) if _small(dev) else BATCH_FOR_D[D]
    C, W = (40, 4) if _small(dev) else (1000, 4)
    rows_n = B + 4
    R = rows_n + 1
    n_pad = 2 if B >= 7 else 0
    rows = _rows(gen, rows_n, B, n_pad, dev)
    real = rows[: B - n_pad]
    x = torch.randn(B, D, C, generator=gen).to(dev, dtype)
    weight = torch.randn(C, W, generator=gen).to(dev, dtype)
    bias = torch.randn(C, generator=gen).to(dev, dtype) if D % 2 else None
    state0 = torch.randn(R, C, W - 1, generator=gen).to(dev, dtype)
    st, st_ref = state0.clone(), state0.clone()
    sc = sc_ref = None
    if mode == "verify":
        sc = torch.full((R, D + 1, C, W - 1), float("nan"), device=dev, dtype=dtype)
        sc_ref = sc.clone()
    y = causal_conv1d_update_triton(x, weight, bias, st, rows, sc)
    y_ref = causal_conv1d_update_ref(x, weight, bias, st_ref, rows, sc_ref)
    tol = 1e-5 if dtype == F32 else 1e-2
    nb = B if mode == "verify" else B - n_pad
    assert _rel_err(y[:nb], y_ref[:nb]) < tol
    untouched = torch.ones(R, dtype=torch.bool, device=dev)
    untouched[rows] = False
    if mode == "verify":
        assert torch.equal(st, state0)
        assert torch.equal(sc[real, :D], sc_ref[real, :D])  # windows are copies: exact
        assert torch.isnan(sc[untouched]).all() and torch.isnan(sc[:, D:]).all()
    else:
        assert torch.equal(st[real], st_ref[real])
        assert torch.equal(st[untouched], state0[untouched])
    with pytest.raises(IndexError):
        causal_conv1d_update_triton(x, weight, bias, st, torch.full((B,), R, device=dev), sc)


# ---------------------------------------------------------------- chunked prefill (fla)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("G", [1, 2])
def test_gdn_prefill_fla(dev, G, dtype):
    if dev.type != "cuda":
        pytest.skip("fla needs CUDA")
    pytest.importorskip("fla")
    from ppspec.kernels.gdn import gdn_prefill
    from ppspec.kernels.gdn.fla_prefill import chunk_gated_delta_rule_fla
    from ppspec.kernels.gdn.naive import chunk_gated_delta_rule_ref

    gen = torch.Generator().manual_seed(31 * G + (dtype == BF16))
    H, K, V = 4, 128, 128
    HV = G * H
    lens = [1, 63, 64, 0, 65, 300]
    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(dev)
    q = torch.randn(T, H, K, generator=gen).to(dev, dtype)
    k = torch.randn(T, H, K, generator=gen).to(dev, dtype)
    v = torch.randn(T, HV, V, generator=gen).to(dev, dtype)
    g = (-torch.rand(T, HV, generator=gen) * 0.3).to(dev, dtype)
    beta = torch.rand(T, HV, generator=gen).to(dev, dtype)
    h0 = (torch.randn(len(lens), HV, K, V, generator=gen) * 0.1).to(dev)
    o, ht = chunk_gated_delta_rule_fla(q, k, v, g, beta, cu, h0, None)
    o_ref, ht_ref = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, h0, None)
    assert o.dtype == v.dtype and ht.dtype == F32 and ht.shape == h0.shape
    tol = 5e-3 if dtype == F32 else 2e-2  # fla's products run in tf32 / bf16
    assert _rel_err(o, o_ref) < tol
    assert _rel_err(ht, ht_ref) < tol
    assert torch.equal(ht[3], h0[3])  # the empty sequence keeps its state
    o2, _ = gdn_prefill(q, k, v, g, beta, cu, h0)
    assert torch.equal(o2, o)


# ---------------------------------------------------------------- paged attention


@pytest.mark.parametrize("mode", ["decode", "verify", "prefill"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("heads", [(8, 8, 128), (16, 2, 256)])
def test_paged_attention(dev, heads, dtype, mode):
    from ppspec.kernels.attention import paged_attention
    from ppspec.kernels.attention.gpu import paged_attention_gpu
    from ppspec.kernels.attention.naive import paged_attention_ref

    Hq, Hkv, hd = heads
    gen = torch.Generator().manual_seed(Hq + hd + (dtype == BF16) * 3 + len(mode))
    small = _small(dev)
    if small and dtype == BF16:
        pytest.skip("Triton's interpreter gets bf16 tl.dot wrong (seen with triton 3.6, numpy 2)")
    if small:
        Hq, Hkv, hd = Hq // 4 or 1, max(Hkv // 4, 1), 16
    page = 16
    B = {"decode": 64, "verify": 33, "prefill": 5}[mode]
    if small:
        B = min(B, 4)
    rng = random.Random(hd)
    fixed = {"decode": 1, "verify": 4}
    Ls = [fixed[mode] if mode in fixed else rng.randint(1, 40 if small else 150) for _ in range(B)]
    ctx = [rng.randint(0, 40 if small else 700) for _ in range(B)]
    kv_lens = [c + l for c, l in zip(ctx, Ls)]
    max_pages = max((n + page - 1) // page for n in kv_lens) + 1
    rows_n = B + 3
    num_pages = (rows_n + 1) * max_pages + 2
    page_table = torch.randperm(num_pages, generator=gen)[: (rows_n + 1) * max_pages].view(rows_n + 1, max_pages)
    rows = torch.randperm(rows_n, generator=gen)[:B]
    k_cache = torch.randn(num_pages, page, Hkv, hd, generator=gen).to(dev, dtype)
    v_cache = torch.randn(num_pages, page, Hkv, hd, generator=gen).to(dev, dtype)
    T = sum(Ls)
    q = torch.randn(T, Hq, hd, generator=gen).to(dev, dtype)
    cu = torch.tensor([0] + Ls).cumsum(0).to(dev)
    args = (q, k_cache, v_cache, page_table.to(dev), rows.to(dev), torch.tensor(kv_lens, device=dev), cu, hd ** -0.5)
    o = paged_attention_gpu(*args)
    o_ref = paged_attention_ref(*args)
    tol = 1e-5 if dtype == F32 else 1e-2
    assert _rel_err(o, o_ref) < tol
    if dev.type == "cuda":
        assert torch.equal(paged_attention(*args), o)
    bad = list(args)
    bad[4] = torch.full((B,), rows_n + 1, device=dev)
    with pytest.raises(IndexError):
        paged_attention_gpu(*bad)


def test_dispatchers_take_gpu_paths(dev):
    """On CUDA the dispatch functions import the GPU modules (no silent CPU fallback)."""
    if dev.type != "cuda":
        pytest.skip("dispatch to the GPU paths needs CUDA tensors")
    import importlib

    for mod in ("gdn.triton_recurrent", "gdn.triton_replay", "commit.triton_commit",
                "conv1d.triton_update", "attention.gpu"):
        importlib.import_module(f"ppspec.kernels.{mod}")
