"""Triton KDA (Kimi Delta Attention) decode / verify / replay at stable rows: the GPU path of
the plain-torch reference (``kernels/gdn/naive.py`` with a per-channel log decay, and
``kernels/gdn/naive_replay.py``'s replay design; same shapes and semantics).

One program per (request, head, V-block). Its ``[K, BV]`` tile of the fp32 state is loaded
once from ``state[row]`` and stays in registers: first, with the replay design, the row's
``pending[row]`` accepted steps of the previous verify (records of slot ``slot[row]``:
``S <- diag(exp g_j) S + k_j delta_j^T``, no reduction), then the D steps of this call
(q and k L2-normalised in the program, eps 1e-6 as ``naive.l2norm``)::

    S <- diag(exp g_t) S;  delta_t = beta_t (v_t - S^T k_t);  S <- S + k_t delta_t^T;  o_t = S^T q_t

Decode writes the last state to ``state[row]``; the copy design's verify writes the state
after step t to ``scratch[row, t]``; the replay design's verify writes the replayed
(committed) state back once and records each step's normalised key, delta and per-channel
log decay in slot ``1 - slot[row]``. The flush is the D = 0 case. Rows are always
``req_pool_indices[b]``; ``pending[row]`` is zeroed after the launch (a device op, no host
read: CUDA-graph capturable). Unlike GDN's replay verify (``kernels/gdn/triton_replay.py``,
a WY form over the D steps) the steps here run one after another: the per-channel decay does
not factor out of ``k_t . k_s``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_rows
from ..gdn.triton_recurrent import _token_rows

_EPS = 1e-6


@triton.jit
def _kda_kernel(
    q, k, v, g, beta, o, state, scratch, rows,
    buf_k, buf_delta, buf_g, pending, slot,
    scale, s_q, s_k, s_v,
    D: tl.constexpr, D_MAX: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, EPS: tl.constexpr,
    STORE_SCRATCH: tl.constexpr, STORE_FINAL: tl.constexpr, REPLAY: tl.constexpr, RECORD: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_vb = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    row = tl.load(rows + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    kv_off = o_k[:, None] * V + o_v[None, :]
    p_state = state + (row * H + i_h) * (K * V) + kv_off
    b_s = tl.load(p_state, mask=m_kv, other=0.0).to(tl.float32)

    new = row * 0
    if REPLAY:
        n_pend = tl.load(pending + row)
        cur = tl.load(slot + row).to(tl.int64)
        new = 1 - cur
        base = (row * 2 + cur) * D_MAX
        for j in tl.static_range(D_MAX):
            # steps from n_pend on read as k = 0, delta = 0, g = 0: the identity
            m_kj = m_k & (o_k * 0 + j < n_pend)
            m_vj = m_v & (o_v * 0 + j < n_pend)
            b_kj = tl.load(buf_k + ((base + j) * H + i_h) * K + o_k, mask=m_kj, other=0.0)
            b_gj = tl.load(buf_g + ((base + j) * H + i_h) * K + o_k, mask=m_kj, other=0.0)
            b_dj = tl.load(buf_delta + ((base + j) * H + i_h) * V + o_v, mask=m_vj, other=0.0)
            b_s = b_s * tl.exp(b_gj)[:, None] + b_kj[:, None] * b_dj[None, :]
        if RECORD:
            tl.store(p_state, b_s.to(state.dtype.element_ty), mask=m_kv)  # the committed state, once

    for t in range(D):
        tok = (i_b * D + t).to(tl.int64)
        b_q = tl.load(q + tok * s_q + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + tok * s_k + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + tok * s_v + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + tok * H + i_h).to(tl.float32)
        b_q = b_q * tl.math.rsqrt(tl.sum(b_q * b_q) + EPS) * scale
        b_k = b_k * tl.math.rsqrt(tl.sum(b_k * b_k) + EPS)
        b_s = b_s * tl.exp(b_g)[:, None]
        b_d = (b_v - tl.sum(b_s * b_k[:, None], axis=0)) * b_beta
        b_s = b_s + b_k[:, None] * b_d[None, :]
        b_o = tl.sum(b_s * b_q[:, None], axis=0)
        tl.store(o + (tok * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if STORE_SCRATCH:
            p_scr = scratch + ((row * D_MAX + t) * H + i_h) * (K * V) + kv_off
            tl.store(p_scr, b_s.to(scratch.dtype.element_ty), mask=m_kv)
        if RECORD:
            rec = ((row * 2 + new) * D_MAX + t) * H + i_h
            tl.store(buf_delta + rec * V + o_v, b_d, mask=m_v)
            if i_vb == 0:
                tl.store(buf_k + rec * K + o_k, b_k, mask=m_k)
                tl.store(buf_g + rec * K + o_k, b_g, mask=m_k)

    if STORE_FINAL:
        tl.store(p_state, b_s.to(state.dtype.element_ty), mask=m_kv)


def _check(q, k, v, g, beta, state):
    B, D, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape != (B, D, H, V) or beta.shape != (B, D, H):
        raise ValueError(f"KDA shapes disagree: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)}")
    if tuple(state.shape[1:]) != (H, K, V) or not state.is_contiguous():
        raise ValueError(f"state rows {tuple(state.shape[1:])} (contiguous) expected {(H, K, V)}")
    return B, D, H, K, V


def _check_bufs(bufs, state, H, K, V) -> int:
    d_max = bufs.k.shape[2]
    R = state.shape[0]
    if (tuple(bufs.k.shape) != (R, 2, d_max, H, K) or tuple(bufs.g.shape) != (R, 2, d_max, H, K)
            or tuple(bufs.delta.shape) != (R, 2, d_max, H, V)):
        raise ValueError("replay buffers (per-channel gate) do not match the state pool / heads")
    if not all(x.is_contiguous() and x.dtype == torch.float32 for x in bufs[:3]):
        raise ValueError("replay buffers must be contiguous fp32")
    if bufs.pending.stride(-1) != 1 or bufs.slot.stride(-1) != 1:
        raise ValueError("pending / slot must be contiguous")
    return d_max


def launch_kda(q, k, v, g, beta, state, rows, scale=None, scratch=None, bufs=None, verify=False):
    """Shared launcher: decode (nothing else), the copy design's verify (``scratch``), the
    replay design's decode (``bufs``) or verify (``bufs``, ``verify=True``). Checks shapes,
    not rows; never reads the device on the host. Returns ``o [B, D, H, V]`` in v's dtype."""
    B, D, H, K, V = _check(q, k, v, g, beta, state)
    rows = rows.to(device=q.device, dtype=torch.int64).contiguous()
    if rows.numel() != B:
        raise ValueError(f"{rows.numel()} rows for a batch of {B}")
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if B == 0 or (D == 0 and bufs is None):
        return o
    scale = K ** -0.5 if scale is None else scale
    (q, s_q), (k, s_k), (v, s_v) = (_token_rows(x) for x in (q, k, v))
    g, beta = g.contiguous(), beta.contiguous()
    if bufs is not None:
        d_max = _check_bufs(bufs, state, H, K, V)
        if scratch is not None:
            raise ValueError("the replay design keeps no scratch")
        if verify and D > d_max:
            raise ValueError(f"D = {D} exceeds the replay buffers' D_max = {d_max}")
        buf_args = tuple(bufs[:3]) + (bufs.pending, bufs.slot)
    else:
        d_max = D
        if scratch is not None:
            d_max = scratch.shape[1]
            if tuple(scratch.shape) != (state.shape[0], d_max, H, K, V) or d_max < D or not scratch.is_contiguous():
                raise ValueError(f"scratch {tuple(scratch.shape)} does not fit state {tuple(state.shape)} and D = {D}")
        buf_args = (state,) * 3 + (rows, rows)  # unused
    BV = min(64, triton.next_power_of_2(V))
    _kda_kernel[(B * H, triton.cdiv(V, BV))](
        q, k, v, g, beta, o, state, scratch if scratch is not None else state, rows, *buf_args, float(scale),
        s_q, s_k, s_v, D=D, D_MAX=max(d_max, 1), H=H, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, EPS=_EPS,
        STORE_SCRATCH=scratch is not None, STORE_FINAL=not verify, REPLAY=bufs is not None,
        RECORD=bufs is not None and verify, num_warps=4,
    )
    if bufs is not None:
        bufs.pending.index_fill_(0, rows, 0)
    return o


