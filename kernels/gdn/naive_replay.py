"""Plain-torch GDN verify with the *replay* commit (docs/DESIGN.md, "Commit rule"): the reference for
``triton_replay.py``.

The copy design (``naive.recurrent_gated_delta_rule_ref`` with a scratch, then
``commit.naive.commit_accept_ref``) writes the state after each of the D verify steps and
copies one of them back: ``1 + D`` state sizes in the verify and 2 more in the commit. The
replay design keeps only what each verify step needs to redo its *write* at the request's
stable row: the normalised key, the log decay and the delta ``beta (v - (a S)^T k)`` of that
step (a few KiB per head, against a 64 KiB state per head at K = V = 128 fp32). The commit
records how many of those steps were accepted; the next verify (or decode) of that row
first replays them onto the committed state, writes the committed state back once, then
runs its own D steps without writing any state. A round reads and writes each state once,
as plain decode does.

A replayed step is ``S <- exp(g) S + k delta^T``: no read of the state (the delta was
computed by the verify against exactly the state the replay reproduces), hence no
reduction over K, and the same arithmetic as the verify's own update, so the replayed state
equals the copy design's ``scratch[row, accept_length - 1]`` bit for bit on the reference.

Buffers, per linear layer (``R = rows + 1`` with the padding row), all fp32::

    k     [R, 2, D_max, H, K]   normalised keys (per key head)
    delta [R, 2, D_max, HV, V]  the step's delta (per value head)
    g     [R, 2, D_max, HV]     the step's log decay (``[R, 2, D_max, HV, K]`` with a
                                per-channel gate: KDA)
    pending [R] int32   accepted steps of slot ``slot[row]`` not yet applied to state[row]
    slot    [R] int32   which of the two slots holds them

A verify reads slot ``slot[row]`` and writes its own inputs into slot ``1 - slot[row]``
(two slots, so that programs of one row never read a step another program of that row is
overwriting); the commit sets ``pending[row] = accept_length`` and flips ``slot[row]``.
``pending``/``slot`` of all layers can live in one ``[L, R]`` tensor, so one launch commits
every layer. Every access is at ``req_pool_indices``; no positional row exists.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .naive import _expand_heads, _prepare, gdn_apply, gdn_delta


class ReplayBuffers(NamedTuple):
    """Per-layer replay state at stable rows; see the module docstring for shapes."""

    k: torch.Tensor
    delta: torch.Tensor
    g: torch.Tensor
    pending: torch.Tensor
    slot: torch.Tensor


def alloc_replay_meta(num_layers: int, num_rows: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pending, slot)``, each ``[num_layers, num_rows]`` int32 zeros (num_rows counts the
    padding row). Layer ``l`` uses ``pending[l]``, ``slot[l]``; the commit takes the whole."""
    z = torch.zeros(num_layers, num_rows, dtype=torch.int32, device=device)
    return z, z.clone()


def alloc_replay_buffers(
    num_rows: int,
    d_max: int,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    device=None,
    meta: tuple[torch.Tensor, torch.Tensor] | None = None,
    per_channel_gate: bool = False,
) -> ReplayBuffers:
    """Buffers for one layer (fp32 whatever the model dtype: they feed the fp32 state).
    ``meta`` = ``(pending[l], slot[l])`` views of :func:`alloc_replay_meta`, else fresh.
    ``per_channel_gate``: the log decay is kept per key channel (KDA), else per head.
    Size per row: ``2 D_max (H K + HV V + HV) 4`` bytes (``HV K`` for the gate per channel)."""
    R = num_rows
    if meta is None:
        p, s = alloc_replay_meta(1, R, device)
        meta = (p[0], s[0])
    return ReplayBuffers(
        k=torch.zeros(R, 2, d_max, num_k_heads, head_k_dim, dtype=torch.float32, device=device),
        delta=torch.zeros(R, 2, d_max, num_v_heads, head_v_dim, dtype=torch.float32, device=device),
        g=torch.zeros(R, 2, d_max, num_v_heads, *((head_k_dim,) if per_channel_gate else ()),
                      dtype=torch.float32, device=device),
        pending=meta[0],
        slot=meta[1],
    )


