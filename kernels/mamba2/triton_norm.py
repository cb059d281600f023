"""Triton Mamba2 output norm, one launch: the GPU path of ``naive.gated_rms_norm_ref`` (the
gate ``silu(z)`` and an RMSNorm over each group of ``group_size`` channels, its weight per
channel), which as plain torch is some ten elementwise and reduction kernels per layer and
step (a third of a NemotronH decode step's launches).

One program per (token, group): the group's ``group_size`` channels (up to
:data:`MAX_GROUP`) are held in registers, fp32 math. The dtype steps follow the reference:
gate then norm rounds ``h / rms(h)`` to y's dtype before the weight's product, rounded to
the product's dtype (torch's promotion of weight and y); norm then gate keeps fp32 up to
the one rounding to y's dtype. Results differ from the reference by fp32 rounding alone
(reduction order, ``rsqrt``, ``exp``). No host sync: capturable in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .naive import gated_rms_norm_ref

MAX_GROUP = 8192  # channels of a group held in one program's registers; wider: the reference


@triton.jit
def _group_gated_norm_kernel(y, z, w, out, G, GS, sy, sz, so, eps,
                             BLOCK: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = row // G
    g = row % G
    o = tl.arange(0, BLOCK)
    m = o < GS
    yv = tl.load(y + t * sy + g * GS + o, mask=m, other=0.0)
    yf = yv.to(tl.float32)
    zf = tl.load(z + t * sz + g * GS + o, mask=m, other=0.0).to(tl.float32)
    s = zf / (1.0 + tl.exp(-zf))  # silu(z)
    wf = tl.load(w + g * GS + o, mask=m, other=0.0).to(tl.float32)
    if NORM_BEFORE_GATE:
        rstd = tl.rsqrt(tl.sum(yf * yf, axis=0) / GS + eps)
        res = (wf * (yf * rstd)) * s
    else:
        h = yf * s
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / GS + eps)
        res = wf * (h * rstd).to(yv.dtype).to(tl.float32)
    tl.store(out + t * so + g * GS + o, res.to(out.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` ``[..., n]`` as ``[M, n]`` with unit last stride, in place where it already is
    (a column slice of a fused projection's output)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def gated_rms_norm_triton(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                          eps: float = 1e-6, norm_before_gate: bool = False) -> torch.Tensor:
    """GPU path of :func:`naive.gated_rms_norm_ref` (same arguments and result dtype): y,
    gate ``[..., I]``, weight ``[I]``, ``I`` a multiple of ``group_size``. Groups wider than
    :data:`MAX_GROUP` take the reference."""
    n = y.shape[-1]
    if group_size > MAX_GROUP or y.numel() == 0:
        return gated_rms_norm_ref(y, gate, weight, group_size, eps, norm_before_gate)
    dtype = y.dtype if norm_before_gate else torch.promote_types(weight.dtype, y.dtype)
    y2, z2 = _rows(y, n), _rows(gate, n)
    out = torch.empty(y2.shape, dtype=dtype, device=y.device)
    G = n // group_size
    BLOCK = triton.next_power_of_2(group_size)
    _group_gated_norm_kernel[(y2.shape[0] * G,)](
        y2, z2, weight.contiguous(), out, G, group_size, y2.stride(0), z2.stride(0), out.stride(0), float(eps),
        BLOCK=BLOCK, NORM_BEFORE_GATE=bool(norm_before_gate), num_warps=4 if BLOCK <= 1024 else 8,
    )
    return out.view(y.shape)
