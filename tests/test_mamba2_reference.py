"""The plain-torch Mamba2 scan (kernels/mamba2/naive.py) against transformers' own torch
Mamba2 ops (NemotronH's mixer functions, the reference every Mamba2 hybrid in transformers
shares), and the verify / commit / replay rules at stable rows against plain decode."""
import pytest
import torch

from ppspec.kernels.commit.naive import commit_accept_ref
from ppspec.kernels.mamba2 import chunk_scan_ref, discretize, gated_rms_norm_ref, recurrent_ref, replay_ref
from transformers.models.nemotron_h import modeling_nemotron_h as hf

SHAPES = [  # (heads, head_dim, groups, state)
    (4, 8, 1, 16),
    (6, 4, 3, 8),
    (8, 16, 2, 32),
]


def _inputs(T, H, P, G, N, seed=0, batch=None):
    g = torch.Generator().manual_seed(seed)
    lead = (T,) if batch is None else (batch, T)
    x = torch.randn(*lead, H, P, generator=g)
    dt = torch.randn(*lead, H, generator=g) - 1.0
    B = torch.randn(*lead, G, N, generator=g) * 0.5
    C = torch.randn(*lead, G, N, generator=g) * 0.5
    A = -torch.rand(H, generator=g) * 2 - 0.1
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    return x, dt, B, C, A, D, dt_bias


@pytest.mark.parametrize("H,P,G,N", SHAPES)
@pytest.mark.parametrize("chunk", [8, 64])
def test_chunk_scan_matches_transformers(H, P, G, N, chunk):
    T, S = 37, 3
    x, dt, B, C, A, D, dt_bias = _inputs(T, H, P, G, N, batch=S)
    init = torch.randn(S, H, P, N, generator=torch.Generator().manual_seed(1))
    limit = (0.05, 3.0)
    ref_y, ref_final = hf.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=16, D=D, dt_bias=dt_bias,
                                            initial_states=init, dt_softplus=True, dt_limit=limit,
                                            return_final_states=True)
    cu = torch.arange(0, (S + 1) * T, T)
    y, final = chunk_scan_ref(x.flatten(0, 1), dt.flatten(0, 1), A, B.flatten(0, 1), C.flatten(0, 1), D, dt_bias,
                              cu, init, chunk_size=chunk, dt_limit=limit)
    torch.testing.assert_close(y.view(S, T, H, P), ref_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref_final, atol=1e-4, rtol=1e-4)


