"""The replay commit (docs/DESIGN.md, "Commit rule") equals commit-from-scratch, on CPU.

Two pools run the same rounds side by side: the copy design (verify writes every step's
state into a scratch at stable rows, the commit copies ``scratch[row, accept_length - 1]``)
and the replay design (verify keeps each step's inputs, the commit records the accept
length, the next verify replays it). Micro-batches with disjoint rows interleave their
verifies and commits in random order, with random accept lengths; plain decode rounds mix
in. Every verify/decode output and, after a flush, every committed state must match.
"""
from __future__ import annotations

import random

import pytest
import torch

from ppspec.kernels.commit.naive import commit_accept_ref
from ppspec.kernels.gdn.naive import recurrent_gated_delta_rule_ref
from ppspec.kernels.gdn.naive_replay import (
    alloc_replay_buffers,
    alloc_replay_meta,
    commit_accept_replay_ref,
    recurrent_gated_delta_rule_replay_ref,
    replay_flush_ref,
    replay_reset_ref,
)


def _inputs(gen, B, D, H, HV, K, V, dtype):
    q = torch.randn(B, D, H, K, generator=gen).to(dtype)
    k = torch.randn(B, D, H, K, generator=gen).to(dtype)
    v = torch.randn(B, D, HV, V, generator=gen).to(dtype)
    g = (-torch.rand(B, D, HV, generator=gen) * 0.5).to(dtype)  # log decay in (-0.5, 0]
    beta = torch.rand(B, D, HV, generator=gen).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("H,HV", [(4, 4), (2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_matches_copy_commit(H, HV, dtype):
    gen = torch.Generator().manual_seed(1234 + H + (dtype == torch.bfloat16))
    rng = random.Random(7 + H)
    rows_n, D, K, V, L = 24, 4, 16, 8, 2  # L layers share one commit launch
    R = rows_n + 1
    state0 = torch.randn(L, R, HV, K, V, generator=gen) * 0.1
    st_copy = state0.clone()
    st_rep = state0.clone()
    scratch = torch.full((L, R, D, HV, K, V), float("nan"))
    pending, slot = alloc_replay_meta(L, R)
    bufs = [alloc_replay_buffers(R, D, H, HV, K, V, meta=(pending[l], slot[l])) for l in range(L)]

    # three micro-batches with disjoint, scattered stable rows (never 0..bs-1)
    perm = torch.randperm(rows_n, generator=gen)
    mbs = [perm[0:5].sort().values.flip(0), perm[5:6], perm[6:15]]
    in_flight: dict[int, torch.Tensor] = {}  # micro-batch -> accept lengths awaiting commit

    def verify(i):
        rows = mbs[i]
        B = rows.numel()
        for l in range(L):
            q, k, v, g, beta = _inputs(gen, B, D, H, HV, K, V, dtype)
            o_c = recurrent_gated_delta_rule_ref(q, k, v, g, beta, st_copy[l], rows, scratch[l])
            o_r = recurrent_gated_delta_rule_replay_ref(q, k, v, g, beta, st_rep[l], rows, bufs[l])
            torch.testing.assert_close(o_r, o_c, rtol=1e-5, atol=1e-5)
        in_flight[i] = torch.tensor([rng.randint(1, D) for _ in range(B)])

    def commit(i):
        rows, acc = mbs[i], in_flight.pop(i)
        commit_accept_ref(st_copy, scratch, rows, acc)  # all layers in one call
        commit_accept_replay_ref(pending, slot, rows, acc)  # all layers in one call

    def decode(i):
        rows = mbs[i]
        for l in range(L):
            q, k, v, g, beta = _inputs(gen, rows.numel(), 1, H, HV, K, V, dtype)
            o_c = recurrent_gated_delta_rule_ref(q, k, v, g, beta, st_copy[l], rows)
            o_r = recurrent_gated_delta_rule_replay_ref(q, k, v, g, beta, st_rep[l], rows, bufs[l], verify=False)
            torch.testing.assert_close(o_r, o_c, rtol=1e-5, atol=1e-5)

    for rnd in range(8):
        order = list(range(len(mbs)))
        rng.shuffle(order)
        for i in order:  # launch every micro-batch's verify ...
            verify(i)
        rng.shuffle(order)
        for i in order:  # ... and commit them in another order
            commit(i)
        if rnd % 3 == 2:  # a plain decode round for one micro-batch replays its pending steps
            decode(rng.randrange(len(mbs)))

    # one last verify left uncommitted must not change the committed state
    verify(0)
    in_flight.clear()

    for l in range(L):
        untouched = st_rep[l].clone()
        replay_flush_ref(st_rep[l], bufs[l], torch.arange(R))
        torch.testing.assert_close(st_rep[l], st_copy[l], rtol=1e-5, atol=1e-5)
        assert torch.equal(bufs[l].pending, torch.zeros(R, dtype=torch.int32))
        # rows never named by a micro-batch (and the padding row) were never written
        named = torch.cat(mbs)
        others = torch.tensor([r for r in range(R) if r not in set(named.tolist())])
        assert torch.equal(st_rep[l][others], state0[l][others])
        assert torch.equal(untouched[others], state0[l][others])


def test_replay_reset_and_flush_touch_only_named_rows():
    gen = torch.Generator().manual_seed(3)
    R, H, HV, K, V, D = 9, 1, 2, 4, 4, 3
    state = torch.randn(R, HV, K, V, generator=gen)
    bufs = alloc_replay_buffers(R, D, H, HV, K, V)
    rows = torch.tensor([6, 2])
    q, k, v, g, beta = _inputs(gen, 2, D, H, HV, K, V, torch.float32)
    before = state.clone()
    recurrent_gated_delta_rule_replay_ref(q, k, v, g, beta, state, rows, bufs)
    assert torch.equal(state, before)  # nothing pending: verify writes no state
    commit_accept_replay_ref(bufs.pending, bufs.slot, rows, torch.tensor([2, 3]))
    assert bufs.pending.tolist() == [0, 0, 3, 0, 0, 0, 2, 0, 0]
    replay_reset_ref(bufs.pending, torch.tensor([2]))  # row 2 released
    replay_flush_ref(state, bufs, torch.arange(R))
    changed = [r for r in range(R) if not torch.equal(state[r], before[r])]
    assert changed == [6]


def test_replay_dispatchers_check_rows_and_match_reference():
    from ppspec.kernels.gdn import (
        alloc_replay_buffers as alloc, commit_accept_replay, gdn_recurrent_replay, replay_flush, replay_reset,
    )

    gen = torch.Generator().manual_seed(11)
    R, H, HV, K, V, D = 7, 1, 2, 4, 4, 3
    state = torch.randn(R, HV, K, V, generator=gen)
    st_ref = state.clone()
    bufs, bufs_ref = alloc(R, D, H, HV, K, V), alloc(R, D, H, HV, K, V)
    rows = torch.tensor([5, 1])
    x = _inputs(gen, 2, D, H, HV, K, V, torch.float32)
    o = gdn_recurrent_replay(*x, state, rows, bufs)
    o_ref = recurrent_gated_delta_rule_replay_ref(*x, st_ref, rows, bufs_ref)
    assert torch.equal(o, o_ref)
    commit_accept_replay(bufs.pending, bufs.slot, rows, torch.tensor([3, 1]), d_max=D)
    commit_accept_replay_ref(bufs_ref.pending, bufs_ref.slot, rows, torch.tensor([3, 1]))
    replay_flush(state, bufs, rows)
    replay_flush_ref(st_ref, bufs_ref, rows)
    assert torch.equal(state, st_ref)
    before = (state.clone(), bufs.pending.clone(), bufs.slot.clone())
    with pytest.raises(IndexError):
        gdn_recurrent_replay(*x, state, torch.tensor([1, R]), bufs)
    with pytest.raises(IndexError):
        commit_accept_replay(bufs.pending, bufs.slot, torch.tensor([1, 1]), torch.tensor([1, 1]))
    with pytest.raises(ValueError):
        commit_accept_replay(bufs.pending, bufs.slot, rows, torch.tensor([0, 1]))
    with pytest.raises(ValueError):
        commit_accept_replay(bufs.pending, bufs.slot, rows, torch.tensor([D + 1, 1]), d_max=D)
    with pytest.raises(IndexError):
        replay_reset(bufs.pending, torch.tensor([-1]))
    assert torch.equal(state, before[0]) and torch.equal(bufs.pending, before[1]) and torch.equal(bufs.slot, before[2])
