"""Chunked Mamba2 (SSD) prefill on the GPU through fla's simple-GLA chunk kernels (fla-core
0.6): the GPU path of ``naive.chunk_scan_ref`` at stable rows (same shapes and semantics).

Mamba2's scan is gated linear attention with one scalar decay per head and token (Dao & Gu,
"Transformers are SSMs", sec. 6; fla's ``chunk_simple_gla`` computes exactly that form)::

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,   o_t = scale * q_t^T S_t

so with ``g = dt A`` (log decay), ``k = B``, ``v = dt x``, ``q = C`` and ``scale = 1`` its
output is Mamba2's ``S_t C_t`` and its state is Mamba2's ``[P, N]`` state (fla's
``state_v_first`` layout ``[H, V, K]``, the pool's own); the ``D x`` skip is added here.
Grouped ``B``, ``C`` are expanded to the heads first. fla wants no empty sequence: those
keep their initial state, as the reference does. Importing this module fails where fla is
absent, so the dispatcher falls back to the reference (``kernels/mamba2/__init__.py``).
"""
from __future__ import annotations

import torch
from fla.ops.simple_gla import chunk_simple_gla

from ..checks import fact
from .naive import _expand_groups, discretize


def mamba2_prefill_rows_fla(x, dt, A, B, C, D, dt_bias, cu_seqlens, state, req_pool_indices, has_init,
                            dt_limit=(0.0, float("inf")), chunk_size: int = 64):
    """Shapes and semantics of :func:`kernels.mamba2.mamba2_prefill_rows`: x ``[T, H, P]``,
    dt ``[T, H]`` raw, B, C ``[T, G, N]``, A, D, dt_bias ``[H]``, cu_seqlens ``[S + 1]``,
    state ``[R, H, P, N]`` fp32 (written in place at ``req_pool_indices``), has_init ``[S]``
    bool. Returns y ``[T, H, P]`` in x's dtype. Rows are checked by the dispatcher; fla's
    own chunk length (64) is used whatever ``chunk_size`` says (the result does not depend
    on it)."""
    T, H, _ = x.shape
    cu_list = fact(cu_seqlens, "values", cu_seqlens.tolist)  # stated by the stage: no device read
    if len(cu_list) != req_pool_indices.numel() + 1 or cu_list[0] != 0 or cu_list[-1] != T \
            or any(b < a for a, b in zip(cu_list, cu_list[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T} with one sequence per row: {cu_list}")
    nonempty = [b for b in range(len(cu_list) - 1) if cu_list[b + 1] > cu_list[b]]
    if not nonempty:  # T = 0
        return torch.empty_like(x)
    dev = x.device
    rows = req_pool_indices.to(dev)
    if len(nonempty) != len(cu_list) - 1:
        keep = torch.tensor(nonempty, device=dev)
        rows, has_init = rows[keep], has_init.to(dev)[keep]
        lens = [cu_list[b + 1] - cu_list[b] for b in nonempty]
        cu_list = [0, *torch.tensor(lens).cumsum(0).tolist()]
    cu_host = torch.tensor(cu_list, dtype=torch.int64)
    cu = cu_host.to(dev)
    # a new sequence starts from zeros (where, not a product: a fresh row may hold anything)
    h0 = torch.where(has_init.to(dev).view(-1, 1, 1, 1), state.index_select(0, rows), 0.0).float()
    dts = discretize(dt, dt_bias, dt_limit)  # [T, H] fp32
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    q = _expand_groups(C, H).to(dtype).unsqueeze(0).contiguous()  # [1, T, H, N]
    k = _expand_groups(B, H).to(dtype).unsqueeze(0).contiguous()
    v = (dts[..., None] * x.float()).to(dtype).unsqueeze(0).contiguous()  # [1, T, H, P]
    g = (dts * A.float()).unsqueeze(0).contiguous()  # [1, T, H] fp32 log decay
    o, final = chunk_simple_gla(q, k, v, g=g, scale=1.0, initial_state=h0.contiguous(), output_final_state=True,
                                state_v_first=True, cu_seqlens=cu, cu_seqlens_cpu=cu_host)
    state.index_copy_(0, rows, final.to(state.dtype))
    return (o[0].float() + D.float()[:, None] * x.float()).to(x.dtype)
