"""Triton GDN verify with the replay commit (docs/DESIGN.md, "Commit rule"): the GPU path of
``naive_replay.py``.

The verify of a row first replays that row's accepted steps of the previous round onto the
committed state (read once from ``state[row]``), writes the committed state back once,
then runs its D speculative steps in registers and keeps only each step's normalised key,
delta and log decay at the row. The commit is a scatter of two int32 per row and layer. A
round moves 2 state sizes per request and layer, the same as plain decode, against
``D + 3`` for the scratch-and-copy design.

The verify is two launches. The D speculative steps never form a state: with ``c_t =
g_0 + .. + g_t`` and S the committed state, the gated delta rule unrolls over one chunk to
(the intra-chunk / WY form of Yang et al. 2024, "Gated Delta Networks", as in
``naive.chunk_gated_delta_rule_ref``)::

    r_t     = v_t - e^{c_t} S^T k_t
    delta   = (I + A)^-1 diag(beta) r,     A_ts = beta_t e^{c_t - c_s} k_t.k_s  (s < t)
    o_t     = e^{c_t} S^T q_t + sum_{s<=t} e^{c_t - c_s} (q_t.k_s) delta_s

Everything but ``S^T k_t`` and ``S^T q_t`` is per request and head, not per state column:
``_gdn_verify_prep_kernel`` (one program per request and key head) normalises q and k,
forms the D x D coefficients ``T = (I + A)^-1 diag(beta)`` and ``W = tril(e^{c_t - c_s}
q_t.k_s) T`` of each value head and the replay weights of the row's pending steps, so
that the state kernel ``_gdn_replay_verify_kernel`` (one program per request, value head
and V-block) does only what scales with the state: the replay, the 2 D reductions over K
of its tile, and ``delta_t = sum_s T_ts r_s``, ``o_t = e^{c_t} S^T q_t + sum_s W_ts r_s``
per column. The state kernel also zeroes ``pending[row]``: the prep kernel read it
before, so no program of the row still needs it.

On sm_90 and later the state kernel is a programmatic dependent launch (PDL) of the prep
kernel: its programs start while the prep kernel runs, load the state tile and every record
of the row's current slot (``slot[row]`` changes only at the commit), and only then wait
(``gdc_wait``) for the prep kernel's outputs. Measured on the H200 (HV 32, K = V = 128,
D = 4, a round): 361 -> 337 us at batch 256, no change at batch 64; outputs bit-identical.

A state program is bound by latency, not by its arithmetic or its bytes (measured: with
40% fewer instructions but its pending records loaded one step at a time it was no faster
than the one-kernel verify it replaced). Its loads are grouped so that it waits for memory
twice in series: the row and ``meta``, then the state, every pending record and the
tokens' inputs (written by the prep kernel, in L2) at once; its stores come last.

Buffers and their layout: :mod:`naive_replay` (``ReplayBuffers``, ``alloc_replay_meta``,
``alloc_replay_buffers`` work for CUDA tensors as they are).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .naive_replay import ReplayBuffers, alloc_replay_buffers, alloc_replay_meta  # noqa: F401
from ..checks import check_commit, check_rows
from .triton_recurrent import (
    _EPS, _block_v, _check_gdn_args, _check_replay_bufs, _gdn_recurrent_kernel, _num_warps, _pow2_steps, _replay_apply,
    _replay_records, _token_rows, launch_gdn_recurrent,
)


@triton.jit
def _mm(a, b):
    """``a @ b`` of tiny fp32 tiles ([M, N] x [N, P]) in registers."""
    return tl.sum(a[:, :, None] * b[None, :, :], 1)


@triton.jit
def _coef_offsets(BT: tl.constexpr, BP: tl.constexpr):
    """Offsets in a ``coef`` row (fp32, one per request and value head): ``e^{c_t}`` [BT],
    ``T`` [BT, BT] and ``W`` [BT, BT] row-major, the replay's ``e^{c_n - c_j}`` [BP] and
    ``e^{c_n}``; the row's length last."""
    return BT, BT + BT * BT, BT + 2 * BT * BT, BT + 2 * BT * BT + BP, BT + 2 * BT * BT + BP + 1


