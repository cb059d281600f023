"""Every GPU kernel of ``kernels/`` against its plain-torch reference, on CUDA.

Marked ``gpu``: ``make test-gpu`` runs them; the CPU ``make test`` deselects them. For
development without a GPU they also run on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1 pytest -m 'gpu and not flashinfer' tests/gpu``, with smaller shapes).

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


@pytest.mark.parametrize("D", [1, 4])
@pytest.mark.parametrize("B", [1, 5])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gdn_reads_conv_output_views_in_place(dev, dtype, B, D):
    """q, k, v as the GDN layer passes them: column splits of the conv output ``[B D, 2 H K +
    HV V]`` viewed per head. The kernels read them in place (no copy) with the results of
    contiguous inputs, bit for bit: plain decode / copy verify, and the replay design."""
    from ppspec.kernels.gdn.naive_replay import alloc_replay_buffers, alloc_replay_meta
    from ppspec.kernels.gdn.triton_recurrent import _token_rows, recurrent_gated_delta_rule_triton
    from ppspec.kernels.gdn.triton_replay import recurrent_gated_delta_rule_replay_triton

    gen = torch.Generator().manual_seed(31 * B + D + (dtype == BF16))
    H, HV, K, V = (2, 4, 16, 16) if _small(dev) else (4, 8, 128, 128)
    R = B + 3
    mixed = torch.randn(B * D, 2 * H * K + HV * V, generator=gen).to(dev, dtype)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    q, k, v = q.view(B, D, H, K), k.view(B, D, H, K), v.view(B, D, HV, V)
    for x in (q, k, v):
        assert _token_rows(x)[0].data_ptr() == x.data_ptr()  # a view, not a copy
    g = (-torch.rand(B, D, HV, generator=gen) * 0.5).to(dev)
    beta = torch.rand(B, D, HV, generator=gen).to(dev, dtype)
    rows = torch.randperm(R, generator=gen)[:B].to(dev)
    state0 = (torch.randn(R, HV, K, V, generator=gen) * 0.1).to(dev)
    contiguous = [x.contiguous() for x in (q, k, v)]
    outs = []
    for qkv in ((q, k, v), contiguous):
        st = state0.clone()
        scratch = torch.zeros(R, D, HV, K, V, device=dev) if D > 1 else None
        o = recurrent_gated_delta_rule_triton(*qkv, g, beta, st, rows, scratch)
        st_rep = state0.clone()
        pend, slot = alloc_replay_meta(1, R, dev)
        bufs = alloc_replay_buffers(R, D, H, HV, K, V, device=dev, meta=(pend[0], slot[0]))
        o_rep = recurrent_gated_delta_rule_replay_triton(*qkv, g, beta, st_rep, rows, bufs, verify=D > 1)
        outs.append((o, st, scratch, o_rep, st_rep, bufs.k, bufs.delta))
    for a, b in zip(*outs):
        assert (a is None and b is None) or torch.equal(a, b)


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


# ---------------------------------------------------------------- commit (replay design: one launch)


def _windows(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Conv windows ``[..., C, W - 1]`` (or a weight ``[C, W]``) in ``layout``: "rows" as made
    (contiguous), "columns" column-major in memory as the stage keeps them (StatePool,
    GatedDeltaNet.fuse_projections); same shape and values."""
    return t if layout == "rows" else t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _replay_pool(gen, L, R, D, S, dt, dev, layout="rows"):
    """Conv windows, their verify scratch and replay counters of L layers, R rows: random
    values everywhere (slot 0 or 1, pending in [0, D]), so that any stray write shows."""
    conv = _windows(torch.randn(L, R, *S, generator=gen).to(dev, dt), layout)
    conv_scratch = _windows(torch.randn(L, R, D, *S, generator=gen).to(dev, dt), layout)
    pending = torch.randint(0, D + 1, (L, R), generator=gen, dtype=torch.int32).to(dev)
    slot = torch.randint(0, 2, (L, R), generator=gen, dtype=torch.int32).to(dev)
    return conv, conv_scratch, pending, slot


