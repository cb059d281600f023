"""Chunked GDN prefill on the GPU through fla's chunked kernels (fla-core 0.6): the GPU path
of ``naive.chunk_gated_delta_rule_ref`` (same shapes and semantics).

fla's public ``chunk_gated_delta_rule`` wraps its forward in an autograd Function, three
decorators (input guard, backend dispatch, a dynamo-disable frame) and plans the chunks of
every call itself: on the H200 that came to ~2.7 ms of host time per GDN layer and
prefill step, ten times the layer's kernels at 512 tokens (docs/PERFORMANCE.md, "Prefill and the token budget").
Here the forward-level functions run directly (``_fla_forward``, the composition of fla's
``chunk_gated_delta_rule_fwd``), with the step's chunk plan made once per micro-batch
(:func:`chunk_plan`, cached on the ``cu_seqlens`` tensor as a fact) or on the device
inside a CUDA graph (``chunk_plan.device_chunk_plan``), and one kernel (``_qkv_prep_kernel``)
that L2-normalises q and k (eps 1e-6, fp32, as fla's ``l2norm_fwd`` and the reference)
and packs q, k, v from the conv output's column views, where fla's path ran five.

KDA's per-key-channel gate (``g [T, HV, K]``, Kimi Linear) runs fla's public ``chunk_kda``
as before. fla expands grouped heads (``HV = G * H``, key head ``hv // G``) itself, starts each
sequence from its initial state and returns the final states. Importing this module
fails where fla is absent, so the dispatcher falls back to the reference.
"""
from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
from fla.ops.common.chunk_o import chunk_fwd_o
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
from fla.ops.kda import chunk_kda
from fla.ops.utils.cumsum import chunk_local_cumsum_scalar
from fla.ops.utils.constant import RCP_LN2

from ..checks import fact, remember
# fla's chunk length (64 tokens); the plan made on the device, re-exported (tests import it from here)
from .chunk_plan import CHUNK, device_chunk_plan  # noqa: F401
from .naive import check_prefill_shapes

def direct() -> bool:
    """Whether the GDN prefill takes fla's forward-level functions (the default;
    ``PPSPEC_FLA_DIRECT=0`` takes its public autograd entry point instead, whose Python costs
    ~2.7 ms per layer call: docs/PERFORMANCE.md, "Prefill and the token budget")."""
    return os.environ.get("PPSPEC_FLA_DIRECT", "1") != "0"


def _direct(fn):
    # fla's default implementation under its wrappers (functools.wraps chains): a
    # dynamo-disable frame and the backend dispatch, which only looks for an alternative
    # backend (none serves these ops on NVIDIA GPUs)
    return inspect.unwrap(fn)


_intra = _direct(chunk_gated_delta_rule_fwd_intra)
_fwd_h = _direct(chunk_gated_delta_rule_fwd_h)
_fwd_o = _direct(chunk_fwd_o)