@triton.jit
def _gdn_verify_prep_kernel(
    q, k, g, beta, rows, pending, slot, buf_k, buf_g, xn, coef, meta,
    scale, s_q, s_k,
    D: tl.constexpr, D_MAX: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BK: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, LOG2_BT: tl.constexpr, EPS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per (request, key head): everything of the verify that is not per state column.

    Writes the D steps' normalised keys and queries (``xn [B, D, 2, H, K]`` fp32, key then
    query; the keys also into the row's next replay slot of ``buf_k``), and for each of
    the key head's ``G = HV / H`` value heads the log decays (into ``buf_g``) and a
    ``coef`` row (:func:`_coef_offsets`: ``e^{c_t}``, ``T``, ``W`` of the module
    docstring, and the replay weights of the row's pending steps); key head 0 writes
    ``meta [B, 2]`` int32 = ``(pending[row], slot[row])``."""
    if PDL:
        # the state kernel may start now: it waits (gdc_wait) before reading what this writes
        tl.extra.cuda.gdc_launch_dependents()
    i_bk = tl.program_id(0)
    i_b = i_bk // H
    i_h = i_bk % H
    G: tl.constexpr = HV // H
    o_t = tl.arange(0, BT)
    m_t = o_t < D
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    tok = (i_b * D + o_t).to(tl.int64)
    b_K = tl.load(k + (tok * s_k + i_h * K)[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_Q = tl.load(q + (tok * s_q + i_h * K)[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    row = tl.load(rows + i_b).to(tl.int64)
    n_pend = tl.load(pending + row)
    cur = tl.load(slot + row)
    o_p = tl.arange(0, BP)
    m_p = (o_p < n_pend) & (o_p < D_MAX)
    st = (row * 2 + 1 - cur) * D_MAX + o_t

    b_K = b_K * tl.math.rsqrt(tl.sum(b_K * b_K, 1) + EPS)[:, None]
    b_Q = b_Q * (tl.math.rsqrt(tl.sum(b_Q * b_Q, 1) + EPS) * scale)[:, None]
    tl.store(buf_k + (st * H + i_h)[:, None] * K + o_k[None, :], b_K, mask=m_tk)
    p_x = xn + ((tok * 2) * H + i_h)[:, None] * K + o_k[None, :]
    tl.store(p_x, b_K, mask=m_tk)
    tl.store(p_x + H * K, b_Q, mask=m_tk)
    if i_h == 0:
        tl.store(meta + i_b * 2, n_pend)
        tl.store(meta + i_b * 2 + 1, cur)
    m_tt = m_t[:, None] & m_t[None, :]
    causal = (o_t[:, None] >= o_t[None, :]) & m_tt
    strict = causal & (o_t[:, None] > o_t[None, :])
    b_kk = _mm(b_K, tl.trans(b_K))
    b_qk = _mm(b_Q, tl.trans(b_K))
    eye = (o_t[:, None] == o_t[None, :]).to(tl.float32)
    OFF_T, OFF_W, OFF_R, OFF_EN, NC = _coef_offsets(BT, BP)
    for gi in tl.static_range(G):
        i_hv = i_h * G + gi
        b_g = tl.load(g + tok * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_b = tl.load(beta + tok * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        # the replay weights of the pending steps (slot cur): e^{c_n - c_j} and e^{c_n}
        b_gp = tl.load(buf_g + ((row * 2 + cur) * D_MAX + o_p) * HV + i_hv, mask=m_p, other=0.0)
        c_n = tl.sum(b_gp, 0)
        b_w = tl.where(m_p, tl.exp(c_n - tl.cumsum(b_gp, 0)), 0.0)
        tl.store(buf_g + st * HV + i_hv, b_g, mask=m_t)
        b_c = tl.cumsum(b_g, 0)
        b_dec = tl.exp(tl.where(causal, b_c[:, None] - b_c[None, :], 0.0))
        # A = diag(beta) (strictly lower e^{c_t - c_s} k_t.k_s) is nilpotent (A^D = 0), so
        # (I + A)^-1 = sum_m (-A)^m = prod_{i < log2 BT} (I + (-A)^(2^i))
        b_N = tl.where(strict, -b_b[:, None] * b_kk * b_dec, 0.0)
        b_T = eye + b_N
        for _ in tl.static_range(1, LOG2_BT):
            b_N = _mm(b_N, b_N)
            b_T = _mm(b_T, eye + b_N)
        b_T = b_T * b_b[None, :]
        b_W = _mm(tl.where(causal, b_qk * b_dec, 0.0), b_T)
        p_c = coef + (i_b * HV + i_hv) * NC
        tl.store(p_c + o_t, tl.exp(b_c))
        tl.store(p_c + OFF_T + o_t[:, None] * BT + o_t[None, :], b_T)
        tl.store(p_c + OFF_W + o_t[:, None] * BT + o_t[None, :], b_W)
        tl.store(p_c + OFF_R + o_p, b_w)
        tl.store(p_c + OFF_EN, tl.exp(c_n))


@triton.jit
def _gdn_replay_verify_kernel(
    v, o, state, rows, buf_k, buf_delta, pending, slot, xn, coef, meta, s_v,
    D: tl.constexpr, D_MAX: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr,
):
    """Per (request, value head, V-block) on the [BK, BV] fp32 tile of ``state[row]``:
    replay the pending steps (weights from the prep kernel), then the D steps' outputs
    ``o`` and deltas (into the row's next slot of ``buf_delta``) from ``xn`` / ``coef``,
    then write the committed state back and zero ``pending[row]``. Tokens are unrolled (D
    is small); per token the tile is reduced twice over K, the rest is [BV]-vector
    arithmetic with scalar coefficients.

    A program is latency-bound, not bound by its arithmetic: what counts is how many
    memory round trips it makes in series. ``meta`` (pending, slot) and ``coef`` are per
    request, so the state's, the records' and the tokens' inputs' loads all wait for one
    round trip (``meta``) and are issued together; every store comes last (for the
    compiler a store may alias any later load, which it then issues only after the store:
    a store per token made the tokens' inputs D round trips in series). Measured on the
    H200 (kernels/bench_verify.py, a round at batch 64 / 256): stores last alone 114.9 /
    401 us, with the inputs preloaded 106.8 / 359 us."""
    i_bh = tl.program_id(0)
    i_vb = tl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    G: tl.constexpr = HV // H
    i_h = i_hv // G
    o_k = tl.arange(0, BK)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    OFF_T, OFF_W, OFF_R, OFF_EN, NC = _coef_offsets(BT, BP)
    p_c = coef + i_bh * NC
    row = tl.load(rows + i_b).to(tl.int64)
    p_state = state + (row * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]
    if PDL:
        # launched while the prep kernel runs: the state and every record of the row's
        # slot (slot[row] changes only at the commit) load before its results are waited for
        cur = tl.load(slot + row).to(tl.int64)
        b_s = tl.load(p_state, mask=m_kv, other=0.0).to(tl.float32)
        kjs, djs = _replay_records(buf_k, buf_delta, (row * 2 + cur) * D_MAX, D_MAX, i_h, i_hv, o_k, o_v, m_k, m_v,
                                   H, HV, K, V, D_MAX)
        tl.extra.cuda.gdc_wait()
        n_pend = tl.load(meta + i_b * 2)
        # records past the pending ones have weight 0, but are stale (a rejected step's,
        # a released row's): zeroed, as the masked loads of the serial path give, so that a
        # non-finite one cannot reach the state through 0 * inf
        kjs_ = ()
        djs_ = ()
        for j in tl.static_range(D_MAX):
            kjs_ = kjs_ + (tl.where(j < n_pend, kjs[j], 0.0),)
            djs_ = djs_ + (tl.where(j < n_pend, djs[j], 0.0),)
        kjs, djs = kjs_, djs_
    else:
        n_pend = tl.load(meta + i_b * 2)
        cur = tl.load(meta + i_b * 2 + 1).to(tl.int64)
        b_s = tl.load(p_state, mask=m_kv, other=0.0).to(tl.float32)
        kjs, djs = _replay_records(buf_k, buf_delta, (row * 2 + cur) * D_MAX, n_pend, i_h, i_hv, o_k, o_v, m_k, m_v,
                                   H, HV, K, V, D_MAX)
    ws = ()
    for j in tl.static_range(D_MAX):
        ws = ws + (tl.load(p_c + OFF_R + j),)
    ins = ()
    for t in tl.static_range(D):
        ins = ins + (_verify_inputs(v, xn, s_v, i_b, i_h, i_hv, o_k, o_v, m_k, m_v, t, D, H, K, V),)
    b_s = _replay_apply(b_s, kjs, djs, tl.load(p_c + OFF_EN), ws)
    rs = ()  # r_s = v_s - e^{c_s} S^T k_s of the tokens so far, [BV] each
    outs = ()
    for t in tl.static_range(D):
        b_k, b_q, b_v = ins[t]
        e_t = tl.load(p_c + t)
        rs = rs + (b_v - e_t * tl.sum(b_s * b_k[:, None], 0),)
        b_o = e_t * tl.sum(b_s * b_q[:, None], 0)
        b_d = tl.zeros([BV], dtype=tl.float32)
        for s in tl.static_range(t + 1):
            b_d += tl.load(p_c + OFF_T + t * BT + s) * rs[s]
            b_o += tl.load(p_c + OFF_W + t * BT + s) * rs[s]
        outs = outs + ((b_o, b_d),)
    nxt_base = (row * 2 + 1 - cur) * D_MAX
    for t in tl.static_range(D):
        tok = (i_b * D + t).to(tl.int64)
        tl.store(o + (tok * HV + i_hv) * V + o_v, outs[t][0].to(o.dtype.element_ty), mask=m_v)
        tl.store(buf_delta + ((nxt_base + t) * HV + i_hv) * V + o_v, outs[t][1], mask=m_v)
    if n_pend > 0:
        # the committed state is final now; the D steps above stay speculative
        tl.store(p_state, b_s.to(state.dtype.element_ty), mask=m_kv)
        if (i_hv == 0) & (i_vb == 0):
            # nothing reads pending[row] after the prep kernel (meta holds it)
            tl.store(pending + row, 0)


@triton.jit
def _verify_inputs(v, xn, s_v, i_b, i_h, i_hv, o_k, o_v, m_k, m_v, t: tl.constexpr, D: tl.constexpr,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Token t's normalised key and query ([BK] fp32, from the prep kernel's ``xn``) and
    value ([BV] fp32)."""
    tok = (i_b * D + t).to(tl.int64)
    p_x = xn + ((tok * 2) * H + i_h) * K + o_k
    b_k = tl.load(p_x, mask=m_k, other=0.0)
    b_q = tl.load(p_x + H * K, mask=m_k, other=0.0)
    b_v = tl.load(v + tok * s_v + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    return b_k, b_q, b_v


def _verify_block_v(V: int, B: int, HV: int) -> int:
    # measured on the H200 (kernels/bench_verify.py, HV 32, K = V = 128, D = 4, a round,
    # the state kernel launched during the prep kernel): BV 64 on 2 warps against BV 32 on
    # one, 98.2 / 101.4 us at batch 64 and 336.4 / 367.8 us at batch 256; 16 columns a
    # warp or 4 warps are slower (154 / 621 us, 116 / 401 us at BV 64). (Before the
    # overlapped launch BV 32 won at batch 64, 102.1 / 106.8 us.) BV 64 from 4096 BV-64
    # programs (31 per SM of 132, batch 64 at HV 32) on; smaller batches, unmeasured
    # with the overlap, keep BV 32; smaller tiles when the grid would not fill the chip.
    bv = min(64 if B * HV * triton.cdiv(V, 64) >= 4096 else 32, triton.next_power_of_2(V))
    while bv > 8 and B * HV * triton.cdiv(V, bv) < 4 * 132:
        bv //= 2
    return bv


def recurrent_gated_delta_rule_replay_triton(
    q, k, v, g, beta, state, req_pool_indices, bufs: ReplayBuffers, scale=None, verify: bool = True
) -> torch.Tensor:
    """GPU path of :func:`naive_replay.recurrent_gated_delta_rule_replay_ref` (same shapes,
    same semantics). Raises IndexError before any launch on a row outside the pool."""
    check_rows(req_pool_indices, state.shape[0])
    return launch_replay_verify(q, k, v, g, beta, state, req_pool_indices, bufs, scale, verify)


def launch_replay_verify(q, k, v, g, beta, state, req_pool_indices, bufs: ReplayBuffers, scale=None, verify=True,
                         block_v=None, num_warps=None):
    """The device work alone (rows not checked, no host sync: CUDA-graph capturable).
    ``verify=False`` is the replay design's decode (``launch_gdn_recurrent``).
    ``block_v`` / ``num_warps`` override the state kernel's tile (benchmarks)."""
    if verify:
        return _launch_verify(q, k, v, g, beta, state, req_pool_indices, bufs, scale, block_v, num_warps)
    o = launch_gdn_recurrent(q, k, v, g, beta, state, req_pool_indices, scale, bufs=bufs,
                             block_v=block_v, num_warps=num_warps)
    if req_pool_indices.numel():
        # after the kernel (stream order): every program of the row has read pending
        bufs.pending.index_fill_(0, req_pool_indices.to(bufs.pending.device, torch.int64), 0)
    return o


PDL = None  # programmatic dependent launch of the state kernel: None = where the device has it


def _use_pdl(device: torch.device) -> bool:
    if PDL is not None:
        return PDL
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _launch_verify(q, k, v, g, beta, state, req_pool_indices, bufs, scale, block_v, num_warps):
    """Prep kernel, then the state kernel (module docstring); the state kernel zeroes the
    rows' ``pending``."""
    B, D, H, HV, K, V = _check_gdn_args(q, k, v, g, beta, state)
    rows = req_pool_indices.to(device=q.device, dtype=torch.int64).contiguous()
    if rows.numel() != B:
        raise ValueError(f"{rows.numel()} rows for a batch of {B}")
    d_max = _check_replay_bufs(bufs, state, H, HV, K, V)
    if B and D > d_max:
        raise ValueError(f"D = {D} exceeds the replay buffers' D_max = {d_max}")
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if B == 0:
        return o
    if D == 0:  # nothing to verify; the pending steps are applied all the same (as the reference does)
        launch_replay_flush(state, bufs, rows)
        return o
    if scale is None:
        scale = K ** -0.5
    (q, s_q), (k, s_k), (v, s_v) = (_token_rows(x) for x in (q, k, v))
    g, beta = g.contiguous(), beta.contiguous()
    BT = max(2, triton.next_power_of_2(D))
    BP = _pow2_steps(d_max)
    BK = triton.next_power_of_2(K)
    dev = q.device
    xn = torch.empty(B, D, 2, H, K, dtype=torch.float32, device=dev)
    coef = torch.empty(B * HV, BT + 2 * BT * BT + BP + 1, dtype=torch.float32, device=dev)
    meta = torch.empty(B, 2, dtype=torch.int32, device=dev)
    pdl = _use_pdl(dev)
    _gdn_verify_prep_kernel[(B * H,)](
        q, k, g, beta, rows, bufs.pending, bufs.slot, bufs.k, bufs.g, xn, coef, meta, float(scale), s_q, s_k,
        D=D, D_MAX=d_max, H=H, HV=HV, K=K, BK=BK, BT=BT, BP=BP, LOG2_BT=BT.bit_length() - 1, EPS=_EPS,
        PDL=pdl, num_warps=1,
    )
    BV = block_v or _verify_block_v(V, B, HV)
    _gdn_replay_verify_kernel[(B * HV, triton.cdiv(V, BV))](
        v, o, state, rows, bufs.k, bufs.delta, bufs.pending, bufs.slot, xn, coef, meta, s_v,
        D=D, D_MAX=d_max, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, BT=BT, BP=BP, PDL=pdl,
        num_warps=num_warps or max(1, BV // 32), **({"launch_pdl": True} if pdl else {}),
    )
    return o


def commit_accept_replay_triton(pending, slot, req_pool_indices, accept_lengths) -> None:
    """Replay commit for all layers at once (``pending``/``slot`` ``[L, R]`` or ``[R]``):
    ``pending[:, row] = accept_length``, ``slot[:, row]`` flips: one tiny launch, no state
    moves. Rows are validated like :func:`kernels.commit.commit_accept` validates them.
    A stage does not call this: its commit (``RowStatePool.commit``) is
    :func:`kernels.commit.commit_accept_conv_replay`, the same counters and the conv windows
    in one launch."""
    if not check_commit(req_pool_indices, accept_lengths, pending.shape[-1], None):
        return
    launch_replay_commit(pending, slot, req_pool_indices.to(pending.device, torch.int64),
                         accept_lengths.to(pending.device, pending.dtype))


@triton.jit
def _replay_commit_kernel(pending, slot, rows, acc, B, s_p, s_s, BLOCK: tl.constexpr):
    """``pending[l, row] = acc``, ``slot[l, row] = 1 - slot[l, row]`` for layer
    ``program_id(1)`` and a block of the batch (rows distinct: one writer each)."""
    i_l = tl.program_id(1)
    o_b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o_b < B
    row = tl.load(rows + o_b, mask=m, other=0)
    tl.store(pending + i_l * s_p + row, tl.load(acc + o_b, mask=m, other=0).to(pending.dtype.element_ty), mask=m)
    p_s = slot + i_l * s_s + row
    tl.store(p_s, 1 - tl.load(p_s, mask=m, other=0), mask=m)


def launch_replay_commit(pending, slot, rows, acc) -> None:
    """The commit's device work alone (no checks, no host sync: CUDA-graph capturable):
    one launch for all layers."""
    n_rows = pending.shape[-1]
    p2, s2 = pending.view(-1, n_rows), slot.view(-1, n_rows)
    B = rows.numel()
    if B == 0:
        return
    BLOCK = min(1024, triton.next_power_of_2(B))
    _replay_commit_kernel[(triton.cdiv(B, BLOCK), p2.shape[0])](
        p2, s2, rows, acc, B, p2.stride(0), s2.stride(0), BLOCK=BLOCK, num_warps=4)


def replay_flush_triton(state, bufs: ReplayBuffers, req_pool_indices) -> None:
    """Apply the rows' pending steps to ``state[row]`` now; ``pending[row]`` becomes 0."""
    check_rows(req_pool_indices, state.shape[0])
    if req_pool_indices.numel():
        launch_replay_flush(state, bufs, req_pool_indices.to(state.device, torch.int64).contiguous())


def launch_replay_flush(state, bufs: ReplayBuffers, rows) -> None:
    """The flush's device work alone (int64 ``rows``, not checked)."""
    B = rows.numel()
    H, K = bufs.k.shape[-2:]
    HV, V = bufs.delta.shape[-2:]
    BV = _block_v(V, B, HV, replay=True)
    # a zero-step "decode" whose only work is the replay and the final store (the input and
    # output pointers are never touched at D = 0)
    _gdn_recurrent_kernel[(B * HV, triton.cdiv(V, BV))](
        state, state, state, state, state, state, state, state, rows, *bufs[:3], bufs.pending, bufs.slot, 1.0, 0, 0, 0,
        D=0, D_MAX=bufs.k.shape[2], H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        BP=_pow2_steps(bufs.k.shape[2]), STORE_SCRATCH=False, STORE_FINAL=True, REPLAY=True,
        num_warps=_num_warps(BV, True),
    )
    bufs.pending.index_fill_(0, rows, 0)