def replay_pending_ref(s: torch.Tensor, bufs: ReplayBuffers, req_pool_indices: torch.Tensor) -> torch.Tensor:
    """State ``s`` (``[B, HV, K, V]`` fp32, the committed state of the rows) with each row's
    ``pending`` accepted steps applied. Does not write anything."""
    rows = req_pool_indices
    if rows.numel() == 0:
        return s
    n = bufs.pending[rows].long()
    n_max = int(n.max())
    if n_max == 0:
        return s
    sl = bufs.slot[rows].long()
    hv = bufs.delta.shape[-2]
    kk = _expand_heads(bufs.k[rows, sl], hv)  # [B, D_max, HV, K]
    dd, gg = bufs.delta[rows, sl], bufs.g[rows, sl]
    for j in range(n_max):
        stepped = gdn_apply(s, kk[:, j], dd[:, j], gg[:, j])
        s = torch.where((j < n)[:, None, None, None], stepped, s)
    return s


def recurrent_gated_delta_rule_replay_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    req_pool_indices: torch.Tensor,
    bufs: ReplayBuffers,
    scale: float | None = None,
    verify: bool = True,
) -> torch.Tensor:
    """Replay each row's pending accepted steps, then run D new steps.

    Shapes as :func:`naive.recurrent_gated_delta_rule_ref`. ``verify=True``: the committed
    state (after the replay) is written to ``state[row]`` and each of the D steps' record
    (normalised key, delta, log decay) to slot ``1 - slot[row]`` of the buffers; no other
    state is written. ``verify=False``
    (plain decode): the state after the D steps is written to ``state[row]``. Either way
    ``pending[row]`` is 0 afterwards.

    Returns:
        o: ``[B, D, HV, V]`` in v's dtype.
    """
    rows = req_pool_indices
    out_dtype = v.dtype
    s = replay_pending_ref(state[rows].float(), bufs, rows)
    qn, kn, vf, gf, bf = _prepare(q, k, v, g, beta, scale)
    B, D, H = k.shape[:3]
    if verify:
        if B and D > bufs.k.shape[2]:
            raise ValueError(f"D = {D} exceeds the replay buffers' D_max = {bufs.k.shape[2]}")
        state[rows] = s.to(state.dtype)
        new = 1 - bufs.slot[rows].long()
        # keys per key head (kn repeats them over the group)
        bufs.k[rows, new, :D] = kn[:, :, :: kn.shape[2] // H]
        bufs.g[rows, new, :D] = gf
    o = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    for t in range(D):
        s, delta = gdn_delta(s, kn[:, t], vf[:, t], gf[:, t], bf[:, t])
        s = s + kn[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        o[:, t] = torch.einsum("bhkv,bhk->bhv", s, qn[:, t])
        if verify:
            bufs.delta[rows, new, t] = delta
    if not verify:
        state[rows] = s.to(state.dtype)
    bufs.pending[rows] = 0
    return o.to(out_dtype)


def commit_accept_replay_ref(
    pending: torch.Tensor, slot: torch.Tensor, req_pool_indices: torch.Tensor, accept_lengths: torch.Tensor
) -> None:
    """Replay commit: ``pending[..., row] = accept_length``; ``slot[..., row]`` flips to the
    slot the verify just wrote. ``pending``/``slot`` are ``[R]`` or ``[L, R]`` (all layers at
    once). No state moves here: the next verify or decode of the row applies the steps."""
    pending[..., req_pool_indices] = accept_lengths.to(pending.dtype)
    slot[..., req_pool_indices] = 1 - slot[..., req_pool_indices]


def replay_flush_ref(state: torch.Tensor, bufs: ReplayBuffers, req_pool_indices: torch.Tensor) -> None:
    """Apply the rows' pending steps to ``state[row]`` now (before a prefill continues the
    row, before a state is read out, or in tests); ``pending[row]`` becomes 0."""
    rows = req_pool_indices
    state[rows] = replay_pending_ref(state[rows].float(), bufs, rows).to(state.dtype)
    bufs.pending[rows] = 0


def replay_reset_ref(pending: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
    """Drop pending steps of rows (a new request's prefill, or a released row).
    ``index_fill_`` takes the 0 as a kernel argument: ``pending[..., rows] = 0`` on CUDA
    copied a 0 from pageable host memory first, a stream sync (test_snapshot_ops_gpu)."""
    pending.index_fill_(-1, req_pool_indices.to(pending.device, torch.int64), 0)
