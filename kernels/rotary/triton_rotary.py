"""Triton rotary embedding: every head of q and k in one launch (the GPU path of
``naive.rotary_ref``).

cos / sin of ``positions x inv_freq`` come from torch's own fp32 ops (four small kernels;
their accuracy at angles of thousands of radians is torch's, not a fast approximation's);
one program rotates one head of one token, in fp32 with the reference's rounding steps
(cos / sin, each product and the sum rounded to x's dtype). No host sync: capturable in
a CUDA graph.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

from ..norm.triton_norm import as_head_rows


@triton.jit
def _rotary_kernel(q, k, qo, ko, cos, sin,
                   sq0, sq1, sk0, sk1, HQ, HALF, HD,
                   BH: tl.constexpr, BR: tl.constexpr, HAS_REST: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    is_q = h < HQ
    hh = tl.where(is_q, h, h - HQ).to(tl.int64)
    # one program per head of q or of k: pick the tensor (pointers are uniform per program)
    if is_q:
        src = q + t * sq0 + hh * sq1
        dst = qo + (t * HQ + hh) * HD
    else:
        src = k + t * sk0 + hh * sk1
        dst = ko + (t * (tl.num_programs(1) - HQ) + hh) * HD
    dt = qo.dtype.element_ty
    j = tl.arange(0, BH)
    m = j < HALF
    c = tl.load(cos + t * HALF + j, mask=m, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin + t * HALF + j, mask=m, other=0.0).to(dt).to(tl.float32)
    x1 = tl.load(src + j, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j, mask=m, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin: each product and the sum rounded as torch's ops round
    o1 = (x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)
    o2 = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
    tl.store(dst + j, o1.to(dt), mask=m)
    tl.store(dst + HALF + j, o2.to(dt), mask=m)
    if HAS_REST:
        r = 2 * HALF + tl.arange(0, BR)
        mr = r < HD
        tl.store(dst + r, tl.load(src + r, mask=mr, other=0.0), mask=mr)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """See ``kernels.rotary.apply_rotary``; q, k ``[T, H, head_dim]`` may be per-head views
    of a wider projection (read in place); outputs are contiguous."""
    T, HQ, HD = q.shape
    HK = k.shape[1]
    half = inv_freq.shape[0]
    q3, _, sq0, sq1 = as_head_rows(q)
    k3, _, sk0, sk1 = as_head_rows(k)
    qo = torch.empty((T, HQ, HD), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, HK, HD), dtype=k.dtype, device=k.device)
    if T == 0:
        return qo, ko
    rest = HD - 2 * half
    ang = positions.float().unsqueeze(-1) * inv_freq  # [T, half] fp32, as the reference forms it
    _rotary_kernel[(T, HQ + HK)](
        q3, k3, qo, ko, ang.cos(), ang.sin(), sq0, sq1, sk0, sk1, HQ, half, HD,
        BH=triton.next_power_of_2(half), BR=triton.next_power_of_2(max(rest, 1)), HAS_REST=rest > 0,
        num_warps=1,
    )
    return qo, ko
