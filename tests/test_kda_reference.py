"""The plain-torch KDA (kernels/kda/naive.py) against transformers' own torch KDA ops
(Kimi Linear's chunked and recurrent functions), and the verify / commit / replay rules at
stable rows against plain decode."""
import pytest
import torch
import torch.nn.functional as F

from ppspec.kernels.commit.naive import commit_accept_ref
from ppspec.kernels.gdn.naive_replay import alloc_replay_buffers, commit_accept_replay_ref, replay_flush_ref
from ppspec.kernels.kda import chunk_kda_ref, kda_recurrent_replay, recurrent_kda_ref
from transformers.models.kimi_linear import modeling_kimi_linear as hf


def _inputs(lead, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(*lead, H, K, generator=gen), torch.randn(*lead, H, K, generator=gen)
    v = torch.randn(*lead, H, V, generator=gen)
    g = -F.softplus(torch.randn(*lead, H, K, generator=gen)) * 0.3  # per-channel log decay <= 0
    beta = torch.rand(*lead, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("H,K,V", [(2, 8, 8), (3, 16, 4)])
@pytest.mark.parametrize("chunk", [8, 64])
def test_chunk_matches_transformers(H, K, V, chunk):
    S, T = 2, 29
    q, k, v, g, beta = _inputs((S, T), H, K, V)
    init = torch.randn(S, H, K, V, generator=torch.Generator().manual_seed(1)) * 0.3
    ro, rs = hf.chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=16, initial_state=init,
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    cu = torch.arange(0, (S + 1) * T, T)
    o, fin = chunk_kda_ref(*(x.flatten(0, 1) for x in (q, k, v, g, beta)), cu, init, chunk_size=chunk)
    torch.testing.assert_close(o.view(S, T, H, V), ro, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fin, rs, atol=1e-4, rtol=1e-4)


def test_packed_variable_lengths_and_recurrent_transformers():
    H, K, V = 2, 8, 6
    lens = [3, 1, 40]
    init = torch.randn(len(lens), H, K, V) * 0.3
    parts = [_inputs((n,), H, K, V, seed=20 + i) for i, n in enumerate(lens)]
    cat = [torch.cat([p[j] for p in parts]) for j in range(5)]
    cu = torch.tensor([0] + lens).cumsum(0)
    o, fin = chunk_kda_ref(*cat, cu, init, chunk_size=16)
    for i, p in enumerate(parts):
        ro, rs = hf.recurrent_kimi_delta_attention(*(x[None] for x in p), initial_state=init[i:i + 1],
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[cu[i]:cu[i + 1]], ro[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fin[i], rs[0], atol=1e-4, rtol=1e-4)


def test_decode_at_stable_rows_matches_transformers():
    H, K, V, rows = 2, 8, 8, 6
    idx = torch.tensor([4, 1])
    q, k, v, g, beta = _inputs((2, 1), H, K, V, seed=3)
    pool = torch.randn(rows + 1, H, K, V) * 0.3
    start = pool.clone()
    o = recurrent_kda_ref(q, k, v, g, beta, pool, idx)
    ro, rs = hf.recurrent_kimi_delta_attention(q, k, v, g, beta, initial_state=start[idx],
                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[idx], rs, atol=1e-5, rtol=1e-5)
    others = [r for r in range(rows + 1) if r not in idx.tolist()]
    assert torch.equal(pool[others], start[others])


@pytest.mark.parametrize("D", [2, 4])
def test_verify_copy_commit_and_replay_equal_decode_of_accepted(D):
    H, K, V, rows = 2, 8, 4, 8
    idx = torch.tensor([6, 0, 3])
    acc = torch.tensor([D, 1, D - 1])
    q, k, v, g, beta = _inputs((3, D), H, K, V, seed=4)
    start = torch.randn(rows + 1, H, K, V) * 0.3

    copy_pool, scratch = start.clone(), torch.zeros(rows + 1, D, H, K, V)
    o = recurrent_kda_ref(q, k, v, g, beta, copy_pool, idx, scratch=scratch)
    assert torch.equal(copy_pool, start)
    commit_accept_ref(copy_pool[None], scratch[None], idx, acc)

    replay_pool = start.clone()
    bufs = alloc_replay_buffers(rows + 1, D, H, H, K, V, per_channel_gate=True)
    o_rec = kda_recurrent_replay(q, k, v, g, beta, replay_pool, idx, bufs)
    torch.testing.assert_close(o_rec, o, atol=1e-6, rtol=1e-6)
    assert torch.equal(replay_pool, start)  # the verify keeps only the steps' inputs
    commit_accept_replay_ref(bufs.pending, bufs.slot, idx, acc)
    replay_flush_ref(replay_pool, bufs, idx)
    torch.testing.assert_close(replay_pool, copy_pool, atol=1e-6, rtol=1e-6)

    for i, row in enumerate(idx.tolist()):
        ref = start.clone()
        a = int(acc[i])
        recurrent_kda_ref(q[i:i + 1, :a], k[i:i + 1, :a], v[i:i + 1, :a], g[i:i + 1, :a], beta[i:i + 1, :a],
                          ref, torch.tensor([row]))
        torch.testing.assert_close(copy_pool[row], ref[row], atol=1e-5, rtol=1e-5)
