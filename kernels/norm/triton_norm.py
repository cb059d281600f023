"""Triton RMSNorms, one launch each: the GPU path of ``naive.rms_norm_ref`` (with the
residual add fused, vLLM's ``fused_add_rms_norm`` idea) and ``naive.gated_rms_norm_ref``.

fp32 math inside. A row of up to ``max_block`` (8192) elements is held in registers
(``BLOCK = next_power_of_2(N)``), ``2048 // BLOCK`` rows to a program (one per program
from 2048 elements up); a longer row is walked twice in blocks of ``max_block`` (sum of
squares, then normalise), one row to a program. Inputs are read
where they lie: row ``i * H + h`` of a ``[..., H, N]`` input at ``i * s0 + h * s1``
(:func:`as_head_rows`), so the per-head q / k / z views of a fused projection's output
take no copy. The dtype steps follow the references (see their docstrings), so a result
differs from the reference only by fp32 rounding (reduction order, ``rsqrt``, ``exp``),
which can move a bf16 output by one ulp (the gated norm's by up to three: it rounds
``x / rms(x)`` to bf16 before two more rounded products). The residual sum
``x + residual`` is rounded as torch rounds it: exact.

Launches take no host sync: capturable in a CUDA graph.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

MAX_BLOCK = 8192
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _load_sum(x, res, o, m, HAS_RES: tl.constexpr):
    # x (+ residual, rounded to x's dtype as torch's add rounds)
    v = tl.load(x + o, mask=m, other=0.0)
    if HAS_RES:
        v = (v.to(tl.float32) + tl.load(res + o, mask=m, other=0.0).to(tl.float32)).to(x.dtype.element_ty)
    return v


@triton.jit
def _norm_store(w, out, o, m, vf, rstd, ZERO_CENTRED: tl.constexpr):
    wf = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        wf = 1.0 + wf
    tl.store(out + o, ((vf * rstd) * wf).to(out.dtype.element_ty), mask=m)


@triton.jit
def _row_tile(M, H, ROWS: tl.constexpr):
    # this program's ROWS rows, their (token, head) split and mask
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    return r, r // H, r % H, r < M


@triton.jit
def _rms_norm_kernel(
    x, res, w, out, xsum,
    M, N, H, sx0, sx1, sr0, sr1, so, ss, eps,
    BLOCK: tl.constexpr, NBLK: tl.constexpr, LOOP: tl.constexpr, ZERO_CENTRED: tl.constexpr, HAS_RES: tl.constexpr,
    ROWS: tl.constexpr,
):
    if not LOOP:
        r, i, h, mr = _row_tile(M, H, ROWS)
        o = tl.arange(0, BLOCK)[None, :]
        m = mr[:, None] & (o < N)
        x += (i * sx0 + h * sx1)[:, None]
        if HAS_RES:
            res += (i * sr0 + h * sr1)[:, None]
            xsum += (r * ss)[:, None]
        v = _load_sum(x, res, o, m, HAS_RES)
        if HAS_RES:
            tl.store(xsum + o, v, mask=m)
        vf = v.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(vf * vf, axis=1) / N + eps)[:, None]
        _norm_store(w, out + (r * so)[:, None], o, m, vf, rstd, ZERO_CENTRED)
    else:  # one row a program
        row = tl.program_id(0).to(tl.int64)
        i, h = row // H, row % H
        x += i * sx0 + h * sx1
        out += row * so
        if HAS_RES:
            res += i * sr0 + h * sr1
            xsum += row * ss
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(NBLK):
            o = i * BLOCK + tl.arange(0, BLOCK)
            vf = _load_sum(x, res, o, o < N, HAS_RES).to(tl.float32)
            acc += vf * vf
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for i in range(NBLK):
            o = i * BLOCK + tl.arange(0, BLOCK)
            m = o < N
            v = _load_sum(x, res, o, m, HAS_RES)
            if HAS_RES:
                tl.store(xsum + o, v, mask=m)
            _norm_store(w, out, o, m, v.to(tl.float32), rstd, ZERO_CENTRED)


@triton.jit
def _gated_block(x, z, w, out, o, m, rstd, ROUND_WN: tl.constexpr):
    # (w * (x * rstd).to(dtype)) * silu(z.float()), cast to x's dtype
    xv = tl.load(x + o, mask=m, other=0.0)
    n = (xv.to(tl.float32) * rstd).to(xv.dtype).to(tl.float32)
    p = tl.load(w + o, mask=m, other=0.0).to(tl.float32) * n
    if ROUND_WN:
        # weight and x share a half dtype: torch's product is rounded to it
        p = p.to(xv.dtype).to(tl.float32)
    zf = tl.load(z + o, mask=m, other=0.0).to(tl.float32)
    s = zf / (1.0 + tl.exp(-zf))
    tl.store(out + o, (p * s).to(out.dtype.element_ty), mask=m)


@triton.jit
def _gated_rms_norm_kernel(
    x, z, w, out,
    M, N, H, sx0, sx1, sz0, sz1, so, eps,
    BLOCK: tl.constexpr, NBLK: tl.constexpr, LOOP: tl.constexpr, ROUND_WN: tl.constexpr, ROWS: tl.constexpr,
):
    if not LOOP:
        r, i, h, mr = _row_tile(M, H, ROWS)
        o = tl.arange(0, BLOCK)[None, :]
        m = mr[:, None] & (o < N)
        x += (i * sx0 + h * sx1)[:, None]
        vf = tl.load(x + o, mask=m, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(vf * vf, axis=1) / N + eps)[:, None]
        _gated_block(x, z + (i * sz0 + h * sz1)[:, None], w, out + (r * so)[:, None], o, m, rstd, ROUND_WN)
    else:  # one row a program
        row = tl.program_id(0).to(tl.int64)
        i, h = row // H, row % H
        x += i * sx0 + h * sx1
        z += i * sz0 + h * sz1
        out += row * so
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(NBLK):
            o = i * BLOCK + tl.arange(0, BLOCK)
            vf = tl.load(x + o, mask=o < N, other=0.0).to(tl.float32)
            acc += vf * vf
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for i in range(NBLK):
            o = i * BLOCK + tl.arange(0, BLOCK)
            _gated_block(x, z, w, out, o, o < N, rstd, ROUND_WN)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[M, N]`` rows with unit column stride: a view where the leading dims
    collapse (a contiguous tensor, or a ``chunk`` / slice of its last dim), else a copy."""
    N = t.shape[-1]
    if t.dim() != 2 or t.stride(-1) != 1:
        try:
            t = t.view(-1, N)
        except RuntimeError:
            t = t.reshape(-1, N)
    if t.stride(-1) != 1 and N > 1:
        t = t.contiguous()
    return t


