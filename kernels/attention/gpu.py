"""GPU paged attention for prefill, decode and verify: the GPU path of
``naive.paged_attention_ref`` (same shapes and semantics).

A Triton flash-attention over paged KV. One program per (request, KV head, block of
``BLOCK_M`` (query, grouped head) pairs): the ``G = Hq / Hkv`` query heads that share a KV
head are processed together, so decode (one query) still fills the matrix unit. The
``L_b`` queries of request b sit at the last ``L_b`` of its ``kv_lens[b]`` positions;
query i sees positions ``<= kv_lens[b] - L_b + i`` (causal). Softmax runs in fp32 with an
online max; fp32 inputs use IEEE fp32 products (no tf32).

Decode and verify at small batch have too few such programs to read KV at speed: their
keys are then split into shares (:func:`kv_splits`), each program of a share writes its
partial softmax to an fp32 workspace, and ``_combine_splits_kernel`` merges the shares
(Dao et al., "Flash-Decoding for long-context inference", 2023).

No cast or copy runs before the launch: the index tensors are read in the dtype the stage
made them (int64, or int32) and q and the output gate in place.

With ``gate`` the epilogue multiplies the fp32 attention output by ``sigmoid(gate)`` (in
fp32) and rounds once to q's dtype. The reference (and the unfused model before it) rounds
the attention output, ``sigmoid(gate)`` and their product each to q's dtype: in bf16 the
two may differ by up to about two ulps per element (three roundings against one); in
fp32 only by fp32 rounding.

This Triton path is the GPU path of decode, verify and graph-captured prefill; eager
prefill chunks take FlashInfer where the stage uses it (``flashinfer.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_rows, fact, min_max
from ..norm.triton_norm import as_head_rows
from .blocks import fit_shared, launch_fitting
from .naive import check_gate


@triton.jit
def _attn_keys(acc, m_i, l_i, b_q, k_cache, v_cache, page_table, row, pt_stride, i_hk, o_d, m_d, q_pos,
               start, end, qk_scale,
               HKV: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
               IEEE: tl.constexpr, MASK: tl.constexpr):
    """One block of ``BLOCK_N`` keys from ``start`` into the online softmax (base 2: the
    scores come scaled by ``scale * log2(e)``). ``MASK`` off: every key of the block lies
    below ``end`` and is visible to every query of the program, so no mask is built."""
    pos = start + tl.arange(0, BLOCK_N)
    if MASK:
        m_n = pos < end
        page = tl.load(page_table + row * pt_stride + pos // PAGE, mask=m_n, other=0).to(tl.int64)
    else:
        page = tl.load(page_table + row * pt_stride + pos // PAGE).to(tl.int64)
    slot = page * PAGE + pos % PAGE
    kv_off = (slot[:, None] * HKV + i_hk) * HD + o_d[None, :]
    if MASK:
        b_k = tl.load(k_cache + kv_off, mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_v = tl.load(v_cache + kv_off, mask=m_n[:, None] & m_d[None, :], other=0.0)
    else:
        b_k = tl.load(k_cache + kv_off, mask=m_d[None, :], other=0.0)
        b_v = tl.load(v_cache + kv_off, mask=m_d[None, :], other=0.0)
    if IEEE:
        s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(b_q.to(b_k.dtype), tl.trans(b_k))
    s = s * qk_scale
    if MASK:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & m_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p, b_v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(b_v.dtype), b_v)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _paged_attn_kernel(
    q, k_cache, v_cache, page_table, rows, kv_lens, cu_q, o, gate, part_acc, part_ml,
    scale, pt_stride, sg0, sg1,
    HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr,
    HAS_GATE: tl.constexpr, SPLITS: tl.constexpr, NS: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_hk = tl.program_id(1)
    # the blocks of late queries, which see the most keys, go first: a causal prefill's
    # longest programs then do not make the launch's tail
    i_mb = tl.num_programs(2) // SPLITS - 1 - tl.program_id(2) // SPLITS
    i_s = tl.program_id(2) % SPLITS
    G: tl.constexpr = HQ // HKV
    # the index tensors come as the stage made them (int64 or int32); int32 arithmetic here
    q0 = tl.load(cu_q + i_b).to(tl.int32)
    L = tl.load(cu_q + i_b + 1).to(tl.int32) - q0
    m_start = i_mb * BLOCK_M
    if m_start // G < L:
        n = tl.load(kv_lens + i_b).to(tl.int32)
        row = tl.load(rows + i_b).to(tl.int64)
        o_m = m_start + tl.arange(0, BLOCK_M)
        i_q = o_m // G
        i_hq = i_hk * G + o_m % G
        m_q = i_q < L
        o_d = tl.arange(0, BD)
        m_d = o_d < HD
        tok = (q0 + i_q).to(tl.int64)
        p_q = q + (tok[:, None] * HQ + i_hq[:, None]) * HD + o_d[None, :]
        b_q = tl.load(p_q, mask=m_q[:, None] & m_d[None, :], other=0.0)
        q_pos = n - L + i_q
        last_i = tl.minimum(L - 1, (m_start + BLOCK_M - 1) // G)
        hi = n - L + last_i + 1  # keys [0, hi) are visible to some query of this block
        qk_scale = scale * 1.4426950408889634  # log2(e): the softmax in base 2

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BD], dtype=tl.float32)
        lo = tl.full([], 0, tl.int32)
        end = hi
        if SPLITS > 1:  # this program's share of the keys, whole BLOCK_N blocks of them
            chunk = tl.cdiv(tl.cdiv(hi, SPLITS), BLOCK_N) * BLOCK_N
            lo = i_s * chunk
            end = tl.minimum(lo + chunk, hi)
        # whole blocks below the first query's position are visible to every query of the
        # block: no mask there (most of a long prefill's keys); the rest is masked
        first = n - L + m_start // G + 1
        full = tl.maximum(lo, tl.minimum(end, first // BLOCK_N * BLOCK_N))
        # NS > 1: Triton's pipeliner issues the next blocks' page-table, K and V loads (cp.async)
        # while this one computes; a decode or verify program is otherwise latency-bound
        for start in tl.range(lo, full, BLOCK_N, num_stages=NS):
            acc, m_i, l_i = _attn_keys(acc, m_i, l_i, b_q, k_cache, v_cache, page_table, row, pt_stride, i_hk, o_d,
                                       m_d, q_pos, start, end, qk_scale, HKV, HD, PAGE, BLOCK_N, IEEE, False)
        for start in tl.range(full, end, BLOCK_N, num_stages=NS):
            acc, m_i, l_i = _attn_keys(acc, m_i, l_i, b_q, k_cache, v_cache, page_table, row, pt_stride, i_hk, o_d,
                                       m_d, q_pos, start, end, qk_scale, HKV, HD, PAGE, BLOCK_N, IEEE, True)
        m_o = m_q[:, None] & m_d[None, :]
        if SPLITS > 1:  # partial (acc, max, sum) of this share; _combine_splits_kernel ends it
            part = (tok[:, None] * HQ + i_hq[:, None]) * SPLITS + i_s
            tl.store(part_acc + part * BD + o_d[None, :], acc, mask=m_o)
            tl.store(part_ml + part * 2, m_i[:, None], mask=m_q[:, None])
            tl.store(part_ml + part * 2 + 1, l_i[:, None], mask=m_q[:, None])
        else:
            _attn_epilogue(acc / tl.maximum(l_i, 1e-30)[:, None], o, gate, tok[:, None], i_hq[:, None], o_d[None, :],
                           m_o, sg0, sg1, HQ, HD, HAS_GATE)


@triton.jit
def _attn_epilogue(out, o, gate, tok, i_hq, o_d, mask, sg0, sg1, HQ: tl.constexpr, HD: tl.constexpr,
                   HAS_GATE: tl.constexpr):
    """Store the fp32 attention output ``out`` at (tok, i_hq, o_d), times sigmoid(gate)."""
    if HAS_GATE:
        p_g = gate + tok * sg0 + i_hq * sg1 + o_d
        out = out * tl.sigmoid(tl.load(p_g, mask=mask, other=0.0).to(tl.float32))
    tl.store(o + (tok * HQ + i_hq) * HD + o_d, out.to(o.dtype.element_ty), mask=mask)


@triton.jit
def _combine_splits_kernel(
    part_acc, part_ml, o, gate, sg0, sg1,
    HQ: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr, SPLITS: tl.constexpr, HAS_GATE: tl.constexpr,
):
    """One (query token, query head): the SPLITS partial softmaxes merged (flash-decoding:
    each share's sum and output rescaled by ``2^{m_s - max_s m_s}``, its scores being in base 2), then the epilogue.
    A share with no visible key holds m = -1e30, l = 0 and weighs nothing."""
    tok = tl.program_id(0).to(tl.int64)
    i_hq = tl.program_id(1)
    o_s = tl.arange(0, SPLITS)
    o_d = tl.arange(0, BD)
    base = (tok * HQ + i_hq) * SPLITS
    m_s = tl.load(part_ml + (base + o_s) * 2)
    l_s = tl.load(part_ml + (base + o_s) * 2 + 1)
    w = tl.exp2(m_s - tl.max(m_s, axis=0))  # the shares' maxima are in base 2
    acc = tl.load(part_acc + (base + o_s)[:, None] * BD + o_d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.maximum(tl.sum(l_s * w, axis=0), 1e-30)
    _attn_epilogue(out, o, gate, tok, i_hq, o_d, o_d < HD, sg0, sg1, HQ, HD, HAS_GATE)


def _validate(q, k_cache, v_cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, gate):
    check_gate(q, gate)
    T, Hq, hd = q.shape
    num_pages, page_size, Hkv, hd_k = k_cache.shape
    if v_cache.shape != k_cache.shape or hd_k != hd or Hq % Hkv:
        raise ValueError(f"attention shapes disagree: q {tuple(q.shape)} k_cache {tuple(k_cache.shape)} "
                         f"v_cache {tuple(v_cache.shape)}")
    B = req_pool_indices.numel()
    if kv_lens.numel() != B or cu_seqlens_q.numel() != B + 1:
        raise ValueError("req_pool_indices, kv_lens and cu_seqlens_q disagree on the batch")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged KV caches must be contiguous")
    if B == 0:
        return
    rows_n, max_pages = page_table.shape
    check_rows(req_pool_indices, rows_n)

    def queries_fit() -> bool:
        lens_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        return int(cu_seqlens_q[-1]) == T and not bool((lens_q < 0).any()) and not bool((lens_q > kv_lens).any())

    # facts (kernels/checks.py) stated by the stage, which built these from host lists
    if not fact(cu_seqlens_q, "queries_fit", queries_fit) or fact(cu_seqlens_q, "total", lambda: T) != T:
        raise ValueError("cu_seqlens_q must cover q, with each request's queries within its kv_lens")
    if min_max(kv_lens)[1] > max_pages * page_size:
        raise IndexError("kv_lens exceed the page table's capacity")

    def pages_in_pool() -> bool:
        need = (kv_lens.to(page_table.device) + page_size - 1) // page_size
        used = torch.arange(max_pages, device=page_table.device)[None, :] < need[:, None]
        pages = page_table[req_pool_indices.to(page_table.device)][used]
        return not pages.numel() or (int(pages.min()) >= 0 and int(pages.max()) < num_pages)

    if not fact(page_table, "pages_in_pool", pages_in_pool):
        raise IndexError(f"page table names pages outside [0, {num_pages})")


def paged_attention_gpu(q, k_cache, v_cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, scale, gate=None):
    """Shapes as :func:`naive.paged_attention_ref`; raises before the launch on rows or pages
    outside the pool.

    Launches one kernel when the stage's usual inputs come: index tensors on q's device
    (any integer dtype, int64 or int32 in practice), contiguous q, a gate view with unit
    last stride. Anything else is copied first."""
    _validate(q, k_cache, v_cache, page_table, req_pool_indices, kv_lens, cu_seqlens_q, gate)
    T, Hq, hd = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    B = req_pool_indices.numel()
    # the kernel writes o packed [T, Hq, hd], whatever q's layout (empty_like keeps a
    # permuted q's strides)
    o = torch.empty((T, Hq, hd), dtype=q.dtype, device=q.device)
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
    if gate is None:
        g3, sg0, sg1 = q, 0, 0  # not read (HAS_GATE off)
    else:
        g3, _, sg0, sg1 = as_head_rows(gate)
    G = Hq // Hkv
    max_l = fact(cu_seqlens_q, "max_len", lambda: int((cu[1:] - cu[:-1]).max()))
    ieee = q.dtype == torch.float32 or k_cache.dtype == torch.float32
    BD = triton.next_power_of_2(hd)
    M = max_l * G  # (query, grouped head) rows of a request and KV head
    block_m, block_n, stages, warps = tiles(M, BD, ieee)
    elt = 4 if ieee else 2
    block_m, block_n, stages = fit_shared(block_m, block_n, stages, BD, elt)

    def launch(block_m, block_n, num_stages):
        m_blocks = triton.cdiv(M, block_m)
        splits = kv_splits(B * Hkv, dev) if m_blocks == 1 else 1
        if splits > 1:
            part_acc = torch.empty((T, Hq, splits, BD), dtype=torch.float32, device=dev)
            part_ml = torch.empty((T, Hq, splits, 2), dtype=torch.float32, device=dev)
        else:
            part_acc = part_ml = o  # not read (SPLITS 1)
        _paged_attn_kernel[(B, Hkv, m_blocks * splits)](
            q, k_cache, v_cache, pt, rows, lens, cu, o, g3, part_acc, part_ml, float(scale), pt.stride(0), sg0, sg1,
            HQ=Hq, HKV=Hkv, HD=hd, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, BD=BD, IEEE=ieee,
            HAS_GATE=gate is not None, SPLITS=splits, NS=num_stages,
            num_warps=warps,
        )
        if splits > 1:
            _combine_splits_kernel[(T, Hq)](
                part_acc, part_ml, o, g3, sg0, sg1, HQ=Hq, HD=hd, BD=BD, SPLITS=splits, HAS_GATE=gate is not None,
                num_warps=4 if BD >= 256 else 2,
            )

    launch_fitting(launch, block_m, block_n, stages, BD, elt)
    return o


def tiles(M: int, BD: int, ieee: bool) -> tuple[int, int, int, int]:
    """``(block_m, block_n, stages, num_warps)`` for ``M`` (query, grouped head) rows per
    request and KV head, padded head dim ``BD``, fp32 (``ieee``) or 16-bit inputs, before
    :func:`fit_shared`.

    Decode and verify (one block of rows) read K and V through a 2-stage pipeline of 64
    keys. A 16-bit prefill takes 128 rows against 64 keys through a 3-stage pipeline on 8
    warps at head dim <= 128 (each K / V block serves twice the queries of 64 rows; the
    fastest of kernels/bench_prefill_attention.py --triton-sweep on the H200 at 8192
    queries after 0 and 24576 cached keys, 331 / 308 TFLOP/s, docs/PERFORMANCE.md,
    "Prefill attention"), 64 rows against 32 keys in 2 stages at 256. fp32 keeps small
    tiles: its IEEE products hold 4-byte operands."""
    if ieee:
        block_m = 16 if M <= 16 else (32 if M <= 32 or BD > 128 else 64)
        return block_m, 32, 1, 4 if block_m <= 32 else 8
    if M <= 64:
        block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
        return block_m, 64, 2, 4 if block_m <= 32 else 8
    return (128, 64, 3, 8) if BD <= 128 else (64, 32, 2, 8)


# Decode and verify launch one program per (request, KV head): at batch 64 with 2 KV heads
# that is 128 programs, one per SM, each streaming its whole context (flash-decoding's
# observation). Below one program per SM the keys are split into shares whose partial
# softmaxes a second kernel merges. kernels/bench_decode_attention.py --sweep on the H200
# (context 1024, heads 16/2/256, graphed, the pipelined key loop) chose the target: at
# batch 16 and 64, decode and a verify of D = 4, the fastest share count was the least
# that gives every SM a program (8, 2, 8, 2 shares); at batch 256 none splits
# (docs/PERFORMANCE.md, "Decode attention").
_PROGRAMS_PER_SM = 1
_MAX_SPLITS = 32


def kv_splits(programs: int, device) -> int:
    """Shares of the keys per (request, KV head): the least power of two in ``[1,
    _MAX_SPLITS]`` that brings ``programs`` to ``_PROGRAMS_PER_SM`` per SM. A share covers
    ``ceil(kv_len / splits)`` keys rounded up to whole blocks, computed in the kernel from
    each request's length (so a captured graph serves every length)."""
    target = _PROGRAMS_PER_SM * _sm_count(device)
    splits = 1
    while splits < _MAX_SPLITS and programs * splits < target:
        splits *= 2
    return splits


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter (tests): a few shares, so the split path runs
    return torch.cuda.get_device_properties(device).multi_processor_count
