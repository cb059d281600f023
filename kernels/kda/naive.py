"""Plain-torch Kimi Delta Attention (KDA): the CPU path and the oracle for GPU kernels.

KDA is the gated delta rule with a decay per key channel instead of one per head (Kimi
Team, "Kimi Linear", 2025, eq. 1). Per head, with the state ``S`` of shape ``[K, V]``::

    S_t = diag(exp(g_t)) S_{t-1} + k_t (beta_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t))^T
    o_t = S_t^T (scale * q_t)

``g_t`` is ``[K]`` per head (<= 0), q and k are L2-normalised, ``scale = K ** -0.5``. Query,
key and value heads are equal in number (Kimi Linear has no grouped heads). States are fp32.

As for GDN, the step's state write ``S <- diag(exp(g)) S + k delta^T`` needs only the step's
key, decay and delta, so the replay commit keeps those three at the row (``replay_ref``).
"""
from __future__ import annotations

import torch

from ..gdn.naive import l2norm


def _prepare(q, k, v, g, beta, scale):
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    return l2norm(q.float()) * scale, l2norm(k.float()), v.float(), g.float(), beta.float()


def kda_delta(s, k_t, v_t, g_t, beta_t):
    """First half of a step on ``s`` ``[B, H, K, V]`` fp32: ``(diag(exp g) s, delta)``,
    delta ``[B, H, V]`` = ``beta (v - (diag(exp g) s)^T k)``. g_t, k_t ``[B, H, K]``."""
    s = s * g_t.exp()[..., None]
    return s, (v_t - torch.einsum("bhkv,bhk->bhv", s, k_t)) * beta_t[..., None]


def kda_apply(s, k_t, delta, g_t):
    """The state write of one step given its delta: ``diag(exp g) s + k delta^T``."""
    return s * g_t.exp()[..., None] + k_t.unsqueeze(-1) * delta.unsqueeze(-2)


