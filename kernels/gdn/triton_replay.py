"""Triton GDN verify with the replay commit (DESIGN.md section 7): the GPU path of
``naive_replay.py``.

The verify program of a row first replays that row's accepted steps of the previous round
onto the committed state (read once from ``state[row]``), writes the committed state back
once, then runs its D speculative steps in registers and keeps only each step's normalised
key, delta and log decay at the row. The commit is a scatter of two int32 per row and layer. A
round moves 2 state sizes per request and layer, the same as plain decode, against
``D + 3`` for the scratch-and-copy design.

Buffers and their layout: :mod:`naive_replay` (``ReplayBuffers``, ``alloc_replay_meta``,
``alloc_replay_buffers`` work for CUDA tensors as they are).
"""
from __future__ import annotations

import torch
import triton

from .naive_replay import ReplayBuffers, alloc_replay_buffers, alloc_replay_meta  # noqa: F401
from ..checks import check_commit, check_rows
from .triton_recurrent import _block_v, _gdn_recurrent_kernel, _num_warps, launch_gdn_recurrent


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
    ``block_v`` / ``num_warps`` override the tile (benchmarks)."""
    o = launch_gdn_recurrent(q, k, v, g, beta, state, req_pool_indices, scale, bufs=bufs, verify=verify,
                             block_v=block_v, num_warps=num_warps)
    if req_pool_indices.numel():
        # after the kernel (stream order): every program of the row has read pending
        bufs.pending.index_fill_(0, req_pool_indices.to(bufs.pending.device, torch.int64), 0)
    return o


def commit_accept_replay_triton(pending, slot, req_pool_indices, accept_lengths) -> None:
    """Replay commit for all layers at once (``pending``/``slot`` ``[L, R]`` or ``[R]``):
    ``pending[:, row] = accept_length``, ``slot[:, row]`` flips. Two tiny scatters; no state
    moves. Rows are validated like :func:`kernels.commit.commit_accept` validates them.
    A stage does not call this: its commit (``StatePool.commit``) is
    :func:`kernels.commit.commit_accept_conv_replay`, the same counters and the conv windows
    in one launch."""
    if not check_commit(req_pool_indices, accept_lengths, pending.shape[-1], None):
        return
    launch_replay_commit(pending, slot, req_pool_indices.to(pending.device, torch.int64),
                         accept_lengths.to(pending.device, pending.dtype))


def launch_replay_commit(pending, slot, rows, acc) -> None:
    """The commit's device work alone (no checks, no host sync: CUDA-graph capturable)."""
    n_rows = pending.shape[-1]
    p2, s2 = pending.view(-1, n_rows), slot.view(-1, n_rows)
    p2.index_copy_(1, rows, acc.expand(p2.shape[0], -1).contiguous())
    s2.index_copy_(1, rows, 1 - s2.index_select(1, rows))


def replay_flush_triton(state, bufs: ReplayBuffers, req_pool_indices) -> None:
    """Apply the rows' pending steps to ``state[row]`` now; ``pending[row]`` becomes 0."""
    check_rows(req_pool_indices, state.shape[0])
    B = req_pool_indices.numel()
    if B == 0:
        return
    H, K = bufs.k.shape[-2:]
    HV, V = bufs.delta.shape[-2:]
    dev = state.device
    rows = req_pool_indices.to(dev, torch.int64).contiguous()
    BV = _block_v(V, B, HV, replay=True)
    # a zero-step "decode" whose only work is the replay and the final store (the input and
    # output pointers are never touched at D = 0)
    _gdn_recurrent_kernel[(B * HV, triton.cdiv(V, BV))](
        state, state, state, state, state, state, state, state, rows, *bufs[:3], bufs.pending, bufs.slot, 1.0, 0, 0, 0,
        D=0, D_MAX=bufs.k.shape[2], H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, BT=2,
        STORE_SCRATCH=False, STORE_FINAL=True, REPLAY=True, STORE_BUF=False,
        num_warps=_num_warps(BV, True),
    )
    bufs.pending.index_fill_(0, rows, 0)


def replay_reset_triton(pending, req_pool_indices) -> None:
    """Drop pending steps of rows (new prefill or released row)."""
    n_rows = pending.shape[-1]
    rows = req_pool_indices.to(pending.device, torch.int64)
    pending.view(-1, n_rows).index_fill_(1, rows, 0)