def kda_recurrent_triton(q, k, v, g, beta, state, req_pool_indices, scratch=None, scale=None):
    """GPU path of ``kda.naive.recurrent_kda_ref`` (decode, or the copy design's verify)."""
    check_rows(req_pool_indices, state.shape[0])
    return launch_kda(q, k, v, g, beta, state, req_pool_indices, scale, scratch=scratch, verify=scratch is not None)


def kda_recurrent_replay_triton(q, k, v, g, beta, state, req_pool_indices, bufs, scale=None, verify=True):
    """GPU path of ``gdn.naive_replay.recurrent_gated_delta_rule_replay_ref`` with per-channel
    gate buffers."""
    check_rows(req_pool_indices, state.shape[0])
    return launch_kda(q, k, v, g, beta, state, req_pool_indices, scale, bufs=bufs, verify=verify)


def kda_replay_flush_triton(state, bufs, req_pool_indices) -> None:
    """Apply the rows' pending steps to ``state[row]`` now (the D = 0 replay)."""
    check_rows(req_pool_indices, state.shape[0])
    R, H, K, V = state.shape
    z = state.new_zeros(req_pool_indices.numel(), 0, H, K)
    launch_kda(z, z, state.new_zeros(z.shape[0], 0, H, V), z, state.new_zeros(z.shape[0], 0, H), state,
               req_pool_indices, bufs=bufs, verify=False)