# ---------------------------------------------------------------- the chunk plan
def _plan_from_lens(lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    counts = [-(-n // CHUNK) for n in lens]
    ci = [(b, i) for b, c in enumerate(counts) for i in range(c)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    host = torch.tensor([x for pair in ci for x in pair] + offsets, dtype=torch.long)
    # from pinned memory: a copy from pageable memory synchronises the stream first, and the
    # host would wait for the layers queued before this one
    dev = host.pin_memory().to(device, non_blocking=True)
    return dev[: 2 * len(ci)].view(-1, 2), dev[2 * len(ci):]


def chunk_plan(cu_seqlens: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's varlen chunk plan of the packed sequences ``cu_seqlens`` ``[B + 1]`` on
    ``device``: ``(chunk_indices [NT, 2]`` int64, (sequence, chunk within it) per chunk,
    ``chunk_offsets [B + 1]`` int64, each sequence's first chunk). Read from the fact
    ``fla_chunks`` (a graph states it, ``chunk_plan.device_chunk_plan``), else made from the
    values the stage states (the fact ``values``) in one host-to-device copy and remembered
    with them, so the layers of one micro-batch share it; without either, from one device
    read (not remembered)."""
    plan = fact(cu_seqlens, "fla_chunks", lambda: None)
    if plan is not None:
        return plan
    cu = fact(cu_seqlens, "values", lambda: None)
    stated = cu is not None
    if not stated:
        cu = cu_seqlens.tolist()
    plan = _plan_from_lens([b - a for a, b in zip(cu, cu[1:])], device)
    if stated:
        remember(cu_seqlens, "fla_chunks", plan)
    return plan


# ---------------------------------------------------------------- q, k, v packing
@triton.jit
def _qkv_prep_kernel(q, k, v, qn, kn, vc, T, s_q, s_k, s_v, eps,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BD: tl.constexpr):
    """One block of BT tokens of one head slot: slots [0, H) are q's heads, [H, 2H) k's
    (L2-normalised in fp32: x / sqrt(sum(x^2) + eps)), [2H, 2H + HV) v's (copied)."""
    i_t = tl.program_id(0)
    i_s = tl.program_id(1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_t = o_t < T
    if i_s < 2 * H:
        is_q = i_s < H
        h = tl.where(is_q, i_s, i_s - H)
        m = m_t[:, None] & (o_d < K)[None, :]
        if is_q:
            x = tl.load(q + o_t[:, None] * s_q + h * K + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        else:
            x = tl.load(k + o_t[:, None] * s_k + h * K + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = 1 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
        y = x * rstd[:, None]
        off = (o_t[:, None] * H + h) * K + o_d[None, :]
        if is_q:
            tl.store(qn + off, y.to(qn.dtype.element_ty), mask=m)
        else:
            tl.store(kn + off, y.to(kn.dtype.element_ty), mask=m)
    else:
        # (names of their own: a name both branches assign must keep one type)
        h_v = i_s - 2 * H
        m_v = m_t[:, None] & (o_d < V)[None, :]
        b_v = tl.load(v + o_t[:, None] * s_v + h_v * V + o_d[None, :], mask=m_v, other=0.0)
        tl.store(vc + (o_t[:, None] * HV + h_v) * V + o_d[None, :], b_v.to(vc.dtype.element_ty), mask=m_v)


def _head_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` ``[T, H, N]`` and its token stride: in place when each token's heads are packed
    (a per-head view of a projection's or the conv output's columns), else a copy."""
    T, H, N = x.shape
    if (x.stride(2) == 1 or N == 1) and (x.stride(1) == N or H == 1):
        return x, x.stride(0)
    return x.contiguous(), H * N


def prep_qkv(q, k, v, dtype, eps: float = 1e-6):
    """``(l2norm(q), l2norm(k), v)`` packed ``[1, T, H|HV, K|V]`` in ``dtype``, one launch.
    q, k ``[T, H, K]``, v ``[T, HV, V]``, any dtype; views of packed columns are read in place."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    qn = torch.empty(1, T, H, K, dtype=dtype, device=q.device)
    kn = torch.empty_like(qn)
    vc = torch.empty(1, T, HV, V, dtype=dtype, device=v.device)
    if T:
        (q, s_q), (k, s_k), (v, s_v) = (_head_view(x) for x in (q, k, v))
        BT = 16
        _qkv_prep_kernel[(triton.cdiv(T, BT), 2 * H + HV)](
            q, k, v, qn, kn, vc, T, s_q, s_k, s_v, eps,
            H=H, HV=HV, K=K, V=V, BT=BT, BD=triton.next_power_of_2(max(K, V)), num_warps=4,
        )
    return qn, kn, vc


# ---------------------------------------------------------------- the forward
def _fla_forward(q, k, v, g, beta, scale, h0, cu, chunk_indices, chunk_offsets):
    """fla's ``chunk_gated_delta_rule_fwd`` (no context parallelism, gate given as log
    decay), with the chunk offsets passed in too (fla would make them through an identity
    cache, which a graph capture must not hit). q, k l2-normalised ``[1, T, H, K]``, v
    ``[1, T, HV, V]``, g fp32 ``[1, T, HV]``, beta ``[1, T, HV]``, h0 fp32 ``[B, HV, K, V]``.
    Returns ``(o [1, T, HV, V], final fp32 [B, HV, K, V])``."""
    g = chunk_local_cumsum_scalar(g, chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu, output_dtype=torch.float32,
                                  chunk_indices=chunk_indices)
    w, u, _ = _intra(k=k, v=v, g=g, beta=beta, cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=CHUNK)
    h, v_new, final = _fwd_h(k=k, w=w, u=u, g=g, initial_state=h0, output_final_state=True, chunk_size=CHUNK,
                             cu_seqlens=cu, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
    o = _fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=cu, chunk_size=CHUNK,
               chunk_indices=chunk_indices)
    return o, final


def _compute_dtype(v: torch.Tensor) -> torch.dtype:
    # one compute dtype for q, k, v (fla's matrix products want them alike)
    return v.dtype if v.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def _has_empty(cu_seqlens: torch.Tensor) -> bool:
    if fact(cu_seqlens, "fla_chunks", lambda: None) is not None:
        return False  # a graph's bucket: no empty sequence by construction
    cu = fact(cu_seqlens, "values", cu_seqlens.tolist)
    return any(b <= a for a, b in zip(cu, cu[1:]))


def chunk_gated_delta_rule_fla(q, k, v, g, beta, cu_seqlens, initial_state, scale=None):
    """Returns ``(o [T, HV, V] in v's dtype, final_state [B, HV, K, V] fp32)``. Empty
    sequences keep their initial state (fla itself wants none). A per-key-channel gate
    ``g [T, HV, K]`` (KDA), or :func:`direct` off, runs fla's public functions."""
    if g.dim() == 3 or not direct():
        return _chunk_fla_public(q, k, v, g, beta, cu_seqlens, initial_state, scale)
    T, H, K, HV, V, B = check_prefill_shapes(q, k, v, g, beta, cu_seqlens, initial_state)
    scale = K ** -0.5 if scale is None else scale
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    cu_list = fact(cu_seqlens, "values", cu.tolist)
    if cu_list[0] != 0 or cu_list[-1] != T or any(b < a for a, b in zip(cu_list, cu_list[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T}: {cu_list}")
    final = initial_state.to(torch.float32).clone()
    nonempty = [b for b in range(B) if cu_list[b + 1] > cu_list[b]]
    if not nonempty:
        return torch.empty(T, HV, V, dtype=v.dtype, device=v.device), final
    lens = [cu_list[b + 1] - cu_list[b] for b in nonempty]
    if len(nonempty) != B:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device=q.device)
        plan = _plan_from_lens(lens, q.device)
    else:
        plan = chunk_plan(cu_seqlens, q.device)
    idx = torch.tensor(nonempty, device=q.device)
    qq, kk, vv = prep_qkv(q, k, v, _compute_dtype(v))
    o, ht = _fla_forward(qq, kk, vv, g.to(torch.float32).unsqueeze(0).contiguous(),
                         beta.to(vv.dtype).unsqueeze(0).contiguous(), float(scale),
                         final[idx].contiguous(), cu, *plan)
    final[idx] = ht
    return o[0].to(v.dtype), final


def gdn_prefill_rows_fla(q, k, v, g, beta, cu_seqlens, state, req_pool_indices, has_init, scale=None):
    """Prefill at stable rows (:func:`kernels.gdn.gdn_prefill_rows`, same shapes and
    semantics): sequence ``b`` starts from ``state[req_pool_indices[b]]`` where
    ``has_init[b]``, else zeros, and its final state is written there. No host read when
    ``cu_seqlens`` carries its chunk plan or its values as facts, so a CUDA graph can record
    it. Rows are checked by the dispatcher. Returns ``o [T, HV, V]`` in v's dtype.

    Raises:
        ValueError: shapes that disagree.
    """
    B = cu_seqlens.numel() - 1
    T, H, K, HV, V, _ = check_prefill_shapes(q, k, v, g, beta, cu_seqlens, state[:1].expand(B, -1, -1, -1))
    if g.dim() == 3 or _has_empty(cu_seqlens):
        # KDA's per-channel gate (fla's chunk_kda), or an empty sequence (whose state the
        # general path keeps): gather, chunk_gated_delta_rule_fla, scatter
        from . import _prefill_rows_gathered
        return _prefill_rows_gathered(q, k, v, g, beta, cu_seqlens, state, req_pool_indices, has_init, scale)
    dev = q.device
    plan = chunk_plan(cu_seqlens, dev)
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    rows = req_pool_indices.to(dev)
    # a new sequence starts from zeros (where, not a product: a fresh row may hold anything)
    h0 = torch.where(has_init.to(dev).view(-1, 1, 1, 1), state.index_select(0, rows), 0.0).to(torch.float32)
    qq, kk, vv = prep_qkv(q, k, v, _compute_dtype(v))
    o, final = _fla_forward(qq, kk, vv, g.to(torch.float32).unsqueeze(0).contiguous(),
                            beta.to(vv.dtype).unsqueeze(0).contiguous(), float(K ** -0.5 if scale is None else scale),
                            h0, cu, *plan)
    state.index_copy_(0, rows, final.to(state.dtype))
    return o[0].to(v.dtype)


def _chunk_fla_public(q, k, v, g, beta, cu_seqlens, initial_state, scale=None):
    """Through fla's public ``chunk_gated_delta_rule`` / ``chunk_kda`` (KDA's per-channel
    gate); shapes and returns as :func:`chunk_gated_delta_rule_fla`."""
    T, H, K, HV, V, B = check_prefill_shapes(q, k, v, g, beta, cu_seqlens, initial_state)
    if scale is None:
        scale = K ** -0.5
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    cu_list = fact(cu_seqlens, "values", cu.tolist)  # stated by the stage: no device read
    if cu_list[0] != 0 or cu_list[-1] != T or any(b < a for a, b in zip(cu_list, cu_list[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T}: {cu_list}")
    cu_host = torch.tensor(cu_list, dtype=torch.int64)
    h0 = initial_state.to(torch.float32)
    o = torch.empty(T, HV, V, dtype=v.dtype, device=v.device)
    final = h0.clone()
    nonempty = [b for b in range(B) if cu_list[b + 1] > cu_list[b]]
    if not nonempty:
        return o, final
    if len(nonempty) != B:  # fla wants no empty sequence: run the others, keep empty ones' states
        idx = torch.tensor(nonempty, device=q.device)
        lens = torch.tensor([cu_list[b + 1] - cu_list[b] for b in nonempty], device=q.device)
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        cu_host = cu.cpu()
        h0 = h0[idx]
    # one compute dtype for q, k, v (fla's matrix products want them alike)
    dt = v.dtype if v.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    qq, kk, vv = (x.to(dt).unsqueeze(0).contiguous() for x in (q, k, v))
    gg = g.to(torch.float32).unsqueeze(0).contiguous()
    bb = beta.to(dt).unsqueeze(0).contiguous()
    fla_fn = chunk_kda if g.dim() == 3 else chunk_gated_delta_rule
    out, ht = fla_fn(
        qq, kk, vv, gg, bb,
        scale=float(scale),
        initial_state=h0.contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_host,
    )
    o.copy_(out[0].to(v.dtype))
    if len(nonempty) != B:
        final[idx] = ht.to(torch.float32)
    else:
        final = ht.to(torch.float32)
    return o, final
