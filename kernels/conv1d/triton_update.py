"""Triton causal depthwise conv1d update over D tokens per request at stable rows: the GPU
path of ``naive.causal_conv1d_update_ref``.

One program per (request, channel block). The window ``conv_state[row]`` (``[C, W - 1]``)
and the D new inputs form ``full = [window | x]``; output ``t`` is
``act(sum_j w[:, j] * full[:, t + j] + bias)``. Verify writes the window after each step
to ``conv_scratch[row, t]``; decode writes the final window back to ``conv_state[row]``.
As in the reference, inputs and window pass through the weight's dtype before the sum
(accumulated in fp32 here).

Every tensor is read and written through its strides, so the layout is the caller's: the
stage's pools keep each window column-major in memory (``[W - 1, C]`` behind the ``[C, W -
1]`` shape, ``StatePool``) and the weight tap-major, so that each column a program loads
or stores is ``BC`` consecutive channels. Against windows stored ``[C, W - 1]``, whose
column loads step over ``W - 1`` elements, that made the kernel 1.2x (decode) to 1.5x
(verify, D = 4) faster at batch 64 and 1.4x to 1.7x at batch 256 on the H200 (one layer,
C = 8192, bf16; ``kernels/bench_conv_update.py``, docs/PERFORMANCE.md, "Conv window update").
``x`` may be a column slice of a larger projection output (unit channel stride): no copy.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

from ..checks import check_rows

_ACT = {None: 0, "silu": 1, "swish": 1}


@triton.jit
def _full_col(x, sxb, sxd, conv_state, s_sr, s_sc, s_sw, row, i_b, o_c, m_c,
              i: tl.constexpr, D: tl.constexpr, W: tl.constexpr, wdt: tl.constexpr):
    # column i of full = [window (W-1 columns) | x (D columns)], rounded to the weight dtype
    if i < W - 1:
        val = tl.load(conv_state + row * s_sr + o_c * s_sc + i * s_sw, mask=m_c, other=0.0)
    else:
        val = tl.load(x + i_b * sxb + (i - (W - 1)) * sxd + o_c, mask=m_c, other=0.0)
    return val.to(wdt)


@triton.jit
def _conv_update_kernel(
    x, weight, bias, conv_state, conv_scratch, rows, out,
    C, sxb, sxd, s_wc, s_ww, s_sr, s_sc, s_sw, s_kr, s_kd, s_kc, s_kw,
    D: tl.constexpr, W: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_SCRATCH: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_cb = tl.program_id(1)
    row = tl.load(rows + i_b).to(tl.int64)
    o_c = i_cb * BC + tl.arange(0, BC)
    m_c = o_c < C
    wdt = weight.dtype.element_ty
    if HAS_BIAS:
        b_bias = tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)
    # every column of full (and every weight column) loaded once, up front: the stores below
    # may alias them as far as the compiler knows, so a load after a store would be issued
    # again, in series with it
    cols = ()
    for i in tl.static_range(W - 1 + D):
        cols = cols + (_full_col(x, sxb, sxd, conv_state, s_sr, s_sc, s_sw, row, i_b, o_c, m_c, i, D, W, wdt),)
    ws = ()
    for j in tl.static_range(W):
        ws = ws + (tl.load(weight + o_c * s_wc + j * s_ww, mask=m_c, other=0.0).to(tl.float32),)
    for t in tl.static_range(D):
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(W):
            acc += ws[j] * cols[t + j].to(tl.float32)
        if HAS_BIAS:
            acc += b_bias
        # the reference rounds the conv to the weight dtype before the activation
        acc = acc.to(wdt).to(tl.float32)
        if ACT == 1:
            acc = acc * tl.sigmoid(acc)
        tl.store(out + (i_b * D + t) * C + o_c, acc.to(wdt).to(out.dtype.element_ty), mask=m_c)
        if STORE_SCRATCH:
            for j in tl.static_range(W - 1):
                p = conv_scratch + row * s_kr + t * s_kd + o_c * s_kc + j * s_kw
                tl.store(p, cols[t + 1 + j].to(conv_scratch.dtype.element_ty), mask=m_c)
    if not STORE_SCRATCH:
        # column j of the new window is full[:, D + j]
        for j in tl.static_range(W - 1):
            tl.store(conv_state + row * s_sr + o_c * s_sc + j * s_sw, cols[D + j].to(conv_state.dtype.element_ty),
                     mask=m_c)


def causal_conv1d_update_triton(x, weight, bias, conv_state, req_pool_indices, conv_scratch=None, activation="silu"):
    """Same shapes and semantics as :func:`naive.causal_conv1d_update_ref`; ``weight``,
    ``conv_state`` and ``conv_scratch`` in any strides (column-major windows are the fast
    layout, module docstring).

    Raises:
        ValueError: an unknown activation, shapes that disagree.
        IndexError: a row outside the pool (before the launch).
    """
    if activation not in _ACT:
        raise ValueError(f"unsupported conv activation {activation!r}")
    B, D, C = x.shape
    W = weight.shape[-1]
    if weight.shape != (C, W) or tuple(conv_state.shape[1:]) != (C, W - 1):
        raise ValueError(f"conv shapes disagree: x {tuple(x.shape)} weight {tuple(weight.shape)} "
                         f"conv_state {tuple(conv_state.shape)}")
    R = conv_state.shape[0]
    if req_pool_indices.numel() != B:
        raise ValueError(f"{req_pool_indices.numel()} rows for a batch of {B}")
    check_rows(req_pool_indices, R)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, as the kernel writes it
    if B == 0 or D == 0:
        return out
    if conv_scratch is not None:
        d_max = conv_scratch.shape[1]
        if tuple(conv_scratch.shape) != (R, d_max, C, W - 1) or d_max < D:
            raise ValueError(f"conv_scratch {tuple(conv_scratch.shape)} does not fit {(R, D, C, W - 1)}")
    if x.stride(-1) != 1:
        x = x.contiguous()  # else read in place: x may be a column slice of a fused projection
    rows = req_pool_indices.to(x.device, torch.int64).contiguous()
    BC = min(256, triton.next_power_of_2(C))
    grid = (B, triton.cdiv(C, BC))
    scratch = conv_scratch if conv_scratch is not None else conv_state.unsqueeze(1)  # not written without one
    _conv_update_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, scratch, rows, out,
        C, x.stride(0), x.stride(1), *weight.stride(), *conv_state.stride(), *scratch.stride(),
        D=D, W=W, BC=BC, HAS_BIAS=bias is not None, ACT=_ACT[activation],
        STORE_SCRATCH=conv_scratch is not None, num_warps=4,
    )
    return out
