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
verify, read from the replay buffers (slot ``slot[row]``), and a verify stores each step's
normalised key, delta and log decay into slot ``1 - slot[row]`` instead of any state
(naive_replay.py).
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
def _gdn_recurrent_kernel(
    q, k, v, g, beta, o,
    state, scratch, rows,
    buf_k, buf_delta, buf_g, pending, slot,
    scale, s_q, s_k, s_v,
    D: tl.constexpr, D_MAX: tl.constexpr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    STORE_SCRATCH: tl.constexpr, STORE_FINAL: tl.constexpr, REPLAY: tl.constexpr, STORE_BUF: tl.constexpr,
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
        # apply the accepted steps of the previous verify: S <- exp(g) S + k delta^T with the
        # normalised key and the delta that verify stored (naive.gdn_apply): no reduction.
        # Unrolled over D_MAX with masked loads (a masked step has k = 0, g = 0: the
        # identity), so the loads of every step issue before the first step's math.
        n_pend = tl.load(pending + row)
        cur = tl.load(slot + row).to(tl.int64)
        for j in tl.static_range(D_MAX):
            st = (row * 2 + cur) * D_MAX + j
            on = j < n_pend
            b_k = tl.load(buf_k + (st * H + i_h) * K + o_k, mask=m_k & on, other=0.0)
            b_d = tl.load(buf_delta + (st * HV + i_hv) * V + o_v, mask=m_v & on, other=0.0)
            g_t = tl.load(buf_g + st * HV + i_hv, mask=on, other=0.0)
            b_s = b_s * tl.exp(g_t) + b_k[:, None] * b_d[None, :]
        if STORE_BUF:
            # verify: the committed state is final now; the D steps below stay speculative
            if n_pend > 0:
                tl.store(p_state, b_s.to(state.dtype.element_ty), mask=m_kv)
        nxt = 1 - cur

    if STORE_BUF:
        # verify of the replay design: its D steps never write a state, so none is formed.
        # With c_t = g_0 + ... + g_t and S the committed state, the recurrence unrolls to
        #   delta_t = beta_t (v_t - e^{c_t} S^T k_t - sum_{s<t} e^{c_t - c_s} (k_t.k_s) delta_s)
        #   o_t     = e^{c_t} S^T q_t + sum_{s<=t} e^{c_t - c_s} (q_t.k_s) delta_s
        # (the intra-chunk form of naive.chunk_gated_delta_rule_ref): 2 D independent
        # reductions over K of one tile instead of 4 D dependent passes over it.
        o_t = tl.arange(0, BT)
        m_t = o_t < D
        tok = (i_b * D + o_t).to(tl.int64)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_Q = tl.load(q + (tok * s_q + i_h * K)[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_K = tl.load(k + (tok * s_k + i_h * K)[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_V = tl.load(v + (tok * s_v + i_hv * V)[:, None] + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_g = tl.load(g + tok * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_b = tl.load(beta + tok * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_Q = b_Q * (tl.math.rsqrt(tl.sum(b_Q * b_Q, 1) + 1e-6) * scale)[:, None]
        b_K = b_K * tl.math.rsqrt(tl.sum(b_K * b_K, 1) + 1e-6)[:, None]
        b_c = tl.cumsum(b_g, 0)
        b_e = tl.exp(b_c)
        causal = o_t[:, None] >= o_t[None, :]
        decay = tl.exp(tl.where(causal, b_c[:, None] - b_c[None, :], 0.0))
        b_kk = tl.where(o_t[:, None] > o_t[None, :], tl.sum(b_K[:, None, :] * b_K[None, :, :], 2) * decay, 0.0)
        b_qk = tl.where(causal, tl.sum(b_Q[:, None, :] * b_K[None, :, :], 2) * decay, 0.0)
        b_SK = tl.zeros([BT, BV], dtype=tl.float32)
        b_SQ = tl.zeros([BT, BV], dtype=tl.float32)
        for t in tl.static_range(D):
            sel = (o_t == t)[:, None]
            k_t = tl.sum(tl.where(sel, b_K, 0.0), 0)
            q_t = tl.sum(tl.where(sel, b_Q, 0.0), 0)
            b_SK = tl.where(sel, tl.sum(b_s * k_t[:, None], 0)[None, :], b_SK)
            b_SQ = tl.where(sel, tl.sum(b_s * q_t[:, None], 0)[None, :], b_SQ)
        # the deltas, by forward substitution over the D steps (rows of b_U)
        b_rhs = b_b[:, None] * (b_V - b_e[:, None] * b_SK)
        b_U = tl.zeros([BT, BV], dtype=tl.float32)
        for t in tl.static_range(D):
            sel = o_t == t
            a_t = tl.sum(tl.where(sel[:, None], b_kk, 0.0), 0) * tl.sum(tl.where(sel, b_b, 0.0))
            u_t = tl.sum(tl.where(sel[:, None], b_rhs, 0.0), 0) - tl.sum(a_t[:, None] * b_U, 0)
            b_U = tl.where(sel[:, None], u_t[None, :], b_U)
        b_O = b_e[:, None] * b_SQ + tl.sum(b_qk[:, :, None] * b_U[None, :, :], 1)
        tl.store(o + (tok * HV + i_hv)[:, None] * V + o_v[None, :], b_O.to(o.dtype.element_ty), mask=m_tv)
        # the steps' record for the replay, in the row's other slot; k is per key head and
        # g per value head: one program writes each
        st = ((row * 2 + nxt) * D_MAX + o_t).to(tl.int64)
        is_k_writer = (i_vb == 0) & (i_hv % G == 0)
        tl.store(buf_k + (st * H + i_h)[:, None] * K + o_k[None, :], b_K, mask=m_tk & is_k_writer)
        tl.store(buf_delta + (st * HV + i_hv)[:, None] * V + o_v[None, :], b_U, mask=m_tv)
        tl.store(buf_g + st * HV + i_hv, b_g, mask=m_t & (i_vb == 0))
    else:
        for t in range(D):
            tok = (i_b * D + t).to(tl.int64)
            b_s = _gdn_token(q, k, v, g, beta, o, b_s, tok, i_h, i_hv, o_k, o_v, m_k, m_v, scale, s_q, s_k, s_v, HV, K, V)
            if STORE_SCRATCH:
                p_scr = scratch + ((row * D_MAX + t) * HV + i_hv) * (K * V) + kv_off
                tl.store(p_scr, b_s.to(scratch.dtype.element_ty), mask=m_kv)

    if STORE_FINAL:
        tl.store(p_state, b_s.to(state.dtype.element_ty), mask=m_kv)


def _block_v(V: int, B: int, HV: int, replay: bool = False) -> int:
    # measured on the H200 (kernels/bench_verify.py, B 64 / 256, HV 32, K = V = 128): plain
    # decode and the copy verify run best at BV 64 / 4 warps; the replay design at BV 32 /
    # 1 warp (its per-step reductions over K then stay inside one warp). Smaller tiles only
    # when the grid would be too small to fill the chip.
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


def launch_gdn_recurrent(q, k, v, g, beta, state, req_pool_indices, scale, scratch=None, bufs=None, verify=None,
                         block_v=None, num_warps=None):
    """Shared launcher: checks shapes, not rows, and never syncs the host (CUDA-graph
    capturable). ``bufs`` (a ``naive_replay.ReplayBuffers``) selects the replay design;
    ``verify`` is implied by ``scratch`` in the copy design and explicit in the replay one.
    ``block_v`` / ``num_warps`` override the tile choice (benchmarks)."""
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
        d_max = bufs.k.shape[2]
        if tuple(bufs.k.shape) != (state.shape[0], 2, d_max, H, K) or tuple(bufs.delta.shape) != (state.shape[0], 2, d_max, HV, V):
            raise ValueError("replay buffers do not match the state pool / heads")
        if not all(x.is_contiguous() and x.dtype == torch.float32 for x in bufs[:3]) or bufs.pending.stride(-1) != 1 or bufs.slot.stride(-1) != 1:
            raise ValueError("replay buffers must be contiguous fp32")
        if verify and D > d_max:
            raise ValueError(f"D = {D} exceeds the replay buffers' D_max = {d_max}")
        store_scratch, store_final, store_buf = False, not verify, bool(verify)
        scratch_arg = state  # unused
        buf_args = tuple(bufs[:3]) + (bufs.pending, bufs.slot)
    else:
        d_max = D
        if scratch is not None:
            d_max = scratch.shape[1]
            if tuple(scratch.shape) != (state.shape[0], d_max, HV, K, V) or d_max < D:
                raise ValueError(f"scratch {tuple(scratch.shape)} does not fit state {tuple(state.shape)} and D = {D}")
            if not scratch.is_contiguous():
                raise ValueError("the verify scratch must be contiguous")
        store_scratch, store_final, store_buf = scratch is not None, scratch is None, False
        scratch_arg = scratch if scratch is not None else state
        buf_args = (state,) * 3 + (rows, rows)  # unused
    BK = triton.next_power_of_2(K)
    BV = block_v or _block_v(V, B, HV, replay)
    grid = (B * HV, triton.cdiv(V, BV))
    _gdn_recurrent_kernel[grid](
        q, k, v, g, beta, o, state, scratch_arg, rows, *buf_args, float(scale), s_q, s_k, s_v,
        D=D, D_MAX=d_max, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, BT=max(2, triton.next_power_of_2(D)),
        STORE_SCRATCH=store_scratch, STORE_FINAL=store_final, REPLAY=replay, STORE_BUF=store_buf,
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
