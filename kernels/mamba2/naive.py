"""Plain-torch Mamba2 (SSD) scan: the CPU path and the oracle for GPU kernels.

Recurrence per head ``h`` (Dao & Gu, "Transformers are SSMs", ICML 2024, eq. 2 with the
scalar-times-identity ``A`` of Mamba2), with the state ``S`` of shape ``[P, N]``
(head dim x state size)::

    dt_t = clamp(softplus(dt_raw_t + dt_bias), *dt_limit)
    S_t  = exp(dt_t * A) * S_{t-1} + dt_t * x_t B_t^T
    y_t  = S_t C_t + D * x_t

``A = -exp(A_log)`` is one negative scalar per head. ``B``, ``C`` are grouped: group ``g``
serves heads ``g * H/G .. (g + 1) * H/G - 1`` (as ``n_groups`` in transformers' Mamba2
mixers: NemotronH, Granite 4.0 hybrid, Bamba, Falcon-H1). States are fp32.

Unlike the gated delta rule, a step's state update reads no state: it is
``S <- a S + u`` with ``a = exp(dt A)`` and ``u = dt x B^T`` known from the step's inputs
alone. So the replay commit keeps ``dt``, ``x`` and ``B`` of each verify step at the row and
redoes the accepted steps onto the committed state (``replay_ref``); no per-step state is
ever written.

``dt_limit``: transformers (and mamba_ssm) clamp ``dt`` in the chunked scan but not in the
single-step update; callers pass the limit where their reference applies it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit=(0.0, float("inf"))) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), *dt_limit)`` in fp32; dt ``[..., H]``, dt_bias ``[H]``."""
    dt = F.softplus(dt.float() + dt_bias.float())
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _expand_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., G, N]`` -> ``[..., H, N]``: group g serves H/G consecutive heads."""
    g = x.shape[-2]
    return x if g == heads else x.repeat_interleave(heads // g, dim=-2)


def ssd_decay(dt_t, A):
    """``exp(dt A)``: a step's state decay, ``[..., H]`` fp32 (dt discretized)."""
    return torch.exp(dt_t * A.float())


def ssd_apply(s, x_t, dt_t, a_t, B_t):
    """``a s + dt x B^T`` on ``s`` ``[B, H, P, N]`` fp32, with the step's decay ``a_t``
    (:func:`ssd_decay`) ``[B, H]``; other shapes as :func:`ssd_step`."""
    return a_t[..., None, None] * s + (dt_t[..., None] * x_t.float()).unsqueeze(-1) * B_t.float().unsqueeze(-2)


def ssd_step(s, x_t, dt_t, A, B_t):
    """One state update on ``s`` ``[B, H, P, N]`` fp32: ``exp(dt A) s + dt x B^T``.
    x_t ``[B, H, P]``, dt_t ``[B, H]`` (discretized), A ``[H]``, B_t ``[B, H, N]`` (heads expanded)."""
    return ssd_apply(s, x_t, dt_t, ssd_decay(dt_t, A), B_t)


def ssd_read(s, x_t, C_t, D):
    """Output of one step from the state after it: ``S C + D x``, ``[B, H, P]`` fp32."""
    return torch.einsum("bhpn,bhn->bhp", s, C_t.float()) + D.float()[:, None] * x_t.float()


def chunk_scan_ref(x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_state, chunk_size: int = 64,
                   dt_limit=(0.0, float("inf"))):
    """Chunked Mamba2 scan over packed variable-length sequences (prefill).

    Args:
        x: ``[T, H, P]`` packed tokens of all sequences (after the conv and activation).
        dt: ``[T, H]`` raw time step (before bias and softplus). A, D, dt_bias: ``[H]``.
        B, C: ``[T, G, N]`` grouped input / output projections of the state.
        cu_seqlens: ``[S + 1]`` int64 offsets of each sequence in the packed dim.
        initial_state: ``[S, H, P, N]`` fp32 state before each sequence.

    Returns:
        ``(y, final_state)``: y ``[T, H, P]`` in x's dtype, final_state ``[S, H, P, N]`` fp32.

    Within a chunk with cumulative log decay ``c_i = sum_{j<=i} dt_j A`` (the SSD block
    decomposition, Dao & Gu sec. 6): ``y_i = exp(c_i) C_i S0 + sum_{j<=i} exp(c_i - c_j)
    (C_i . B_j) dt_j x_j + D x_i`` and ``S = exp(c_last) S0 + sum_j exp(c_last - c_j) dt_j x_j B_j^T``.
    """
    H = x.shape[1]
    dts = discretize(dt, dt_bias, dt_limit)  # [T, H]
    Bh, Ch = _expand_groups(B.float(), H), _expand_groups(C.float(), H)  # [T, H, N]
    xf, Af = x.float(), A.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    finals = []
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        s = initial_state[b].float().clone()  # [H, P, N]
        for c0 in range(bounds[b], bounds[b + 1], chunk_size):
            c1 = min(c0 + chunk_size, bounds[b + 1])
            L = c1 - c0
            dtc = dts[c0:c1].transpose(0, 1)  # [H, L]
            cum = (dtc * Af[:, None]).cumsum(-1)  # [H, L]
            diff = cum[:, :, None] - cum[:, None, :]  # c_i - c_j
            causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
            decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()  # [H, L, L]
            xc = xf[c0:c1].transpose(0, 1)  # [H, L, P]
            bc, cc = Bh[c0:c1].transpose(0, 1), Ch[c0:c1].transpose(0, 1)  # [H, L, N]
            scores = (cc @ bc.transpose(-1, -2)) * decay * dtc[:, None, :]  # [H, L, L]
            yc = scores @ xc + cum.exp()[..., None] * (cc @ s.transpose(-1, -2))  # [H, L, P]
            y[c0:c1] = yc.transpose(0, 1)
            w = (cum[:, -1:] - cum).exp() * dtc  # [H, L]
            s = cum[:, -1].exp()[:, None, None] * s + (xc * w[..., None]).transpose(-1, -2) @ bc
        finals.append(s)
    y = y + D.float()[:, None] * xf
    final = torch.stack(finals) if finals else initial_state.new_zeros((0,) + tuple(initial_state.shape[1:]))
    return y.to(x.dtype), final