def test_chunk_scan_packed_variable_lengths():
    H, P, G, N = 4, 8, 2, 16
    lens = [5, 1, 70, 16]
    init = torch.randn(len(lens), H, P, N, generator=torch.Generator().manual_seed(2))
    parts = [_inputs(n, H, P, G, N, seed=10 + i) for i, n in enumerate(lens)]
    A, D, dt_bias = parts[0][4:]
    cat = [torch.cat([p[j] for p in parts]) for j in range(4)]  # x, dt, B, C
    cu = torch.tensor([0] + lens).cumsum(0)
    y, final = chunk_scan_ref(cat[0], cat[1], A, cat[2], cat[3], D, dt_bias, cu, init, chunk_size=16)
    for i, (n, p) in enumerate(zip(lens, parts)):
        ry, rf = hf.mamba2_chunk_scan(p[0][None], p[1][None], A, p[2][None], p[3][None], chunk_size=32, D=D,
                                      dt_bias=dt_bias, initial_states=init[i:i + 1], dt_softplus=True,
                                      return_final_states=True)
        torch.testing.assert_close(y[cu[i]:cu[i + 1]], ry[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[i], rf[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("H,P,G,N", SHAPES)
def test_decode_matches_transformers_at_stable_rows(H, P, G, N):
    rows, Bs = 7, 3
    x, dt, B, C, A, D, dt_bias = _inputs(1, H, P, G, N, batch=Bs, seed=3)
    pool = torch.randn(rows + 1, H, P, N, generator=torch.Generator().manual_seed(4))
    before = pool.clone()
    idx = torch.tensor([5, 0, 2])
    y = recurrent_ref(x, dt, A, B, C, D, dt_bias, pool, idx)
    # transformers' single-step update, on its own copy of the rows' states
    st = before[idx].clone()
    ry = hf.mamba2_selective_state_update(
        st, x[:, 0], dt[:, 0, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N), B[:, 0], C[:, 0],
        D[:, None].expand(-1, P), dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True)
    torch.testing.assert_close(y[:, 0], ry, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[idx], st, atol=1e-5, rtol=1e-5)
    untouched = [r for r in range(rows + 1) if r not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_prefill_final_state_equals_steps():
    H, P, G, N, T = 4, 8, 2, 16, 23
    x, dt, B, C, A, D, dt_bias = _inputs(T, H, P, G, N, seed=5)
    init = torch.randn(1, H, P, N)
    y, final = chunk_scan_ref(x, dt, A, B, C, D, dt_bias, torch.tensor([0, T]), init, chunk_size=8)
    pool = torch.cat([init, torch.zeros(1, H, P, N)])
    ys = recurrent_ref(x[None], dt[None], A, B[None], C[None], D, dt_bias, pool, torch.tensor([0]))
    torch.testing.assert_close(ys[0], y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool[0], final[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("Dd", [2, 5])
def test_verify_commit_and_replay_equal_decode_of_accepted(Dd):
    """Copy design (scratch + commit) and replay design both leave each row at the state a
    plain decode of its accepted tokens reaches; rows outside the micro-batch are untouched."""
    H, P, G, N, rows = 6, 4, 3, 8, 9
    idx = torch.tensor([7, 1, 4, 0])
    acc = torch.tensor([Dd, 1, Dd - 1, 2])  # accept lengths count the bonus token: >= 1
    x, dt, B, C, A, D, dt_bias = _inputs(Dd, H, P, G, N, batch=len(idx), seed=6)
    pool = torch.randn(rows + 1, H, P, N, generator=torch.Generator().manual_seed(7))
    start = pool.clone()

    copy_pool = start.clone()
    scratch = torch.zeros(rows + 1, Dd, H, P, N)
    y_verify = recurrent_ref(x, dt, A, B, C, D, dt_bias, copy_pool, idx, scratch=scratch)
    assert torch.equal(copy_pool, start)  # a verify never writes committed state
    commit_accept_ref(copy_pool[None], scratch[None], idx, acc)  # one layer

    replay_pool = start.clone()
    replay_ref(replay_pool, idx, x, discretize(dt, dt_bias), B, A, acc)
    assert torch.equal(replay_pool, copy_pool)  # same arithmetic, bit for bit

    for i, row in enumerate(idx.tolist()):
        ref = start.clone()
        for t in range(int(acc[i])):
            yt = recurrent_ref(x[i:i + 1, t:t + 1], dt[i:i + 1, t:t + 1], A, B[i:i + 1, t:t + 1],
                               C[i:i + 1, t:t + 1], D, dt_bias, ref, torch.tensor([row]))
            torch.testing.assert_close(yt[0, 0], y_verify[i, t], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(copy_pool[row], ref[row], atol=1e-5, rtol=1e-5)
    others = [r for r in range(rows + 1) if r not in idx.tolist()]
    assert torch.equal(copy_pool[others], start[others])


def test_replay_of_nothing_keeps_state():
    H, P, G, N = 4, 8, 2, 16
    x, dt, B, C, A, D, dt_bias = _inputs(3, H, P, G, N, batch=2, seed=8)
    pool = torch.randn(5, H, P, N)
    start = pool.clone()
    replay_ref(pool, torch.tensor([3, 1]), x, discretize(dt, dt_bias), B, A, torch.tensor([0, 2]))
    assert torch.equal(pool[3], start[3]) and not torch.equal(pool[1], start[1])


def test_gated_norm_matches_transformers():
    I, G = 48, 3
    norm = hf.NemotronHRMSNormGated(I, group_size=I // G, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(I))
    y, z = torch.randn(2, 5, I), torch.randn(2, 5, I)
    torch.testing.assert_close(gated_rms_norm_ref(y, z, norm.weight.detach(), I // G, 1e-5), norm(y, z).detach())


@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_falcon_h1_gated_norm_matches_transformers(before, dtype):
    """Falcon-H1's gated norm, the gate before or after the group norm (``mamba_norm_before_gate``)."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

    I, G = 48, 3
    norm = FalconH1RMSNormGated(I, eps=1e-5, n_groups=G, norm_before_gate=before)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(I))
    norm = norm.to(dtype)
    y, z = torch.randn(2, 5, I, dtype=dtype), torch.randn(2, 5, I, dtype=dtype)
    got = gated_rms_norm_ref(y, z, norm.weight.detach(), I // G, 1e-5, norm_before_gate=before)
    torch.testing.assert_close(got, norm(y, z).detach(), **({} if before or dtype == torch.float32 else
                                                             dict(atol=2e-2, rtol=2e-2)))
