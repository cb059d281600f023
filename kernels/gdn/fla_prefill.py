"""Chunked gated-delta-rule prefill on the GPU through fla (fla-core 0.6): the GPU path of
``naive.chunk_gated_delta_rule_ref`` (same shapes and semantics). A per-head log decay
``g [T, HV]`` (GDN) runs fla's ``chunk_gated_delta_rule``, a per-key-channel one
``g [T, HV, K]`` (KDA, Kimi Linear) fla's ``chunk_kda``; both take the same arguments here.

Packed variable-length sequences go in as one batch of ``[1, T, ...]`` with ``cu_seqlens``;
fla L2-normalises q and k in the kernel (``use_qk_l2norm_in_kernel=True``, eps 1e-6 as the
reference), expands grouped heads (``HV = G * H``, key head ``hv // G``) itself, starts each
sequence from its ``initial_state`` and returns the final states. Importing this module
fails where fla is absent, so the dispatcher falls back to the reference.
"""
from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from fla.ops.kda import chunk_kda

from ..checks import fact
from .naive import check_prefill_shapes


def chunk_gated_delta_rule_fla(q, k, v, g, beta, cu_seqlens, initial_state, scale=None):
    """Returns ``(o [T, HV, V] in v's dtype, final_state [B, HV, K, V] fp32)``."""
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
