"""Triton rotary embedding: every head of q and k in one launch, and nothing else on the
device but the outputs' allocation (the GPU path of ``naive.rotary_ref``).

One program rotates one head of one token. It forms the angle ``float(position) *
inv_freq`` in fp32 as the reference does, takes cos / sin with libdevice's accurate
``cosf`` / ``sinf``, multiplies them by ``scale`` in fp32 (YaRN's attention factor; 1
elsewhere, an exact product), then follows the reference's rounding steps in fp32 (cos /
sin, each product and the sum rounded to x's dtype). No host sync: capturable in a CUDA
graph.

libdevice is named rather than left to ``tl.cos`` / ``tl.sin``: positions in the thousands
give angles of thousands of radians, where the approximate PTX ``cos.approx`` /
``sin.approx`` lose all accuracy. (Triton 3.6 happens to lower fp32 ``tl.cos`` / ``tl.sin``
to the same libdevice calls, PTX for sm_90 checked; naming them keeps that whatever a
version or backend picks.)

Triton's interpreter (``TRITON_INTERPRET=1``, triton 3.6) has no libdevice: its stubs
return None. There the kernel takes ``tl.cos`` / ``tl.sin``, which the interpreter runs as
numpy's fp32 ``cos`` / ``sin`` (accurate too, not bit-equal to libdevice's).
"""
from __future__ import annotations

import os

import torch

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..norm.triton_norm import as_head_rows


def _interpreted() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rotary_kernel(q, k, qo, ko, positions, inv_freq, scale,
                   sq0, sq1, sk0, sk1, HQ, HALF, HD,
                   BH: tl.constexpr, BR: tl.constexpr, HAS_REST: tl.constexpr, LIBDEVICE: tl.constexpr):
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
    # the reference's fp32 angle: the position converted, times inv_freq, one rounding
    ang = tl.load(positions + t).to(tl.float32) * tl.load(inv_freq + j, mask=m, other=0.0).to(tl.float32)
    if LIBDEVICE:
        c = libdevice.cos(ang)
        s = libdevice.sin(ang)
    else:
        c = tl.cos(ang)
        s = tl.sin(ang)
    # the reference's ``cos * scale`` in fp32, then its rounding to x's dtype
    c = (c * scale).to(dt).to(tl.float32)
    s = (s * scale).to(dt).to(tl.float32)
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


def rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  scale: float = 1.0):
    """See ``kernels.rotary.apply_rotary``; q, k ``[T, H, head_dim]`` may be per-head views
    of a wider projection (read in place); outputs are contiguous. positions (int32 or
    int64) and inv_freq are read in their own dtype; a non-contiguous one is copied."""
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
    _rotary_kernel[(T, HQ + HK)](
        q3, k3, qo, ko, positions.contiguous(), inv_freq.contiguous(), float(scale),
        sq0, sq1, sk0, sk1, HQ, half, HD,
        BH=triton.next_power_of_2(half), BR=triton.next_power_of_2(max(rest, 1)), HAS_REST=rest > 0,
        LIBDEVICE=not _interpreted(), num_warps=1,
    )
    return qo, ko
