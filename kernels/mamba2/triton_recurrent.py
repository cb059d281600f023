"""Triton Mamba2 recurrent decode / verify at stable rows, both commit designs (the GPU
path of ``naive.recurrent_ref`` and ``naive_replay.recurrent_replay_ref``).

One program per (request, head, P-block). Its ``[BP, N]`` tile of the fp32 state is loaded
once from ``state[row]`` and stays in registers across the D steps. Per step: ``dt =
softplus(dt_raw + dt_bias)`` (clamped to ``dt_limit``), ``S <- exp(dt A) S + dt x B^T``,
``y = S C + D x``, with B / C of the head's group ``h // (H / G)``. Copy design: a verify
writes the state after step t to ``scratch[row, t]``, a decode the final state to
``state[row]``. Replay design (``REPLAY``): the program first applies the row's
``pending[row]`` recorded steps of slot ``slot[row]`` (``S <- dA S + dt x B^T``, no model
parameter needed); a verify then writes that committed state to ``state[row]`` and its own
steps' ``x``, ``dt``, ``exp(dt A)`` and ``B`` to slot ``1 - slot[row]``, a decode its final
state. ``pending[rows]`` is zeroed by the wrapper after the launch (every program of a row
reads it first). Rows are always ``req_pool_indices[b]``: no positional row anywhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .naive import recurrent_ref  # noqa: F401  (the oracle; documented pairing)
from .naive_replay import Mamba2ReplayBuffers, recurrent_replay_ref  # noqa: F401


@triton.jit
def _softplus(x):
    # torch.nn.functional.softplus (beta 1, threshold 20)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit
def _mamba2_recurrent_kernel(
    x, dt, Bm, Cm, y, A, Dskip, dt_bias,
    state, scratch, rows,
    buf_x, buf_dt, buf_da, buf_b, pending, slot,
    s_x, s_dt, s_b, s_c,
    dt_lo, dt_hi,
    T: tl.constexpr, D_MAX: tl.constexpr,
    H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr,
    STORE_SCRATCH: tl.constexpr, STORE_FINAL: tl.constexpr, REPLAY: tl.constexpr, RECORD: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_pb = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    i_g = i_h // (H // G)
    row = tl.load(rows + i_b).to(tl.int64)

    o_p = i_pb * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    m_pn = m_p[:, None] & m_n[None, :]
    pn_off = o_p[:, None] * N + o_n[None, :]

    p_state = state + (row * H + i_h) * (P * N) + pn_off
    b_s = tl.load(p_state, mask=m_pn, other=0.0).to(tl.float32)

    if REPLAY:
        n_pend = tl.load(pending + row)
        cur = tl.load(slot + row).to(tl.int64)
        base = (row * 2 + cur) * D_MAX
        for j in tl.static_range(D_MAX):
            live = j < n_pend
            b_xj = tl.load(buf_x + ((base + j) * H + i_h) * P + o_p, mask=m_p & live, other=0.0)
            dt_j = tl.load(buf_dt + (base + j) * H + i_h, mask=live, other=0.0)
            da_j = tl.load(buf_da + (base + j) * H + i_h, mask=live, other=1.0)
            b_bj = tl.load(buf_b + ((base + j) * G + i_g) * N + o_n, mask=m_n & live, other=0.0)
            b_s = da_j * b_s + (dt_j * b_xj)[:, None] * b_bj[None, :]
        if RECORD:
            # the committed state, once; the verify's own steps write no state
            tl.store(p_state, b_s.to(state.dtype.element_ty), mask=m_pn)
            new = (row * 2 + 1 - cur) * D_MAX

    a_h = tl.load(A + i_h).to(tl.float32)
    d_h = tl.load(Dskip + i_h).to(tl.float32)
    bias_h = tl.load(dt_bias + i_h).to(tl.float32)
    for t in tl.static_range(T):
        tok = i_b * T + t
        b_x = tl.load(x + tok * s_x + i_h * P + o_p, mask=m_p, other=0.0).to(tl.float32)
        dt_t = _softplus(tl.load(dt + tok * s_dt + i_h).to(tl.float32) + bias_h)
        dt_t = tl.minimum(tl.maximum(dt_t, dt_lo), dt_hi)
        da_t = tl.exp(dt_t * a_h)
        b_b = tl.load(Bm + tok * s_b + i_g * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_c = tl.load(Cm + tok * s_c + i_g * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_s = da_t * b_s + (dt_t * b_x)[:, None] * b_b[None, :]
        b_y = tl.sum(b_s * b_c[None, :], axis=1) + d_h * b_x
        tl.store(y + (tok * H + i_h) * P + o_p, b_y.to(y.dtype.element_ty), mask=m_p)
        if STORE_SCRATCH:
            tl.store(scratch + ((row * D_MAX + t) * H + i_h) * (P * N) + pn_off, b_s.to(scratch.dtype.element_ty),
                     mask=m_pn)
        if REPLAY:
            if RECORD:
                tl.store(buf_x + ((new + t) * H + i_h) * P + o_p, b_x, mask=m_p)
                if i_pb == 0:
                    tl.store(buf_dt + (new + t) * H + i_h, dt_t)
                    tl.store(buf_da + (new + t) * H + i_h, da_t)
                    if i_h % (H // G) == 0:
                        tl.store(buf_b + ((new + t) * G + i_g) * N + o_n, b_b, mask=m_n)
    if STORE_FINAL:
        tl.store(p_state, b_s.to(state.dtype.element_ty), mask=m_pn)


def _rows_major(t: torch.Tensor, inner: int) -> tuple[torch.Tensor, int]:
    """``t`` ``[Bs, T, ...]`` as a tensor whose token ``i`` starts at ``i * stride``
    elements with its last ``inner`` elements contiguous (column slices of a GEMM output
    stay in place); returns (tensor, token stride)."""
    flat = t.reshape(-1, inner)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, flat.stride(0)


def _launch(x, dt, A, B, C, D, dt_bias, state, rows, scratch, bufs, verify, dt_limit):
    Bs, T, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    if Bs == 0:
        return torch.empty_like(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xf, s_x = _rows_major(x, H * P)
    dtf, s_dt = _rows_major(dt, H)
    bf, s_b = _rows_major(B, G * N)
    cf, s_c = _rows_major(C, G * N)
    rows = rows.to(device=x.device, dtype=torch.int64).contiguous()
    replay = bufs is not None
    d_max = (bufs.x.shape[2] if replay else (scratch.shape[1] if scratch is not None else T))
    dummy = state  # never dereferenced when its constexpr flag is off
    BN = triton.next_power_of_2(N)
    BP = min(triton.next_power_of_2(P), max(1, 4096 // BN))
    grid = (Bs * H, triton.cdiv(P, BP))
    _mamba2_recurrent_kernel[grid](
        xf, dtf, bf, cf, y, A.float().contiguous(), D.contiguous(), dt_bias.contiguous(),
        state, scratch if scratch is not None else dummy, rows,
        *((bufs.x, bufs.dt, bufs.dA, bufs.B, bufs.pending, bufs.slot) if replay else (dummy,) * 6),
        s_x, s_dt, s_b, s_c, float(dt_limit[0]), float(dt_limit[1]),
        T=T, D_MAX=d_max, H=H, P=P, G=G, N=N, BP=BP, BN=BN,
        STORE_SCRATCH=scratch is not None, STORE_FINAL=scratch is None and not (replay and verify),
        REPLAY=replay, RECORD=replay and verify,
    )
    if replay:
        # one kernel, as KDA's (``pending[rows] = 0`` launches two: a device scalar's fill,
        # then the index put)
        bufs.pending.index_fill_(0, rows, 0)
    return y


def mamba2_recurrent_triton(x, dt, A, B, C, D, dt_bias, state, req_pool_indices, scratch=None,
                            dt_limit=(0.0, float("inf"))):
    """GPU path of :func:`naive.recurrent_ref` (same arguments and result). ``state`` and
    ``scratch`` contiguous fp32."""
    return _launch(x, dt, A, B, C, D, dt_bias, state, req_pool_indices, scratch, None, False, dt_limit)


def mamba2_recurrent_replay_triton(x, dt, A, B, C, D, dt_bias, state, req_pool_indices, bufs: Mamba2ReplayBuffers,
                                   verify=True, dt_limit=(0.0, float("inf"))):
    """GPU path of :func:`naive_replay.recurrent_replay_ref` (same arguments and result)."""
    if verify and x.shape[0] and x.shape[1] > bufs.x.shape[2]:
        raise ValueError(f"D = {x.shape[1]} exceeds the replay buffers' D_max = {bufs.x.shape[2]}")
    return _launch(x, dt, A, B, C, D, dt_bias, state, req_pool_indices, None, bufs, verify, dt_limit)