@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("B", [1, 64, 256])
def test_commit_conv_replay(dev, B, layout):
    """The replay design's one-launch commit (conv windows, pending, slot of every layer)
    equals today's two reference calls composed, and today's two GPU calls, bit for bit:
    rows scattered over a pool with rows nobody names (left untouched), several layers,
    three micro-batches at disjoint rows committed over two rounds (slots flip twice).
    Windows stored either way (``_windows``); a window laid out differently in the state
    and the scratch is refused."""
    from ppspec.kernels.commit import commit_accept_conv_replay
    from ppspec.kernels.commit.naive import commit_accept_conv_replay_ref, commit_accept_ref
    from ppspec.kernels.commit.triton_commit import (
        commit_accept_conv_replay_triton, commit_accept_triton, launch_commit_conv_replay,
    )
    from ppspec.kernels.gdn.naive_replay import commit_accept_replay_ref
    from ppspec.kernels.gdn.triton_replay import commit_accept_replay_triton

    gen = torch.Generator().manual_seed(1000 + B)
    L, D = 3, 4
    S = (12, 3) if _small(dev) else (96, 3)  # [C, W - 1]
    R = 3 * B + 7  # the last row pads; rows nobody names stay as they were
    perm = torch.randperm(R, generator=gen)
    sizes = [B, max(1, B // 2), 1]
    mbs, at = [], 0
    for n in sizes:
        mbs.append(perm[at:at + n].to(dev))
        at += n
    named = torch.cat(mbs)
    others = torch.ones(R, dtype=torch.bool, device=dev)
    others[named] = False
    # a window of one chunk in two dtypes, and one of two chunks (4098 elements: the
    # counters are written by one program per layer and row, not by every chunk)
    for S, dt in ((S, BF16), (S, F32), ((1366, 3), BF16)):
        pool0 = _replay_pool(gen, L, R, D, S, dt, dev, layout)
        ref, two_gpu, fused, launched, dispatched = ([t.clone() for t in pool0] for _ in range(5))
        assert fused[0].stride() == pool0[0].stride()  # clone keeps the layout
        for rnd in range(2):
            for rows in (mbs if rnd == 0 else mbs[::-1]):
                acc = torch.randint(1, D + 1, (rows.numel(),), generator=gen).to(dev)
                # the reference: today's two reference calls composed
                commit_accept_ref(ref[0], ref[1], rows, acc)
                commit_accept_replay_ref(ref[2], ref[3], rows, acc)
                # today's GPU path: two dispatches, seven launches
                commit_accept_triton(two_gpu[0], two_gpu[1], rows, acc)
                commit_accept_replay_triton(two_gpu[2], two_gpu[3], rows, acc)
                commit_accept_conv_replay_triton(*fused, rows, acc)
                launch_commit_conv_replay(*launched, rows, acc)
                commit_accept_conv_replay(*dispatched, rows, acc)  # CUDA: validate once, one launch
                for got in (two_gpu, fused, launched, dispatched):  # after every commit (a flip)
                    for name, a, b in zip(("conv", "conv_scratch", "pending", "slot"), got, ref):
                        assert a.dtype == b.dtype and torch.equal(a, b), f"{dt}: {name} differs from the reference"
        for name, a, b in zip(("conv", "pending", "slot"), (fused[0], fused[2], fused[3]), (pool0[0], pool0[2], pool0[3])):
            assert torch.equal(a[:, others], b[:, others]), f"{dt}: {name} of a row nobody named changed"
        assert torch.equal(fused[1], pool0[1]), "the scratch is read only"
        # every named row: last round's accept length in every layer, the slot flipped twice
        assert torch.equal(fused[3][:, named], pool0[3][:, named])
        # the composed reference function is the same two calls
        composed = [t.clone() for t in pool0]
        for rows in mbs:
            acc = torch.randint(1, D + 1, (rows.numel(),), generator=gen).to(dev)
            commit_accept_conv_replay_ref(*composed, rows, acc)
            commit_accept_ref(pool0[0], pool0[1], rows, acc)
            commit_accept_replay_ref(pool0[2], pool0[3], rows, acc)
        assert all(torch.equal(a, b) for a, b in zip(composed, pool0))
    other = "columns" if layout == "rows" else "rows"
    conv, scratch, pending, slot = pool0
    before = conv.clone()
    with pytest.raises(ValueError, match="laid out"):
        launch_commit_conv_replay(conv, _windows(scratch.contiguous(), other), pending, slot, rows, acc)
    assert torch.equal(conv, before)


@pytest.mark.parametrize("design", ["replay", "copy"])
def test_commit_padding_entries_write_nothing(dev, design):
    """A CUDA graph's padded commit (``StatePool.launch_commit``, the launches
    ``CommitGraphs`` records): entries with accept length 0, all on the padding row, write
    nothing (that row's conv window, state, pending and slot stay as they were); the real
    entries equal the reference commit of those entries alone."""
    from ppspec.kernels.commit.naive import commit_accept_conv_replay_ref, commit_accept_ref
    from ppspec.stage_server.pools import StatePool

    gen = torch.Generator().manual_seed(7)
    rows_n, D = 9, 4
    pool = StatePool(3, rows_n, 2, 8, 8, 12, 4, D, BF16, dev, num_k_heads=1, commit_design=design)
    for t in (pool.conv, pool.conv_scratch, pool.ssm, pool.ssm_scratch):
        if t is not None:
            t.copy_(torch.randn(t.shape, generator=gen).to(dev, t.dtype))
    if design == "replay":
        pool.replay_pending.copy_(torch.randint(0, D + 1, pool.replay_pending.shape, generator=gen))
        pool.replay_slot.copy_(torch.randint(0, 2, pool.replay_slot.shape, generator=gen))
    names = ("conv", "ssm", "replay_pending", "replay_slot")
    before = {n: getattr(pool, n).clone() for n in names if getattr(pool, n) is not None}
    rows, acc = [5, 0, 7], [2, 4, 1]
    pad = rows_n  # the padding row
    pool.launch_commit(torch.tensor(rows + [pad] * 5, device=dev), torch.tensor(acc + [0] * 5, device=dev))
    ref = {n: t.clone() for n, t in before.items()}
    r, a = torch.tensor(rows, device=dev), torch.tensor(acc, device=dev)
    if design == "replay":
        commit_accept_conv_replay_ref(ref["conv"], pool.conv_scratch, ref["replay_pending"], ref["replay_slot"], r, a)
    else:
        commit_accept_ref(ref["conv"], pool.conv_scratch, r, a)
        commit_accept_ref(ref["ssm"], pool.ssm_scratch, r, a)
    for n, want in ref.items():
        got = getattr(pool, n)
        assert torch.equal(got, want), f"{design}: {n} differs from the reference commit of the real entries"
        assert torch.equal(got[:, pad], before[n][:, pad]), f"{design}: padding wrote {n} of the padding row"


def test_commit_conv_replay_checks_before_writing(dev):
    """Bad rows or accept lengths raise before anything is written (conv windows, pending,
    slot all unchanged), through the dispatcher and the Triton entry point; host-known
    facts (``checks.known``) are what the check reads, as the stage states them."""
    from ppspec.kernels.checks import known
    from ppspec.kernels.commit import commit_accept_conv_replay
    from ppspec.kernels.commit.triton_commit import commit_accept_conv_replay_triton, launch_commit_conv_replay

    gen = torch.Generator().manual_seed(5)
    L, R, D, S = 2, 9, 3, (8, 3)
    pool0 = _replay_pool(gen, L, R, D, S, BF16, dev)
    pool = [t.clone() for t in pool0]
    T = lambda x: torch.tensor(x, device=dev)  # noqa: E731
    bad = [
        ([1, R], [1, 1], IndexError),          # a row past the padding row
        ([-1, 2], [1, 1], IndexError),         # a negative row
        ([3, 3], [1, 2], IndexError),          # a repeated row
        ([1, 2], [1, 0], ValueError),          # an accept length of 0
        ([1, 2], [D + 1, 1], ValueError),      # an accept length past D
        ([1, 2, 4], [1, 1], ValueError),       # a length mismatch
    ]
    for fn in (commit_accept_conv_replay, commit_accept_conv_replay_triton):
        for rows, acc, err in bad:
            with pytest.raises(err):
                fn(*pool, T(rows), T(acc))
            assert all(torch.equal(a, b) for a, b in zip(pool, pool0)), f"{fn.__name__} wrote before raising {rows} {acc}"
        # facts the host states are what the check reads: a stated bound outside the pool
        # refuses rows whose values are fine
        with pytest.raises(IndexError):
            fn(*pool, known(T([1, 2]), min=1, max=R, unique=True), known(T([1, 1]), min=1, max=1))
        with pytest.raises(ValueError):
            fn(*pool, known(T([1, 2]), min=1, max=2, unique=True), known(T([1, 1]), min=1, max=D + 1))
        assert all(torch.equal(a, b) for a, b in zip(pool, pool0))
    with pytest.raises(ValueError):  # pending / slot of another pool's layers or rows
        commit_accept_conv_replay(pool[0], pool[1], pool[2][:1], pool[3][:1], T([1]), T([1]))
    with pytest.raises(ValueError):
        commit_accept_conv_replay(pool[0], pool[1], pool[2][:, :-1], pool[3][:, :-1], T([1]), T([1]))
    with pytest.raises(ValueError):  # conv_scratch of another shape
        commit_accept_conv_replay(pool[0], pool[1][:, :, :, :-1], pool[2], pool[3], T([1]), T([1]))
    with pytest.raises(ValueError):  # the launch addresses rows by pointer: they must be contiguous
        launch_commit_conv_replay(*pool, T([1, 0, 2, 0])[::2], T([1, 1]))
    assert all(torch.equal(a, b) for a, b in zip(pool, pool0))
    # nothing to commit is no error and writes nothing
    commit_accept_conv_replay(*pool, T([]).long(), T([]).long())
    assert all(torch.equal(a, b) for a, b in zip(pool, pool0))


def test_commit_conv_replay_graph_capture(dev):
    """The one-launch commit is CUDA-graph capturable: a captured commit replayed with new
    rows and lengths in the same device tensors equals the reference."""
    if dev.type != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    from ppspec.kernels.commit.naive import commit_accept_conv_replay_ref
    from ppspec.kernels.commit.triton_commit import launch_commit_conv_replay

    gen = torch.Generator().manual_seed(11)
    L, R, D, B = 4, 300, 4, 64
    pool0 = _replay_pool(gen, L, R, D, (96, 3), BF16, dev)
    pool, ref = [t.clone() for t in pool0], [t.clone() for t in pool0]
    rows = torch.randperm(R, generator=gen)[:B].to(dev)
    acc = torch.randint(1, D + 1, (B,), generator=gen).to(dev)
    launch_commit_conv_replay(*pool, rows, acc)  # compile outside the capture
    commit_accept_conv_replay_ref(*ref, rows, acc)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch_commit_conv_replay(*pool, rows, acc)
    for _ in range(3):
        rows.copy_(torch.randperm(R, generator=gen)[:B].to(dev))
        acc.copy_(torch.randint(1, D + 1, (B,), generator=gen).to(dev))
        g.replay()
        commit_accept_conv_replay_ref(*ref, rows, acc)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(pool, ref))


# ---------------------------------------------------------------- conv1d update


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("D", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_conv1d_update(dev, dtype, D, mode, layout):
    """The decode / verify conv update against the reference, windows and weight stored
    either way (``_windows``): outputs close, windows exact, rows nobody names untouched."""
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
    weight = _windows(torch.randn(C, W, generator=gen).to(dev, dtype), layout)
    bias = torch.randn(C, generator=gen).to(dev, dtype) if D % 2 else None
    state0 = _windows(torch.randn(R, C, W - 1, generator=gen).to(dev, dtype), layout)
    st, st_ref = state0.clone(), state0.clone()
    sc = sc_ref = None
    if mode == "verify":
        sc = _windows(torch.full((R, D + 1, C, W - 1), float("nan"), device=dev, dtype=dtype), layout)
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
    # x as the GDN layer passes it: the conv columns of its fused input projection
    # ([B * D, C + more] rows), read in place; same results bit for bit (the padding row,
    # written by several programs, aside)
    wide = torch.cat([x, torch.randn(B, D, 9, generator=gen).to(dev, dtype)], dim=-1).view(B * D, C + 9)
    xs = wide[:, :C].view(B, D, C)
    st2, sc2 = state0.clone(), (torch.full_like(sc, float("nan")) if sc is not None else None)
    assert torch.equal(causal_conv1d_update_triton(xs, weight, bias, st2, rows, sc2), y)
    assert torch.equal(st2[:rows_n], st[:rows_n])
    if sc is not None:
        torch.testing.assert_close(sc2[:rows_n], sc[:rows_n], rtol=0, atol=0, equal_nan=True)
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


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("G", [1, 2])
def test_gdn_prefill_rows_fla_direct(dev, G, dtype, monkeypatch):
    """fla's forward-level kernels at stable rows (``gdn_prefill_rows_fla``: q, k, v read
    from the conv output's column views, the chunk plan made once from the stated values)
    against the torch reference; rows it does not own untouched; the device-made chunk plan
    equals the host's; and the path recorded in a CUDA graph (plan made inside it from a
    static ``cu_seqlens``) replays another layout of the same chunk count right."""
    if dev.type != "cuda":
        pytest.skip("fla needs CUDA")
    pytest.importorskip("fla")
    from ppspec.kernels.checks import known
    from ppspec.kernels.gdn import gdn_prefill_rows
    from ppspec.kernels.gdn.fla_prefill import chunk_plan, device_chunk_plan, gdn_prefill_rows_fla
    from ppspec.kernels.gdn.naive import chunk_gated_delta_rule_ref

    monkeypatch.setenv("PPSPEC_FLA_DIRECT", "1")
    gen = torch.Generator().manual_seed(7 * G + (dtype == BF16))
    H, K, V, R = 4, 128, 128, 9
    HV = G * H
    tol = 5e-3 if dtype == F32 else 2e-2  # fla's products run in tf32 / bf16

    def inputs(lens):
        T = sum(lens)
        conv = torch.randn(T, 2 * H * K + HV * V, generator=gen).to(dev, dtype)
        q, k, v = torch.split(conv, [H * K, H * K, HV * V], dim=-1)
        g = (-torch.rand(T, HV, generator=gen) * 0.3).to(dev)
        beta = torch.rand(T, HV, generator=gen).to(dev, dtype)
        return q.view(T, H, K), k.view(T, H, K), v.view(T, HV, V), g, beta

    def reference(q, k, v, g, beta, cu, state, rows, has_init):
        init = torch.where(has_init.view(-1, 1, 1, 1), state[rows], torch.zeros_like(state[rows]))
        return chunk_gated_delta_rule_ref(q.float(), k.float(), v.float(), g, beta.float(), cu, init)

    lens = [200, 64, 1, 130]
    cu_list = [0, 200, 264, 265, 395]
    q, k, v, g, beta = inputs(lens)
    state = torch.randn(R, HV, K, V, generator=gen).to(dev) * 0.1
    rows = torch.tensor([6, 0, 3, 8], device=dev)
    has_init = torch.tensor([True, False, True, False], device=dev)
    cu = known(torch.tensor(cu_list, device=dev), values=cu_list, max_len=200)
    st = state.clone()
    o = gdn_prefill_rows_fla(q, k, v, g, beta, cu, st, rows, has_init)
    o_ref, ht_ref = reference(q, k, v, g, beta, cu, state, rows, has_init)
    assert o.dtype == dtype and o.shape == (395, HV, V)
    assert _rel_err(o, o_ref) < tol
    assert _rel_err(st[rows], ht_ref) < tol
    others = [r for r in range(R) if r not in (6, 0, 3, 8)]
    assert torch.equal(st[others], state[others])
    st2 = state.clone()  # the dispatcher takes this path for sequences over 64 tokens
    assert torch.equal(gdn_prefill_rows(q, k, v, g, beta, cu, st2, rows, has_init), o)
    assert torch.equal(st2, st)
    ci, co = chunk_plan(cu, dev)
    assert ci.shape == (4 + 1 + 1 + 3, 2) and co.tolist() == [0, 4, 5, 6, 9]
    ci2, co2 = device_chunk_plan(cu, ci.shape[0])
    assert torch.equal(ci2, ci) and torch.equal(co2, co)

    # in a graph: one request of T tokens and a padding sequence up to t = 320 tokens, the
    # plan made from the static cu_seqlens inside the graph (5 chunks: T = 130 and 190 both)
    t, nt = 320, 6
    static_cu = torch.zeros(3, dtype=torch.long, device=dev)
    plan = (torch.zeros(nt, 2, dtype=torch.long, device=dev), torch.zeros(3, dtype=torch.long, device=dev))
    slots = torch.arange(nt, device=dev)
    big = inputs([t])
    sq, sk, sv, sg, sb = (x.clone() for x in big)
    srows = torch.tensor([2, 5], device=dev)
    shas = torch.tensor([True, False], device=dev)
    sstate = state.clone()

    def body():
        new_ci, new_co = device_chunk_plan(static_cu, nt, slots)
        plan[0].copy_(new_ci)
        plan[1].copy_(new_co)
        return gdn_prefill_rows_fla(sq, sk, sv, sg, sb, static_cu, sstate, srows, shas)

    static_cu.copy_(torch.tensor([0, 100, t], device=dev))  # 2 + 4 chunks
    # stated after the fill: an in-place copy drops a tensor's facts (the stage's graphs use
    # inference-mode tensors, which keep no version counter)
    known(static_cu, fla_chunks=plan, max_len=t)
    from ppspec.stage_server.graphs import record
    graph, out, _ = record(body)
    for T in (130, 190):  # 3 + 3 chunks each
        static_cu.copy_(torch.tensor([0, T, t], device=dev))
        fresh = inputs([t])
        for dst, src in zip((sq, sk, sv, sg, sb), fresh):
            dst.copy_(src)
        sstate.copy_(state)
        graph.replay()
        want_state = state.clone()
        cu_e = known(torch.tensor([0, T, t], device=dev), values=[0, T, t], max_len=max(T, t - T))
        want = gdn_prefill_rows_fla(*fresh, cu_e, want_state, srows, shas)
        torch.cuda.synchronize()
        assert _rel_err(out, want) < 1e-5  # the same kernels: equal up to a reordering at most
        assert _rel_err(sstate, want_state) < 1e-5


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("G", [1, 2])
def test_gdn_prefill_recurrent(dev, G, dtype):
    """The one-launch prefill of short sequences (``triton_prefill``) against the chunked
    reference: empty, single-token and full 64-token sequences, a longer one (the kernel
    takes any length; the dispatcher sends only short ones), q/k/v read in place from the
    conv output's columns, and the dispatcher's pick for a short chunk on CUDA."""
    from ppspec.kernels.gdn import SHORT_PREFILL_TOKENS, gdn_prefill
    from ppspec.kernels.gdn.naive import chunk_gated_delta_rule_ref
    from ppspec.kernels.gdn.triton_prefill import gdn_prefill_recurrent_triton

    gen = torch.Generator().manual_seed(17 * G + (dtype == BF16))
    H, K, V = (2, 16, 16) if _small(dev) else (4, 128, 128)
    HV = G * H
    for lens in ([1, 7, 0, SHORT_PREFILL_TOKENS, 3], [90]):
        if _small(dev):
            lens = [min(n, 9) for n in lens]
        T = sum(lens)
        cu = torch.tensor([0] + lens).cumsum(0).to(dev)
        mixed = torch.randn(T, 2 * H * K + HV * V, generator=gen).to(dev, dtype)
        q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
        q, k, v = q.view(T, H, K), k.view(T, H, K), v.view(T, HV, V)
        g = (-torch.rand(T, HV, generator=gen) * 0.3).to(dev)
        beta = torch.rand(T, HV, generator=gen).to(dev, dtype)
        h0 = (torch.randn(len(lens), HV, K, V, generator=gen) * 0.1).to(dev)
        o, ht = gdn_prefill_recurrent_triton(q, k, v, g, beta, cu, h0)
        o_ref, ht_ref = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, h0)
        assert o.dtype == v.dtype and ht.dtype == F32 and ht.shape == h0.shape
        tol = 1e-5 if dtype == F32 else 1e-2
        assert _rel_err(o, o_ref) < tol and _rel_err(ht, ht_ref) < tol
        for b, n in enumerate(lens):
            if n == 0:
                assert torch.equal(ht[b], h0[b])  # an empty sequence keeps its state
        o_c, ht_c = gdn_prefill_recurrent_triton(*(x.contiguous() for x in (q, k, v)), g, beta, cu, h0)
        assert torch.equal(o_c, o) and torch.equal(ht_c, ht)
        if dev.type == "cuda" and max(lens) <= SHORT_PREFILL_TOKENS:
            o2, _ = gdn_prefill(q, k, v, g, beta, cu, h0)
            assert torch.equal(o2, o)


@pytest.mark.parametrize("G", [1, 2])
def test_gdn_prefill_rows(dev, G):
    """Prefill at stable rows (``gdn_prefill_rows``: on CUDA one launch that reads and
    writes the pool rows itself) against the reference between a gather and a scatter:
    rows scattered over the pool, new (zero state) and continuing rows, an empty sequence;
    rows nobody names are untouched; a row outside the pool raises before any write."""
    from ppspec.kernels.gdn import gdn_prefill_rows
    from ppspec.kernels.gdn.naive import chunk_gated_delta_rule_ref
    from ppspec.kernels.gdn.triton_prefill import gdn_prefill_rows_triton

    gen = torch.Generator().manual_seed(31 + G)
    H, K, V = (2, 16, 16) if _small(dev) else (4, 128, 128)
    HV = G * H
    lens = [5, 1, 0, 9, 3]
    B, T, R = len(lens), sum(lens), len(lens) + 4
    cu = torch.tensor([0] + lens).cumsum(0).to(dev)
    rows = torch.randperm(R, generator=gen)[:B].to(dev)
    has_init = torch.tensor([True, False, True, True, False], device=dev)
    q, k = (torch.randn(T, H, K, generator=gen).to(dev, BF16) for _ in range(2))
    v = torch.randn(T, HV, V, generator=gen).to(dev, BF16)
    g = (-torch.rand(T, HV, generator=gen) * 0.3).to(dev)
    beta = torch.rand(T, HV, generator=gen).to(dev, BF16)
    state = (torch.randn(R, HV, K, V, generator=gen) * 0.1).to(dev)
    before = state.clone()
    init = torch.where(has_init.view(-1, 1, 1, 1), before[rows], 0.0)
    o_ref, ht_ref = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, init)
    others = torch.ones(R, dtype=torch.bool, device=dev)
    others[rows] = False
    direct = state.clone()
    for fn, st in ((gdn_prefill_rows, state), (gdn_prefill_rows_triton, direct)):
        o = fn(q, k, v, g, beta, cu, st, rows, has_init)
        assert o.dtype == v.dtype and _rel_err(o, o_ref) < 1e-2
        assert _rel_err(st[rows], ht_ref) < 1e-5
        assert torch.equal(st[others], before[others]), "a row nobody named changed"
    bad = rows.clone()
    bad[0] = R
    snapshot = state.clone()
    with pytest.raises(IndexError):
        gdn_prefill_rows(q, k, v, g, beta, cu, state, bad, has_init)
    assert torch.equal(state, snapshot)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_conv1d_prefill(dev, dtype, bias, layout):
    """The one-launch conv prefill (``triton_prefill``) against the reference over packed
    sequences shorter and longer than the window and than a token block, new and continuing
    rows, x a column slice of a wider projection, windows and weight stored either way
    (``_windows``): outputs close, windows exact, other rows untouched; rows outside the
    pool raise before the launch."""
    from ppspec.kernels.conv1d.naive import causal_conv1d_prefill_ref
    from ppspec.kernels.conv1d.triton_prefill import causal_conv1d_prefill_triton

    gen = torch.Generator().manual_seed(5 + bias + 2 * (dtype == BF16))
    C, W = (40, 4) if _small(dev) else (1000, 4)
    lens = [1, 2, 5, 16, 17, 40, 3]
    init = torch.tensor([True, True, False, False, True, True, False], device=dev)
    B = len(lens)
    rows_n = B + 4
    rows = torch.randperm(rows_n, generator=gen)[:B].to(dev)
    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(dev)
    wide = torch.randn(T, C + 7, generator=gen).to(dev, dtype)
    x = wide[:, 3:3 + C]  # strided rows: read in place
    weight = _windows(torch.randn(C, W, generator=gen).to(dev, dtype), layout)
    b = torch.randn(C, generator=gen).to(dev, dtype) if bias else None
    state0 = _windows(torch.randn(rows_n + 1, C, W - 1, generator=gen).to(dev, dtype), layout)
    st, st_ref = state0.clone(), state0.clone()
    y = causal_conv1d_prefill_triton(x, weight, b, st, rows, cu, init)
    y_ref = causal_conv1d_prefill_ref(x, weight, b, st_ref, rows, cu, init)
    tol = 1e-5 if dtype == F32 else 1e-2
    assert y.dtype == x.dtype and _rel_err(y, y_ref) < tol
    assert torch.equal(st, st_ref)  # windows are copies of inputs: exact; other rows untouched
    with pytest.raises(IndexError):
        causal_conv1d_prefill_triton(x, weight, b, st, torch.full((B,), rows_n + 1, device=dev), cu, init)
    assert torch.equal(st, st_ref)


