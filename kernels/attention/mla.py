"""GPU multi-head latent attention (MLA) over the paged latent cache: the GPU path of
``naive.mla_attention_ref`` (same shapes and semantics), for prefill, decode and verify.

An MLA layer (Kimi Linear, DeepSeek-V2) caches per token one latent row ``[c, k_rope]``
(``rank + rope`` values, e.g. 512 + 64) and attends with the key up-projection absorbed
into the query, so every query head of a request reads the same latent rows, as keys (the
whole row) and as values (``c``, the first ``rank`` columns). The generic paged kernel
(``gpu.py``) ran this as multi-query attention of head dim 576 padded to 1024, with a
separate value tile of the same width: twice the QK work and registers, two loads of each
latent, and tiles that Triton refused for shared memory until shrunk by trial compiles.

Here one program takes one request and a block of ``BLOCK_M`` (query, head) rows (decode
with 16 heads: the request's heads; verify and prefill: one query's heads each), loads each block of
``BLOCK_N`` latent rows once, and computes ``q . latent`` as a ``rank``-wide dot plus a
``rope``-wide dot (no padding to a power of two of their sum), the online softmax in fp32,
and ``p @ c`` from the same tile. Queries are causal within the request (query i of L sees
positions ``<= kv_len - L + i``). Tiles come from ``blocks.mla_tiles`` (fit before any
compile). fp32 inputs use IEEE fp32 products.

Decode and verify with fewer programs than SMs split each request's keys into shares
(``gpu.kv_splits``, flash-decoding): each share writes its partial ``(acc, max, sum)`` to an
fp32 workspace and ``_mla_combine_kernel`` merges them. The share count is a launch
argument, not a compile-time constant: the batches of a mode share a compile (Triton's own
specialisation of an integer argument that is 1 or a multiple of 16 aside).

Compiled for sm_90 at 16 heads of 512 + 64 (Triton 3.6, ``blocks.mla_tiles``): bf16 68 KiB
of shared memory and 214 registers without spills, fp32 72 KiB. Checked against the
reference under Triton's interpreter in fp32; not yet run on a GPU at this commit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import fact
from .blocks import mla_tiles
from .gpu import _validate, kv_splits
from .naive import check_mla

# decode / verify: at most this many row blocks per request take key shares; a prefill
# chunk has enough programs without
_SPLIT_MAX_M_BLOCKS = 8


@triton.jit
def _mla_attn_kernel(
    q, cache, page_table, rows, kv_lens, cu_q, o, part_acc, part_ml,
    scale, pt_stride, n_splits,
    HQ: tl.constexpr, R: tl.constexpr, RO: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BR: tl.constexpr, BRO: tl.constexpr,
    IEEE: tl.constexpr, SPLIT: tl.constexpr, NS: tl.constexpr,
):
    W: tl.constexpr = R + RO  # a latent row (and a query row): c then k_rope
    i_b = tl.program_id(0)
    i_mb = tl.program_id(1) // n_splits
    i_s = tl.program_id(1) % n_splits
    q0 = tl.load(cu_q + i_b).to(tl.int32)
    L = tl.load(cu_q + i_b + 1).to(tl.int32) - q0
    m_start = i_mb * BLOCK_M
    if m_start // HQ < L:
        n = tl.load(kv_lens + i_b).to(tl.int32)
        row = tl.load(rows + i_b).to(tl.int64)
        o_m = m_start + tl.arange(0, BLOCK_M)
        i_q = o_m // HQ
        i_h = o_m % HQ
        m_q = i_q < L
        o_c = tl.arange(0, BR)
        m_c = o_c < R
        o_r = tl.arange(0, BRO)
        m_r = o_r < RO
        tok = (q0 + i_q).to(tl.int64)
        p_q = q + (tok * HQ + i_h) * W  # [BLOCK_M] row starts
        b_qc = tl.load(p_q[:, None] + o_c[None, :], mask=m_q[:, None] & m_c[None, :], other=0.0)
        b_qr = tl.load(p_q[:, None] + R + o_r[None, :], mask=m_q[:, None] & m_r[None, :], other=0.0)
        q_pos = n - L + i_q
        last_i = tl.minimum(L - 1, (m_start + BLOCK_M - 1) // HQ)
        hi = n - L + last_i + 1  # keys [0, hi) are visible to some query of this block

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BR], dtype=tl.float32)
        lo = tl.full([], 0, tl.int32)
        end = hi
        if SPLIT:  # this program's share of the keys, whole BLOCK_N blocks of them
            chunk = tl.cdiv(tl.cdiv(hi, n_splits), BLOCK_N) * BLOCK_N
            lo = i_s * chunk
            end = tl.minimum(lo + chunk, hi)
        for start in tl.range(lo, end, BLOCK_N, num_stages=NS):
            pos = start + tl.arange(0, BLOCK_N)
            m_n = pos < end
            page = tl.load(page_table + row * pt_stride + pos // PAGE, mask=m_n, other=0).to(tl.int64)
            p_kv = cache + (page * PAGE + pos % PAGE) * W  # [BLOCK_N] latent row starts (one head)
            b_kc = tl.load(p_kv[:, None] + o_c[None, :], mask=m_n[:, None] & m_c[None, :], other=0.0)
            if IEEE:
                s = tl.dot(b_qc.to(tl.float32), tl.trans(b_kc.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(b_qc.to(b_kc.dtype), tl.trans(b_kc))
            if RO > 0:
                b_kr = tl.load(p_kv[:, None] + R + o_r[None, :], mask=m_n[:, None] & m_r[None, :], other=0.0)
                if IEEE:
                    s += tl.dot(b_qr.to(tl.float32), tl.trans(b_kr.to(tl.float32)), input_precision="ieee")
                else:
                    s += tl.dot(b_qr.to(b_kr.dtype), tl.trans(b_kr))
            s = s * scale
            vis = (pos[None, :] <= q_pos[:, None]) & m_n[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            # the values are the latent's first R columns: the tile already loaded
            if IEEE:
                pv = tl.dot(p, b_kc.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(b_kc.dtype), b_kc)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        m_o = m_q[:, None] & m_c[None, :]
        head_row = tok * HQ + i_h  # [BLOCK_M] (token, head) rows of o
        if SPLIT:  # partial (acc, max, sum) of this share; _mla_combine_kernel ends it
            part = head_row * n_splits + i_s
            tl.store(part_acc + part[:, None] * BR + o_c[None, :], acc, mask=m_o)
            tl.store(part_ml + part * 2, m_i, mask=m_q)
            tl.store(part_ml + part * 2 + 1, l_i, mask=m_q)
        else:
            out = acc / tl.maximum(l_i, 1e-30)[:, None]
            tl.store(o + head_row[:, None] * R + o_c[None, :], out.to(o.dtype.element_ty), mask=m_o)


@triton.jit
def _mla_combine_kernel(part_acc, part_ml, o, n_splits, HQ: tl.constexpr, R: tl.constexpr, BR: tl.constexpr):
    """One (query token, head): the ``n_splits`` partial softmaxes merged, each share's sum
    and output rescaled by ``e^{m_s - max_s m_s}``. A share with no visible key holds
    m = -1e30, l = 0 and weighs nothing."""
    tok = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_c = tl.arange(0, BR)
    m_c = o_c < R
    base = (tok * HQ + i_h) * n_splits
    m_max = tl.full([], -1.0e30, tl.float32)
    for s in range(n_splits):
        m_max = tl.maximum(m_max, tl.load(part_ml + (base + s) * 2))
    l_sum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BR], dtype=tl.float32)
    for s in range(n_splits):
        w = tl.exp(tl.load(part_ml + (base + s) * 2) - m_max)
        l_sum += tl.load(part_ml + (base + s) * 2 + 1) * w
        acc += tl.load(part_acc + (base + s) * BR + o_c, mask=m_c, other=0.0) * w
    out = acc / tl.maximum(l_sum, 1e-30)
    tl.store(o + (tok * HQ + i_h) * R + o_c, out.to(o.dtype.element_ty), mask=m_c)


def mla_attention_gpu(q, cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, scale, rank):
    """Shapes as :func:`naive.mla_attention_ref`; raises before the launch on shapes that
    disagree and on rows or pages outside the pool (``gpu._validate``'s checks, read from
    the stage's stated facts: no host read in a decode or verify step).

    Returns ``[T, Hq, rank]`` in q's dtype. Index tensors are read in the dtype the stage
    made them; q is copied only when not contiguous; the cache must be contiguous."""
    check_mla(q, cache, rank)
    _validate(q, cache, cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, None)
    T, Hq, W = q.shape
    page_size = cache.shape[1]
    B = req_pool_indices.numel()
    o = torch.empty((T, Hq, rank), dtype=q.dtype, device=q.device)
    if B == 0 or T == 0:
        return o
    dev = q.device
    q = q.contiguous()
    rows = req_pool_indices.to(dev).contiguous()
    lens = kv_lens.to(dev).contiguous()
    cu = cu_seqlens_q.to(dev).contiguous()
    pt = page_table.to(dev)
    if pt.stride(1) != 1:
        pt = pt.contiguous()
    max_l = fact(cu_seqlens_q, "max_len", lambda: int((cu[1:] - cu[:-1]).max()))
    ieee = q.dtype == torch.float32 or cache.dtype == torch.float32
    BR = max(16, triton.next_power_of_2(rank))
    BRO = max(16, triton.next_power_of_2(W - rank))
    block_m, block_n, stages, warps = mla_tiles(BR + BRO, 4 if ieee else 2)
    m_blocks = triton.cdiv(max_l * Hq, block_m)
    splits = kv_splits(B * m_blocks, dev) if m_blocks <= _SPLIT_MAX_M_BLOCKS else 1
    if splits > 1:
        part_acc = torch.empty((T, Hq, splits, BR), dtype=torch.float32, device=dev)
        part_ml = torch.empty((T, Hq, splits, 2), dtype=torch.float32, device=dev)
    else:
        part_acc = part_ml = o  # not read (SPLIT off)
    _mla_attn_kernel[(B, m_blocks * splits)](
        q, cache, pt, rows, lens, cu, o, part_acc, part_ml, float(scale), pt.stride(0), splits,
        HQ=Hq, R=rank, RO=W - rank, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, BR=BR, BRO=BRO,
        IEEE=ieee, SPLIT=splits > 1, NS=stages, num_warps=warps,
    )
    if splits > 1:
        _mla_combine_kernel[(T, Hq)](part_acc, part_ml, o, splits, HQ=Hq, R=rank, BR=BR,
                                     num_warps=4 if BR >= 256 else 2)
    return o
