"""Plain-torch gated delta rule: the CPU path and the oracle for the GPU kernels, of GDN
(one decay per head) and KDA (one decay per key channel) alike.

Recurrence per value head (Yang et al., "Gated Delta Networks", ICLR 2025, eq. 10; Kimi
Team, "Kimi Linear", 2025, eq. 1), with the state ``S`` of shape ``[K, V]``::

    S_t = diag(a_t) S_{t-1} + k_t (beta_t * (v_t - (diag(a_t) S_{t-1})^T k_t))^T
    o_t = S_t^T (scale * q_t)

with ``a_t = exp(g_t)``. The log decay ``g`` is given per head (``[..., HV]``: GDN, the
same decay for every key channel) or per key channel (``[..., HV, K]``: KDA, Kimi Delta
Attention); every function here takes either, and a per-head gate is the per-channel rule
with the gate broadcast over K.

q and k are L2-normalised here (``use_qk_l2norm`` in the reference models). Grouped
heads: query/key head ``h`` serves value heads ``h * G .. h * G + G - 1`` with
``G = HV // H`` (the Qwen3-Next / Qwen3.5 layout).
"""
from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the fla / transformers definition)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    h = x.shape[-2]
    return x if h == hv else x.repeat_interleave(hv // h, dim=-2)


def _prepare(q, k, v, g, beta, scale):
    hv = v.shape[-2]
    q = _expand_heads(l2norm(q.float()), hv) * (scale if scale is not None else q.shape[-1] ** -0.5)
    k = _expand_heads(l2norm(k.float()), hv)
    return q, k, v.float(), g.float(), beta.float()


def _channel_gate(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The log decay with a key-channel dim: ``[..., HV, 1]`` for a per-head gate
    (``g`` has one dim fewer than ``v [..., HV, V]``), ``[..., HV, K]`` as given per channel."""
    return g.unsqueeze(-1) if g.dim() == v.dim() - 1 else g


def _decay(s: torch.Tensor, g_t: torch.Tensor) -> torch.Tensor:
    """``exp(g_t)`` shaped to scale the rows of ``s`` ``[B, HV, K, V]``: ``g_t`` ``[B, HV]``
    (per head) or ``[B, HV, K]`` (per key channel)."""
    a = g_t.exp()
    return a[..., None, None] if a.dim() == s.dim() - 2 else a[..., None]


def check_prefill_shapes(q, k, v, g, beta, cu_seqlens, initial_state) -> tuple[int, int, int, int, int, int]:
    """``(T, H, K, HV, V, B)`` of a packed prefill (shapes as :func:`chunk_gated_delta_rule_ref`,
    g per head or per key channel);
    raises ValueError when they disagree. Shared by the GPU paths."""
    T, H, K = q.shape
    HV, V = v.shape[-2:]
    B = cu_seqlens.numel() - 1
    if (k.shape != q.shape or v.shape[0] != T or g.shape not in ((T, HV), (T, HV, K)) or beta.shape != (T, HV)
            or HV % H):
        raise ValueError(f"GDN prefill shapes disagree: q {tuple(q.shape)} v {tuple(v.shape)} g {tuple(g.shape)}")
    if tuple(initial_state.shape) != (B, HV, K, V):
        raise ValueError(f"initial_state {tuple(initial_state.shape)} for {B} sequences of {(HV, K, V)}")
    return T, H, K, HV, V, B


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over packed variable-length sequences (prefill).

    Args:
        q, k: ``[T, H, K]`` packed tokens of all sequences (any float dtype).
        v: ``[T, HV, V]``. g: ``[T, HV]`` log decay per head (GDN) or ``[T, HV, K]`` per
            key channel (KDA), <= 0. beta: ``[T, HV]`` in (0, 1).
        cu_seqlens: ``[B + 1]`` int64 offsets of each sequence in the packed dim.
        initial_state: ``[B, HV, K, V]`` fp32 state before each sequence.
        scale: query scale, default ``K ** -0.5``.
        chunk_size: tokens per chunk of the WY / UT-transform formulation.

    Returns:
        ``(o, final_state)``: o ``[T, HV, V]`` in v's dtype, final_state ``[B, HV, K, V]`` fp32.

    Within a chunk with cumulative log decay ``c_i`` (``[K]`` per channel, or one value
    broadcast over K; the UT transform of the DeltaNet paper, Yang et al. 2024, sec. 3):
    ``A_ij = beta_i sum_k k_ik k_jk exp(c_ik - c_jk)`` for j < i,
    ``U = (I + A)^-1 (beta v)``, ``W = (I + A)^-1 (beta exp(c) * k)``, ``v' = U - W S0``,
    ``o_i = (exp(c_i) * q_i) S0 + sum_{j<=i} (q_i . (exp(c_i - c_j) * k_j)) v'_j``,
    ``S = diag(exp(c_C)) S0 + sum_j (exp(c_C - c_j) * k_j) v'_j^T``.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    g = _channel_gate(g, v)  # [T, HV, 1 or K]
    T, HV, K = q.shape
    o = torch.empty(T, HV, v.shape[-1], dtype=torch.float32, device=v.device)
    finals = []
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        s = initial_state[b].float().clone()
        for c0 in range(bounds[b], bounds[b + 1], chunk_size):
            c1 = min(c0 + chunk_size, bounds[b + 1])
            # heads first: [HV, C, .]
            qc, kc, vc, gc = (x[c0:c1].transpose(0, 1) for x in (q, k, v, g))
            bc = beta[c0:c1].transpose(0, 1)
            C = c1 - c0
            cum = gc.cumsum(1)  # [HV, C, 1 or K]
            diff = cum[:, :, None, :] - cum[:, None, :, :]  # c_i - c_j: [HV, C, C, 1 or K]
            causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
            decay = torch.where(causal[None, :, :, None], diff, torch.full_like(diff, float("-inf"))).exp()

            def decayed_dot(a):  # sum_k a_ik k_jk exp(c_ik - c_jk), j <= i: [HV, C, C]
                if decay.shape[-1] == 1:  # one decay per head: it factors out of the sum
                    return (a @ kc.transpose(-1, -2)) * decay[..., 0]
                return torch.einsum("hik,hjk,hijk->hij", a, kc, decay)

            a = bc.unsqueeze(-1) * decayed_dot(kc).tril(-1)
            lhs = torch.eye(C, dtype=torch.float32, device=q.device) + a
            u = torch.linalg.solve_triangular(lhs, bc.unsqueeze(-1) * vc, upper=False, unitriangular=True)
            w = torch.linalg.solve_triangular(lhs, bc.unsqueeze(-1) * cum.exp() * kc, upper=False, unitriangular=True)
            v_new = u - w @ s
            o[c0:c1] = ((qc * cum.exp()) @ s + decayed_dot(qc) @ v_new).transpose(0, 1)
            last = cum[:, -1:, :]  # [HV, 1, 1 or K]
            s = last.transpose(1, 2).exp() * s + (kc * (last - cum).exp()).transpose(-1, -2) @ v_new
        finals.append(s)
    final = torch.stack(finals) if finals else initial_state.new_zeros((0,) + tuple(initial_state.shape[1:]))
    return o.to(out_dtype), final


def gdn_delta(s, k_t, v_t, g_t, beta_t):
    """The first half of one step on ``s`` ``[B, HV, K, V]`` fp32 (k_t normalised, heads
    expanded; g_t ``[B, HV]`` or ``[B, HV, K]``): ``(diag(exp g_t) s, delta)`` with
    ``delta = beta_t (v_t - (diag(exp g_t) s)^T k_t)``, ``[B, HV, V]`` (Yang et al.,
    "Gated Delta Networks", ICLR 2025, eq. 10)."""
    s = s * _decay(s, g_t)
    kv_mem = torch.einsum("bhkv,bhk->bhv", s, k_t)
    return s, (v_t - kv_mem) * beta_t[..., None]


def gdn_apply(s, k_t, delta, g_t):
    """The state update of one step given its delta: ``diag(exp g_t) s + k_t delta^T``."""
    return s * _decay(s, g_t) + k_t.unsqueeze(-1) * delta.unsqueeze(-2)


def gdn_step(s, k_t, v_t, g_t, beta_t):
    """One step of the recurrence on ``s`` ``[B, HV, K, V]`` fp32 (k_t normalised, heads
    expanded): decay, read ``S^T k``, write the beta-scaled delta. Returns the new state."""
    s, delta = gdn_delta(s, k_t, v_t, g_t, beta_t)
    return s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    req_pool_indices: torch.Tensor,
    scratch: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Step-by-step GDN over ``D`` tokens per request, reading committed state at stable rows.

    Args:
        q, k: ``[B, D, H, K]``. v: ``[B, D, HV, V]``. beta: ``[B, D, HV]``.
        g: ``[B, D, HV]`` per head or ``[B, D, HV, K]`` per key channel.
        state: ``[rows + 1, HV, K, V]`` fp32 committed state pool (last row = padding).
        req_pool_indices: ``[B]`` int64 stable rows of the requests (never batch positions).
        scratch: ``[rows + 1, D_max, HV, K, V]`` verify scratch, or None.
            With a scratch (verify) the state after step ``t`` goes to ``scratch[row, t]`` and
            ``state`` is left untouched until the commit. Without (plain decode) the state
            after the last step is written back to ``state[row]``.
        scale: query scale, default ``K ** -0.5``.

    Returns:
        o: ``[B, D, HV, V]`` in v's dtype.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    s = state[req_pool_indices].float()  # [B, HV, K, V]
    D = q.shape[1]
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(D):
        s = gdn_step(s, k[:, t], v[:, t], g[:, t], beta[:, t])
        o[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t])
        if scratch is not None:
            scratch[req_pool_indices, t] = s.to(scratch.dtype)
    if scratch is None:
        state[req_pool_indices] = s.to(state.dtype)
    return o.to(out_dtype)
