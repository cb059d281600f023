"""Triton causal depthwise conv1d prefill over packed sequences, one launch: the GPU path of
``naive.causal_conv1d_prefill_ref`` (same shapes and semantics).

Every output depends only on its token's ``W`` inputs, so tokens run in parallel: one
program per (sequence, block of ``BT`` tokens, block of ``BC`` channels). Input ``i - (W-1)
+ j`` of a sequence's token ``i`` is the packed ``x[cu[b] + i - (W-1) + j]`` when
non-negative, else column ``i + j`` of the row's old window (zeros for a new request).
Only tokens ``i < W - 1`` read the old window, all in token block 0, so that block's program
writes the new window (the sequence's last ``W - 1`` inputs) after its own reads: no other
program reads ``conv_state``. Weight and windows are read through their strides (the
stage's layout: ``triton_update``). Rounding as the decode kernel (``triton_update``): inputs in
the weight's dtype, products summed in fp32, the sum rounded to the weight's dtype before
the activation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_rows, fact
from .triton_update import _ACT


@triton.jit
def _conv_prefill_kernel(
    x, weight, bias, conv_state, rows, cu, has_init, out,
    C, sx, s_wc, s_ww, s_sr, s_sc, s_sw,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_t = tl.program_id(1)
    i_cb = tl.program_id(2)
    bos = tl.load(cu + i_b).to(tl.int64)
    L = tl.load(cu + i_b + 1).to(tl.int64) - bos
    start = i_t * BT
    if start < L or i_t == 0:  # block 0 always runs: it writes the window, even of L = 0
        row = tl.load(rows + i_b).to(tl.int64)
        init = tl.load(has_init + i_b) != 0
        o_c = i_cb * BC + tl.arange(0, BC)
        m_c = o_c < C
        o_t = start + tl.arange(0, BT)
        m_t = o_t < L
        wdt = weight.dtype.element_ty
        p_win = conv_state + row * s_sr + o_c[None, :] * s_sc  # + column * s_sw
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            pos = o_t - (W - 1) + j
            in_x = pos >= 0
            vx = tl.load(x + (bos + pos)[:, None] * sx + o_c[None, :], mask=(m_t & in_x)[:, None] & m_c[None, :], other=0.0)
            vw = tl.load(p_win + (pos + (W - 1))[:, None] * s_sw, mask=(m_t & (pos < 0) & init)[:, None] & m_c[None, :],
                         other=0.0)
            val = tl.where(in_x[:, None], vx.to(wdt), vw.to(wdt)).to(tl.float32)
            w_j = tl.load(weight + o_c * s_wc + j * s_ww, mask=m_c, other=0.0).to(tl.float32)
            acc += val * w_j[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
        acc = acc.to(wdt).to(tl.float32)
        if ACT == 1:
            acc = acc * tl.sigmoid(acc)
        tl.store(out + (bos + o_t)[:, None] * C + o_c[None, :], acc.to(wdt).to(out.dtype.element_ty),
                 mask=m_t[:, None] & m_c[None, :])
        if i_t == 0:
            # new window column j = input L - (W-1) + j; from the old window (column L + j,
            # never one already rewritten: L + j > j) when that is negative
            for j in tl.static_range(W - 1):
                p_in = L - (W - 1) + j
                wx = tl.load(x + (bos + p_in) * sx + o_c, mask=m_c & (p_in >= 0), other=0.0)
                ww = tl.load(conv_state + row * s_sr + o_c * s_sc + (p_in + (W - 1)) * s_sw,
                             mask=m_c & (p_in < 0) & init, other=0.0)
                col = tl.where(p_in >= 0, wx.to(wdt), ww.to(wdt))
                tl.store(conv_state + row * s_sr + o_c * s_sc + j * s_sw, col.to(conv_state.dtype.element_ty),
                         mask=m_c)

def causal_conv1d_prefill_triton(x, weight, bias, conv_state, req_pool_indices, cu_seqlens, has_initial_state,
                                 activation="silu"):
    """Shapes as :func:`naive.causal_conv1d_prefill_ref`: x ``[T, C]`` (may be a column slice
    of a wider projection: read in place), weight ``[C, W]``, bias ``[C]`` or None, conv_state
    ``[rows + 1, C, W - 1]`` (weight and conv_state in any strides), ``req_pool_indices`` / ``has_initial_state``
    ``[B]``, ``cu_seqlens`` ``[B + 1]``. Returns ``[T, C]`` in x's dtype. One launch; the
    longest sequence comes from the stage's stated facts (else one device read).

    Raises:
        ValueError: shapes that disagree, an unknown activation.
        IndexError: a row outside the pool (before the launch).
    """
    if activation not in _ACT:
        raise ValueError(f"unsupported conv activation {activation!r}")
    T, C = x.shape
    W = weight.shape[-1]
    B = req_pool_indices.numel()
    if weight.shape != (C, W) or tuple(conv_state.shape[1:]) != (C, W - 1):
        raise ValueError(f"conv shapes disagree: x {tuple(x.shape)} weight {tuple(weight.shape)} "
                         f"conv_state {tuple(conv_state.shape)}")
    if cu_seqlens.numel() != B + 1 or has_initial_state.numel() != B:
        raise ValueError(f"{B} rows but cu_seqlens {tuple(cu_seqlens.shape)} and has_initial_state "
                         f"{tuple(has_initial_state.shape)}")
    check_rows(req_pool_indices, conv_state.shape[0])
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    longest = fact(cu_seqlens, "max_len", lambda: int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
    BT = max(16, triton.next_power_of_2(W))  # >= W - 1: only block 0 reads the old window
    BC = min(128, triton.next_power_of_2(C))
    grid = (B, max(1, triton.cdiv(longest, BT)), triton.cdiv(C, BC))
    _conv_prefill_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, req_pool_indices, cu_seqlens,
        has_initial_state, out, C, x.stride(0), *weight.stride(), *conv_state.stride(),
        W=W, BT=BT, BC=BC, HAS_BIAS=bias is not None, ACT=_ACT[activation], num_warps=4,
    )
    return out
