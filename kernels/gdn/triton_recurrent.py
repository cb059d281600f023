"""Triton GDN recurrent decode / verify at stable rows (the GPU path of
``naive.recurrent_gated_delta_rule_ref``), and the kernel body shared with the replay
commit (``triton_replay.py``).

One program per (request, value head, V-block). Its ``[K, BV]`` tile of the fp32 state is
loaded once from ``state[row]`` and stays in registers across the D steps; q and k are
L2-normalised in the program, and the grouped heads (``HV = G * H``) are resolved by
reading query/key head ``hv // G``. Verify writes the state after step t to
``scratch[row, t]``; decode writes the final state back to ``state[row]``. Rows are always
``req_pool_indices[b]``: there is no positional row anywhere.

With ``REPLAY`` the program first applies ``pending[row]`` accepted steps of the previous
verify, read from the replay buffers (slot ``slot[row]``; naive_replay.py) by
:func:`_replay_pending`, then decodes (or, at D = 0, only stores: the flush). The replay
design's verify is its own pair of kernels in ``triton_replay.py``; the replay itself
(:func:`_replay_records`, :func:`_replay_apply`) is shared.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_rows
from .naive import recurrent_gated_delta_rule_ref  # noqa: F401  (the oracle; documented pairing)

_EPS = 1e-6  # naive.l2norm


@triton.jit
def _gdn_step(b_s, b_k, b_v, g_t, beta_t):
    """One gated delta step on the [BK, BV] tile, in the reference's order
    (``naive.gdn_step``): ``(new state, delta [BV])``."""
    b_s = b_s * tl.exp(g_t)
    kv_mem = tl.sum(b_s * b_k[:, None], axis=0)
    delta = (b_v - kv_mem) * beta_t
    return b_s + b_k[:, None] * delta[None, :], delta


@triton.jit
def _gdn_token(q, k, v, g, beta, o, b_s, tok, i_h, i_hv, o_k, o_v, m_k, m_v, scale, s_q, s_k, s_v,
               HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Token ``tok`` of head ``i_hv`` on the [BK, BV] tile: L2-normalise its q and k (eps
    1e-6, as ``naive.l2norm``), one gated delta step, its output stored in ``o``; returns the
    new tile."""
    b_q = tl.load(q + tok * s_q + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_kr = tl.load(k + tok * s_k + i_h * K + o_k, mask=m_k, other=0.0)
    b_vr = tl.load(v + tok * s_v + i_hv * V + o_v, mask=m_v, other=0.0)
    g_r = tl.load(g + tok * HV + i_hv)
    beta_r = tl.load(beta + tok * HV + i_hv)
    b_q = b_q * tl.math.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_kr.to(tl.float32)
    b_k = b_k * tl.math.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    b_s, b_d = _gdn_step(b_s, b_k, b_vr.to(tl.float32), g_r.to(tl.float32), beta_r.to(tl.float32))
    b_o = tl.sum(b_s * b_q[:, None], axis=0)
    tl.store(o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    return b_s


@triton.jit
def _replay_records(buf_k, buf_delta, base, n_pend, i_h, i_hv, o_k, o_v, m_k, m_v,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, D_MAX: tl.constexpr):
    """The normalised keys ([BK] each) and deltas ([BV] each) of the D_MAX steps at
    ``base = (row * 2 + slot) * D_MAX`` of the replay buffers, as two tuples; steps from
    ``n_pend`` on read as zeros. All loads are issued at once: the records come from HBM,
    and one round trip for all of them is what matters here, not the arithmetic of the
    masked steps (a branch per step made them serial)."""
    kjs = ()
    djs = ()
    for j in tl.static_range(D_MAX):
        kjs = kjs + (tl.load(buf_k + ((base + j) * H + i_h) * K + o_k, mask=m_k & (j < n_pend), other=0.0),)
        djs = djs + (tl.load(buf_delta + ((base + j) * HV + i_hv) * V + o_v, mask=m_v & (j < n_pend), other=0.0),)
    return kjs, djs


@triton.jit
def _replay_apply(b_s, kjs, djs, e_n, ws):
    """``S_n = e^{c_n} S + sum_j e^{c_n - c_j} k_j delta_j^T`` on the fp32 [BK, BV] tile
    ``b_s`` (``e_n = e^{c_n}``, ``ws[j] = e^{c_n - c_j}``, ``c_j = g_0 + .. + g_j``): the n
    replayed steps ``S <- e^{g_j} S + k_j delta_j^T`` (``naive.gdn_apply``) unrolled, one
    scaling of the tile instead of n, the weights on the [BV] delta rows."""
    b_s = b_s * e_n
    for j in tl.static_range(len(kjs)):
        b_s += kjs[j][:, None] * (djs[j] * ws[j])[None, :]
    return b_s


@triton.jit
def _replay_pending(b_s, buf_k, buf_delta, buf_g, pending, slot, row, i_h, i_hv, o_k, o_v, m_k, m_v,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    D_MAX: tl.constexpr, BP: tl.constexpr):
    """Apply the ``pending[row]`` accepted steps of slot ``slot[row]`` to ``b_s``, the fp32
    [BK, BV] tile of the committed state (:func:`_replay_apply`); returns
    ``(tile, pending[row], slot[row])``. A step is the normalised key and the delta that
    its verify stored, so a replay needs no reduction (naive_replay.py)."""
    n_pend = tl.load(pending + row)
    cur = tl.load(slot + row).to(tl.int64)
    base = (row * 2 + cur) * D_MAX
    o_p = tl.arange(0, BP)
    m_p = (o_p < n_pend) & (o_p < D_MAX)
    b_g = tl.load(buf_g + (base + o_p) * HV + i_hv, mask=m_p, other=0.0)
    kjs, djs = _replay_records(buf_k, buf_delta, base, n_pend, i_h, i_hv, o_k, o_v, m_k, m_v, H, HV, K, V, D_MAX)
    c_n = tl.sum(b_g, 0)
    b_w = tl.exp(c_n - tl.cumsum(b_g, 0))
    ws = ()
    for j in tl.static_range(D_MAX):
        ws = ws + (tl.sum(tl.where(o_p == j, b_w, 0.0), 0),)
    return _replay_apply(b_s, kjs, djs, tl.exp(c_n), ws), n_pend, cur


@triton.jit
def _gdn_recurrent_kernel(
    q, k, v, g, beta, o,
    state, scratch, rows,
    buf_k, buf_delta, buf_g, pending, slot,
    scale, s_q, s_k, s_v,
    D: tl.constexpr, D_MAX: tl.constexpr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr,
    STORE_SCRATCH: tl.constexpr, STORE_FINAL: tl.constexpr, REPLAY: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_vb = tl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    G: tl.constexpr = HV // H
    i_h = i_hv // G
    row = tl.load(rows + i_b).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    kv_off = o_k[:, None] * V + o_v[None, :]

    # committed state of the row: [K, V] tile of head i_hv
    p_state = state + (row * HV + i_hv) * (K * V) + kv_off
    b_s = tl.load(p_state, mask=m_kv, other=0.0).to(tl.float32)

    if REPLAY:
        # the accepted steps of the previous verify first (a decode, or the flush at D = 0)
        b_s, n_pend, cur = _replay_pending(b_s, buf_k, buf_delta, buf_g, pending, slot, row, i_h, i_hv,
                                           o_k, o_v, m_k, m_v, H, HV, K, V, D_MAX, BP)

    for t in range(D):
        tok = (i_b * D + t).to(tl.int64)
        b_s = _gdn_token(q, k, v, g, beta, o, b_s, tok, i_h, i_hv, o_k, o_v, m_k, m_v, scale, s_q, s_k, s_v, HV, K, V)
        if STORE_SCRATCH:
            p_scr = scratch + ((row * D_MAX + t) * HV + i_hv) * (K * V) + kv_off
            tl.store(p_scr, b_s.to(scratch.dtype.element_ty), mask=m_kv)

    if STORE_FINAL:
        tl.store(p_state, b_s.to(state.dtype.element_ty), mask=m_kv)


def _pow2_steps(d_max: int) -> int:
    """The replay's step axis (``BP`` of :func:`_replay_pending`): a power of two >= 2."""
    return max(2, triton.next_power_of_2(d_max))


def _block_v(V: int, B: int, HV: int, replay: bool = False) -> int:
    # measured on the H200 (kernels/bench_verify.py, B 64 / 256, HV 32, K = V = 128): plain
    # decode and the copy verify run best at BV 64 / 4 warps; the replay design's decode
    # at BV 32 / 1 warp (its reductions over K then stay inside one warp; BV 64 / 4 warps
    # is level: 93 us at B 64, 326 against 334 us at B 256). The replay verify has its own
    # choice (triton_replay._verify_block_v). Smaller tiles only when the grid would be too
    # small to fill the chip.
    bv = min(32 if replay else 64, triton.next_power_of_2(V))
    while bv > 8 and B * HV * triton.cdiv(V, bv) < 4 * 132:
        bv //= 2
    return bv


def _num_warps(BV: int, replay: bool) -> int:
    if replay:
        return 1 if BV <= 32 else 2
    return 4 if BV <= 64 else 8


def _check_gdn_args(q, k, v, g, beta, state):
    B, D, H, K = q.shape
    HV, V = v.shape[-2:]
    if k.shape != q.shape or v.shape[:2] != (B, D) or g.shape != (B, D, HV) or beta.shape != (B, D, HV):
        raise ValueError(f"GDN shapes disagree: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)}")
    if HV % H:
        raise ValueError(f"value heads {HV} not a multiple of key heads {H}")
    if tuple(state.shape[1:]) != (HV, K, V):
        raise ValueError(f"state rows are {tuple(state.shape[1:])}, expected {(HV, K, V)}")
    if not state.is_contiguous():
        raise ValueError("the state pool must be contiguous")
    return B, D, H, HV, K, V


def _token_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` ``[B, D, H, N]`` and the stride (elements) between its tokens, heads packed
    within a token: in place when its layout allows (the ``split`` of a projection's
    columns viewed per head), else a contiguous copy."""
    B, D, H, N = x.shape
    if (x.stride(3) == 1 or N == 1) and (x.stride(2) == N or H == 1):
        # token b * D + t sits at b * stride(0) + t * stride(1): one stride when they agree
        if D == 1:
            return x, x.stride(0)
        if B == 1 or x.stride(0) == D * x.stride(1):
            return x, x.stride(1)
    return x.contiguous(), H * N


def _check_replay_bufs(bufs, state, H, HV, K, V) -> int:
    """``D_max`` of the replay buffers ``bufs`` (``naive_replay.ReplayBuffers``) after
    checking them against the state pool and the heads."""
    d_max = bufs.k.shape[2]
    if tuple(bufs.k.shape) != (state.shape[0], 2, d_max, H, K) or tuple(bufs.delta.shape) != (state.shape[0], 2, d_max, HV, V):
        raise ValueError("replay buffers do not match the state pool / heads")
    if not all(x.is_contiguous() and x.dtype == torch.float32 for x in bufs[:3]) or bufs.pending.stride(-1) != 1 or bufs.slot.stride(-1) != 1:
        raise ValueError("replay buffers must be contiguous fp32")
    return d_max


def launch_gdn_recurrent(q, k, v, g, beta, state, req_pool_indices, scale, scratch=None, bufs=None,
                         block_v=None, num_warps=None):
    """Shared launcher of plain decode, the copy design's verify (``scratch``) and the
    replay design's decode (``bufs``, a ``naive_replay.ReplayBuffers``: the row's pending
    steps first; the replay verify is ``triton_replay.launch_replay_verify``). Checks
    shapes, not rows, and never syncs the host (CUDA-graph capturable). ``block_v`` /
    ``num_warps`` override the tile choice (benchmarks)."""
    B, D, H, HV, K, V = _check_gdn_args(q, k, v, g, beta, state)
    rows = req_pool_indices.to(device=q.device, dtype=torch.int64).contiguous()
    if rows.numel() != B:
        raise ValueError(f"{rows.numel()} rows for a batch of {B}")
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if B == 0 or D == 0:
        return o
    if scale is None:
        scale = K ** -0.5
    # q, k, v are per-head views of the conv output's columns: read in place, token by token
    (q, s_q), (k, s_k), (v, s_v) = (_token_rows(x) for x in (q, k, v))
    g, beta = g.contiguous(), beta.contiguous()
    replay = bufs is not None
    if replay:
        d_max = _check_replay_bufs(bufs, state, H, HV, K, V)
        if scratch is not None:
            raise ValueError("the replay design keeps no scratch")
        buf_args = tuple(bufs[:3]) + (bufs.pending, bufs.slot)
    else:
        d_max = D
        if scratch is not None:
            d_max = scratch.shape[1]
            if tuple(scratch.shape) != (state.shape[0], d_max, HV, K, V) or d_max < D:
                raise ValueError(f"scratch {tuple(scratch.shape)} does not fit state {tuple(state.shape)} and D = {D}")
            if not scratch.is_contiguous():
                raise ValueError("the verify scratch must be contiguous")
        buf_args = (state,) * 3 + (rows, rows)  # unused
    BK = triton.next_power_of_2(K)
    BV = block_v or _block_v(V, B, HV, replay)
    _gdn_recurrent_kernel[(B * HV, triton.cdiv(V, BV))](
        q, k, v, g, beta, o, state, scratch if scratch is not None else state, rows, *buf_args, float(scale), s_q, s_k, s_v,
        D=D, D_MAX=d_max, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, BP=_pow2_steps(d_max),
        STORE_SCRATCH=scratch is not None, STORE_FINAL=scratch is None, REPLAY=replay,
        num_warps=num_warps or _num_warps(BV, replay),
    )
    return o


def recurrent_gated_delta_rule_triton(q, k, v, g, beta, state, req_pool_indices, scratch=None, scale=None):
    """GPU path of :func:`naive.recurrent_gated_delta_rule_ref` (same shapes and semantics).

    Rows are checked by the dispatcher (``gdn_recurrent``); this also refuses rows outside
    the pool before the launch, so it is safe to call directly.
    """
    check_rows(req_pool_indices, state.shape[0])
    return launch_gdn_recurrent(q, k, v, g, beta, state, req_pool_indices, scale, scratch=scratch)