def as_head_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``t`` ``[..., N]`` as ``[M / H, H, N]`` rows with unit column stride, ``H`` its
    second-last dim (1 for a 2-D ``t``): row ``i * H + h`` starts at ``i * s0 + h * s1``.
    A view where the dims before the second-last collapse (a ``split`` / ``chunk`` of a
    projection's last dim viewed per head, ``[T, H, N]`` with row stride > ``H * N``),
    else a contiguous copy.

    Returns:
        ``(t3, H, s0, s1)``.
    """
    N = t.shape[-1]
    H = t.shape[-2] if t.dim() >= 3 else 1
    if t.stride(-1) == 1 or N == 1:
        try:
            t3 = t.view(-1, H, N)
        except RuntimeError:
            pass
        else:
            return t3, H, t3.stride(0), t3.stride(1)
    t3 = t.contiguous().view(-1, H, N)
    return t3, H, H * N, N


def _launch_cfg(N: int, M: int, max_block: int) -> tuple[tuple[int], dict]:
    """Grid and launch constants. Short rows (head dims: 128, 256) go several to a program
    in a ``[ROWS, BLOCK]`` tile of at most 2048 elements, keeping ~512 programs: one
    program per 128-element row took 6.3 us per gated norm of a 1B verify at batch 64
    (8192 rows), 16 rows a program 4.9 us; 16 rows a program at decode (2048 rows, 128
    programs) was slower than one row (3.9 against 2.6 us)."""
    block = triton.next_power_of_2(N)
    loop = block > max_block
    if loop:
        block = triton.next_power_of_2(max_block)
    rows = 1 if loop else max(1, min(2048 // block, 1 << max(0, (M // 512).bit_length() - 1)))
    tile = rows * block
    num_warps = 1 if tile <= 256 else 2 if tile <= 512 else 4 if tile <= 2048 else 8
    return (triton.cdiv(M, rows),), dict(BLOCK=block, NBLK=triton.cdiv(N, block), LOOP=loop, ROWS=rows,
                                         num_warps=num_warps)


def _check(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, not {t.dtype}")


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dim, got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}: expected [{x.shape[-1]}]")
    if weight.device != x.device:
        raise ValueError(f"weight on {weight.device}, x on {x.device}")
    _check("x", x)
    _check("weight", weight)


def rms_norm_triton(x, weight, eps, residual=None, zero_centred=True, max_block=MAX_BLOCK):
    """Same shapes and semantics as :func:`naive.rms_norm_ref`; ``max_block`` caps the
    register block (longer rows loop; tests lower it to cover the loop)."""
    _check_weight(x, weight)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
            )
    N = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xsum = torch.empty_like(out) if residual is not None else None
    M = out.numel() // N
    if M == 0:
        return out if residual is None else (out, xsum)
    (x3, H, sx0, sx1), weight = as_head_rows(x), weight.contiguous()
    r3, _, sr0, sr1 = as_head_rows(residual) if residual is not None else (x3, H, sx0, sx1)
    o2, s2 = out.view(M, N), (xsum.view(M, N) if xsum is not None else out.view(M, N))
    grid, cfg = _launch_cfg(N, M, max_block)
    _rms_norm_kernel[grid](
        x3, r3, weight, o2, s2,
        M, N, H, sx0, sx1, sr0, sr1, o2.stride(0), s2.stride(0), float(eps),
        ZERO_CENTRED=bool(zero_centred), HAS_RES=residual is not None, **cfg,
    )
    return out if residual is None else (out, xsum)


def gated_rms_norm_triton(x, z, weight, eps, max_block=MAX_BLOCK):
    """Same shapes and semantics as :func:`naive.gated_rms_norm_ref`."""
    _check_weight(x, weight)
    if z.shape != x.shape or z.device != x.device:
        raise ValueError(f"gate z {tuple(z.shape)} must have x's shape {tuple(x.shape)}")
    _check("z", z)
    N = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    M = out.numel() // N
    if M == 0:
        return out
    (x3, H, sx0, sx1), (z3, _, sz0, sz1) = as_head_rows(x), as_head_rows(z)
    o2, weight = out.view(M, N), weight.contiguous()
    # the reference's weight * x_normed is rounded when both are of x's (half) dtype;
    # otherwise torch promotes it to fp32
    round_wn = x.dtype != torch.float32 and torch.promote_types(weight.dtype, x.dtype) == x.dtype
    grid, cfg = _launch_cfg(N, M, max_block)
    _gated_rms_norm_kernel[grid](
        x3, z3, weight, o2,
        M, N, H, sx0, sx1, sz0, sz1, o2.stride(0), float(eps), ROUND_WN=round_wn, **cfg,
    )
    return out


@triton.jit
def _sigmoid_gated_rms_norm_kernel(x, z, w, out, H, N, sx0, sx1, sz0, sz1, so, eps, BLOCK: tl.constexpr):
    # one row a program: w * x / rms(x) * sigmoid(z), every step in fp32, one cast at the end
    row = tl.program_id(0).to(tl.int64)
    i, h = row // H, row % H
    o = tl.arange(0, BLOCK)
    m = o < N
    xf = tl.load(x + i * sx0 + h * sx1 + o, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    zf = tl.load(z + i * sz0 + h * sz1 + o, mask=m, other=0.0).to(tl.float32)
    wf = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    tl.store(out + row * so + o, (wf * (xf * rstd) * (1.0 / (1.0 + tl.exp(-zf)))).to(out.dtype.element_ty), mask=m)


def sigmoid_gated_rms_norm_triton(x, z, weight, eps, max_block=MAX_BLOCK):
    """Same shapes and semantics as :func:`naive.sigmoid_gated_rms_norm_ref` (a KDA layer's
    output norm; some eight plain-torch kernels as the reference): one launch, a row per
    program. Rows longer than ``max_block`` take the reference."""
    from .naive import sigmoid_gated_rms_norm_ref

    _check_weight(x, weight)
    if z.shape != x.shape or z.device != x.device:
        raise ValueError(f"gate z {tuple(z.shape)} must have x's shape {tuple(x.shape)}")
    _check("z", z)
    N = x.shape[-1]
    BLOCK = triton.next_power_of_2(N)
    if BLOCK > max_block:
        return sigmoid_gated_rms_norm_ref(x, z, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    M = out.numel() // N
    if M == 0:
        return out
    (x3, H, sx0, sx1), (z3, _, sz0, sz1) = as_head_rows(x), as_head_rows(z)
    o2 = out.view(M, N)
    _sigmoid_gated_rms_norm_kernel[(M,)](
        x3, z3, weight.contiguous(), o2, H, N, sx0, sx1, sz0, sz1, o2.stride(0), float(eps), BLOCK=BLOCK,
        num_warps=1 if BLOCK <= 256 else 4 if BLOCK <= 2048 else 8,
    )
    return out