# ---------------------------------------------------------------- paged attention


def _attention_case(dev, heads, dtype, mode, kv_dtype=None):
    """Random paged-attention inputs: ``(q, k_cache, v_cache, page_table, rows, kv_lens,
    cu_seqlens_q, scale)`` with scattered rows and pages; interpreter-sized off CUDA."""
    Hq, Hkv, hd = heads
    gen = torch.Generator().manual_seed(Hq + hd + (dtype == BF16) * 3 + len(mode))
    small = _small(dev)
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
    kv_dtype = kv_dtype or dtype
    k_cache = torch.randn(num_pages, page, Hkv, hd, generator=gen).to(dev, kv_dtype)
    v_cache = torch.randn(num_pages, page, Hkv, hd, generator=gen).to(dev, kv_dtype)
    T = sum(Ls)
    q = torch.randn(T, Hq, hd, generator=gen).to(dev, dtype)
    cu = torch.tensor([0] + Ls).cumsum(0).to(dev)
    return q, k_cache, v_cache, page_table.to(dev), rows.to(dev), torch.tensor(kv_lens, device=dev), cu, hd ** -0.5


@pytest.mark.parametrize("mode", ["decode", "verify", "prefill"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("heads", [(8, 8, 128), (16, 2, 256)])
def test_paged_attention(dev, heads, dtype, mode):
    from ppspec.kernels.attention import paged_attention
    from ppspec.kernels.attention.gpu import paged_attention_gpu
    from ppspec.kernels.attention.naive import paged_attention_ref

    if _small(dev) and dtype == BF16:
        pytest.skip("Triton's interpreter gets bf16 tl.dot wrong (seen with triton 3.6, numpy 2)")
    args = _attention_case(dev, heads, dtype, mode)
    o = paged_attention_gpu(*args)
    o_ref = paged_attention_ref(*args)
    tol = 1e-5 if dtype == F32 else 1e-2
    assert _rel_err(o, o_ref) < tol
    if dev.type == "cuda":
        assert torch.equal(paged_attention(*args), o)
    # the stage's index tensors are int64; int32 ones read the same
    args32 = list(args)
    for i in (4, 5, 6):
        args32[i] = args[i].to(torch.int32)
    assert torch.equal(paged_attention_gpu(*args32), o)
    bad = list(args)
    bad[4] = torch.full((args[4].numel(),), args[3].shape[0], device=dev)
    with pytest.raises(IndexError):
        paged_attention_gpu(*bad)


@pytest.mark.parametrize("splits", [2, 8, 32])
@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("heads", [(8, 8, 128), (16, 2, 256)])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_paged_attention_split_kv(dev, heads, mode, splits, dtype, monkeypatch):
    """The keys split into ``splits`` shares merged by a second kernel (flash-decoding),
    with the output gate: the reference's output whatever the split, including shares
    that hold no key of a short request (32 shares of a 5-token context). fp32 runs the
    one-stage loop of 32 keys; bf16 the two-stage pipelined loop of 64 keys that decode and
    verify take on the GPU (a share shorter than a pipeline's blocks included)."""
    from ppspec.kernels.attention import gpu
    from ppspec.kernels.attention.naive import paged_attention_ref

    if _small(dev) and dtype == BF16:
        pytest.skip("Triton's interpreter gets bf16 tl.dot wrong (seen with triton 3.6, numpy 2)")
    args = list(_attention_case(dev, heads, dtype, mode))
    args[5][0] = int(args[6][1] - args[6][0]) + 4  # request 0: 4 cached tokens, most shares empty
    T, Hq, hd = args[0].shape
    gate = torch.randn(T, Hq, hd, generator=torch.Generator().manual_seed(splits)).to(dev, dtype)
    tol = 1e-5 if dtype == F32 else 1e-2
    monkeypatch.setattr(gpu, "kv_splits", lambda *a, **k: splits)
    o = gpu.paged_attention_gpu(*args, gate=gate)
    assert _rel_err(o, paged_attention_ref(*args, gate=gate)) < tol
    monkeypatch.setattr(gpu, "kv_splits", lambda *a, **k: 1)
    assert _rel_err(o, gpu.paged_attention_gpu(*args, gate=gate)) < tol


@pytest.mark.parametrize("mode", ["decode", "verify", "prefill"])
@pytest.mark.parametrize("dtype,kv_dtype", [(F32, F32), (BF16, BF16), (BF16, F32)])
@pytest.mark.parametrize("heads", [(8, 8, 128), (16, 2, 256)])
def test_paged_attention_output_gate(dev, heads, dtype, kv_dtype, mode):
    """The gate fused into the kernel's epilogue, read in place from the strided view
    GatedAttention passes (per head, the second half of the q projection's ``2 hd``
    columns, in a row of the fused q|k|v GEMM), against the reference's
    ``attn * sigmoid(gate)``; one rounding instead of three (fp32 KV isolates it)."""
    from ppspec.kernels.attention import paged_attention
    from ppspec.kernels.attention.gpu import paged_attention_gpu
    from ppspec.kernels.attention.naive import paged_attention_ref

    if _small(dev) and kv_dtype == BF16:
        pytest.skip("Triton's interpreter gets bf16 tl.dot wrong (seen with triton 3.6, numpy 2)")
    args = _attention_case(dev, heads, dtype, mode, kv_dtype)
    q = args[0]
    T, Hq, hd = q.shape
    gen = torch.Generator().manual_seed(T + Hq)
    qkv = (torch.randn(T, 2 * Hq * hd + 2 * hd, generator=gen) * 3).to(dev, dtype)  # sigmoid's whole range
    gate = qkv[:, : 2 * Hq * hd].view(T, Hq, 2 * hd).chunk(2, dim=-1)[1]
    assert not gate.is_contiguous() and gate.stride() == (qkv.shape[1], 2 * hd, 1)
    o = paged_attention_gpu(*args, gate=gate)
    o_ref = paged_attention_ref(*args, gate=gate)
    assert o.dtype == dtype and o.shape == q.shape
    assert _rel_err(o, o_ref) < (1e-5 if dtype == F32 else 1e-2)
    if kv_dtype == F32:
        # fp32 attention: the fused result is the fp32 product rounded once to q's dtype, so
        # within one ulp of the exact product rounded, plus the two fp32 computations'
        # difference. That difference is ~1e-6 of the output's scale, not of each element:
        # an output that cancels to near zero carries it whole (seen on the H200: one
        # element of 262144 off by 1.1e-6 absolute, 1e-4 relative, in fp32).
        exact = paged_attention_ref(q.float(), *args[1:]) * torch.sigmoid(gate.float())
        r = exact.to(dtype).double()
        noise = 1e-5 * float(exact.abs().max())
        rounds = _bf16_cast_rounds(dev)  # the interpreter truncates: one more ulp, anywhere
        ulp = 0.0 if dtype == F32 else torch.finfo(dtype).eps * r.abs() * (1.01 if rounds else 2.02)
        diff = (o.double() - r).abs()
        assert (diff <= ulp + noise).all(), f"{int((diff > ulp + noise).sum())} elements beyond an ulp + {noise:.1e}"
        assert dtype == F32 or not rounds or float((diff > 0).double().mean()) <= 0.01
    if dev.type == "cuda":
        assert torch.equal(paged_attention(*args, gate=gate), o)
    for bad in (gate[..., :1], gate.float() if dtype != F32 else gate.to(BF16)):
        with pytest.raises(ValueError):
            paged_attention_gpu(*args, gate=bad)
        with pytest.raises(ValueError):
            paged_attention_ref(*args, gate=bad)


def test_dispatchers_take_gpu_paths(dev):
    """On CUDA the dispatch functions import the GPU modules (no silent CPU fallback)."""
    if dev.type != "cuda":
        pytest.skip("dispatch to the GPU paths needs CUDA tensors")
    import importlib

    for mod in ("gdn.triton_recurrent", "gdn.triton_replay", "gdn.triton_prefill", "commit.triton_commit",
                "conv1d.triton_update", "conv1d.triton_prefill", "attention.gpu", "norm.triton_norm", "activation.triton_activation"):
        importlib.import_module(f"ppspec.kernels.{mod}")


# ---------------------------------------------------------------- norms and activations

# hidden sizes: powers of two and not, up to Qwen3.5's 5120; rows: 1 (decode at batch 1)
# to 300 (a prefill chunk)
NORM_N = [64, 100, 256, 1000, 2048, 5120]
NORM_M = [1, 7, 300]


def _bf16_cast_rounds(dev) -> bool:
    """Whether Triton's fp32 -> bf16 cast rounds to nearest even here, as on the GPU.
    Triton 3.6's interpreter truncates, so under it a bf16 result of the kernels may sit
    one ulp (per rounding step) off the reference's, and sums of bf16 are not exact."""
    global _BF16_ROUNDS
    if dev.type == "cuda":
        return True
    if _BF16_ROUNDS is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _cast(x, y):
            tl.store(y, tl.load(x).to(tl.bfloat16))

        x = torch.tensor([1 + 3 * 2 ** -9])  # 3/4 of a bf16 ulp above 1: rounds up, truncates down
        y = torch.zeros(1, dtype=BF16)
        _cast[(1,)](x, y)
        _BF16_ROUNDS = y.item() != 1.0
    return _BF16_ROUNDS


_BF16_ROUNDS = None


def _ulp_close(out, ref, dtype, dev, ulps=1, frac=0.01):
    """fp32: within 1e-5 (relative). bf16: every element within ``ulps`` ulps of the
    reference (fp32 rounding inside, e.g. of ``rsqrt``, may move a result across a bf16
    rounding boundary; a rounding step after it can double that) and at most ``frac`` of
    them off at all; ``ulps=0``: bit-identical."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.double(), ref.double()
    assert not torch.isnan(o).any(), "NaN in the output"
    if dtype == F32:
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
        return
    if not _bf16_cast_rounds(dev):
        ulps, frac = ulps + 1, 1.0  # the interpreter truncates: one more ulp, anywhere
    if ulps == 0:
        assert torch.equal(out, ref)
        return
    ulp = torch.finfo(dtype).eps * r.abs().clamp_min(torch.finfo(dtype).tiny)  # one ulp above |r| or finer
    diff = (o - r).abs()
    assert (diff <= ulp * ulps * 1.01 + 1e-30).all(), f"max diff {float(diff.max())} beyond {ulps} ulp"
    off = float((diff > 0).double().mean())
    assert off <= frac, f"{off:.4f} of the elements differ"


def _norm_shape(M, N, small):
    if small and M * N > 300 * 1024:
        M = 61  # the interpreter runs programs one by one
    return M, N


@pytest.mark.parametrize("M", NORM_M)
@pytest.mark.parametrize("N", NORM_N)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(dev, residual, dtype, N, M):
    from ppspec.kernels.norm import rms_norm
    from ppspec.kernels.norm.naive import rms_norm_ref
    from ppspec.kernels.norm.triton_norm import rms_norm_triton

    M, N = _norm_shape(M, N, _small(dev))
    gen = torch.Generator().manual_seed(N + M + residual * 3 + (dtype == BF16))
    x = (torch.randn(M, N, generator=gen) * 3 + 0.5).to(dev, dtype)
    w = (torch.randn(N, generator=gen) * 0.2).to(dev, dtype)
    res = (torch.randn(M, N, generator=gen) * 3).to(dev, dtype) if residual else None
    eps = 1e-6
    out = rms_norm_triton(x, w, eps, res)
    ref = rms_norm_ref(x, w, eps, res)
    if residual:
        (out, s), (ref, s_ref) = out, ref
        _ulp_close(s, s_ref, dtype, dev, ulps=0)  # the sum is rounded as torch's add rounds: exact
    _ulp_close(out, ref, dtype, dev)
    # rows longer than the register block loop over blocks
    if N > 256:
        out2 = rms_norm_triton(x, w, eps, res, max_block=256)
        if residual:
            out2, s2 = out2
            _ulp_close(s2, s_ref, dtype, dev, ulps=0)
        _ulp_close(out2, ref, dtype, dev)
    # the plain (not zero-centred) form
    out3 = rms_norm_triton(x, w + 1, eps, zero_centred=False)
    _ulp_close(out3, rms_norm_ref(x, w + 1, eps, zero_centred=False), dtype, dev)
    if dev.type == "cuda":
        got = rms_norm(x, w, eps, res)  # the dispatcher takes the GPU path
        if residual:
            assert torch.equal(got[0], out) and torch.equal(got[1], s)
        else:
            assert torch.equal(got, out)


def test_rms_norm_strided_and_errors(dev):
    """q/k norms read a ``chunk`` of the q projection per head: strided rows, no copy."""
    from ppspec.kernels.norm import rms_norm
    from ppspec.kernels.norm.naive import rms_norm_ref
    from ppspec.kernels.norm.triton_norm import rms_norm_triton

    gen = torch.Generator().manual_seed(5)
    T, nh, hd = 9, 4, 64
    for dtype in (F32, BF16):
        proj = torch.randn(T, nh * 2 * hd, generator=gen).to(dev, dtype)
        q, gate = proj.view(T, nh, 2 * hd).chunk(2, dim=-1)
        w = (torch.randn(hd, generator=gen) * 0.1).to(dev, dtype)
        out = rms_norm_triton(q, w, 1e-6)
        assert out.shape == q.shape and out.is_contiguous()
        _ulp_close(out, rms_norm_ref(q, w, 1e-6), dtype, dev)
        # a transposed view (no common row stride) is copied first
        xt = torch.randn(hd, T, generator=gen).to(dev, dtype).t()
        _ulp_close(rms_norm_triton(xt, w, 1e-6), rms_norm_ref(xt, w, 1e-6), dtype, dev)
        # empty input
        assert rms_norm_triton(q[:0], w, 1e-6).shape == (0, nh, hd)
    x = torch.randn(3, 64, device=dev)
    for fn in (rms_norm, rms_norm_triton):
        with pytest.raises(ValueError):
            fn(x, torch.zeros(65, device=dev), 1e-6)
        with pytest.raises(ValueError):
            fn(x, torch.zeros(64, device=dev), 1e-6, residual=torch.zeros(3, 63, device=dev))
        with pytest.raises(ValueError):
            fn(x, torch.zeros(64, device=dev), 1e-6, residual=torch.zeros(3, 64, device=dev, dtype=BF16))


@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kernels_read_fused_projection_views_in_place(dev, dtype, T):
    """The layers split one GEMM's output ``[T, width]`` by columns (GDN qkv | z | b | a,
    attention q+gate | k | v, MLP gate | up) and view the parts per head: each kernel
    reads them where they lie (no copy) with the results of contiguous inputs, bit for bit."""
    from ppspec.kernels.activation.triton_activation import gdn_gates_triton, silu_mul_triton
    from ppspec.kernels.norm.triton_norm import as_head_rows, gated_rms_norm_triton, rms_norm_triton

    T = min(T, 37) if _small(dev) else T
    gen = torch.Generator().manual_seed(T + (dtype == BF16))
    rnd = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s).to(dev, dtype)  # noqa: E731
    eps = 1e-6

    def same(got, want):
        for g, w in zip(got, want) if isinstance(got, tuple) else ((got, want),):
            assert torch.equal(g, w)

    # gated attention: q and gate interleaved per head, then k, then v
    nh, nkv, hd = 4, 2, 64
    y = rnd(T, 2 * nh * hd + 2 * nkv * hd, s=2.0)
    qg, k, v = torch.split(y, [2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, _ = qg.view(T, nh, 2 * hd).chunk(2, dim=-1)
    k = k.view(T, nkv, hd)
    w = rnd(hd, s=0.1)
    for t in (q, k):
        assert as_head_rows(t)[0].data_ptr() == t.data_ptr()  # a view, not a copy
        same(rms_norm_triton(t, w, eps), rms_norm_triton(t.contiguous(), w, eps))
        res = rnd(*t.shape)
        same(rms_norm_triton(t, w, eps, res), rms_norm_triton(t.contiguous(), w, eps, res))
        same(rms_norm_triton(res, w, eps, t), rms_norm_triton(res, w, eps, t.contiguous()))
    # GDN: conv channels | z | b | a; z per value head into the gated norm, b / a into the gates
    hv, dv, conv = 4, 64, 2 * 2 * 64 + 4 * 64
    y = rnd(T, conv + hv * dv + 2 * hv, s=2.0)
    _, z, b, a = torch.split(y, [conv, hv * dv, hv, hv], dim=-1)
    z = z.view(T, hv, dv)
    o, wg = rnd(T, hv, dv), (1 + rnd(dv, s=0.2)).float()
    assert as_head_rows(z)[0].data_ptr() == z.data_ptr()
    same(gated_rms_norm_triton(o, z, wg, eps), gated_rms_norm_triton(o, z.contiguous(), wg, eps))
    A_log, dt_bias = torch.randn(hv, generator=gen).to(dev), torch.randn(hv, generator=gen).to(dev)
    same(gdn_gates_triton(a, b, A_log, dt_bias), gdn_gates_triton(a.contiguous(), b.contiguous(), A_log, dt_bias))
    # MLP: gate | up
    gate, up = rnd(T, 2 * 96, s=3.0).chunk(2, dim=-1)
    same(silu_mul_triton(gate, up), silu_mul_triton(gate.contiguous(), up.contiguous()))


@pytest.mark.parametrize("M", NORM_M)
@pytest.mark.parametrize("N", [64, 100, 128, 256, 1000, 5120])
@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, BF16), (BF16, F32)])  # (x and z, weight)
def test_gated_rms_norm(dev, dtypes, N, M):
    from ppspec.kernels.norm import gated_rms_norm
    from ppspec.kernels.norm.naive import gated_rms_norm_ref
    from ppspec.kernels.norm.triton_norm import gated_rms_norm_triton

    dtype, wdtype = dtypes
    M, N = _norm_shape(M, N, _small(dev))
    gen = torch.Generator().manual_seed(7 * N + M + (dtype == BF16) + 2 * (wdtype == BF16))
    x = (torch.randn(M, N, generator=gen) * 2).to(dev, dtype)
    z = (torch.randn(M, N, generator=gen) * 4).to(dev, dtype)
    w = (1 + torch.randn(N, generator=gen) * 0.2).to(dev, wdtype)
    ref = gated_rms_norm_ref(x, z, w, 1e-6)
    # x / rms(x) is rounded to bf16 before two more rounded products: a one-ulp move of
    # it (fp32 rsqrt) can grow to three ulps of the output
    _ulp_close(gated_rms_norm_triton(x, z, w, 1e-6), ref, dtype, dev, ulps=3)
    if N > 128:
        _ulp_close(gated_rms_norm_triton(x, z, w, 1e-6, max_block=128), ref, dtype, dev, ulps=3)
    # [T, HV, V] as the GDN layer calls it
    x3, z3 = x.view(M, 1, N), z.view(M, 1, N)
    _ulp_close(gated_rms_norm_triton(x3, z3, w, 1e-6), gated_rms_norm_ref(x3, z3, w, 1e-6), dtype, dev, ulps=3)
    if dev.type == "cuda":
        assert torch.equal(gated_rms_norm(x, z, w, 1e-6), gated_rms_norm_triton(x, z, w, 1e-6))
    for fn in (gated_rms_norm, gated_rms_norm_triton):
        with pytest.raises(ValueError):
            fn(x, z[:, :-1], w, 1e-6)
        with pytest.raises(ValueError):
            fn(x, z, w[:-1], 1e-6)


@pytest.mark.parametrize("dtype,N", [(F32, 96), (BF16, 200), (torch.float16, 64)])
def test_norm_row_tiles(dev, monkeypatch, dtype, N):
    """Several rows to a program (``_launch_cfg``'s ROWS > 1, from 1024 rows up; the other
    norm tests stay below): the tiled launch gives the one-row launch's results to one
    ulp (a ``[ROWS, BLOCK]`` tile's sum may reduce in another order: on the H200, bf16 and
    fp16 rows differ in the last bit), with a ragged last tile, fewer rows than a tile,
    per-head strided views and the residual, both weight forms and the gated norm."""
    import triton

    from ppspec.kernels.norm import triton_norm as tn
    from ppspec.kernels.norm.naive import rms_norm_ref

    gen = torch.Generator().manual_seed(N + (dtype == BF16))
    rnd = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s).to(dev, dtype)  # noqa: E731
    w, wg, eps = rnd(N, s=0.2), 1 + rnd(N, s=0.2), 1e-6

    def calls(x, z, res):
        return [tn.rms_norm_triton(x, w, eps), *tn.rms_norm_triton(x, w, eps, res),
                tn.rms_norm_triton(x, w, eps, zero_centred=False), tn.gated_rms_norm_triton(x, z, wg, eps),
                tn.gated_rms_norm_triton(x, z, wg.float(), eps)]

    # the real config: 1025 head rows of a fused projection (T = 205, H = 5, strided)
    T, H = 205, 5
    proj = rnd(T, H * 2 * N + 7, s=2.0)
    x, z = proj[:, : H * 2 * N].view(T, H, 2 * N).chunk(2, dim=-1)
    res = rnd(T, H, N)
    assert tn._launch_cfg(N, T * H, tn.MAX_BLOCK)[1]["ROWS"] == 2
    tiled = calls(x, z, res)
    _ulp_close(tiled[0], rms_norm_ref(x, w, eps), dtype, dev)
    orig = tn._launch_cfg

    def cfg(rows):
        def f(N, M, max_block):
            grid, c = orig(N, M, max_block)
            return (triton.cdiv(M, rows),), c | dict(ROWS=rows)
        return f

    monkeypatch.setattr(tn, "_launch_cfg", cfg(1))
    for got, want in zip(tiled, calls(x, z, res)):
        _ulp_close(got, want, dtype, dev)
    # ragged tiles and fewer rows than a tile (forced: the real config never makes them)
    x, z, res = rnd(7, 3, N, s=3.0), rnd(7, 3, N, s=4.0), rnd(7, 3, N)
    one = calls(x, z, res)
    for rows in (2, 4, 16, 32):
        monkeypatch.setattr(tn, "_launch_cfg", cfg(rows))
        for got, want in zip(calls(x, z, res), one):
            _ulp_close(got, want, dtype, dev)


@pytest.mark.parametrize("M", NORM_M)
@pytest.mark.parametrize("N", [64, 100, 1000, 3000, 5120])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_silu_mul(dev, dtype, N, M):
    from ppspec.kernels.activation import silu_mul
    from ppspec.kernels.activation.naive import silu_mul_ref
    from ppspec.kernels.activation.triton_activation import silu_mul_triton

    M, N = _norm_shape(M, N, _small(dev))
    gen = torch.Generator().manual_seed(11 * N + M + (dtype == BF16))
    gate = (torch.randn(M, N, generator=gen) * 4).to(dev, dtype)
    up = torch.randn(M, N, generator=gen).to(dev, dtype)
    ref = silu_mul_ref(gate, up)
    out = silu_mul_triton(gate, up)
    _ulp_close(out, ref, dtype, dev)
    # the two halves of a concatenated gate_up projection (MoE experts), read in place
    gu = torch.cat([gate, up], dim=-1)
    g2, u2 = gu.chunk(2, dim=-1)
    assert torch.equal(silu_mul_triton(g2, u2), out)
    if dev.type == "cuda":
        assert torch.equal(silu_mul(gate, up), out)
    assert silu_mul_triton(gate[:0], up[:0]).shape == (0, N)
    for fn in (silu_mul, silu_mul_triton):
        with pytest.raises(ValueError):
            fn(gate, up[:, :-1])


@pytest.mark.parametrize("M", NORM_M)
@pytest.mark.parametrize("HV", [1, 8, 32, 48, 64])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gdn_gates(dev, dtype, HV, M):
    from ppspec.kernels.activation import gdn_gates
    from ppspec.kernels.activation.naive import gdn_gates_ref
    from ppspec.kernels.activation.triton_activation import gdn_gates_triton

    gen = torch.Generator().manual_seed(13 * HV + M + (dtype == BF16))
    # a + dt_bias spans softplus's regimes: tiny (log1p), ordinary, past its threshold 20
    a = (torch.randn(M, HV, generator=gen) * 12).to(dev, dtype)
    b = (torch.randn(M, HV, generator=gen) * 3).to(dev, dtype)
    A_log = (torch.rand(HV, generator=gen) * 4 - 2).to(dev, dtype)
    dt_bias = (torch.randn(HV, generator=gen)).to(dev, dtype)
    g, beta = gdn_gates_triton(a, b, A_log, dt_bias)
    g_ref, beta_ref = gdn_gates_ref(a, b, A_log, dt_bias)
    assert g.dtype == F32 and beta.dtype == dtype and g.shape == a.shape
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-30)
    _ulp_close(beta, beta_ref, dtype, dev)
    # [B, D, HV] (verify) reads the same
    g3, beta3 = gdn_gates_triton(a.view(M, 1, HV), b.view(M, 1, HV), A_log, dt_bias)
    assert torch.equal(g3.view(M, HV), g) and torch.equal(beta3.view(M, HV), beta)
    if dev.type == "cuda":
        g4, beta4 = gdn_gates(a, b, A_log, dt_bias)
        assert torch.equal(g4, g) and torch.equal(beta4, beta)
    for fn in (gdn_gates, gdn_gates_triton):
        with pytest.raises(ValueError):
            fn(a, b[:, :-1] if HV > 1 else b[:0], A_log, dt_bias)
        with pytest.raises(ValueError):
            fn(a, b, A_log[:0], dt_bias)


@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("hd,rd,hq,hk", [(64, 16, 4, 2), (128, 32, 16, 2), (256, 64, 8, 8), (64, 64, 4, 4)])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("scale", [1.0, 1.2079441541679836])  # 1, and YaRN's attention factor at factor 8
def test_rotary(dev, dtype, T, hd, rd, hq, hk, scale):
    from ppspec.kernels.rotary import apply_rotary
    from ppspec.kernels.rotary.naive import rotary_ref
    from ppspec.kernels.rotary.triton_rotary import rotary_triton

    if _small(dev) and T > 7:
        T = 9
    gen = torch.Generator().manual_seed(T * hd + hq + (dtype == BF16))
    # q as GatedAttention has it: per-head halves of a [T, hq, 2 hd] projection (read in place)
    qg = torch.randn(T, hq, 2 * hd, generator=gen).to(dev, dtype)
    q = qg.chunk(2, dim=-1)[0]
    k = torch.randn(T, hk, hd, generator=gen).to(dev, dtype)
    # positions up to 8k tokens: angles of thousands of radians
    positions = torch.randint(0, 8192, (T,), generator=gen).to(dev)
    inv_freq = (1.0 / (1e7 ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))).to(dev)
    q_ref, k_ref = rotary_ref(q, k, positions, inv_freq, scale)
    q_out, k_out = rotary_triton(q, k, positions, inv_freq, scale)
    ang = positions.float()[:, None] * inv_freq
    for x, out, ref in ((q, q_out, q_ref), (k, k_out, k_ref)):
        assert out.is_contiguous() and out.shape == x.shape and out.dtype == dtype
        # each rotated dim is x_i cos - x_j sin (or x_i cos + x_j sin), cos / sin rounded to
        # x's dtype: forward error bound of a two-term sum whose products and sum are each
        # rounded once (Higham, Accuracy and Stability of Numerical Algorithms, sec. 3.1):
        # |out - exact| <= u (|x_i cos| + |x_j sin|) + u |out| per implementation; the kernel
        # and the reference may round differently (fp32 FMA contraction, the interpreter's
        # truncating casts), so their distance is bounded by twice that, with u one ulp
        xr = x[..., :rd].float()
        cs = (torch.cat([ang.cos(), ang.cos()], -1) * scale).to(dtype).float()[:, None]
        sn = (torch.cat([ang.sin(), ang.sin()], -1) * scale).to(dtype).float()[:, None]
        swapped = torch.cat([xr[..., rd // 2:], xr[..., : rd // 2]], -1)
        u = torch.finfo(dtype).eps
        bound = 2 * u * ((xr * cs).abs() + (swapped * sn).abs() + ref[..., :rd].float().abs()) + 1e-30
        diff = (out[..., :rd].float() - ref[..., :rd].float()).abs()
        assert (diff <= bound).all(), f"max excess {float((diff - bound).max())}"
        # the dims past rotary_dim pass through untouched
        assert torch.equal(out[..., rd:], x[..., rd:])
    if dev.type == "cuda":
        q2, k2 = apply_rotary(q, k, positions, inv_freq, scale)
        assert torch.equal(q2, q_out) and torch.equal(k2, k_out)
    if scale != 1.0:
        # the factor reaches the kernel: without it the rotated dims differ
        q1, _ = rotary_triton(q, k, positions, inv_freq)
        assert not torch.equal(q1[..., :rd], q_out[..., :rd])
    q0, k0 = rotary_triton(q[:0], k[:0], positions[:0], inv_freq)
    assert q0.shape == (0, hq, hd) and k0.shape == (0, hk, hd)
    with pytest.raises(ValueError):
        apply_rotary(q, k[:, :, :-1], positions, inv_freq)
    with pytest.raises(ValueError):
        apply_rotary(q, k, positions[:-1] if T > 1 else positions[:0], inv_freq)
    with pytest.raises(ValueError):
        apply_rotary(q, k, positions, torch.cat([inv_freq] * (hd // rd + 1)))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            apply_rotary(q, k, positions, inv_freq, bad)


# ---------------------------------------------------------------- greedy argmax on model-dtype logits


@pytest.mark.parametrize("V", [1000, 151936])
def test_argmax_of_bf16_logits_is_argmax_of_their_upcast(dev, V):
    """The fused greedy round takes argmax over bf16 logits without the fp32 copy
    (``StageModel.logits(upcast=False)``): the same index as over the exact upcast,
    ties (common in bf16) going to the first index in both."""
    gen = torch.Generator().manual_seed(V)
    x = torch.randn(6, V, generator=gen).to(BF16)
    top = x.max(-1, keepdim=True).values
    x.scatter_(1, torch.randint(0, V, (6, 4), generator=gen), top.expand(6, 4))  # ties at random places
    first = torch.stack([(row == row.max()).nonzero()[0, 0] for row in x])
    x = x.to(dev)
    assert torch.equal(x.argmax(-1).cpu(), first)
    assert torch.equal(x.float().argmax(-1).cpu(), first)
    assert torch.equal(x.view(2, 3, V).argmax(-1).flatten().cpu(), first)  # as the round views [B, D, V]


# ---------------------------------------------------------------- paged layout of a graphed step


@pytest.mark.parametrize("D", [1, 4])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("B", [1, 64, 300])
def test_paged_layout(dev, B, D, page_size):
    """Positions, KV lengths and slots from the Triton kernel == the torch reference, for
    scattered rows (the last entries on the padding row), random page tables and lengths;
    without positions the kernel writes the slots alone."""
    from ppspec.kernels.paging.naive import paged_layout_ref
    from ppspec.kernels.paging.triton_layout import paged_layout_triton

    gen = torch.Generator().manual_seed(B * 10 + D + page_size)
    pages = 40
    R = B + 5
    rows = _rows(gen, R, B, min(3, B - 1), "cpu")
    page_table = torch.randint(0, 10_000, (R + 1, pages), generator=gen)
    seq = torch.randint(0, pages * page_size - D + 1, (B,), generator=gen)
    want = [torch.full((n,), -1, dtype=torch.long) for n in (B * D, B * D, B)]
    paged_layout_ref(rows, seq, D, page_table, page_size, *want)
    got = [torch.full((n,), -1, dtype=torch.long, device=dev) for n in (B * D, B * D, B)]
    paged_layout_triton(rows.to(dev), seq.to(dev), D, page_table.to(dev), page_size, *got)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)
    slots_only = torch.full((B * D,), -1, dtype=torch.long, device=dev)
    paged_layout_triton(rows.to(dev), seq.to(dev), D, page_table.to(dev), page_size, slots_only)
    assert torch.equal(slots_only.cpu(), want[0])


def test_replay_verify_with_programmatic_dependent_launch(dev):
    """Qwen3.5-sized heads at batch 64 (the 2-warp, 64-column tile): the state kernel
    launched while the prep kernel still runs (PDL, sm_90 on) gives bit for bit the
    outputs, states and replay buffers of the serial launch, and both match the naive
    reference, over rounds with random accept lengths (so the records past the pending
    ones are stale; in one round they are made NaN / inf, which must not reach the state)."""
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    from ppspec.kernels.gdn import triton_replay as TR
    from ppspec.kernels.gdn.naive_replay import (
        alloc_replay_buffers, commit_accept_replay_ref, recurrent_gated_delta_rule_replay_ref, replay_flush_ref,
    )

    B, D, H, HV, K, V, R = 64, 4, 16, 32, 128, 128, 70
    assert TR._verify_block_v(V, B, HV) == 64
    results = []
    for pdl in (False, True, "ref"):
        TR.PDL = pdl if pdl != "ref" else None
        try:
            gen = torch.Generator().manual_seed(5)
            rows = _rows(gen, R, B, 0, dev)  # distinct rows: padding rows race on their garbage
            state = (torch.randn(R + 1, HV, K, V, generator=gen) * 0.1).to(dev)
            bufs = alloc_replay_buffers(R + 1, D, H, HV, K, V, device=dev)
            outs = []
            for rnd in range(4):
                x = _gdn_inputs(gen, B, D, H, HV, K, V, BF16, dev)
                acc = torch.randint(1, D + 1, (B,), generator=gen).to(dev)
                if rnd == 2:  # stale records past every row's pending steps turn non-finite
                    for i, r in enumerate(rows.tolist()):
                        n = int(bufs.pending[r])
                        cur = int(bufs.slot[r])
                        bufs.k[r, cur, n:] = float("nan")
                        bufs.delta[r, cur, n:] = float("inf")
                if pdl == "ref":
                    outs.append(recurrent_gated_delta_rule_replay_ref(*x, state, rows, bufs))
                    commit_accept_replay_ref(bufs.pending, bufs.slot, rows, acc)
                else:
                    outs.append(TR.launch_replay_verify(*x, state, rows, bufs))
                    TR.launch_replay_commit(bufs.pending, bufs.slot, rows, acc.to(torch.int32))
            (replay_flush_ref if pdl == "ref" else TR.launch_replay_flush)(state, bufs, rows)
            results.append((outs, state, bufs))
        finally:
            TR.PDL = None
    (o0, s0, b0), (o1, s1, b1), (o_ref, s_ref, _) = results
    assert all(torch.equal(a, b) for a, b in zip(o0, o1))
    assert torch.equal(s0, s1)
    assert all(torch.equal(a, b) for a, b in zip(b0, b1))
    assert all(_rel_err(a, b) < 1e-2 for a, b in zip(o1, o_ref))  # (_rel_err refuses NaN)
    assert _rel_err(s1, s_ref) < 1e-5 and bool(torch.isfinite(s1).all())