def chunk_kda_ref(q, k, v, g, beta, cu_seqlens, initial_state, scale=None, chunk_size: int = 64):
    """Chunked KDA over packed variable-length sequences (prefill).

    Args:
        q, k: ``[T, H, K]``. v: ``[T, H, V]``. g: ``[T, H, K]`` log decay per channel (<= 0).
        beta: ``[T, H]`` in (0, 1). cu_seqlens: ``[S + 1]`` int64 offsets.
        initial_state: ``[S, H, K, V]`` fp32 state before each sequence.

    Returns:
        ``(o, final_state)``: o ``[T, H, V]`` in v's dtype, final_state ``[S, H, K, V]`` fp32.

    Within a chunk with per-channel cumulative log decay ``c_i`` ``[K]``, the UT transform of
    the delta rule with ``A_ij = beta_i sum_k k_ik k_jk exp(c_ik - c_jk)`` (j < i),
    ``U = (I + A)^-1 (beta v)``, ``W = (I + A)^-1 (beta exp(c) * k)``, ``v' = U - W S0``,
    ``o_i = (exp(c_i) * q_i) S0 + sum_{j<=i} (q_i . (exp(c_i - c_j) * k_j)) v'_j`` and
    ``S = diag(exp(c_C)) S0 + sum_j (exp(c_C - c_j) * k_j) v'_j^T``.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    finals = []
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        s = initial_state[b].float().clone()  # [H, K, V]
        for c0 in range(bounds[b], bounds[b + 1], chunk_size):
            c1 = min(c0 + chunk_size, bounds[b + 1])
            C = c1 - c0
            qc, kc, vc, gc = (x[c0:c1].transpose(0, 1) for x in (q, k, v, g))  # [H, C, .]
            bc = beta[c0:c1].transpose(0, 1)  # [H, C]
            cum = gc.cumsum(1)  # [H, C, K]
            # pairwise channel decays exp(c_i - c_j), masked to j <= i: [H, C, C, K]
            diff = cum[:, :, None, :] - cum[:, None, :, :]
            causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
            decay = torch.where(causal[None, :, :, None], diff, torch.full_like(diff, float("-inf"))).exp()
            kk = torch.einsum("hik,hjk,hijk->hij", kc, kc, decay).tril(-1)
            a = bc[..., None] * kk
            lhs = torch.eye(C, dtype=torch.float32, device=q.device) + a
            u = torch.linalg.solve_triangular(lhs, bc[..., None] * vc, upper=False, unitriangular=True)
            w = torch.linalg.solve_triangular(lhs, bc[..., None] * cum.exp() * kc, upper=False, unitriangular=True)
            v_new = u - w @ s
            qk = torch.einsum("hik,hjk,hijk->hij", qc, kc, decay)
            o[c0:c1] = ((qc * cum.exp()) @ s + qk @ v_new).transpose(0, 1)
            last = cum[:, -1:, :]  # [H, 1, K]
            s = last.transpose(1, 2).exp() * s + (kc * (last - cum).exp()).transpose(-1, -2) @ v_new
        finals.append(s)
    final = torch.stack(finals) if finals else initial_state.new_zeros((0,) + tuple(initial_state.shape[1:]))
    return o.to(out_dtype), final


def recurrent_kda_ref(q, k, v, g, beta, state, req_pool_indices, scratch=None, scale=None):
    """Step-by-step KDA over ``D`` tokens per request at stable rows (decode / verify).

    Args:
        q, k, g: ``[B, D, H, K]``. v: ``[B, D, H, V]``. beta: ``[B, D, H]``.
        state: ``[rows + 1, H, K, V]`` fp32 committed pool (last row = padding).
        req_pool_indices: ``[B]`` int64 stable rows.
        scratch: ``[rows + 1, D_max, H, K, V]`` or None: with it (verify, copy design) the state
            after step t goes to ``scratch[row, t]`` and ``state`` is untouched; without it
            (decode) the last state is written to ``state[row]``.

    Returns:
        o: ``[B, D, H, V]`` in v's dtype.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    s = state[req_pool_indices].float()
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        s, delta = kda_delta(s, k[:, t], v[:, t], g[:, t], beta[:, t])
        s = s + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        o[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t])
        if scratch is not None:
            scratch[req_pool_indices, t] = s.to(scratch.dtype)
    if scratch is None:
        state[req_pool_indices] = s.to(state.dtype)
    return o.to(out_dtype)


def verify_record_ref(q, k, v, g, beta, state, req_pool_indices, scale=None):
    """A verify of the replay design: outputs as :func:`recurrent_kda_ref`, no state written;
    returns ``(o, k_n, delta, g)`` with what each step's write needs (k normalised, fp32):
    k_n, g ``[B, D, H, K]``, delta ``[B, D, H, V]``, to keep at the rows for :func:`replay_ref`."""
    out_dtype = v.dtype
    q, kn, v, g, beta = _prepare(q, k, v, g, beta, scale)
    s = state[req_pool_indices].float()
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    deltas = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        _, deltas[:, t] = kda_delta(s, kn[:, t], v[:, t], g[:, t], beta[:, t])
        s = kda_apply(s, kn[:, t], deltas[:, t], g[:, t])
        o[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t])
    return o.to(out_dtype), kn, deltas, g


def replay_ref(state, req_pool_indices, k_n, delta, g, accept_lengths):
    """Apply each row's first ``accept_lengths[i]`` recorded steps onto its committed state in
    place (the replay commit); ``accept_lengths`` ``[B]`` in ``[0, D]``."""
    s = state[req_pool_indices].float()
    for t in range(k_n.shape[1]):
        nxt = kda_apply(s, k_n[:, t], delta[:, t], g[:, t])
        s = torch.where((accept_lengths > t).view(-1, 1, 1, 1), nxt, s)
    state[req_pool_indices] = s.to(state.dtype)
