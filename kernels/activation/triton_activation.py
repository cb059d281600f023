"""Triton elementwise activations, one launch each: the GPU path of
``naive.silu_mul_ref`` (SwiGLU) and ``naive.gdn_gates_ref`` (a GDN layer's gates).

fp32 math inside, with the references' dtype steps (their docstrings); a result differs
from the reference only by fp32 rounding of ``exp`` / ``log``, which can move a bf16
output by one ulp. Launches take no host sync: capturable in a CUDA graph.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

from ..norm.triton_norm import as_rows

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _silu_mul_kernel(gate, up, out, N, sg, su, so, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    g = tl.load(gate + row * sg + o, mask=m, other=0.0)
    gf = g.to(tl.float32)
    # silu(gate) rounded to gate's dtype, then the product rounded (torch's two ops)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    u = tl.load(up + row * su + o, mask=m, other=0.0).to(tl.float32)
    tl.store(out + row * so + o, (s * u).to(out.dtype.element_ty), mask=m)


@triton.jit
def _gdn_gates_kernel(
    a, b, A_log, dt_bias, g_out, beta_out,
    M, HV, sa, sb,
    BR: tl.constexpr, BH: tl.constexpr,
):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    h = tl.arange(0, BH)
    mh = h < HV
    m = (r < M)[:, None] & mh[None, :]
    A = tl.load(A_log + h, mask=mh, other=0.0).to(tl.float32)
    dt = tl.load(dt_bias + h, mask=mh, other=0.0).to(tl.float32)
    x = tl.load(a + r[:, None] * sa + h[None, :], mask=m, other=0.0).to(tl.float32) + dt[None, :]
    # softplus as F.softplus (threshold 20); log1p(e) = e * log(1 + e) / ((1 + e) - 1) keeps
    # fp32 accuracy where 1 + e rounds (Goldberg's trick; no log1p in tl)
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    d = u - 1.0
    sp = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    sp = tl.where(x > 20.0, x, sp)
    g = -tl.exp(A)[None, :] * sp
    tl.store(g_out + r[:, None] * HV + h[None, :], g, mask=m)
    bv = tl.load(b + r[:, None] * sb + h[None, :], mask=m, other=0.0)
    bf = bv.to(tl.float32)
    tl.store(beta_out + r[:, None] * HV + h[None, :], (1.0 / (1.0 + tl.exp(-bf))).to(beta_out.dtype.element_ty), mask=m)


def _check(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, not {t.dtype}")


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Same shapes and semantics as :func:`naive.silu_mul_ref`. gate / up may be the two
    halves of a concatenated ``[..., 2I]`` tensor (``chunk(2, -1)``): read in place."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    if gate.dim() < 1:
        raise ValueError("gate and up need at least one dim")
    _check("gate", gate)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    N = gate.shape[-1]
    M = out.numel() // N if N else 0
    if M == 0:
        return out
    g2, u2, o2 = as_rows(gate), as_rows(up), out.view(M, N)
    block = min(1024, triton.next_power_of_2(N))
    _silu_mul_kernel[(M, triton.cdiv(N, block))](
        g2, u2, o2, N, g2.stride(0), u2.stride(0), o2.stride(0),
        BLOCK=block, num_warps=4 if block >= 512 else 1 if block <= 128 else 2,
    )
    return out


def gdn_gates_triton(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Same shapes and semantics as :func:`naive.gdn_gates_ref`."""
    if a.shape != b.shape or a.dim() < 1 or A_log.shape != (a.shape[-1],) or dt_bias.shape != (a.shape[-1],):
        raise ValueError(
            f"gdn gates: a {tuple(a.shape)}, b {tuple(b.shape)} must be [..., HV] with A_log "
            f"{tuple(A_log.shape)} and dt_bias {tuple(dt_bias.shape)} [HV]"
        )
    for name, t in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _check(name, t)
    HV = a.shape[-1]
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    M = g.numel() // HV if HV else 0
    if M == 0:
        return g, beta
    a2, b2 = as_rows(a), as_rows(b)
    BH = triton.next_power_of_2(HV)
    BR = max(1, min(64, 1024 // BH))
    _gdn_gates_kernel[(triton.cdiv(M, BR),)](
        a2, b2, A_log.contiguous(), dt_bias.contiguous(), g, beta,
        M, HV, a2.stride(0), b2.stride(0),
        BR=BR, BH=BH, num_warps=1 if BR * BH <= 256 else 4,
    )
    return g, beta
