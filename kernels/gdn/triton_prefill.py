"""Triton GDN prefill of short packed sequences, token by token: the GPU path of
``naive.chunk_gated_delta_rule_ref`` (same shapes and semantics) for chunks whose longest
sequence is at most ``kernels.gdn.SHORT_PREFILL_TOKENS`` tokens, and for the batched prefill
graphs' chunks (sequences of at most ``stage_server.graphs.BATCHED_PREFILL_SEQ_TOKENS``,
the fact ``gdn_recurrent``).

fla's chunked kernels win on long prompts, but a short prompt pays their fixed cost: about
fourteen launches per layer, each with its host-side Python (autotune lookup, argument
specialisation), which on the H200 machine came to ~3 ms of host time per GDN layer for a
24-token prompt, more than the whole decode of a token. Here one launch per layer runs the
recurrent form (the reference's own definition, ``naive.gdn_step``): one program per
(sequence, value head, V-block) keeps its ``[K, BV]`` fp32 state tile in registers and steps
through its tokens with the decode kernel's token body (``triton_recurrent._gdn_token``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_recurrent import _block_v, _gdn_token, _num_warps
from .naive import check_prefill_shapes


@triton.jit
def _gdn_prefill_kernel(
    q, k, v, g, beta, o, h0, ht, cu, rows, has_init, scale, s_q, s_k, s_v,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    AT_ROWS: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_vb = tl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu + i_b).to(tl.int64)
    eos = tl.load(cu + i_b + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    if AT_ROWS:
        # the state pool itself: start from state[row] where the row has one (else zeros),
        # end by writing state[row]
        row = tl.load(rows + i_b).to(tl.int64)
        off = (row * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]
        b_s = tl.load(h0 + off, mask=m_kv & (tl.load(has_init + i_b) != 0), other=0.0).to(tl.float32)
    else:
        off = (i_b * HV + i_hv).to(tl.int64) * (K * V) + o_k[:, None] * V + o_v[None, :]
        b_s = tl.load(h0 + off, mask=m_kv, other=0.0).to(tl.float32)
    tok = bos
    while tok < eos:  # (while: Triton's interpreter cannot range() over loaded bounds)
        b_s = _gdn_token(q, k, v, g, beta, o, b_s, tok, i_h, i_hv, o_k, o_v, m_k, m_v, scale, s_q, s_k, s_v, HV, K, V)
        tok += 1
    tl.store(ht + off, b_s.to(ht.dtype.element_ty), mask=m_kv)


def _token_stride(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` ``[T, H, N]`` and its token stride (elements): in place when heads are packed
    within a token (a per-head view of a projection's columns), else a contiguous copy."""
    T, H, N = x.shape
    if (x.stride(2) == 1 or N == 1) and (x.stride(1) == N or H == 1):
        return x, x.stride(0)
    return x.contiguous(), H * N


def gdn_prefill_recurrent_triton(q, k, v, g, beta, cu_seqlens, initial_state, scale=None):
    """Shapes and semantics as :func:`naive.chunk_gated_delta_rule_ref`: q, k ``[T, H, K]``,
    v ``[T, HV, V]``, g ``[T, HV]`` (log decay), beta ``[T, HV]``, ``cu_seqlens`` ``[B + 1]``,
    ``initial_state`` ``[B, HV, K, V]``. Returns ``(o [T, HV, V]`` in v's dtype, ``final_state
    [B, HV, K, V]`` fp32). One launch, no host sync (the bounds are read in the kernel).

    Raises:
        ValueError: shapes that disagree.
    """
    T, H, K, HV, V, B = check_prefill_shapes(q, k, v, g, beta, cu_seqlens, initial_state)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    final = torch.empty(initial_state.shape, dtype=torch.float32, device=v.device)
    if B == 0:
        return o, final
    _launch(q, k, v, g, beta, o, initial_state.contiguous(), final, cu_seqlens, None, None, scale, B, H, K, HV, V)
    return o, final


def gdn_prefill_rows_triton(q, k, v, g, beta, cu_seqlens, state, req_pool_indices, has_init, scale=None):
    """Prefill at stable rows (:func:`kernels.gdn.gdn_prefill_rows`, same shapes and
    semantics): sequence ``b`` starts from ``state[req_pool_indices[b]]`` where
    ``has_init[b]`` (else zeros) and its final state is written there, inside the same
    launch, so no gather, select or scatter kernel runs around it. Returns ``o [T, HV, V]``.
    Rows are not checked here (the dispatcher checks them).

    Raises:
        ValueError: shapes that disagree, or a state pool that is not contiguous.
    """
    B = cu_seqlens.numel() - 1
    T, H, K, HV, V, _ = check_prefill_shapes(q, k, v, g, beta, cu_seqlens, state[:1].expand(B, -1, -1, -1))
    if req_pool_indices.shape != (B,) or has_init.shape != (B,):
        raise ValueError(f"{B} sequences, {tuple(req_pool_indices.shape)} rows and {tuple(has_init.shape)} has_init")
    if not state.is_contiguous():
        raise ValueError("the state pool must be contiguous")
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if B:
        _launch(q, k, v, g, beta, o, state, state, cu_seqlens, req_pool_indices.contiguous(), has_init.contiguous(),
                scale, B, H, K, HV, V)
    return o


def _launch(q, k, v, g, beta, o, h0, ht, cu_seqlens, rows, has_init, scale, B, H, K, HV, V) -> None:
    (q, s_q), (k, s_k), (v, s_v) = (_token_stride(x) for x in (q, k, v))
    BV = _block_v(V, B, HV)
    at_rows = rows is not None
    _gdn_prefill_kernel[(B * HV, triton.cdiv(V, BV))](
        q, k, v, g.contiguous(), beta.contiguous(), o, h0, ht, cu_seqlens,
        rows if at_rows else cu_seqlens, has_init if at_rows else cu_seqlens,  # unused unless AT_ROWS
        float(K ** -0.5 if scale is None else scale), s_q, s_k, s_v,
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, AT_ROWS=at_rows, num_warps=_num_warps(BV, False),
    )

