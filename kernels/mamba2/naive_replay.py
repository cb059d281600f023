"""Plain-torch Mamba2 verify with the *replay* commit (docs/DESIGN.md, "Commit rule").

A Mamba2 step's state update ``S <- exp(dt A) S + dt x B^T`` reads no state, so redoing an
accepted verify step needs only that step's discretised ``dt``, its decay ``exp(dt A)``
(kept so that a replay needs no model parameter: a snapshot or a prefill flushes rows from
the pool alone), its ``x`` and its ``B`` (``C`` and ``D`` shape the step's output, not the
state: they are not kept). A verify keeps these at the
request's stable row; the commit (``kernels.commit.commit_accept_conv_replay``, the same
commit as GDN's) records how many steps were accepted and flips the row's slot; the next
verify, decode or continuing prefill of the row replays them onto the committed state
first. The replayed state equals the copy design's ``scratch[row, accept_length - 1]`` bit
for bit on this reference (the same ``ssd_step`` arithmetic in the same order).

Buffers, per Mamba2 layer (``R = rows + 1`` with the padding row), all fp32::

    x  [R, 2, D_max, H, P]   the step's conv output for the SSM (per head)
    dt [R, 2, D_max, H]      the step's discretised time step
    dA [R, 2, D_max, H]      the step's decay exp(dt A)
    B  [R, 2, D_max, G, N]   the step's input projection (per group)
    pending [R] int32, slot [R] int32   as kernels.gdn.naive_replay (two slots per row)
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .naive import _expand_groups, discretize, ssd_apply, ssd_decay, ssd_read


class Mamba2ReplayBuffers(NamedTuple):
    """Per-layer replay record at stable rows; shapes in the module docstring."""

    x: torch.Tensor
    dt: torch.Tensor
    dA: torch.Tensor
    B: torch.Tensor
    pending: torch.Tensor
    slot: torch.Tensor


def alloc_mamba2_replay_buffers(num_rows: int, d_max: int, num_heads: int, head_dim: int, n_groups: int,
                                state_size: int, device=None,
                                meta: tuple[torch.Tensor, torch.Tensor] | None = None) -> Mamba2ReplayBuffers:
    """Buffers for one layer; ``meta`` = ``(pending[l], slot[l])`` rows of
    ``kernels.gdn.alloc_replay_meta`` (one commit covers every layer), else fresh.
    Size per row: ``2 D_max (H P + 2 H + G N) 4`` bytes."""
    if meta is None:
        z = torch.zeros(2, num_rows, dtype=torch.int32, device=device)
        meta = (z[0], z[1])
    f32 = dict(dtype=torch.float32, device=device)
    return Mamba2ReplayBuffers(
        x=torch.zeros(num_rows, 2, d_max, num_heads, head_dim, **f32),
        dt=torch.zeros(num_rows, 2, d_max, num_heads, **f32),
        dA=torch.zeros(num_rows, 2, d_max, num_heads, **f32),
        B=torch.zeros(num_rows, 2, d_max, n_groups, state_size, **f32),
        pending=meta[0],
        slot=meta[1],
    )


def replay_pending_ref(s: torch.Tensor, bufs: Mamba2ReplayBuffers, req_pool_indices: torch.Tensor) -> torch.Tensor:
    """``s`` (``[Bs, H, P, N]`` fp32, the rows' committed state) with each row's ``pending``
    recorded steps applied. Writes nothing."""
    rows = req_pool_indices
    if rows.numel() == 0:
        return s
    n = bufs.pending[rows].long()
    n_max = int(n.max())
    if n_max == 0:
        return s
    sl = bufs.slot[rows].long()
    H = s.shape[1]
    x, dt, dA, B = bufs.x[rows, sl], bufs.dt[rows, sl], bufs.dA[rows, sl], _expand_groups(bufs.B[rows, sl], H)
    for j in range(n_max):
        stepped = ssd_apply(s, x[:, j], dt[:, j], dA[:, j], B[:, j])
        s = torch.where((j < n).view(-1, 1, 1, 1), stepped, s)
    return s


def recurrent_replay_ref(x, dt, A, B, C, D, dt_bias, state, req_pool_indices, bufs: Mamba2ReplayBuffers,
                         verify: bool = True, dt_limit=(0.0, float("inf"))):
    """Replay each row's pending steps, then run ``T`` new steps (shapes as
    :func:`naive.recurrent_ref`).

    ``verify=True``: the committed state (after the replay) is written to ``state[row]``
    and each new step's ``x``, discretised ``dt`` and ``B`` to slot ``1 - slot[row]``; no
    other state is written. ``verify=False`` (decode): the state after the ``T`` steps is
    written to ``state[row]``. Either way ``pending[row]`` is 0 afterwards.

    Returns:
        y: ``[Bs, T, H, P]`` in x's dtype.
    """
    rows = req_pool_indices
    Bs, T, H = x.shape[:3]
    s = replay_pending_ref(state[rows].float(), bufs, rows)
    dts = discretize(dt, dt_bias, dt_limit)
    decay = ssd_decay(dts, A)
    if verify:
        if Bs and T > bufs.x.shape[2]:
            raise ValueError(f"D = {T} exceeds the replay buffers' D_max = {bufs.x.shape[2]}")
        state[rows] = s.to(state.dtype)
        new = 1 - bufs.slot[rows].long()
        bufs.x[rows, new, :T] = x.float()
        bufs.dt[rows, new, :T] = dts
        bufs.dA[rows, new, :T] = decay
        bufs.B[rows, new, :T] = B.float()
    Bh, Ch = _expand_groups(B, H), _expand_groups(C, H)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for t in range(T):
        s = ssd_apply(s, x[:, t], dts[:, t], decay[:, t], Bh[:, t])
        y[:, t] = ssd_read(s, x[:, t], Ch[:, t], D)
    if not verify:
        state[rows] = s.to(state.dtype)
    bufs.pending[rows] = 0
    return y.to(x.dtype)


def replay_flush_ref(state: torch.Tensor, bufs: Mamba2ReplayBuffers, req_pool_indices: torch.Tensor) -> None:
    """Apply the rows' pending steps to ``state[row]`` now (before a prefill continues the
    row or a snapshot reads it); ``pending[row]`` becomes 0."""
    rows = req_pool_indices
    state[rows] = replay_pending_ref(state[rows].float(), bufs, rows).to(state.dtype)
    bufs.pending[rows] = 0