def recurrent_ref(x, dt, A, B, C, D, dt_bias, state, req_pool_indices, scratch=None,
                  dt_limit=(0.0, float("inf"))):
    """Step-by-step Mamba2 over ``T`` tokens per request at stable rows (decode: T = 1,
    verify: T = D draft positions).

    Args:
        x: ``[Bs, T, H, P]``. dt: ``[Bs, T, H]`` raw. B, C: ``[Bs, T, G, N]``. A, D, dt_bias: ``[H]``.
        state: ``[rows + 1, H, P, N]`` fp32 committed state pool (last row = padding).
        req_pool_indices: ``[Bs]`` int64 stable rows (never batch positions).
        scratch: ``[rows + 1, T_max, H, P, N]`` or None. With a scratch (verify, copy design)
            the state after step t goes to ``scratch[row, t]`` and ``state`` is untouched until
            the commit; without (decode) the state after the last step is written to ``state[row]``.

    Returns:
        y: ``[Bs, T, H, P]`` in x's dtype.
    """
    H = x.shape[2]
    dts = discretize(dt, dt_bias, dt_limit)
    Bh, Ch = _expand_groups(B, H), _expand_groups(C, H)
    s = state[req_pool_indices].float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[1]):
        s = ssd_step(s, x[:, t], dts[:, t], A, Bh[:, t])
        y[:, t] = ssd_read(s, x[:, t], Ch[:, t], D)
        if scratch is not None:
            scratch[req_pool_indices, t] = s.to(scratch.dtype)
    if scratch is None:
        state[req_pool_indices] = s.to(state.dtype)
    return y.to(x.dtype)


def replay_ref(state, req_pool_indices, x, dt, B, A, accept_lengths):
    """Apply each row's first ``accept_lengths[i]`` recorded verify steps onto its committed
    state (the replay commit design; see the module docstring).

    Args:
        state: ``[rows + 1, H, P, N]`` fp32 pool, updated in place at ``req_pool_indices``.
        x: ``[Bs, T, H, P]``, dt: ``[Bs, T, H]`` discretized, B: ``[Bs, T, G, N]``: the inputs the
            verify recorded at these rows. accept_lengths: ``[Bs]`` int in ``[0, T]``.

    The result equals the copy design's ``scratch[row, accept_length - 1]`` (the same
    arithmetic in the same order), and leaves the state as is for ``accept_length`` 0.
    """
    H = x.shape[2]
    Bh = _expand_groups(B, H)
    s = state[req_pool_indices].float()
    for t in range(x.shape[1]):
        s_next = ssd_step(s, x[:, t], dt[:, t], A, Bh[:, t])
        keep = (accept_lengths > t).view(-1, 1, 1, 1)
        s = torch.where(keep, s_next, s)
    state[req_pool_indices] = s.to(state.dtype)


def gated_rms_norm_ref(y, gate, weight, group_size: int, eps: float = 1e-6, norm_before_gate: bool = False):
    """Mamba2's output norm: ``y * silu(gate)`` RMS-normalised per group of ``group_size``
    channels (``intermediate / n_groups``), times ``weight`` (``norm_before_gate=False``,
    transformers' ``*RMSNormGated`` of the Mamba2 hybrids); or ``weight * rmsnorm_per_group(y)
    * silu(gate)`` in fp32, cast once (``norm_before_gate=True``, ``FalconH1RMSNormGated``).
    y, gate ``[..., I]``; returns y's dtype."""
    h = y.float() if norm_before_gate else y.float() * F.silu(gate.float())
    shape = h.shape
    h = h.view(*shape[:-1], shape[-1] // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if norm_before_gate:
        return (weight * h.view(shape) * F.silu(gate.float())).to(y.dtype)
    return weight * h.view(shape).to(y.dtype)
